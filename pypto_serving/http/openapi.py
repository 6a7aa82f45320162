"""The OpenAPI document served at /openapi.json, generated from the msgspec Structs.

Request schemas come from bodies.py and response schemas from responses.py, the same types
the handlers decode and encode, so the document cannot drift from the server's behaviour.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from pypto_serving.http import responses as r
from pypto_serving.http.bodies import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from pypto_serving.http.responses_api import Response, ResponsesBody

_REF = "#/components/schemas/{name}"
_TYPES = (CompletionBody, ChatBody, r.CompletionResponse, r.ChatResponse, r.ChatChunk,
          r.ErrorResponse, r.ModelList, r.Health, TokenizeBody, r.Tokenized, DetokenizeBody,
          r.Detokenized, r.Version, ResponsesBody, Response)


def _json(ref: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref}}}


def _generation(summary: str, body: dict, result: dict, error: dict) -> dict[str, Any]:
    ok = _json(result, "the whole response, or with stream: true Server-Sent Events of chunks")
    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
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


def openapi_document(title: str = "pypto-serving") -> dict[str, Any]:
    refs, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    completion, chat, completion_out, chat_out, _, error, models, health = refs[:8]
    tokenize, tokenized, detokenize, detokenized, version, responses, response = refs[8:]
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {
            "/v1/completions": _generation("Text completion", completion, completion_out, error),
            "/v1/chat/completions": _generation("Chat completion", chat, chat_out, error),
            "/v1/responses": _generation("Response (OpenAI Responses API)", responses, response, error),
            "/v1/models": {"get": {"summary": "The served model",
                                   "responses": {"200": _json(models, "one model")}}},
            "/health": {"get": {"summary": "Liveness", "responses": {
                "200": _json(health, "the engine runs"),
                "503": _json(health, "the engine has stopped")}}},
            "/tokenize": _post("Token ids of a prompt or of chat messages", tokenize, tokenized, error),
            "/detokenize": _post("The text of token ids", detokenize, detokenized, error),
            "/version": {"get": {"summary": "The server's version",
                                 "responses": {"200": _json(version, "the version")}}},
        },
        "components": {"schemas": components},
    }


@functools.cache
def openapi_json() -> bytes:
    return msgspec.json.encode(openapi_document())
