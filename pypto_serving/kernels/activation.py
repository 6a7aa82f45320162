"""Gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*i] = [gate | up] -> silu(gate) * up [..., i]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
