"""Rotary position embedding (HF / neox half-rotation layout) with linear and llama3 scaling.

The cos/sin cache is built once per model; `rotary_cos_sin` gathers the rows of one step's
positions once per forward, and every layer reuses them.
"""

from __future__ import annotations

import math

import torch

from pypto_serving.loader.arch import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unknown rope scaling kind {scaling.kind!r}")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn more than `beta_fast` times over the original context keep
    their value, those under `beta_slow` times are divided by `factor`, a linear ramp between
    (the correction range rounded outwards, as transformers does)."""
    def correction_dim(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.fast_rotations)), 0)
    high = min(math.ceil(correction_dim(s.slow_rotations)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the unscaled frequency
    # theta ** (2i / dim) again, so that the sums round as transformers' do
    periods = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (s.factor * periods) * (1 - keep) + inv_freq * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2, head_dim / 2] float32: cos and sin per position."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    return torch.stack([freqs.cos(), freqs.sin()], dim=1)


def rotary_cos_sin(
    cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `positions` [T] -> cos, sin [T, 1, head_dim / 2] (broadcast over heads)."""
    rows = cache[positions].to(dtype)
    return rows[:, 0].unsqueeze(1), rows[:, 1].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by its token's angle; halves pair up (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
