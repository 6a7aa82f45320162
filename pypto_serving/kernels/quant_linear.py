"""Weight-only quantized linear layers: packing, and the portable matmul over packed weights.

Weights are stored in panels of 16 output rows with one fp16 scale and zero per row and
group of 32 along K (w = q * scale + zero), the layout the CPU kernels in `kernels/cpu` read.
Levels are stored in "quads": for each 4 consecutive k, the 4 levels of a row side by side
(32 bits, which one vpmaddubsw + vpmaddwd sums against 4 activations), rows 0..7 then rows
8..15, so the int8 kernels load a panel as it is stored:
  int8: symmetric, q in [-127, 127], zero 0 (exact for GGUF Q8_0 weights);
  int4: asymmetric, q in [0, 15], zero = group minimum, the step that of the grid the
        group's weights already lie on where they do (GGUF Q4_1, Q4_K, Q5_K sub-blocks that
        use at most 16 levels: exact up to the fp16 scale), else (max - min) / 15; `pack`
        reports how far any weight moved;
  int5: levels 0..31, the nibbles stored as int4's plus one plane of high bits (5/8 of int8's
        bytes). Where a group's weights lie on a Q5_0 grid (w = s * (q - 16), s an fp16 scale,
        possibly negative), scale s and zero -16 s: exact, bit for bit. Other groups get
        int4's treatment with 32 levels.
The portable matmul dequantizes to fp32 and calls F.linear; it is the reference the fast
kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PANEL = 16
GROUP = 32
LEVELS = {4: 15, 5: 31, 8: 127}
GRID_TOLERANCE = 1e-3  # of a step: how far from a level a weight on a grid may be (fp32 rounding)


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)  # identity: kernels cache per weight
class PackedWeight:
    """An [n, k] weight, n padded to a multiple of 16 inside the panels."""

    # [n_pad / 16, k / 4, 64] int8 (8 bits): byte 32 h + 4 r + i = row 8 h + r at k = 4 j + i;
    # [n_pad / 16, k / 4, 32] uint8 (4 bits): byte 4 r + i = row r (low nibble) and row r + 8
    # (high nibble) at k = 4 j + i;
    # [n_pad / 16, k / 32, 320] uint8 (5 bits), per group of 32 along K: bytes 32 j + 4 r + i
    # = the low 4 bits of rows r and r + 8 at k = 4 j + i (j = 0..7, as int4), then bytes
    # 256 + 32 h + 4 r + i whose bit j is bit 4 of row 8 h + r at k = 4 j + i.
    q: torch.Tensor
    scale: torch.Tensor  # fp16 [n_pad / 16, k / 32, 16]
    zero: torch.Tensor  # fp16 [n_pad / 16, k / 32, 16]
    bits: int
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero))


def packed_layout(n: int, k: int, bits: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each of a packed [n, k] weight's tensors (`PackedWeight`)."""
    panels = -(-n // PANEL)
    q = {8: (panels, k // 4, 4 * PANEL), 4: (panels, k // 4, 2 * PANEL),
         5: (panels, k // GROUP, 10 * GROUP)}[bits]
    groups = ((panels, k // GROUP, PANEL), torch.float16)
    return {"q": (q, torch.int8 if bits == 8 else torch.uint8), "scale": groups, "zero": groups}


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
    safe_step = torch.where(step != 0, step, 1.0)  # int5 steps may be negative (Q5_0's d)
    # In place, and without the int8 zero (w - 0 is w): each pass over a big weight counts.
    q = wg / safe_step if bits == 8 else (wg - zero.float().unsqueeze(-1)).div_(safe_step)
    q = q.round_().clamp_(*_q_range(bits))
    moved = q * step if bits == 8 else (q * step).add_(zero.float().unsqueeze(-1))
    error = moved.sub_(wg).abs_().div_(safe_step.abs()).max()
    packed = PackedWeight(_panel_q(q.view(n_pad, k), bits), _panel_groups(scale), _panel_groups(zero),
                          bits, n, k)
    return packed, float(error)


def probe_rows(w: torch.Tensor) -> torch.Tensor:
    """The rows of `w` (padded to whole panels) that `pack`'s 4-bit grid search probes, as a
    weight of their own. Packed alone they get the steps they get in the whole weight, so
    their error is at most the whole's: a probe beyond a bound proves the whole is too."""
    n_pad = -(-w.shape[0] // PANEL) * PANEL
    if n_pad <= PROBE_ROWS:
        return w
    rows = torch.linspace(0, n_pad - 1, PROBE_ROWS).long()
    real = rows < w.shape[0]  # the others are padding: zero rows
    probe = w.new_zeros(PROBE_ROWS, w.shape[1])
    probe[real] = w[rows[real]]
    return probe


def symmetric_grid(w: PackedWeight) -> bool:
    """Every zero is its group's level midpoint times its scale, exactly: 0 for int8 panels
    (signed levels), -16 scale for int5 packed from Q5_0, -8 scale for int4 from Q4_0. The
    int8-activation kernels then compute the zeros from the scales instead of reading them: a
    sixth to a tenth fewer bytes per decode step on such panels."""
    if w.bits == 8:
        return not w.zero.any()
    return torch.equal(w.zero.float(), w.scale.float() * -(1 << (w.bits - 1)))


def _q_range(bits: int) -> tuple[int, int]:
    return (-127, 127) if bits == 8 else (0, LEVELS[bits])


def _scale_zero(wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero per [row, group]; the values the kernel computes with."""
    if bits == 8:  # symmetric; a 5- or 6-bit grid would fit exactly, but the search costs
        # seconds per large tensor at load for a rounding of 1/16 of such a grid's step
        scale = (wg.abs().amax(-1) / LEVELS[8]).half()
        return scale, torch.zeros_like(scale)
    if bits == 5:
        return _scale_zero5(wg)
    low, high = wg.amin(-1), wg.amax(-1)
    usual = (high - low) / LEVELS[4]
    step = _grid_step(wg, low, usual, high - low, LEVELS[4])
    return torch.where(step.isfinite(), step, usual).half(), low.half()


def _scale_zero5(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int5: scale s and zero -16 s where a group lies on a Q5_0 grid (`_offset_grid_step`; both
    exact in fp16, so dequantizing gives the weights back bit for bit), else the group's range
    over 32 levels (zero its minimum; a Q5_1 block's own grid up to the fp16 rounding)."""
    step = _offset_grid_step(wg)
    scale, zero = step.half(), (-16 * step).half()
    rest = step.isnan()
    if rest.any():
        w = wg[rest]  # [groups, 32]
        low, high = w.amin(-1), w.amax(-1)
        scale[rest] = ((high - low) / LEVELS[5]).half()
        zero[rest] = low.half()
    return scale, zero


def _offset_grid_step(wg: torch.Tensor) -> torch.Tensor:
    """Per [row, group], an fp16 step s (possibly negative) with every w / s an integer in
    -16..15 (GGUF Q5_0: w = d * (q - 16)), else NaN; 0 for a group of zeros. llama.cpp's
    quantizer puts the largest |w| at level -16 (d = max / -16, max signed); its imatrix search
    may put it at any level m, so the steps |w_max| / m come next, largest level first. A probe
    of rows spread over the tensor comes first: weights on no such grid skip the search."""
    probe = torch.linspace(0, wg.shape[0] - 1, min(PROBE_ROWS, wg.shape[0])).long()
    if wg.shape[0] > PROBE_ROWS and not _offset_search(wg[probe]).isfinite().any():
        return torch.full(wg.shape[:-1], torch.nan, device=wg.device)
    return _offset_search(wg)


def _offset_search(wg: torch.Tensor) -> torch.Tensor:
    shape, w = wg.shape[:-1], wg.reshape(-1, wg.shape[-1])
    largest, at = w.abs().max(-1)
    extreme = w.gather(-1, at.unsqueeze(-1)).squeeze(-1)
    found = torch.where(largest == 0, 0.0, torch.nan)
    todo = (largest > 0).nonzero().squeeze(-1)
    for level in range(16, 0, -1):
        if not len(todo):
            break
        candidate = -extreme[todo] / 16 if level == 16 else largest[todo] / level
        step = candidate.half().float()  # the step the packed weight will hold
        # the first 4 weights of a group rule most candidates out, at an eighth of the cost
        maybe = (step != 0) & _on_steps(w[todo, :4], step)
        fits = maybe.clone()
        fits[maybe] = _on_steps(w[todo[maybe]], step[maybe])
        found[todo[fits]] = step[fits]
        todo = todo[~fits]
    return found.view(shape)


def _on_steps(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Per row of w: every w / step is an integer in -16..15 (within GRID_TOLERANCE)."""
    levels = w / step.unsqueeze(-1)
    return ((levels - levels.round()).abs() < GRID_TOLERANCE).all(-1) & \
        (levels.amin(-1) > -16 - GRID_TOLERANCE) & (levels.amax(-1) < 15 + GRID_TOLERANCE)


def _grid_step(wg: torch.Tensor, origin: torch.Tensor, usual: torch.Tensor, span: torch.Tensor,
               highest: int) -> torch.Tensor:
    """Per [row, group], the step of a grid the weights already lie on, levels counted from
    `origin` within [0, highest] (inf where there is none). GGUF formats put a block's
    weights on such a grid, often without using every level: a Q4_K or Q5_K sub-block (scale x
    6-bit sub-scale, minus a minimum) may leave its top levels empty. The step is the `usual`
    one where it fits (Q4_1 blocks span their 16 levels), else the distance from the origin to
    the nearest value off it, divided by the level that value sits on (1, 2, ...: each tried
    only on the groups still without one, and only while the step still covers the group's span
    in `highest` levels). A probe of rows spread over the tensor comes first: a float
    checkpoint's weights lie on no grid and Q4_1 ones on the usual one, and both skip the
    search. (A group of equal weights "fits" any step; its scale is 0 either way.)"""
    probe = torch.linspace(0, wg.shape[0] - 1, min(PROBE_ROWS, wg.shape[0])).long()
    found = _search(wg[probe], origin[probe], usual[probe], span[probe], highest)
    if not found.isfinite().any() or torch.equal(found, usual[probe]):
        return torch.full_like(origin, torch.inf)  # no grid, or the usual step's (Q4_1, Q8_0)
    return _search(wg, origin, usual, span, highest)


PROBE_ROWS = 64


def _search(wg: torch.Tensor, origin: torch.Tensor, usual: torch.Tensor, span: torch.Tensor,
            highest: int) -> torch.Tensor:
    shape, groups = origin.shape, wg.shape[-1]
    w, o, sp = wg.reshape(-1, groups), origin.reshape(-1, 1), span.reshape(-1, 1)
    offsets = (w - o).abs()
    nearest = torch.where(offsets > sp * 1e-3, offsets, torch.inf).amin(-1, keepdim=True)
    found = torch.full((w.shape[0],), torch.inf)
    todo = torch.arange(w.shape[0])
    # the largest step that fits wins: candidates from the largest down, each tried only on the
    # groups no larger one fitted
    candidates = (usual.reshape(-1, 1), *(nearest / level for level in range(1, highest + 1)))
    for i, candidate in enumerate(candidates):
        if i >= 1:  # a step too small to cover the span now stays too small: those groups are done
            todo = todo[(candidate[todo] * highest >= sp[todo] * (1 - GRID_TOLERANCE)).squeeze(-1)]
            if not len(todo):
                break
        whole = len(todo) == w.shape[0]  # no copy of the whole weight on the first pass
        step = candidate if whole else candidate[todo]
        levels = ((w - o) if whole else (w[todo] - o[todo])) / step
        fits = ((levels - levels.round()).abs() < GRID_TOLERANCE).all(-1) & \
            (levels.amax(-1) < highest + GRID_TOLERANCE) & (levels.amin(-1) > -GRID_TOLERANCE)
        found[todo[fits]] = step[fits].squeeze(-1)
        todo = todo[~fits]
        if not len(todo):
            break
    return found.view(shape)


def _panel_q(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[n_pad, k] integer levels -> the panels' quads (see `PackedWeight.q`)."""
    n_pad, k = q.shape
    # [panel, half, row, quad, i] -> [panel, quad, half, row, i]
    quads = q.view(n_pad // PANEL, 2, PANEL // 2, k // 4, 4).permute(0, 3, 1, 2, 4)
    if bits == 8:
        return quads.to(torch.int8).reshape(n_pad // PANEL, k // 4, 4 * PANEL).contiguous()
    if bits == 5:
        return _panel_q5(q)
    nibbles = quads.to(torch.uint8)
    packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # rows 0..7 low, rows 8..15 high
    return packed.reshape(n_pad // PANEL, k // 4, 2 * PANEL).contiguous()


def _panel_q5(q: torch.Tensor) -> torch.Tensor:
    """[n_pad, k] levels 0..31 -> [n_pad / 16, k / 32, 320] (see `PackedWeight.q`)."""
    n_pad, k = q.shape
    # [panel, half, row, group, quad, i] -> [panel, group, quad, half, row, i]
    levels = q.to(torch.uint8).view(n_pad // PANEL, 2, PANEL // 2, k // GROUP, GROUP // 4, 4)
    levels = levels.permute(0, 3, 4, 1, 2, 5)
    low = levels & 15
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).flatten(2)  # [panel, group, 256]
    shifts = torch.arange(GROUP // 4, dtype=torch.uint8, device=q.device).view(1, 1, -1, 1, 1, 1)
    high = ((levels >> 4) << shifts).sum(2, dtype=torch.uint8).flatten(2)  # bit j: quad j; [.., 64]
    return torch.cat([nibbles, high], -1).contiguous()


def _panel_groups(values: torch.Tensor) -> torch.Tensor:
    """[n_pad, k / 32] -> [n_pad / 16, k / 32, 16]."""
    n_pad, groups = values.shape
    return values.view(n_pad // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def unpack_levels(w: PackedWeight) -> torch.Tensor:
    """The integer levels as [n_pad, k] float32."""
    panels = w.q.shape[0]
    if w.bits == 8:
        quads = w.q.view(panels, w.k // 4, 2, PANEL // 2, 4)
    elif w.bits == 5:
        groups = w.q.view(panels, w.k // GROUP, 10 * GROUP)
        nibbles = groups[..., : 8 * GROUP].reshape(panels, w.k // GROUP, GROUP // 4, PANEL // 2, 4)
        low = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [panel, group, quad, half, row, i]
        high = groups[..., 8 * GROUP :].reshape(panels, w.k // GROUP, 1, 2, PANEL // 2, 4)
        shifts = torch.arange(GROUP // 4, dtype=torch.uint8, device=w.q.device).view(1, 1, -1, 1, 1, 1)
        quads = (low | (((high >> shifts) & 1) << 4)).reshape(panels, w.k // 4, 2, PANEL // 2, 4)
    else:
        nibbles = w.q.view(panels, w.k // 4, PANEL // 2, 4)
        quads = torch.stack([nibbles & 15, nibbles >> 4], dim=2)
    # [panel, quad, half, row, i] -> [panel, half, row, quad, i]
    return quads.permute(0, 2, 3, 1, 4).reshape(-1, w.k).float()


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
