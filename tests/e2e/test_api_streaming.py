"""Streaming invariants, checked on the raw SSE bytes in the style of llama.cpp's server tests:
one stable id, the role once per choice, finish_reason once per choice, exact usage, the
concatenation equal to the non-streamed text; and disconnects that abort every choice."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.api import COUNT, SHORT_ANSWER, sse, streamed_text, text_of
from tests.e2e.server import ServerProcess

PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
# Multi-token stops: " 6," and "= 4" end the text; " 5x" and "+ 3" start to match, then don't.
STOPS = {"stop": [" 6,", " 5x", "= 4", "+ 3"]}


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def body_for(kind: str, **fields: object) -> dict:
    prompt = {"messages": SHORT_ANSWER} if kind == "chat" else {"prompt": COUNT}
    return {**prompt, "temperature": 0, "max_tokens": 10, **fields}


def both(http: httpx.Client, kind: str, **fields: object) -> tuple[dict, list[dict]]:
    """(the non-streamed response, the streamed chunks) of the same request."""
    full = http.post(PATHS[kind], json=body_for(kind, **fields))
    assert full.status_code == 200, full.text
    streamed = http.post(PATHS[kind], json=body_for(kind, stream=True, **fields))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    chunks, last = sse(streamed.text)
    assert last == "[DONE]"
    return full.json(), chunks


def token_entries(chunks: list[dict], kind: str, index: int = 0) -> list:
    entries = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            lp = choice["logprobs"]
            if choice["index"] == index and lp is not None:
                entries += lp["content"] if kind == "chat" else list(zip(lp["tokens"], lp["token_logprobs"],
                                                                         strict=True))
    return entries


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("fields", [{}, {"ignore_eos": True}, STOPS])
def test_streaming_invariants(http: httpx.Client, kind: str, fields: dict):
    full, chunks = both(http, kind, logprobs=True if kind == "chat" else 1, **fields)
    *choice_chunks, usage_chunk = chunks
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != full["id"]
    assert all(c["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")
               for c in chunks)
    assert all(len(c["choices"]) == 1 for c in choice_chunks)
    if kind == "chat":
        roles = [c["choices"][0]["delta"].get("role") for c in choice_chunks]
        assert roles[0] == "assistant" and roles.count("assistant") == 1
    reasons = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert reasons[:-1] == [None] * (len(reasons) - 1)
    assert reasons[-1] == full["choices"][0]["finish_reason"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the cache hits may differ
    assert usage_chunk["choices"] == []
    assert [usage_chunk["usage"][k] for k in counts] == [full["usage"][k] for k in counts]
    assert len(token_entries(chunks, kind)) == full["usage"]["completion_tokens"]
    assert streamed_text(chunks) == text_of(full)
    if fields is STOPS:
        assert full["choices"][0]["finish_reason"] == "stop"
        assert not any(s in text_of(full) for s in STOPS["stop"]) and text_of(full)


def test_streamed_logprobs_equal_non_streamed(http: httpx.Client):
    full, chunks = both(http, "chat", logprobs=True, top_logprobs=2, max_tokens=6, ignore_eos=True)
    assert token_entries(chunks, "chat") == full["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_streamed_choices_carry_their_index(http: httpx.Client, kind: str):
    fields = dict(n=2, seed=3, temperature=1.0, max_tokens=5, ignore_eos=True)
    full, chunks = both(http, kind, **fields)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert [m["finish_reason"] for m in mine].count("length") == 1
        if kind == "chat":
            assert sum("role" in m["delta"] for m in mine) == 1
        assert streamed_text(chunks, index) == text_of({"choices": [full["choices"][index]]})
    assert chunks[-1]["usage"]["completion_tokens"] == 10 == full["usage"]["completion_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]


def wait_for(server: ServerProcess, text: str, count: int) -> int:
    deadline = time.monotonic() + 30
    while server.output().count(text) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return server.output().count(text)


def test_disconnects_abort_every_choice(http: httpx.Client, server: ServerProcess):
    before = server.output().count("request aborted")
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "n": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for _ in r.iter_lines():
            break  # go away after the first event
    assert wait_for(server, "request aborted", before + 3) == before + 3
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", timeout=1.0,
                  json={"messages": SHORT_ANSWER, "max_tokens": 400, "n": 2, "ignore_eos": True})
    assert wait_for(server, "request aborted", before + 5) == before + 5
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
