"""`--weight-cache-dir` end to end: the second start of the default model maps the weights
the first one packed, says so, and generates the same tokens; `--no-weight-cache` writes none."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_cli import run_cli

OFFLINE = ("--prompt", "The capital of France is", "--generate-config", '{"max_new_tokens": 6}',
           "--kv-cache-memory", "64MiB")


def token_ids(stdout: str) -> str:
    return stdout.split("token_ids: [")[1].split("]")[0]


def test_the_second_start_maps_the_cache_and_generates_the_same_tokens(tmp_path: Path) -> None:
    cache = tmp_path / "weights"
    cold = run_cli(*OFFLINE, "--weight-cache-dir", str(cache))
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert "weight cache miss" in cold.stderr and "weight cache entry written" in cold.stderr
    warm = run_cli(*OFFLINE, "--weight-cache-dir", str(cache))
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "weight cache hit" in warm.stderr and "loading weights" not in warm.stderr
    assert token_ids(warm.stdout) == token_ids(cold.stdout)
    uncached = run_cli(*OFFLINE, "--no-weight-cache")
    assert uncached.returncode == 0 and "weight cache" not in uncached.stderr
    assert token_ids(uncached.stdout) == token_ids(cold.stdout)
