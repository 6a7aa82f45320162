"""/openapi.json is generated from the msgspec Structs the handlers decode and encode."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import InvalidRequest
from pypto_serving.http import bodies, protocol
from pypto_serving.http.openapi import openapi_document, openapi_json


def test_document_describes_every_endpoint_and_schema():
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                 "/tokenize", "/detokenize", "/version", "/v1/responses",
                                 "/v1/models/{model}"}
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


def _request_schemas() -> dict:
    schemas = openapi_document()["components"]["schemas"]
    return {name: schemas[name] for name in ("CompletionBody", "ChatBody", "TokenizeBody",
                                              "DetokenizeBody", "ResponsesBody", "Message")}


def completion(**fields: object) -> protocol.Parsed:
    body = protocol.decode_body(json.dumps({"prompt": "x", **fields}).encode(), bodies.CompletionBody)
    return protocol.parse_completion(body, GenerateDefaults())


def test_integer_fields_are_integers_and_a_whole_float_is_one():
    # JSON Schema's integer includes 13.0; schemathesis sends it, so the decoder takes it too
    assert "multipleOf" not in json.dumps(_request_schemas())
    n = openapi_document()["components"]["schemas"]["CompletionBody"]["properties"]["n"]
    assert n["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": bodies.MAX_CHOICES}
    parsed = completion(n=13.0, max_tokens=5.0, seed=1e3, stop_token_ids=[2.0, 3])
    assert (parsed.n, parsed.request.max_tokens, parsed.request.sampling.seed) == (13, 5, 1000)
    assert all(type(v) is int for v in (parsed.n, parsed.request.max_tokens, *parsed.request.stop_token_ids))
    assert completion(prompt=[1.0, 2]).request.prompt == (1, 2)
    for bad, words in ((13.5, "Expected an integer"), ("13", "Expected `int | null`, got `str`"),
                       (17.0, "Expected `int` <= 16")):
        with pytest.raises(InvalidRequest, match=re.escape(words)):
            completion(n=bad)


def test_unimplemented_fields_list_exactly_their_defaults():
    fields = openapi_document()["components"]["schemas"]["ChatBody"]["properties"]
    assert fields["logit_bias"]["enum"] == [None, {}]
    assert fields["modalities"]["enum"] == [None, ["text"]]
    assert completion(echo=False, best_of=1.0, logit_bias={}).n == 1
    for field, value in (("echo", 0), ("skip_special_tokens", 1), ("logit_bias", {"1": 2})):
        with pytest.raises(InvalidRequest, match=field):  # not the JSON value of a default
            completion(**{field: value})


def test_the_rules_of_protocol_py_are_in_the_document():
    schemas = _request_schemas()
    assert schemas["CompletionBody"]["properties"]["prompt"]["anyOf"][1]["items"]["type"] == "integer"
    part = schemas["Message"]["properties"]["content"]["anyOf"][1]["items"]
    assert part["properties"]["type"] == {"enum": ["text"]} and part["required"] == ["type", "text"]
    assert schemas["Message"]["then"]["required"] == ["tool_call_id"]  # when role is tool
    kwargs = schemas["ChatBody"]["properties"]["chat_template_kwargs"]["anyOf"][0]
    assert set(kwargs["propertyNames"]["not"]["enum"]) == bodies.RESERVED_TEMPLATE_KWARGS
    assert [o["required"] for o in schemas["TokenizeBody"]["oneOf"]] == [["prompt"], ["messages"]]
    responses, chat = schemas["ResponsesBody"]["properties"], schemas["ChatBody"]["properties"]
    assert responses["temperature"] == chat["temperature"] and responses["top_p"] == chat["top_p"]


def test_an_event_stream_is_described_event_by_event():
    # before OpenAPI 3.2's itemSchema, a text/event-stream schema describes one event
    ok = openapi_document()["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    event = ok["content"]["text/event-stream"]["schema"]
    assert event["type"] == "object" and event["properties"]["data"]["type"] == "string"


def test_the_served_document_names_the_one_model_id_it_answers():
    """A live server's /openapi.json allows only its own id in /v1/models/{model}: a request
    the schema allows is never the 404 another id gets."""
    param = openapi_document(served_name="org/m")["paths"]["/v1/models/{model}"]["get"]["parameters"][0]
    assert (param["name"], param["in"], param["schema"]) == ("model", "path", {"enum": ["org/m"]})
    assert openapi_document()["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["schema"] == {
        "type": "string"}
