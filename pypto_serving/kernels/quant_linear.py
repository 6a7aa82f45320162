"""Weight-only quantized linear layers: packing, and the portable matmul over packed weights.

Weights are stored in panels of 16 output rows with one fp16 scale and zero per row and
group of 32 along K (w = q * scale + zero), the layout the CPU kernel in `kernels/cpu` reads:
  int8: symmetric, q in [-127, 127], zero 0 (exact for GGUF Q8_0 weights);
  int4: asymmetric, q in [0, 15], zero = group minimum (exact for GGUF Q4_1 weights, whose
        groups span their 16 levels; `pack` reports how far any weight moved).
The portable matmul dequantizes to fp32 and calls F.linear; it is the reference the fast
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PANEL = 16
GROUP = 32
LEVELS = {4: 15, 8: 127}


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)  # identity: kernels cache per weight
class PackedWeight:
    """An [n, k] weight, n padded to a multiple of 16 inside the panels."""

    q: torch.Tensor  # uint8 [n_pad / 16, k, 8] (4 bits) or int8 [n_pad / 16, k, 16] (8 bits)
    scale: torch.Tensor  # fp16 [n_pad / 16, k / 32, 16]
    zero: torch.Tensor  # fp16 [n_pad / 16, k / 32, 16]
    bits: int
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero))


def can_pack(n: int, k: int) -> bool:
    return k % GROUP == 0 and n > 0


def pack(w: torch.Tensor, bits: int) -> tuple[PackedWeight, float]:
    """(packed weight, largest |w - dequantized| relative to its group's step)."""
    n, k = w.shape
    if not can_pack(n, k):
        raise ValueError(f"cannot pack a [{n}, {k}] weight: K must be a multiple of {GROUP}")
    n_pad = -(-n // PANEL) * PANEL
    wg = F.pad(w.float(), (0, 0, 0, n_pad - n)).view(n_pad, k // GROUP, GROUP)
    scale, zero = _scale_zero(wg, bits)
    step = scale.float().unsqueeze(-1)
    q = ((wg - zero.float().unsqueeze(-1)) / torch.where(step > 0, step, 1.0)).round()
    q = q.clamp(*_q_range(bits))
    error = (q * step + zero.float().unsqueeze(-1) - wg).abs() / torch.where(step > 0, step, 1.0)
    packed = PackedWeight(_panel_q(q.view(n_pad, k), bits), _panel_groups(scale), _panel_groups(zero),
                          bits, n, k)
    return packed, float(error.max())


def _q_range(bits: int) -> tuple[int, int]:
    return (0, 15) if bits == 4 else (-127, 127)


def _scale_zero(wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero per [row, group]; the values the kernel computes with."""
    if bits == 8:
        scale = (wg.abs().amax(-1) / LEVELS[8]).half()
        return scale, torch.zeros_like(scale)
    low, high = wg.amin(-1), wg.amax(-1)
    return ((high - low) / LEVELS[4]).half(), low.half()


def _panel_q(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[n_pad, k] integer levels -> [n_pad / 16, k, 16] (int8) or [.., k, 8] nibble pairs."""
    n_pad, k = q.shape
    lanes = q.view(n_pad // PANEL, PANEL, k).transpose(1, 2)
    if bits == 8:
        return lanes.to(torch.int8).contiguous()
    nibbles = lanes.to(torch.uint8)
    return (nibbles[..., :8] | (nibbles[..., 8:] << 4)).contiguous()


def _panel_groups(values: torch.Tensor) -> torch.Tensor:
    """[n_pad, k / 32] -> [n_pad / 16, k / 32, 16]."""
    n_pad, groups = values.shape
    return values.view(n_pad // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def unpack_levels(w: PackedWeight) -> torch.Tensor:
    """The integer levels as [n_pad, k] float32."""
    if w.bits == 8:
        lanes = w.q.float()
    else:
        lanes = torch.cat([w.q & 15, w.q >> 4], dim=-1).float()
    return lanes.transpose(1, 2).reshape(-1, w.k)


def dequantize(w: PackedWeight) -> torch.Tensor:
    """[n, k] float32, bit-identical to the kernels' fused multiply-add dequantization."""
    q = unpack_levels(w).view(-1, w.k // GROUP, GROUP)
    scale = w.scale.transpose(1, 2).reshape(-1, w.k // GROUP, 1).float()
    zero = w.zero.transpose(1, 2).reshape(-1, w.k // GROUP, 1).float()
    # q * scale is exact in fp32 (<= 8 + 11 significant bits), so this rounds once, like an fma.
    return (q * scale + zero).view(-1, w.k)[: w.n]


def quant_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Portable: x [..., k] -> [..., n] through the dequantized weight; bias [n], or padded
    to whole panels (as the CPU kernel takes it)."""
    return F.linear(x, dequantize(w).to(x.dtype), None if bias is None else bias[: w.n])


def quant_embedding(ids: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Portable: rows `ids` [t] of the weight -> [t, k]."""
    return dequantize(w)[ids]
