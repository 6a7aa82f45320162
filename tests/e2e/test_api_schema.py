"""/openapi.json describes the API exactly, and the live server keeps to it: schemathesis sends
generated requests to every operation, valid and invalid ones (benchmarks/schema_fuzz.py, with
fewer examples). Every answer must be a documented status with a body matching its schema,
never a 5xx, and no schema-valid body may be refused."""

from __future__ import annotations

import json

import httpx

from benchmarks.schema_fuzz import fuzz
from tests.e2e.server import ServerProcess

EXAMPLES = 200  # about 30 s here: generation requests ask for two tokens


def test_openapi_document_is_served(server: ServerProcess):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(doc["paths"])
    assert "max_completion_tokens" in doc["components"]["schemas"]["ChatBody"]["properties"]


def test_live_server_conforms_to_its_schema(server: ServerProcess):
    tally = fuzz(server.url, EXAMPLES)
    summary = tally.summary(0.0)
    shown = json.dumps(summary)  # in full: pytest shortens a dict's repr, failures included
    assert summary["cases"] >= EXAMPLES
    assert summary["server_errors"] == 0, shown
    assert summary["rejected_valid"] == 0, shown
    assert not summary["failures"], shown
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
        assert {200, 400} <= set(tally.statuses[path]), (path, summary)  # valid and invalid ones
