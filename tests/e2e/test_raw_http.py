"""SSE framing, error shapes and resilience, checked on the wire with raw HTTP."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.api import assert_error
from tests.e2e.server import ServerProcess


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def test_health(http: httpx.Client):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_sse_framing_completion(http: httpx.Client):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_sse_framing_chat(http: httpx.Client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    events = sse_events(http.post("/v1/chat/completions", json=body).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 5


def test_malformed_json(http: httpx.Client):
    r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, "JSON")


def test_wrong_types_name_the_field(http: httpx.Client):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": "ten"}), "max_tokens")
    assert_error(http.post("/v1/chat/completions", json={"messages": "hi"}), "messages")
    assert_error(http.post("/v1/chat/completions", json={}), "messages")


def test_invalid_values(http: httpx.Client):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), "max_tokens")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), "temperature")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "top_p": 0}), "top_p")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "top_k": -2}), "top_k")  # 0, -1: no cut


def test_prompt_longer_than_max_model_len(http: httpx.Client):
    r = http.post("/v1/completions", json={"prompt": "hello " * 600, "max_tokens": 4})
    assert_error(r, "--max-model-len", "512")
    r = http.post("/v1/completions", json={"prompt": "hello " * 600, "stream": True})
    assert_error(r, "--max-model-len")


def test_multimodal_parts_rejected(http: httpx.Client):
    """Text parts are text (issue 17); an image part is refused by name."""
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:"}}]
    body = {"messages": [{"role": "user", "content": parts}]}
    assert_error(http.post("/v1/chat/completions", json=body), "multimodal", "image_url")


def test_empty_prompt_starts_from_bos(http: httpx.Client):
    r = http.post("/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1


def test_max_tokens_capped_to_context(http: httpx.Client):
    r = http.post("/v1/completions", json={"prompt": "hello " * 500, "max_tokens": 400})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 512 and r.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_path_is_json_404(http: httpx.Client):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["object"] == "error"


def test_bad_requests_do_not_disturb_good_ones(http: httpx.Client, server: ServerProcess):
    good = {"prompt": "Count: 1, 2,", "max_tokens": 24, "temperature": 0}
    alone = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    bad = [{"prompt": "x", "max_tokens": -3}, {"prompt": 5}, {"prompt": "hello " * 700}]
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(http.post, "/v1/completions", json=good) for _ in range(3)]
        bads = [pool.submit(http.post, "/v1/completions", json=b) for b in bad * 3]
        assert all(f.result().status_code == 400 for f in bads)
        assert [f.result().json()["choices"][0]["text"] for f in goods] == [alone] * 3
    assert http.get("/health").status_code == 200


def test_client_disconnect_aborts_and_frees(http: httpx.Client, server: ServerProcess):
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for _ in r.iter_lines():
            break  # go away after the first event
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": "Tell me a long story.", "max_tokens": 400},
                  timeout=0.5)
    # both sequences were aborted: the server still answers promptly and correctly
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 10
    while server.output().count("request aborted") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.output().count("request aborted") >= 2
