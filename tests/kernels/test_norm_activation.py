"""RMSNorm (Llama's and Gemma's), SiLU- and GELU-tanh-and-mul against their textbook definitions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pypto_serving.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pypto_serving.kernels.rmsnorm import add_rms_norm, gemma_rms_norm, rms_norm


def naive_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_matches_definition() -> None:
    x, w = torch.randn(5, 3, 32), torch.randn(32)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), naive_rms_norm(x, w, 1e-6))


def test_rms_norm_keeps_low_precision_dtype_and_computes_in_float32() -> None:
    x, w = torch.randn(4, 64) * 300, torch.randn(64)
    out = rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert out.dtype == torch.bfloat16
    ref = naive_rms_norm(x.bfloat16().float(), w.bfloat16().float(), 1e-6)
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)


def test_add_rms_norm_returns_the_new_residual() -> None:
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    normed, residual = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, naive_rms_norm(x + r, w, 1e-5))


def test_silu_and_mul() -> None:
    gate, up = torch.randn(6, 10), torch.randn(6, 10)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * up)


def test_gemma_rms_norm_scales_by_one_plus_weight_and_rounds_once() -> None:
    x, w = torch.randn(5, 32) * 30, torch.randn(32)
    torch.testing.assert_close(gemma_rms_norm(x, w, 1e-6), naive_rms_norm(x, 1 + w, 1e-6))
    low = gemma_rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    # Gemma rounds to bfloat16 after the weight multiply (Llama's norm rounds before it)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, gemma_rms_norm(x.bfloat16().float(), w.bfloat16(), 1e-6).bfloat16())


def test_gelu_tanh_and_mul() -> None:
    gate, up = torch.randn(6, 10) * 3, torch.randn(6, 10)
    out = gelu_tanh_and_mul(torch.cat([gate, up], dim=-1))
    tanh = torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))
    torch.testing.assert_close(out, 0.5 * gate * (1 + tanh) * up)
