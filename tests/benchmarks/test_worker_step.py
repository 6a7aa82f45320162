"""`benchmarks/worker_step.py --linears`: a batch-1 step's packed linears timed alone, per
kind and width, with the bytes of weights each reads per second."""

from __future__ import annotations

from pathlib import Path

from benchmarks.worker_step import runner_for, time_linears
from tests.worker.tiny_models import write_tiny_gguf


def test_linears_are_timed_per_kind_and_width_with_their_bandwidth(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q5_0.gguf", "llama", linear_type="Q5_0")
    runner = runner_for(str(path), 1, "auto", "int8")
    got = time_linears(runner, steps=3)
    # the tiny llama's four linears per layer, packed to int5 from Q5_0; the lm_head is not among them
    assert set(got) == {"all", "qkv_proj int5", "o_proj int5", "gate_up_proj int5", "down_proj int5"}
    assert all(ms > 0 and gbs > 0 for ms, gbs in got.values())
    assert got["all"][0] >= max(ms for kind, (ms, _) in got.items() if kind != "all")
