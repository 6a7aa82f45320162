"""schemathesis against a live pypto-serving: requests generated from its /openapi.json, valid
and invalid ones, for every operation. No answer may be a 5xx, and no schema-valid body may be
refused (`positive_data_acceptance`); status codes, content types and response bodies must be
the documented ones.

    python benchmarks/schema_fuzz.py --examples 1000

starts the default packaged model (or fuzzes `--url`) and prints one JSON summary: cases sent,
5xx answers, schema-valid bodies refused, other check failures (the first few in full) and
seconds taken. Exits 1 if any check failed. tests/e2e/test_api_schema.py runs the same with
fewer examples.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHECKS = [not_a_server_error, positive_data_acceptance, status_code_conformance,
          content_type_conformance, response_schema_conformance]
SMALL = 2  # generated requests must stay cheap: a few tokens each (~0.1 s a token on 2 CPUs)
# Rules no schema can state, so bounded() keeps generated bodies clear of them; what is left
# is still schema-valid. The served SmolLM2 has no tool-call parser (tools are a 400), a tool
# result must answer an earlier call, call arguments must hold a JSON object, a json_schema
# must be a usable schema, a previous response must have been stored, token ids must be in
# the model's vocabulary, and the prompt must fit --max-model-len in tokens (TEXT_CHARS).
UNSTATED = ("tools", "tool_choice", "response_format", "previous_response_id")
CALL_ITEMS = ("function_call", "function_call_output")
IDS_IN_ANY_VOCAB = 256
# The prompt's text in all, and its messages or input items: at up to four tokens a character
# (byte fallback) and a few of the template's per message, well inside a 512-token context.
TEXT_CHARS, TEXT_ITEMS = 96, 8
TEXT_FIELDS = frozenset({"prompt", "messages", "input", "instructions", "content", "text", "name"})


def bounded(body: object) -> object:
    """The same request, asking for at most SMALL tokens (the server default is 256), with
    what only protocol.py can check made to hold."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k not in UNSTATED}
    if isinstance(body.get("messages"), list):
        body["messages"] = [_plain(m) for m in body["messages"]]
    if isinstance(body.get("input"), list):  # a Responses input: its messages, no call items
        body["input"] = [i for i in body["input"]
                         if not isinstance(i, dict) or i.get("type") not in CALL_ITEMS] or ""
    limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for name in limits:
        body[name] = _at_most(body.get(name), SMALL)
    if "n" in body or "best_of" in body:
        body["n"] = body["best_of"] = _at_most(body.get("n"), 2)  # best_of must equal n
    if _number(body.get("min_tokens")):  # at most the max tokens
        body["min_tokens"] = min(body["min_tokens"], *(body[name] for name in limits))
    if body.get("max_tokens") == 0 and body.get("echo") is not True:
        body["max_tokens"] = SMALL  # 0 only scores an echoed prompt
    if body.get("stream") is not True:
        body.pop("stream_options", None)  # only allowed with stream: true
    else:
        body.pop("prompt_logprobs", None)  # not with stream: true
    if "messages" in body and body.get("top_logprobs") and body.get("logprobs") is not True:
        body["logprobs"] = True  # a chat's top_logprobs needs logprobs
    for name in ("prompt", "tokens", "stop_token_ids"):
        if isinstance(body.get(name), list):
            body[name] = [i % IDS_IN_ANY_VOCAB if _number(i) else i for i in body[name]]
    budget = [TEXT_CHARS]
    return {k: _short(v, budget) if k in TEXT_FIELDS else v for k, v in body.items()}


def _short(value: object, budget: list[int]) -> object:
    """`value`'s text cut to what is left of `budget` (shared, in characters) and its lists to
    TEXT_ITEMS entries; roles, types and other enumerated strings are left whole."""
    if isinstance(value, str):
        kept = value[: budget[0]]
        budget[0] -= len(kept)
        return kept
    if isinstance(value, list):
        return [_short(v, budget) for v in value[:TEXT_ITEMS]] or value
    if isinstance(value, dict):
        return {k: _short(v, budget) if k in TEXT_FIELDS else v for k, v in value.items()}
    return value


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _at_most(value: object, limit: int) -> object:
    return value if _number(value) and value <= limit else limit


def _plain(message: object) -> object:
    if not isinstance(message, dict):
        return message
    message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    return {**message, "role": "user"} if message.get("role") == "tool" else message


@dataclass
class Tally:
    cases: int = 0
    statuses: dict[str, collections.Counter] = field(  # by operation
        default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: collections.Counter = field(default_factory=collections.Counter)  # by kind
    examples: list[dict] = field(default_factory=list)  # the first few failures in full

    def summary(self, seconds: float) -> dict:
        codes = collections.Counter()
        for counts in self.statuses.values():
            codes.update(counts)
        return {"cases": self.cases,
                "server_errors": sum(n for code, n in codes.items() if code >= 500),
                "rejected_valid": self.failures["RejectedPositiveData"],
                "failures": dict(self.failures), "statuses": dict(sorted(codes.items())),
                "seconds": round(seconds, 1), "first_failures": self.examples}


def fuzz_operation(operation: schemathesis.APIOperation, mode: GenerationMode, examples: int,
                   tally: Tally) -> None:
    """Sends up to `examples` generated requests; every failed check is counted, none stops it."""

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        if case.body is not None:
            case.body = bounded(case.body)
        tally.cases += 1
        try:
            response = case.call_and_validate(checks=CHECKS, timeout=60)
        except FailureGroup as group:
            _record(tally, operation, case, group)
        else:
            tally.statuses[operation.path][response.status_code] += 1

    check()


def _record(tally: Tally, operation: schemathesis.APIOperation, case: schemathesis.Case,
            group: FailureGroup) -> None:
    statuses = {getattr(f, "status_code", None) for f in group.exceptions} - {None}
    for status in statuses:
        tally.statuses[operation.path][status] += 1
    for failure in group.exceptions:
        kind = type(failure).__name__
        tally.failures[kind] += 1
        if len(tally.examples) < 10:
            tally.examples.append({"operation": operation.label, "kind": kind,
                                   "message": failure.message[:300],
                                   "body": json.dumps(case.body, default=str)[:500]})


def fuzz(url: str, examples: int) -> Tally:
    """About `examples` requests in all: positive ones for every operation, negative ones for
    those with a body (a GET without parameters has no invalid form), one each per GET."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    each = math.ceil(examples / (2 * len(posts)))
    tally = Tally()
    for operation in operations:
        if operation.method.upper() != "POST":
            fuzz_operation(operation, GenerationMode.POSITIVE, 1, tally)
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(operation, mode, each, tally)
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="generated requests in all")
    parser.add_argument("--url", help="a running server (default: start the packaged model)")
    args = parser.parse_args()
    start = time.monotonic()
    if args.url:
        tally = fuzz(args.url, args.examples)
    else:
        from tests.e2e.server import ServerProcess

        with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "256MiB"]) as server:
            tally = fuzz(server.url, args.examples)
    summary = tally.summary(time.monotonic() - start)
    print(json.dumps(summary, indent=1))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
