"""The OpenAPI document served at /openapi.json, generated from the msgspec Structs.

Request schemas come from bodies.py and response schemas from responses.py, the same types
the handlers decode and encode, so the document cannot drift from the server's behaviour.
It says exactly what a request may hold (a schema-valid body is never refused for its shape):
what the Structs leave open for protocol.py's friendlier messages is added here, from the
same tables protocol.py reads.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from pypto_serving.http import responses as r
from pypto_serving.http.bodies import (
    RESERVED_TEMPLATE_KWARGS,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    unimplemented_defaults,
)
from pypto_serving.http.responses_api import UNIMPLEMENTED, Response, ResponsesBody

_REF = "#/components/schemas/{name}"
_TYPES = (CompletionBody, ChatBody, r.CompletionResponse, r.ChatResponse, r.ChatChunk,
          r.ErrorResponse, r.ModelList, r.Health, TokenizeBody, r.Tokenized, DetokenizeBody,
          r.Detokenized, r.Version, ResponsesBody, Response, r.ModelCard)


def _json(ref: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref}}}


# Before OpenAPI 3.2's itemSchema, an event stream's schema describes each of its events.
_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "one JSON chunk, or [DONE] at the end"},
    "event": {"type": "string"}}}


def _generation(summary: str, body: dict, result: dict, error: dict) -> dict[str, Any]:
    ok = _json(result, "the whole response, or with stream: true Server-Sent Events of chunks")
    ok["content"]["text/event-stream"] = {"schema": _EVENT}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": ok, "400": _json(error, "invalid request, or rejected by the engine"),
                      "500": _json(error, "the engine failed before producing any text"),
                      "503": _json(error, "the server is shutting down")},
    }}


def _post(summary: str, body: dict, result: dict, error: dict) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": _json(result, summary), "400": _json(error, "invalid request")},
    }}


def _integers(node: Any) -> Any:
    """Each `bodies.whole` pair (an integer, or a number that is a multiple of 1) as the one
    JSON Schema `integer` it is: 13.0 is an integer there too."""
    if isinstance(node, list):
        return [_integers(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _integers(v) for k, v in node.items()}
    branches = node.pop("anyOf", None)
    if branches is None:
        return node
    kept = [b for b in branches if not _whole_twin(b, branches)]
    return {**node, **kept[0]} if len(kept) == 1 else {**node, "anyOf": kept}


def _whole_twin(branch: dict[str, Any], branches: list[dict[str, Any]]) -> bool:
    if branch.get("type") != "number" or branch.get("multipleOf") != 1:
        return False
    return {**{k: v for k, v in branch.items() if k != "multipleOf"}, "type": "integer"} in branches


def _text_part(*kinds: str) -> dict[str, Any]:
    return {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": list(kinds)}, "text": {"type": "string"}}}


def _item(kind: str, required: tuple[str, ...], **fields: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required),
            "properties": {"type": {"const": kind}, **fields}}


_STRING = {"type": "string"}
# A Responses `input` item as responses_api.input_messages reads it.
_INPUT_ITEM = {"anyOf": [
    _item("message", ("role", "content"), role={"enum": ["user", "system", "developer", "assistant"]},
          content={"anyOf": [_STRING, {"type": "array", "items": _text_part(
              "input_text", "output_text", "text")}]}),
    _item("function_call", ("type", "call_id", "name", "arguments"), call_id=_STRING,
          name=_STRING, arguments=_STRING),
    _item("function_call_output", ("type", "call_id", "output"), call_id=_STRING, output=_STRING)]}


def _unstated_rules(schemas: dict[str, Any]) -> None:
    """What protocol.py and responses_api.py refuse with messages of their own rather than
    leave to msgspec's."""
    for body in (CompletionBody, ChatBody):
        fields = schemas[body.__name__]["properties"]
        _defaults_only(fields, {f: a for f, a in unimplemented_defaults(body).items() if f != "best_of"})
        fields["best_of"]["description"] = "must equal n: extra candidates are not supported"
    prompt = _branch(schemas["CompletionBody"]["properties"]["prompt"], "array")
    prompt["items"] = {"type": "integer", "minimum": 0}  # token ids, not a batch of prompts
    message = schemas["Message"]
    _branch(message["properties"]["content"], "array")["items"] = _text_part("text")  # no images
    message["if"] = {"properties": {"role": {"const": "tool"}}}  # a tool result names its call
    message["then"] = {"required": ["tool_call_id"], "properties": {"tool_call_id": _STRING}}
    for name in ("ChatBody", "TokenizeBody"):
        kwargs = _branch(schemas[name]["properties"]["chat_template_kwargs"], "object")
        kwargs["propertyNames"] = {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}
    schemas["TokenizeBody"]["oneOf"] = [  # exactly one of them, not null
        {"required": ["prompt"], "properties": {"prompt": _STRING}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]
    _responses_rules(schemas["ResponsesBody"]["properties"], schemas["ChatBody"]["properties"])


def _responses_rules(fields: dict[str, Any], chat: dict[str, Any]) -> None:
    """A Responses body becomes a chat body: its fields take the chat fields' ranges; the
    fields it knows but lacks take only their defaults (responses_api.UNIMPLEMENTED)."""
    fields["temperature"], fields["top_p"] = chat["temperature"], chat["top_p"]
    _defaults_only(fields, UNIMPLEMENTED)
    _branch(fields["input"], "array").update(items=_INPUT_ITEM, minItems=1)


def _defaults_only(fields: dict[str, Any], allowed: dict[str, tuple[Any, ...]]) -> None:
    """Fields known but not implemented (`protocol.refuse_unimplemented` refuses the rest)
    take only the values listed for them."""
    for field, values in allowed.items():
        if field in fields:
            fields[field] = {"enum": list(values), "default": None,
                             "description": "not implemented: only its default is accepted"}


def _branch(schema: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(b for b in schema.get("anyOf", [schema]) if b.get("type") == kind)


def openapi_document(title: str = "pypto-serving", served_name: str | None = None) -> dict[str, Any]:
    """`served_name`: the one id `/v1/models/{model}` answers (the live server's document names
    it, so a request the schema allows is never a 404)."""
    refs, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    components = _integers(components)
    _unstated_rules(components)
    completion, chat, completion_out, chat_out, _, error, models, health = refs[:8]
    tokenize, tokenized, detokenize, detokenized, version, responses, response, card = refs[8:]
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {
            "/v1/completions": _generation("Text completion", completion, completion_out, error),
            "/v1/chat/completions": _generation("Chat completion", chat, chat_out, error),
            "/v1/responses": _generation("Response (OpenAI Responses API)", responses, response, error),
            "/v1/models": {"get": {"summary": "The served model",
                                   "responses": {"200": _json(models, "one model")}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model's card (OpenAI's retrieve)",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": _STRING if served_name is None else {"enum": [served_name]}}],
                "responses": {"200": _json(card, "the served model"),
                              "404": _json(error, "no model of that id is served")}}},
            "/health": {"get": {"summary": "Liveness", "responses": {
                "200": _json(health, "the engine runs (with --dp: a replica serves)"),
                "503": _json(health, "the engine has stopped (with --dp: every replica)")}}},
            "/tokenize": _post("Token ids of a prompt or of chat messages", tokenize, tokenized, error),
            "/detokenize": _post("The text of token ids", detokenize, detokenized, error),
            "/version": {"get": {"summary": "The server's version",
                                 "responses": {"200": _json(version, "the version")}}},
        },
        "components": {"schemas": components},
    }


@functools.cache
def openapi_json(served_name: str | None = None) -> bytes:
    return msgspec.json.encode(openapi_document(served_name=served_name))
