"""Decode graphs on the CPU, with a stand-in capture: a replayed, padded all-decode step gives
the eager step's logits and leaves every sequence's KV as the eager step does; prefill and
mixed steps run eagerly; the runner reserves the padding's scratch block and --enforce-eager
turns the graphs off."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pypto_serving.backends.cuda import CudaBackend
from pypto_serving.backends.graphs import DecodeGraphs, DecodeInputs, GraphSpec
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.worker.batch import prepare
from tests.worker.test_model_runner import FakeAccelerator
from tests.worker.tiny_models import BLOCK_SIZE, Driver

PROMPTS = [[(7 * i + 3 + j) % 256 for i in range(n)] for j, n in enumerate((5, 9, 3, 12))]


class FakeCapture:
    """A graph without a GPU: capture runs the step once; a replay runs it again over the same
    buffers and writes the output tensor the capture returned, as a CUDA graph's replay does."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[int] = []

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        out = step()
        rows = out.shape[0]
        self.captured.append(rows)

        def replay() -> torch.Tensor:
            self.replayed.append(rows)
            return out.copy_(step())

        return replay


def with_graphs(d: Driver, sizes: tuple[int, ...]) -> FakeCapture:
    """The runner's decode steps through graphs of `sizes`; the cache's last block is scratch."""
    runner, capture = d.runner, FakeCapture()
    scratch = (runner.num_blocks - 1) * BLOCK_SIZE  # the driver hands out blocks from 0
    spec = GraphSpec(sizes, runner.cfg.limits.max_model_len)
    runner.stack = DecodeGraphs(runner.model, runner.kv_caches, spec, scratch, runner.device, capture)
    return capture


def decode_run(d: Driver) -> list[torch.Tensor]:
    """Prefill three prompts, decode them (3 rows: padded to 4), one finishes (2 rows), a fourth
    joins in a mixed step, then all three decode (3 rows again); every step's logits."""
    params = SamplingParams(temperature=1.0, seed=5)
    out = [d.step([d.add(i, p, len(p), params) for i, p in enumerate(PROMPTS[:3])])[1]]
    for _ in range(2):
        out.append(d.step([d.next(i) for i in range(3)])[1])
    for _ in range(2):
        out.append(d.step([d.next(i) for i in (0, 2)], finished=[1] if len(out) == 3 else [])[1])
    out.append(d.step([d.next(0), d.add(3, PROMPTS[3], 12, params), d.next(2)])[1])
    for _ in range(3):
        out.append(d.step([d.next(i) for i in (0, 2, 3)])[1])
    return out


def test_replayed_padded_decode_steps_give_the_eager_logits_and_tokens(driver) -> None:
    graphs, _ = driver("llama")
    eager, _ = driver("llama")
    capture = with_graphs(graphs, (1, 2, 4))
    assert capture.captured == [4, 2, 1]  # the largest first, at start-up
    got, want = decode_run(graphs), decode_run(eager)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert graphs.tokens == eager.tokens
    # 3 decode rows pad to 4, 2 rows replay the graph of 2; prefill and mixed steps are eager
    assert capture.replayed == [4, 4, 2, 2, 4, 4, 4]


def test_padded_rows_leave_every_sequences_kv_as_the_unpadded_step_does(driver) -> None:
    """A portable run of a batch padded from 2 rows to 4 gives the 2 real rows the unpadded
    batch's hidden states and KV (to rounding: a matmul of 4 rows may round as one of 2 does
    not); the padding wrote the scratch block alone."""
    d, _ = driver("llama")
    for i, p in enumerate(PROMPTS[:2]):
        d.step([d.add(i, p, len(p))])
    runner = d.runner
    seqs = [d.next(0), d.next(1)]
    states = [runner.seqs[s.seq_id] for s in seqs]
    batch = prepare(seqs, states, BLOCK_SIZE, runner.device)
    before = [t.clone() for kv in runner.kv_caches for t in kv]
    with torch.inference_mode():
        want = runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches)
        after_eager = [t.clone() for kv in runner.kv_caches for t in kv]
        for t, saved in zip((t for kv in runner.kv_caches for t in kv), before, strict=True):
            t.copy_(saved)
        scratch_block = runner.num_blocks - 1
        scratch = scratch_block * BLOCK_SIZE
        padded = DecodeInputs.empty(4, runner.cfg.limits.max_model_len, scratch, runner.device)
        padded.fill(batch.input_ids, batch.positions, batch.attn, scratch)
        got = runner.model(padded.input_ids, padded.positions, padded.metadata(), runner.kv_caches)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    for t, e in zip((t for kv in runner.kv_caches for t in kv), after_eager, strict=True):
        torch.testing.assert_close(t[:scratch_block], e[:scratch_block], atol=1e-5, rtol=1e-5)
        assert e[scratch_block].abs().sum() == 0 < t[scratch_block].abs().sum()


@pytest.fixture
def cuda_on_cpu(monkeypatch) -> FakeCapture:
    """The cuda backend on CPU tensors: torch.cuda's memory API and graph capture stood in for
    (its Triton kernels run under Triton's interpreter, tests/conftest.py)."""
    pytest.importorskip("triton")
    capture = FakeCapture()
    fake = FakeAccelerator()
    monkeypatch.setattr(CudaBackend, "memory", property(lambda self: fake))
    monkeypatch.setattr(CudaBackend, "capture", lambda self: capture)
    return capture


def test_the_cuda_runner_captures_its_ladder_over_a_spare_block(driver, cuda_on_cpu) -> None:
    d, _ = driver("llama", backend="cuda", max_num_seqs=6, max_num_blocks=64)
    runner = d.runner
    assert runner.graph_sizes == [1, 2, 4, 6] and cuda_on_cpu.captured == [6, 4, 2, 1]
    assert runner.num_blocks == 64 and runner.kv_caches[0][0].shape[0] == 65  # the scratch block
    assert "decode graphs" in runner.budget.how
    d.step([d.add(i, p, len(p)) for i, p in enumerate(PROMPTS[:3])])
    d.step([d.next(i) for i in range(3)])
    assert cuda_on_cpu.replayed == [4]


def test_enforce_eager_captures_nothing(driver, cuda_on_cpu, monkeypatch) -> None:
    import msgspec

    from tests.worker import conftest

    real = conftest.worker_config
    monkeypatch.setattr(conftest, "worker_config", lambda *a, **kw: msgspec.structs.replace(
        real(*a, **kw), device=msgspec.structs.replace(real(*a, **kw).device, enforce_eager=True)))
    d, _ = driver("llama", backend="cuda", max_num_blocks=64)
    assert d.runner.graph_sizes == [] and cuda_on_cpu.captured == []
    assert d.runner.stack is None and d.runner.kv_caches[0][0].shape[0] == 64
