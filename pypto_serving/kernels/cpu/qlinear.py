"""The C kernels of qlinear.c and qdot.c over `PackedWeight`s: the same contract as the
portable `quant_linear` / `quant_embedding`, with float32 activations (qlinear.c, equal to the
portable path up to summation order) or with activations quantized to int8 per row and group
of 32 (qdot.c, `quant_linear_cpu_q8`: ~2x the multiply-adds per second on 4-bit weights).

A decode step makes ~120 of these calls, so the weight's pointers are turned into ctypes
arguments once per weight (cached on it), not on every call.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from pypto_serving.kernels.cpu import library
from pypto_serving.kernels.quant_linear import PANEL, PackedWeight, symmetric_grid

_ARGS: weakref.WeakKeyDictionary[PackedWeight, tuple[tuple, tuple]] = weakref.WeakKeyDictionary()


def weight_args(w: PackedWeight, quantized: bool = False) -> tuple:
    """(k, n_blocks, q, scale, zero, bits) as ctypes values; `w` keeps its tensors alive. For
    the int8-activation kernels (`quantized`) zero is NULL on a symmetric grid: they compute
    the zeros from the scales (`symmetric_grid`)."""
    both = _ARGS.get(w)
    if both is None:
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (w.q, w.scale, w.zero)]
        args = (ctypes.c_int64(w.k), ctypes.c_int64(w.q.shape[0]), *ptrs, ctypes.c_int64(w.bits))
        zero = ctypes.c_void_p(None) if symmetric_grid(w) else ptrs[2]
        both = _ARGS[w] = args, (*args[:4], zero, args[5])
    return both[quantized]


# qdot.c's `planes` for each --activation-quantization (also the C stack's and fused MoE's):
# 0 float activations (qlinear.c), 1 int8, 2 two int8 planes, 3 int8 with two planes for the
# outlier groups.
ACTIVATION_PLANES = {"none": 0, "int8": 1, "int16": 2, "mixed": 3}
INT16_HEAD = 4  # `_linear`'s planes for qhead.c's one int16 plane


def quant_linear_cpu(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] float32 -> [..., n]; bias padded to whole panels (n_blocks * 16)."""
    return _linear(ACTIVATION_PLANES["none"], x, w, bias)


def quant_linear_cpu_q8(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `quant_linear_cpu`, with x quantized to int8 per row and group of 32 first."""
    return _linear(ACTIVATION_PLANES["int8"], x, w, bias)


def quant_linear_cpu_q16(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `quant_linear_cpu_q8`, with a second int8 plane for each rounding's residual (in
    steps of d / 254): about 15-bit activations, at twice the integer multiply-adds."""
    return _linear(ACTIVATION_PLANES["int16"], x, w, bias)


def quant_linear_cpu_mixed(x: torch.Tensor, w: PackedWeight,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `quant_linear_cpu_q8`, with the second plane of `quant_linear_cpu_q16` for the groups
    of a row whose int8 rounding error is a sizeable part of the row (d^2 > 1e-6 sum(x^2): the
    groups of its outlier channels): those groups' rounding errors, which dominate the row's,
    shrink 254 times, at the cost of one more pass over those groups only."""
    return _linear(ACTIVATION_PLANES["mixed"], x, w, bias)


def quant_linear_cpu_head(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The lm_head's matmul: int8 panels against x quantized to int16 per row and group of 32
    (qhead.c: about 15-bit activations, exact integer dots, one vpmaddwd per 16 products), the
    same for a row alone or in any batch. Other widths take the two-plane int16 kernel."""
    return _linear(INT16_HEAD if w.bits == 8 else ACTIVATION_PLANES["int16"], x, w, bias)


_L1MAX: weakref.WeakKeyDictionary[PackedWeight, torch.Tensor] = weakref.WeakKeyDictionary()


def head_argmax_cpu(x: torch.Tensor, w: PackedWeight) -> torch.Tensor | None:
    """Each row's argmax of `quant_linear_cpu_head(x, w)` (first index on ties), from the
    int16 logits of a few candidate panels that int8-activation logits and a bound on their
    error pick (qhead.c, `qhead_greedy`; a row with too many candidates takes the whole int16
    head); None where that does not apply (not int8 panels, no AVX-512 VNNI, a row not
    finite): the caller computes the logits."""
    if w.bits != 8 or x.dim() != 2 or not x.shape[0] or x.dtype != torch.float32 \
            or not library().qdot_use_vnni(-1):
        return None
    x = x.contiguous()
    k, n_blocks, q, scale, _, _ = weight_args(w)
    l1max = _L1MAX.get(w)
    if l1max is None:
        l1max = _L1MAX[w] = torch.empty(n_blocks.value * PANEL)
        library().qhead_l1max(k, n_blocks, q, scale, l1max.data_ptr())
    out = torch.empty(x.shape[0], dtype=torch.int64)
    status = library().qhead_greedy(x.data_ptr(), x.shape[0], k, n_blocks, w.n, q, scale, l1max.data_ptr(),
                                    out.data_ptr())
    if status == -1:
        raise MemoryError(f"greedy head: no memory for {x.shape[0]} rows")
    if status < 0:
        return None
    if status:  # rows with too many candidates: their logits are needed after all
        flat = out < 0
        out[flat] = quant_linear_cpu_head(x[flat], w).argmax(-1)
    return out


def _linear(planes: int, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`planes`: one of ACTIVATION_PLANES, or INT16_HEAD (one int16 plane, int8 weights)."""
    if x.dim() != 2:
        return _linear(planes, x.reshape(-1, w.k), w, bias).view(*x.shape[:-1], w.n)
    if not x.is_contiguous():
        x = x.contiguous()
    args = weight_args(w, quantized=planes > 0)
    out = torch.empty(x.shape[0], args[1].value * PANEL)
    if x.shape[0]:
        lib, b = library(), bias if bias is None else bias.data_ptr()
        if planes == INT16_HEAD:
            status = lib.qlinear_a16(x.data_ptr(), x.shape[0], *args[:4], b, out.data_ptr())
        elif planes:
            status = lib.qlinear_q8(x.data_ptr(), x.shape[0], *args, b, out.data_ptr(), planes)
        else:
            status = lib.qlinear(x.data_ptr(), x.shape[0], *args, b, out.data_ptr())
        if status:  # the quantizing kernels only: their activation buffer could not be allocated
            raise MemoryError(f"quantized linear: no memory for {x.shape[0]} rows of {w.k} activations")
    return out if out.shape[1] == w.n else out[:, : w.n]


def quant_embedding_cpu(ids: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Rows `ids` [t] of the weight -> [t, k] float32."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.k, dtype=torch.float32)
    if ids.numel():
        k, _, q, scale, zero, bits = weight_args(w)
        library().qgather(ids.data_ptr(), ids.numel(), k, q, scale, zero, bits, out.data_ptr())
    return out
