"""N-gram speculation end to end (SmolLM2): a server with --speculative-config writes the
same greedy text as one without, on a prompt whose answer repeats it, keeps proposals
(/metrics says how many), and samples seeded requests reproducibly."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import ServerProcess

NUMBERS = ", ".join(map(str, range(1, 41)))
PROMPT = f"{NUMBERS}\n{NUMBERS}\n1, 2, 3,"  # greedy goes on " 4, 5, ...": the prompt's own tokens
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


@pytest.fixture(scope="module")
def spec_server() -> ServerProcess:
    with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                        "--speculative-config", SPEC]) as srv:
        yield srv


def complete(url: str, **body: object) -> dict:
    with httpx.Client(base_url=url, timeout=120) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, **body})
    assert r.status_code == 200, r.text
    return r.json()


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:spec_decode") and "position" not in s.labels}


def test_greedy_text_is_the_same_and_proposals_are_kept(server: ServerProcess, spec_server: ServerProcess):
    before = spec_counters(spec_server.url)
    plain = complete(server.url, temperature=0, logprobs=0)["choices"][0]
    fast = complete(spec_server.url, temperature=0, logprobs=0)["choices"][0]
    assert fast["text"] == plain["text"] and len(fast["logprobs"]["tokens"]) == 40
    assert fast["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=0.05)
    after = spec_counters(spec_server.url)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0)
    drafts = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0)
    assert accepted >= 24 and 0 < drafts <= 12  # the copy is mostly proposed and kept
    snapshot = httpx.get(spec_server.url + "/metrics/json").json()["replicas"][0]["spec_decode"]
    assert snapshot["num_accepted_tokens"] == after["vllm:spec_decode_num_accepted_tokens_total"]
    assert "vllm:spec_decode_num_drafts_total" not in spec_counters(server.url)  # off: no families


def test_seeded_sampling_is_reproducible(spec_server: ServerProcess):
    first, second = (complete(spec_server.url, temperature=0.8, seed=7)["choices"][0]["text"]
                     for _ in range(2))
    assert first == second
