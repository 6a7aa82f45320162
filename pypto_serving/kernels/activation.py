"""Gated activations of the MLP: SiLU (Llama, Qwen), GELU-tanh (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*i] = [gate | up] -> silu(gate) * up [..., i]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*i] = [gate | up] -> gelu_tanh(gate) * up [..., i] (Gemma's GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
