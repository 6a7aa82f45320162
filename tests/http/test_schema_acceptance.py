"""Every request body /openapi.json calls valid is accepted by the decoder and the request
rules, checked in-process on bodies schemathesis generates from the document (no server, no
model; tests/e2e/test_api_schema.py sends them to the real one)."""

from __future__ import annotations

import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from benchmarks.schema_fuzz import IDS_IN_ANY_VOCAB, bounded
from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import check_token_ids
from pypto_serving.http import bodies, protocol
from pypto_serving.http.openapi import openapi_document
from pypto_serving.http.responses_api import ResponsesBody, chat_body

DEFAULTS = GenerateDefaults()


def _completion(raw: bytes) -> None:
    protocol.parse_completion(protocol.decode_body(raw, bodies.CompletionBody), DEFAULTS)


def _chat(raw: bytes) -> None:
    protocol.parse_chat(protocol.decode_body(raw, bodies.ChatBody), DEFAULTS)


def _responses(raw: bytes) -> None:
    body = protocol.decode_body(raw, ResponsesBody)
    protocol.parse_chat(chat_body(body, []), DEFAULTS)


def _tokenize(raw: bytes) -> None:
    protocol.parse_tokenize(protocol.decode_body(raw, bodies.TokenizeBody))


def _detokenize(raw: bytes) -> None:
    body = protocol.decode_body(raw, bodies.DetokenizeBody)
    check_token_ids(body.tokens, IDS_IN_ANY_VOCAB, "tokens")


ACCEPT = {"/v1/completions": _completion, "/v1/chat/completions": _chat,
          "/v1/responses": _responses, "/tokenize": _tokenize, "/detokenize": _detokenize}


@pytest.mark.parametrize("path", sorted(ACCEPT))
def test_schema_valid_bodies_are_accepted(path: str):
    schema = schemathesis.openapi.from_dict(openapi_document())
    operation = schema[path]["POST"]

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def check(case: schemathesis.Case) -> None:
        ACCEPT[path](msgspec.json.encode(bounded(case.body)))  # an InvalidRequest fails it

    check()
