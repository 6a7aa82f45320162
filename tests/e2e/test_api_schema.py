"""/openapi.json describes the API, and the live server keeps to it: schemathesis sends a few
generated requests per operation, valid and invalid ones, and every answer must be a
documented status with a body matching its schema; never a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.server import ServerProcess

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
SMALL = 3  # generated requests must stay cheap: a few tokens each


def test_openapi_document_is_served(server: ServerProcess):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(doc["paths"])
    assert "max_completion_tokens" in doc["components"]["schemas"]["ChatBody"]["properties"]


# Rules the schema cannot state: the served SmolLM2 has no tool-call parser (tools are a 400),
# a tool result must answer an earlier call, call arguments must hold a JSON object, and a
# json_schema must be a usable schema. Positive examples drop what would break them.
UNSTATED = ("tools", "tool_choice", "response_format")


def bounded(body: object) -> object:
    """The same request, asking for at most SMALL tokens (the server default is 256)."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k not in UNSTATED}
    if isinstance(body.get("messages"), list):
        body["messages"] = [_plain(m) for m in body["messages"]]
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value > SMALL:
            body[field] = SMALL
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    return body


def _plain(message: object) -> object:
    if not isinstance(message, dict):
        return message
    message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    return {**message, "role": "user"} if message.get("role") == "tool" else message


def fuzz(operation: object, mode: GenerationMode) -> set[int]:
    """Runs a few generated requests against one operation; returns the statuses seen."""
    seen: set[int] = set()

    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        if case.body is not None:
            case.body = bounded(case.body)
        seen.add(case.call_and_validate(checks=CHECKS, timeout=60).status_code)

    check()
    return seen


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_live_server_conforms_to_its_schema(server: ServerProcess, mode: GenerationMode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    statuses = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        # a GET without parameters has no invalid form to try
        if mode is GenerationMode.POSITIVE or operation.method.upper() == "POST":
            statuses[operation.path] = fuzz(operation, mode)
    wanted = 200 if mode is GenerationMode.POSITIVE else 400
    assert all(wanted in statuses[p] for p in ("/v1/completions", "/v1/chat/completions")), statuses
