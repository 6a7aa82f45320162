"""The cuda backend's decoder ops (SDPA prefill, Triton paged decode under Triton's
interpreter) run a whole tiny model as the portable ones do, on CPU tensors."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from pypto_serving.backends.cuda import CudaBackend  # noqa: E402
from pypto_serving.kernels.decoder_ops import PORTABLE  # noqa: E402
from tests.worker.test_decoder_stack import steps_of_every_kind  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton without its interpreter (tests/conftest.py); no GPU here")


def test_the_cuda_backends_decoder_ops_run_a_model_as_the_portable_ones_do(driver, monkeypatch):
    """Every kind of step (prefill, decode, mixed, a cached prefix) through a tiny Llama."""
    from pypto_serving.kernels.triton import paged_attention

    calls = []
    kernel = paged_attention.paged_decode_attention
    monkeypatch.setattr(paged_attention, "paged_decode_attention",
                        lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    assert CudaBackend("cpu", torch.float32).decoder_ops(packed=False).attend is not PORTABLE.attend
    runs_as_the_portable_ops(driver, "llama")
    assert len(calls) == 2 * 7  # both layers of every step with decode rows


def test_sliding_window_layers_keep_their_window_on_the_cuda_backends_ops(driver):
    """Gemma 3's sliding layers: SDPA prefill gets the window, and decode rows past it take
    the portable kernel (the paged one reads every key)."""
    runs_as_the_portable_ops(driver, "gemma3")


def runs_as_the_portable_ops(driver, name: str) -> None:
    """Checkpoint `name` with the cuda backend's decoder ops steps as with the portable ones."""
    cuda_ops = CudaBackend("cpu", torch.float32).decoder_ops(packed=False)
    fast, _ = driver(name)
    slow, _ = driver(name)
    for module in fast.runner.model.modules():
        if hasattr(module, "ops"):
            module.ops = cuda_ops
    got, want = steps_of_every_kind(fast), steps_of_every_kind(slow)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert fast.tokens == slow.tokens
