"""Tensor parallelism through the real command: offline mode on the packaged GGUFs, a group
spanning two `pypto-serving` processes (node 0 serving HTTP, node 1 only its rank), and the
flag and startup errors of the distributed flags."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.server import ServerProcess, free_port
from tests.e2e.test_cli import run_cli

PROMPTS = ("--prompt", "The capital of France is", "--prompt", "def add(a, b):")
# Packed weights, float activations: the ranks' partial sums differ from one rank's only in
# float rounding (int8 activations can tip a near tie late in a long greedy run).
PATH = ("--activation-quantization", "none", "--kv-cache-memory", "64MiB", "--max-model-len", "256")
QWEN = ("--model", "qwen2.5-coder-0.5b")


def token_ids(stdout: str) -> list[str]:
    return [part.split("]")[0] for part in stdout.split("token_ids: [")[1:]]


def offline(*args: str) -> list[str]:
    config = '{"max_new_tokens": 32, "ignore_eos": true}'
    out = run_cli(*PROMPTS, "--generate-config", config, *PATH, *args, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ids = token_ids(out.stdout)
    assert len(ids) == 2 and all(len(i.split(",")) == 32 for i in ids)
    return ids


def test_smollm2_over_three_ranks_gives_the_tokens_of_one():
    """9 heads and 3 KV heads: one KV head per rank."""
    assert offline("--tp", "3") == offline()


def test_qwen_coder_over_two_ranks_gives_the_tokens_of_one():
    """14 heads and 2 KV heads, q/k/v biases, an untied lm_head, Q4_K/Q6_K weights."""
    assert offline(*QWEN, "--tp", "2") == offline(*QWEN)


def _completion(url: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_group_spanning_two_nodes_serves_and_a_dead_node_is_engine_death():
    port = str(free_port())
    nodes = ("--tp", "2", "--nnodes", "2", "--master-port", port, *QWEN, *PATH)
    node1 = subprocess.Popen([sys.executable, "-m", "pypto_serving", *nodes, "--node-rank", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with ServerProcess([*nodes, "--node-rank", "0"], startup_timeout=600) as server:
            assert any("Parallelism:" in line and "tp 2" in line for line in server.lines)
            reply = _completion(server.url, 24)
            assert reply["choices"][0]["finish_reason"] == "length"
            assert "return" in reply["choices"][0]["text"]
            with urllib.request.urlopen(urllib.request.Request(
                    f"{server.url}/v1/completions", json.dumps(
                        {"prompt": "Write a long story.", "max_tokens": 200, "stream": True}).encode(),
                    {"Content-Type": "application/json"}), timeout=60) as stream:
                assert stream.readline().startswith(b"data: ")  # a token has come: it runs
                node1.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                rest = stream.read().decode()
                seconds = time.monotonic() - t0
            assert '"engine_error"' in rest or '"error"' in rest, rest[-500:]
            assert seconds < 5
            assert _health(server.url) == 503
    finally:
        node1.kill()
        node1.wait()


def test_node_0_names_the_node_that_did_not_join():
    out = run_cli("--tp", "3", "--nnodes", "3", "--master-port", str(free_port()),
                  "--distributed-timeout", "3", "--port", str(free_port()), *PATH)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "rank(s) [1, 2] (node(s) [1, 2]) did not join within 3 s" in out.stderr, out.stderr[-2000:]


def test_a_node_whose_master_never_answers_fails_with_one_line():
    out = run_cli("--tp", "3", "--nnodes", "3", "--node-rank", "2", "--master-port", str(free_port()),
                  "--distributed-timeout", "2", *PATH)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("pypto-serving: error: node 2 could not join")


@pytest.mark.parametrize(("args", "words"), [
    (["--tp", "2"], "--tensor-parallel-size 2: the model's 9 attention heads"),
    (["--tp", "3", "--devices", "0,1"], "--devices: 2 device(s) given but --dp x --tp is 3"),
    (["--tp", "3", "--nnodes", "3", "--node-rank", "3"], "--node-rank 3 is not one of the 3 node(s)"),
    (["--tp", "3", "--nnodes", "2"], "--nnodes 2: --tensor-parallel-size 3 does not split evenly"),
    (["--tp", "3", "--nnodes", "3", "--master-addr", "no-such-host.invalid"], "no such host"),
])
def test_bad_parallel_flags_exit_2_with_one_line(args: list[str], words: str):
    """(Checks that need the model's shape come after the "starting" log line.)"""
    out = run_cli(*args, "--port", str(free_port()))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and words in errors[0], out.stderr
