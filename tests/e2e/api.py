"""Helpers of the API tests: raw SSE parsing, error checks, clients for a server."""

from __future__ import annotations

import json

import httpx
import openai

from tests.e2e.server import ServerProcess

COUNT = "1, 2, 3, 4,"  # greedy SmolLM2 goes on " 5, 6, 7, 8, ..."
SHORT_ANSWER = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]  # EOS ~8th token
EOS_TEXT = "<|im_end|>"


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse(raw: str) -> tuple[list[dict], str]:
    """(the JSON events, the last event) of a raw SSE body; checks the framing."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    payloads = [e[len("data: "):] for e in events]
    return [json.loads(p) for p in payloads[:-1]], payloads[-1]


def assert_error(r: httpx.Response, *words: str) -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["object"] == "error"
    for word in words:
        assert word in body["message"], body["message"]
    return body


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def streamed_text(chunks: list[dict], index: int = 0) -> str:
    out = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index:
                out.append((choice["delta"].get("content") or "") if "delta" in choice else choice["text"])
    return "".join(out)
