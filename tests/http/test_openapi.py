"""/openapi.json is generated from the msgspec Structs the handlers decode and encode."""

from __future__ import annotations

import msgspec

from pypto_serving.http import bodies
from pypto_serving.http.openapi import openapi_document, openapi_json


def test_document_describes_every_endpoint_and_schema():
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                 "/tokenize", "/detokenize", "/version", "/v1/responses"}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatBody"}
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    schemas = doc["components"]["schemas"]
    assert {"CompletionBody", "ChatBody", "Message", "CompletionResponse", "ChatResponse",
            "ChatChunk", "ErrorResponse", "Usage"} <= set(schemas)


def test_request_schemas_follow_the_structs():
    schemas = openapi_document()["components"]["schemas"]
    chat = schemas["ChatBody"]
    assert set(bodies.ChatBody.__struct_fields__) == set(chat["properties"])
    assert chat["required"] == ["messages"]
    top_p = chat["properties"]["top_p"]["anyOf"][0]
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0.0, 1.0)
    roles = schemas["Message"]["properties"]["role"]["enum"]
    assert set(roles) == set(bodies.ROLES)


def test_served_bytes_are_the_document():
    assert msgspec.json.decode(openapi_json()) == openapi_document()
