"""--data-parallel-size: real servers (and offline mode) on a tiny random Llama checkpoint.

dp=2 answers a burst of 32 concurrent requests once each, on both replicas (one series per
`engine` label), with the same greedy text as dp=1; the startup log names the device groups
and each replica's KV blocks; a replica whose device worker is killed ends only its own
requests with `error` while the other serves, /health staying 200 and naming it, and 503
once no replica can serve.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.ops_helpers import BackgroundStream, save_bpe_tokenizer, wait_for
from tests.e2e.server import ServerProcess

TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time a dragon counted 1, 2, 3."
PROMPTS = [f"Story {i}: the fox and the dragon" for i in range(32)]
MAX_TOKENS = 12


def save_checkpoint(path: Path) -> None:
    save_bpe_tokenizer(path, [TEXT] * 20)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1))  # peaky logits: clear greedy winners
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_checkpoint(path)
    return path


def flags(checkpoint: Path, *more: str) -> list[str]:
    return ["--model", str(checkpoint), "--max-model-len", "1024", "--kv-cache-memory", "16MiB",
            "--no-weight-cache", "--log-format", "json", *more]


@pytest.fixture(scope="module")
def dp1(checkpoint: Path) -> ServerProcess:
    with ServerProcess(flags(checkpoint)) as server:
        yield server


@pytest.fixture(scope="module")
def dp2(checkpoint: Path) -> ServerProcess:
    with ServerProcess(flags(checkpoint, "--dp", "2")) as server:
        yield server


def by_engine(url: str) -> dict[str, dict]:
    return {r["engine"]: r for r in httpx.get(url + "/metrics/json", timeout=30).json()["replicas"]}


async def complete_all(url: str, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}) for p in prompts))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


def test_dp2_answers_32_concurrent_requests_once_each_on_both_replicas_as_dp1_does(
        dp1: ServerProcess, dp2: ServerProcess):
    before = by_engine(dp2.url)
    two, one = asyncio.run(complete_all(dp2.url, PROMPTS)), asyncio.run(complete_all(dp1.url, PROMPTS))
    assert len({body["id"] for body in two}) == 32
    for body in two:
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == MAX_TOKENS
    assert [b["choices"][0]["text"] for b in two] == [b["choices"][0]["text"] for b in one]
    after = by_engine(dp2.url)
    served = {e: after[e]["counters"]["requests_finished"] - before[e]["counters"]["requests_finished"]
              for e in ("0", "1")}
    assert sum(served.values()) == 32 and min(served.values()) >= 4, served
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(dp2.url + "/metrics").text)}
    done = {s.labels["engine"]: s.value for s in families["vllm:request_success"].samples
            if s.labels["finished_reason"] == "length" and s.name.endswith("_total")}
    assert done == {e: after[e]["finish_reasons"]["length"] for e in ("0", "1")}


def test_the_startup_log_names_the_device_groups_and_each_replicas_kv_blocks(dp2: ServerProcess):
    events = [r["event"] for r in dp2.json_records()]
    assert "Platform: a2a3, backend cpu, device groups [[0], [1]]" in events
    assert any(e.startswith("Parallelism: replicas 2, dp 2, tp 1") for e in events)
    assert "Max running requests: 16 per replica; max model len: 1024" in events
    loaded = {r["replica"]: r for r in dp2.json_records() if r["event"] == "model loaded"}
    assert sorted(loaded) == [0, 1] and loaded[0]["worker_pids"] != loaded[1]["worker_pids"]
    kv = next(e for e in events if e.startswith("KV cache: "))
    blocks = [r["blocks"] for r in dp2.json_records() if r["event"] == "allocating the KV cache"]
    assert kv == f"KV cache: {blocks[0]} blocks of 16 tokens on replica 0, {blocks[1]} on replica 1"
    health = httpx.get(dp2.url + "/health").json()
    assert health == {"status": "ok", "replicas": [{"engine": "0", "status": "ok"},
                                                   {"engine": "1", "status": "ok"}]}


def test_offline_prompts_run_on_two_replicas_with_dp1s_greedy_text(checkpoint: Path, dp1: ServerProcess):
    prompts = PROMPTS[:6]
    cmd = [sys.executable, "-m", "pypto_serving", *flags(checkpoint, "--dp", "2"), "--max-tokens",
           str(MAX_TOKENS), "--temperature", "0", "--generate-config", '{"ignore_eos": true}']
    for p in prompts:
        cmd += ["--prompt", p]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    texts = [ast.literal_eval(line.split("text: ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith("    text: ")]
    served = asyncio.run(complete_all(dp1.url, prompts))
    assert texts == [b["choices"][0]["text"] for b in served]
    loaded = [json.loads(line) for line in done.stderr.splitlines() if '"model loaded"' in line]
    assert sorted(r["replica"] for r in loaded) == [0, 1]


def test_a_killed_replica_ends_only_its_requests_and_the_other_keeps_serving(checkpoint: Path):
    with ServerProcess(flags(checkpoint, "--dp", "2")) as server:
        loaded = [r for r in server.json_records() if r["event"] == "model loaded"]
        pids = {r["replica"]: r["worker_pids"][0] for r in loaded}
        streams = [BackgroundStream(server.url, {"prompt": p, "max_tokens": 400}) for p in PROMPTS[:4]]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.first.wait(120)
        assert {e: r["gauges"]["running"] + r["gauges"]["waiting"]
                for e, r in by_engine(server.url).items()} == {"0": 2, "1": 2}
        os.kill(pids[1], signal.SIGKILL)
        for stream in streams:
            stream.join(120)
        assert Counter(s.finish_reason for s in streams) == {"error": 2, "length": 2}
        replicas = by_engine(server.url)
        assert replicas["1"]["finish_reasons"]["error"] == 2
        assert (replicas["0"]["finish_reasons"]["error"], replicas["0"]["finish_reasons"]["length"]) == (0, 2)

        health = httpx.get(server.url + "/health")
        body = health.json()
        assert health.status_code == 200 and body["replicas"][0] == {"engine": "0", "status": "ok"}
        assert body["replicas"][1]["status"] == "error" and "died" in body["replicas"][1]["reason"]
        later = asyncio.run(complete_all(server.url, PROMPTS[:4]))  # all on replica 0
        assert all(b["choices"][0]["finish_reason"] == "length" for b in later)
        assert by_engine(server.url)["0"]["finish_reasons"]["length"] == 6

        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=30,
                 what="/health 503 with no replica left")
        body = httpx.get(server.url + "/health").json()
        assert body["status"] == "error" and "replica 0" in body["reason"] and "replica 1" in body["reason"]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and "died" in r.json()["message"]
