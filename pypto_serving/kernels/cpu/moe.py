"""The fused-MoE op of moe.c: the portable `fused_moe`'s contract (kernels/moe.py) over an
`ExpertGroup` whose experts are packed, in one C call per layer and step.

The group's C table (every expert's weight pointers) is built once per `PackedExperts` and
cached on it. Where the C op does not fit (float experts, a width the kernels do not take,
not float32) the portable op runs.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from pypto_serving.kernels.cpu import library
from pypto_serving.kernels.cpu.qlinear import ACTIVATION_PLANES
from pypto_serving.kernels.moe import ExpertGroup, PackedExperts, fused_moe, group_by_expert
from pypto_serving.kernels.quant_linear import PANEL, PackedWeight

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):
    _fields_ = [("q", _P), ("scale", _P), ("zero", _P), ("k", _I), ("n_blocks", _I), ("bits", _I)]


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", _Linear), ("down", _Linear)]


_TABLES: weakref.WeakKeyDictionary[PackedExperts, ctypes.Array] = weakref.WeakKeyDictionary()


def _linear(w: PackedWeight) -> _Linear:
    return _Linear(w.q.data_ptr(), w.scale.data_ptr(), w.zero.data_ptr(), w.k, w.q.shape[0], w.bits)


def _table(packed: PackedExperts) -> ctypes.Array:
    table = _TABLES.get(packed)
    if table is None:
        table = _TABLES[packed] = (_Expert * len(packed.gate_up))(*(
            _Expert(_linear(g), _linear(d)) for g, d in zip(packed.gate_up, packed.down, strict=True)))
    return table


def fits(packed: PackedExperts | None, hidden: int) -> bool:
    """The C op takes these experts: gate_up exactly 2 x inter wide, inter a multiple of 8
    (silu_and_mul's), down back to `hidden`."""
    return packed is not None and all(
        g.n == 2 * d.k and d.k % 8 == 0 and g.q.shape[0] * PANEL == g.n and g.k == hidden and d.n == hidden
        for g, d in zip(packed.gate_up, packed.down, strict=True))


def fused_moe_cpu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  experts: ExpertGroup) -> torch.Tensor:
    """As `kernels.moe.fused_moe`, in C where the experts are packed (float32 only)."""
    packed = experts.packed
    if x.dtype != torch.float32 or x.dim() != 2 or not fits(packed, x.shape[1]):
        return fused_moe(x, weights, ids, experts)
    x = x.contiguous()
    routes, offsets = group_by_expert(ids, experts.first, len(experts))
    flat_weights = weights.float().contiguous()
    out = torch.zeros_like(x)
    status = library().moe_experts(
        x.data_ptr(), x.shape[1], ids.shape[1], _table(packed), len(experts), routes.data_ptr(),
        offsets.data_ptr(), flat_weights.data_ptr(), ACTIVATION_PLANES[packed.activations], out.data_ptr())
    if status:
        raise MemoryError(f"fused MoE: no memory for the rows of a {x.shape[0]}-token step")
    return out
