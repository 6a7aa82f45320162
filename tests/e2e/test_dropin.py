"""What clients written for vLLM send and read, on the real server (SmolLM2): chat content
as text parts, stream usage on request (`include_usage`, `continuous_usage_stats`),
`/v1/models` as vLLM fills it, `/tokenize`, `/detokenize` and `/version`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json

import httpx
import openai
import pytest

from tests.e2e.api import SHORT_ANSWER, openai_client
from tests.e2e.server import ServerProcess


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_text_parts_are_the_same_prompt_as_a_string(http: httpx.Client):
    parts = [{"type": "text", "text": "What is 1+1?"}, {"type": "text", "text": "Answer briefly."}]
    as_parts = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}).json()
    as_text = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is 1+1?\nAnswer briefly."}], "max_tokens": 8,
        "temperature": 0}).json()
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]
    assert as_parts["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": image}]})
    assert r.status_code == 400 and "image_url" in r.json()["message"]


def test_include_usage_false_leaves_out_the_usage_event(http: httpx.Client):
    body = {"prompt": "1, 2, 3,", "max_tokens": 4}
    assert "usage" in sse(http, "/v1/completions", body)[-1]  # the default: usage last
    chunks = sse(http, "/v1/completions", {**body, "stream_options": {"include_usage": False}})
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_continuous_usage_stats_counts_every_chunk(http: httpx.Client):
    chunks = sse(http, "/v1/chat/completions", {
        "messages": SHORT_ANSWER, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    running = [c["usage"] for c in chunks[:-1]]
    assert running and all(u["prompt_tokens"] == final["usage"]["prompt_tokens"] for u in running)
    counts = [u["completion_tokens"] for u in running]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)


def test_the_openai_sdk_honours_include_usage_false(server: ServerProcess):
    client: openai.OpenAI = openai_client(server)
    chunks = list(client.completions.create(model="m", prompt="Hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": False}))
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_models_carry_vllms_fields(http: httpx.Client):
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"].endswith(".gguf") and card["parent"] is None
    assert card["max_model_len"] == 512
    assert card["permission"][0]["object"] == "model_permission"


def test_the_openai_sdk_retrieves_the_served_model_and_only_it(server: ServerProcess, http: httpx.Client):
    """`client.models.retrieve(id)` (GET /v1/models/{id}): the card /v1/models lists, by an id
    that may hold a slash; another id is a 404 naming the served one."""
    listed = http.get("/v1/models").json()["data"][0]
    model = openai_client(server).models.retrieve(listed["id"])
    assert (model.id, model.object, model.owned_by) == (listed["id"], "model", "pypto-serving")
    assert http.get(f"/v1/models/{listed['id']}").json() == listed
    with pytest.raises(openai.NotFoundError):
        openai_client(server).models.retrieve("org/other-model")
    missing = http.get("/v1/models/org/other-model")
    assert missing.status_code == 404 and listed["id"] in missing.json()["message"]
    assert missing.json()["param"] == "model"


def test_tokenize_and_detokenize_round_trip(http: httpx.Client):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "messages": SHORT_ANSWER}).status_code == 400


def test_tokenize_messages_counts_what_a_chat_request_reads(http: httpx.Client):
    counted = http.post("/tokenize", json={"messages": SHORT_ANSWER}).json()["count"]
    used = http.post("/v1/chat/completions", json={"messages": SHORT_ANSWER, "max_tokens": 1}).json()
    assert counted == used["usage"]["prompt_tokens"]


def test_version(http: httpx.Client):
    assert http.get("/version").json() == {"version": importlib.metadata.version("pypto-serving")}


def test_the_openai_sdk_speaks_the_responses_api(server: ServerProcess):
    client: openai.OpenAI = openai_client(server)
    first = client.responses.create(model="m", input="What is 1+1?", instructions="Answer briefly.",
                                    max_output_tokens=8, temperature=0)
    assert first.output_text and first.usage.output_tokens <= 8
    assert first.status in ("completed", "incomplete")
    with client.responses.stream(model="m", input="Say hi.", max_output_tokens=6, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and deltas
    later = client.responses.create(model="m", input="And 2+2?", previous_response_id=first.id,
                                    max_output_tokens=4, temperature=0)
    assert later.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


# The bodies `vllm bench serve` (v0.33.0, benchmarks/lib/endpoint_request_func.py) sends for
# its openai, openai-chat and openai-responses backends, with --ignore-eos.
VLLM_BENCH = {
    "/v1/completions": {"model": "smollm2", "prompt": "The quick brown fox", "repetition_penalty": 1.0,
                        "max_tokens": 5, "logprobs": None, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True},
    "/v1/chat/completions": {"model": "smollm2", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}],
        "max_completion_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True},
    "/v1/responses": {"model": "smollm2", "input": "The quick brown fox", "max_output_tokens": 5,
                      "stream": True, "store": False, "ignore_eos": True},
}


@pytest.mark.parametrize("path", list(VLLM_BENCH))
def test_the_bodies_vllm_bench_sends(http: httpx.Client, path: str):
    r = http.post(path, json=VLLM_BENCH[path], headers={"x-request-id": "bench-0"})
    assert r.status_code == 200
    data = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
    if path == "/v1/responses":
        assert data[-1]["type"] == "response.completed"
        assert data[-1]["response"]["usage"]["output_tokens"] == 5
    else:
        assert data[-1]["usage"]["completion_tokens"] == 5 and r.text.rstrip().endswith("data: [DONE]")


def test_the_async_sdk_runs_requests_side_by_side(server: ServerProcess):
    async def main() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            async def chat(i: int) -> str:
                r = await client.chat.completions.create(model="m", messages=SHORT_ANSWER, max_tokens=4,
                                                         temperature=0, seed=i)
                return r.choices[0].message.content

            async def streamed() -> list[str]:
                stream = await client.completions.create(model="m", prompt="1, 2, 3,", max_tokens=4,
                                                         stream=True, temperature=0)
                return [c.choices[0].text async for c in stream if c.choices]

            *answers, parts = await asyncio.gather(*(chat(i) for i in range(4)), streamed())
            return answers, parts

    answers, parts = asyncio.run(main())
    assert len(set(answers)) == 1 and answers[0]  # greedy: the same answer in any batch
    assert "".join(parts)
