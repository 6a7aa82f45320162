"""A stand-in `torch_npu` for the CPU: each operator asserts what its page in Ascend/op-plugin
(docs/zh/custom_APIs/torch_npu/) says about its arguments' shapes, dtypes and layouts, and
computes its result with the portable kernels (or the page's own formula), on CPU tensors.
`install` puts it (and a `torch.npu` memory API over a pretend device) where the npu backend
looks for them; `calls` counts each operator's calls."""

from __future__ import annotations

import collections
import importlib.machinery
import sys
import types

import pytest
import torch

from pypto_serving.kernels.activation import silu_and_mul
from pypto_serving.kernels.attention import decode_attention, prefill_attention
from pypto_serving.kernels.rmsnorm import rms_norm

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, *HALF)
calls: collections.Counter[str] = collections.Counter()


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor,
                 epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta)torch_npu-npu_rms_norm.md: x 2-8 dims; gamma the trailing dims, x's dtype or float32."""
    calls["npu_rms_norm"] += 1
    assert 2 <= x.dim() <= 8 and x.dtype in FLOATS, (x.shape, x.dtype)
    assert gamma.shape == x.shape[-1:] and gamma.dtype in (x.dtype, torch.float32), (gamma.shape, gamma.dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return rms_norm(x, gamma, epsilon), rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu-npu_add_rms_norm.md: x1, x2 alike; gamma x1's dtype and trailing dims; -> (y, rstd, x)."""
    calls["npu_add_rms_norm"] += 1
    assert x1.shape == x2.shape and x1.dtype == x2.dtype and x1.dtype in FLOATS, (x1.shape, x2.shape)
    assert gamma.dtype == x1.dtype and gamma.shape == x1.shape[-1:], (gamma.shape, gamma.dtype)
    total = x1 + x2
    y, rstd = npu_rms_norm(total, gamma, epsilon)
    calls["npu_rms_norm"] -= 1
    return y, rstd, total


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(beta)torch_npu-npu_swiglu.md: contiguous, even along `dim`; swish(first half) * second half."""
    calls["npu_swiglu"] += 1
    assert x.is_contiguous() and x.shape[dim] % 2 == 0 and x.dtype in FLOATS, (x.shape, x.dtype)
    assert dim == -1  # what the backend passes; silu_and_mul splits the last dim
    return silu_and_mul(x)


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                   rotate: torch.Tensor | None = None) -> torch.Tensor:
    """torch_npu-npu_rotary_mul.md, half mode: x BSND with D < 896 and even, B and N < 1000; r1
    and r2 1S1D or BS1D, in [-1, 1]; x * r1 + rotate_half(x) * r2."""
    calls["npu_rotary_mul"] += 1
    assert rotary_mode == "half" and rotate is None
    assert x.dim() == 4 and x.dtype in FLOATS, (x.shape, x.dtype)
    b, s, n, d = x.shape
    assert d < 896 and d % 2 == 0 and b < 1000 and n < 1000, x.shape
    for r in (r1, r2):
        assert r.shape in ((1, s, 1, d), (b, s, 1, d)) and r.dtype == x.dtype, (r.shape, r.dtype)
        assert r.abs().max() <= 1
    x1, x2 = x.chunk(2, dim=-1)
    return x * r1 + torch.cat([-x2, x1], dim=-1) * r2


def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """torch_npu-npu_scatter_nd_update_.md: indices int32/int64, at least 2-D, last dim a <=
    input's dims; updates indices.shape[:-1] + input.shape[a:], input's dtype; in place."""
    calls["npu_scatter_nd_update_"] += 1
    a = indices.shape[-1]
    assert indices.dtype in (torch.int32, torch.int64) and indices.dim() >= 2 and a <= input.dim()
    assert updates.shape == indices.shape[:-1] + input.shape[a:], (updates.shape, indices.shape, input.shape)
    assert updates.dtype == input.dtype, (updates.dtype, input.dtype)
    input[tuple(indices.long().unbind(-1))] = updates
    return input


def npu_fused_infer_attention_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                    block_table: torch.Tensor | None = None, block_size: int = 0,
                                    actual_seq_lengths: list[int] | None = None,
                                    actual_seq_lengths_kv: list[int] | None = None, num_heads: int = 1,
                                    num_key_value_heads: int = 0, scale: float = 1.0,
                                    input_layout: str = "BSH",
                                    sparse_mode: int = 0, atten_mask: torch.Tensor | None = None,
                                    **rest: object) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu-npu_fused_infer_attention_score.md, the PageAttention case with a BSH query and
    a BnBsH cache; the lengths are host ints."""
    calls["fused_attention_decode" if query.shape[1] == 1 else "fused_attention_prefill"] += 1
    assert not rest, f"arguments the backend does not mean to pass: {sorted(rest)}"
    assert input_layout == "BSH" and query.dim() == 3 and query.is_contiguous() and query.dtype in HALF
    batch, q_s, hidden = query.shape
    assert num_key_value_heads and num_heads % num_key_value_heads == 0
    assert num_heads // num_key_value_heads <= 64 and hidden % num_heads == 0
    head_dim = hidden // num_heads
    assert head_dim <= 512 and head_dim * query.element_size() % 16 == 0, head_dim
    assert key.shape == value.shape and key.dim() == 3 and key.dtype in HALF and value.dtype == key.dtype
    assert key.is_contiguous() and value.is_contiguous()
    assert key.shape[1:] == (block_size, num_key_value_heads * head_dim), (key.shape, block_size)
    _check_pages(q_s, block_size, block_table, batch, actual_seq_lengths_kv)
    assert scale != 1.0  # the page: the default 1.0 is almost always wrong; 1/sqrt(d) is meant
    cache = [c.view(*c.shape[:2], num_key_value_heads, head_dim) for c in (key, value)]
    q = query.view(batch, q_s, num_heads, head_dim)
    if q_s == 1:
        out = _decode(q[:, 0], cache, block_table, actual_seq_lengths_kv, scale)[:, None]
    else:
        _check_right_down_causal(sparse_mode, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                                 batch, q_s)
        out = torch.zeros_like(q)
        for b, (n, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv, strict=False)):
            slots = _slots(block_table[b], block_size, length)
            out[b, :n] = prefill_attention(q[b, :n], *cache, slots, scale)
    return out.reshape(batch, q_s, hidden), torch.zeros(1)


