"""Prompt logprobs through the API on the real server (SmolLM2): OpenAI's `echo` with
`logprobs` (and max_tokens 0 to only score a prompt) and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.api import COUNT, SHORT_ANSWER, assert_error
from tests.e2e.server import ServerProcess

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str = "/v1/completions", **body: object) -> dict:
    r = http.post(path, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_zero_scores_the_prompt(http: httpx.Client):
    body = post(http, prompt=TEXT, echo=True, max_tokens=0, logprobs=1)
    [choice] = body["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == TEXT == "".join(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                                   strict=True):
        assert top[token] == logprob and len(top) <= 2  # the top 1 and the prompt's own token
    assert body["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    # A model this size knows the second capital once it has read the first.
    rome = lp["tokens"].index(" Rome")
    assert lp["token_logprobs"][rome] > -1.0
    assert_error(http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 0}), "max_tokens", "echo")


def test_prompt_logprobs_are_what_generation_gave_the_same_tokens(http: httpx.Client):
    """Teacher forcing through the API: the logprobs of generated tokens, fed back as prompt,
    come out as prompt logprobs (prefill rows against the decode steps that sampled them)."""
    gen = post(http, prompt=COUNT, max_tokens=6, logprobs=0)["choices"][0]["logprobs"]
    ids = http.post("/tokenize", json={"prompt": COUNT + "".join(gen["tokens"])}).json()["tokens"]
    body = post(http, prompt=ids, echo=True, max_tokens=0, logprobs=0)
    scored = body["choices"][0]["logprobs"]["token_logprobs"][-6:]
    assert scored == pytest.approx(gen["token_logprobs"], abs=0.02)


def test_vllm_prompt_logprobs_field(http: httpx.Client):
    text = f"{TEXT} {COUNT} 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert len(ids) > 32  # two full KV blocks
    post(http, prompt=text, max_tokens=1)  # ... now in the prefix cache
    for _ in range(2):  # cached blocks are not served to a request that scores its prompt
        body = post(http, prompt=text, max_tokens=2, prompt_logprobs=2)
        [choice] = body["choices"]
        assert choice["text"] and not choice["text"].startswith(text)  # no echo
        prompt = choice["prompt_logprobs"]
        assert len(prompt) == len(ids) and prompt[0] is None
        for token_id, entry in zip(ids[1:], prompt[1:], strict=True):
            own = entry[str(token_id)]
            assert own["logprob"] <= 0 and own["rank"] >= 1 and own["decoded_token"]
            ranks = sorted(e["rank"] for k, e in entry.items() if k != str(token_id))
            assert ranks in ([1, 2], [1], [2])  # the top 2, less the prompt token if among them
            assert len(entry) <= 3
    assert "prompt_logprobs" not in post(http, prompt=TEXT, max_tokens=1)["choices"][0]


def test_chat_prompt_logprobs_and_refusals(http: httpx.Client):
    body = post(http, "/v1/chat/completions", messages=SHORT_ANSWER, max_tokens=2, prompt_logprobs=0)
    prompt = body["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in prompt[1:])
    stream = {"messages": SHORT_ANSWER, "stream": True, "prompt_logprobs": 1}
    assert_error(http.post("/v1/chat/completions", json=stream), "prompt_logprobs", "stream")
    assert_error(http.post("/v1/chat/completions", json={"messages": SHORT_ANSWER, "echo": True}), "echo")


def test_streamed_echo_comes_first(http: httpx.Client):
    with http.stream("POST", "/v1/completions", json={"prompt": COUNT, "echo": True, "max_tokens": 3,
                                                       "temperature": 0, "stream": True,
                                                       "logprobs": 0}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == COUNT and first["logprobs"]["token_logprobs"][0] is None
    texts = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    plain = post(http, prompt=COUNT, max_tokens=3)["choices"][0]["text"]
    assert texts == COUNT + plain
    offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
