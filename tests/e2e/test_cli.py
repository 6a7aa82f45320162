"""Flags are checked before any model loads; offline mode prints results."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.server import free_port


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pypto_serving", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, flag", [
    (["--max-model-len", "zero"], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--devices", "0,0"], "--devices"),
    (["--devices", "a"], "--devices"),
    (["--backend", "tpu"], "--backend"),
    (["--dtype", "int3"], "--dtype"),
    (["--generate-config", '{"temprature": 1}'], "temprature"),
    (["--generate-config", '{"top_k": "x"}'], "top_k"),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "100"], "--max-num-batched-tokens"),
])
def test_bad_flags_exit_2_with_one_line(args: list[str], flag: str):
    out = run_cli(*args, "--model", "/nonexistent")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], out.stderr


def test_npu_without_torch_npu():
    out = run_cli("--backend", "npu")
    assert out.returncode == 2
    assert "torch_npu" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_missing_model_is_named(tmp_path):
    out = run_cli("--model", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr
    (tmp_path / "config.json").write_text("{}")
    out = run_cli("--model", str(tmp_path))
    assert out.returncode == 2 and "safetensors" in out.stderr and "tokenizer" in out.stderr


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"not a model")
    out = run_cli("--model", str(path))
    assert out.returncode == 2 and "GGUF" in out.stderr


def test_offline_prompts_are_batched_and_printed():
    out = run_cli("--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
                  "--generate-config", '{"max_new_tokens": 6}', "--kv-cache-memory", "64MiB")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("finish_reason: length") == 2
    assert "token_ids: [" in out.stdout and "tokens/s" in out.stdout
    assert "[1] prompt: '1, 2, 3,'" in out.stdout


def test_offline_chat_with_vllm_style_shorthands():
    """--chat renders each prompt with the chat template; --max-tokens and --temperature
    stand in for the generate config."""
    out = run_cli("--prompt", "What is 1+1?", "--chat", "--max-tokens", "3", "--temperature", "0",
                  "--kv-cache-memory", "64MiB")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "finish_reason: length" in out.stdout
    ids = out.stdout.split("token_ids: [")[1].split("]")[0].split(",")
    assert len(ids) == 3


def test_packaged_qwen_coder_by_short_name():
    out = run_cli("--model", "qwen2.5-coder-0.5b", "--prompt", "def add(a, b):\n",
                  "--generate-config", '{"max_new_tokens": 8}', "--kv-cache-memory", "64MiB",
                  "--max-model-len", "256", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "return a + b" in out.stdout, out.stdout


def test_a_worker_that_cannot_start_is_one_error_line():
    """The worker fails after loading (no KV block fits): the server says why and exits 1,
    with no traceback and no process left behind."""
    out = run_cli("--kv-cache-memory", "1KiB", "--port", str(free_port()))
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert errors == [errors[0]] and "device worker could not start" in errors[0], out.stderr
    assert "KV cache budget" in errors[0] and "Traceback" not in out.stderr