def _check_pages(q_s: int, block_size: int, table: torch.Tensor | None, batch: int,
                 lens: list[int] | None) -> None:
    if q_s > 1:
        assert block_size % 128 == 0 and 128 <= block_size <= 512, block_size
    else:
        assert 0 < block_size <= 512, block_size
    assert table is not None and table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == batch
    assert isinstance(lens, list) and len(lens) >= batch and all(type(n) is int for n in lens), lens
    assert max(lens[:batch]) <= table.shape[1] * block_size, (lens, table.shape)


def _check_right_down_causal(sparse_mode: int, mask: torch.Tensor | None, q_lens: list[int] | None,
                             kv_lens: list[int], batch: int, q_s: int) -> None:
    """sparse_mode 3 with the optimised 2048 x 2048 mask (True above the diagonal: not attended)."""
    assert sparse_mode == 3 and mask is not None and mask.dtype == torch.bool and mask.shape == (2048, 2048)
    assert torch.equal(mask, torch.ones(2048, 2048, dtype=torch.bool).triu_(1))
    assert isinstance(q_lens, list) and len(q_lens) >= batch and all(type(n) is int for n in q_lens)
    assert all(n <= min(q_s, k) for n, k in zip(q_lens, kv_lens, strict=False)), (q_lens, kv_lens)


def _slots(table_row: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    positions = torch.arange(length)
    return table_row.long()[positions // block_size] * block_size + positions % block_size


def _decode(q: torch.Tensor, cache: list[torch.Tensor], table: torch.Tensor, lens: list[int],
            scale: float) -> torch.Tensor:
    longest = max(lens)
    slots = torch.stack([_slots(row, cache[0].shape[1], longest) for row in table[: len(q)]])
    mask = torch.arange(longest) < torch.tensor(lens[: len(q)]).unsqueeze(1)
    return decode_attention(q, *cache, slots, mask[:, None, None, :], scale)


class _Memory(types.ModuleType):
    """torch.npu's memory calls the backend makes, over a pretend device of `total` bytes
    whose allocations are the CPU's (nothing is counted: the peak is 0)."""

    total = 8 << 30

    def synchronize(self, device: object = None) -> None: ...
    def reset_peak_memory_stats(self, device: object = None) -> None: ...
    def empty_cache(self) -> None: ...
    def memory_allocated(self, device: object = None) -> int: return 0
    def max_memory_allocated(self, device: object = None) -> int: return 0
    def memory_reserved(self, device: object = None) -> int: return 0
    def mem_get_info(self, device: object = None) -> tuple[int, int]: return self.total, self.total


def module() -> types.ModuleType:
    stand_in = types.ModuleType("torch_npu")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    for op in (npu_rms_norm, npu_add_rms_norm, npu_swiglu, npu_rotary_mul, npu_scatter_nd_update_,
               npu_fused_infer_attention_score):
        setattr(stand_in, op.__name__, op)
    stand_in.npu = _Memory("torch.npu")
    return stand_in


def install(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in as `torch_npu` (and its memory API as `torch.npu`) until the test ends."""
    stand_in = module()
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    monkeypatch.setattr(torch, "npu", stand_in.npu, raising=False)
    monkeypatch.delitem(sys.modules, "pypto_serving.kernels.npu", raising=False)  # binds torch_npu at import
    calls.clear()
    return stand_in
