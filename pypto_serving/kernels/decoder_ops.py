"""The kernels a decoder layer is made of, as one swappable set: portable torch, or the CPU
backend's fused C kernels (kernels/cpu/decoder.c) where they apply, portable elsewhere.

`attend` covers rotary -> KV write -> paged attention, so the CPU set can rotate q and k in
place inside the fused qkv projection and write the cache in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pypto_serving.kernels.activation import silu_and_mul
from pypto_serving.kernels.attention import AttentionMetadata, paged_attention
from pypto_serving.kernels.paged_kv import write_kv
from pypto_serving.kernels.rmsnorm import add_rms_norm, rms_norm
from pypto_serving.kernels.rotary import apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]
Rotary = tuple[torch.Tensor, torch.Tensor]
# (q, k, v [T, heads, d] views, rotary, kv, meta, scale) -> [T, heads, d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Rotary, KVCache, AttentionMetadata, float],
                  torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Portable: rotate q and k, store k and v, attend over each sequence's cached context."""
    q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
    return paged_attention(q, kv[0], kv[1], meta, scale)


@dataclass(frozen=True, slots=True)
class DecoderOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    attend: Attend


PORTABLE = DecoderOps(rms_norm, add_rms_norm, silu_and_mul, attend)


def decoder_ops(fast: bool) -> DecoderOps:
    """The CPU set when asked for and the C kernels can run here, else the portable one."""
    from pypto_serving.kernels import cpu

    if not (fast and cpu.available()):
        return PORTABLE
    from pypto_serving.kernels.cpu import decoder as c

    return DecoderOps(_fp32(c.rms_norm_cpu, rms_norm), _fp32(c.add_rms_norm_cpu, add_rms_norm),
                      _fp32(c.silu_and_mul_cpu, silu_and_mul), attend_cpu)


def _fp32(fast: Callable, portable: Callable) -> Callable:
    """`fast` for contiguous 2-D float32 rows of a width the kernels take (multiple of 8)."""
    def pick(x: torch.Tensor, *args: object) -> object:
        ok = x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 8 == 0
        return (fast if ok else portable)(x, *args)

    return pick


def attend_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv: KVCache,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The fused rotary + KV write when q, k, v are the fused projection's views and the cache
    is float32 or float16; the C attention for every row, decode and prefill, in every kind of
    step (with int8 activations a last-bit difference between two kernels can flip a
    rounding, so a token must see one kernel whatever it is batched with or chunked into)."""
    from pypto_serving.kernels.cpu.decoder import (
        decode_attention_cpu,
        prefill_attention_cpu,
        rope_write_kv_cpu,
    )

    if not _fused_qkv(q, k, v, kv, rotary):
        return attend(q, k, v, rotary, kv, meta, scale)
    width = (q.shape[1] + 2 * k.shape[1]) * q.shape[2]
    qkv = torch.as_strided(q, (q.shape[0], width), (width, 1))
    rope_write_kv_cpu(qkv, q.shape[1], k.shape[1], *rotary, meta.slot_mapping, *kv)
    if q.shape[2] > 64:  # the C attention keeps 8 keys of at most 64 floats on the stack
        return paged_attention(q, kv[0], kv[1], meta, scale)

    def decode(dq: torch.Tensor) -> torch.Tensor:
        return decode_attention_cpu(dq, kv[0], kv[1], meta.decode_slots, meta.decode_lens, scale)

    def prefill(pq: torch.Tensor, ctx_slots: torch.Tensor) -> torch.Tensor:
        return prefill_attention_cpu(pq, kv[0], kv[1], ctx_slots, scale)

    decode_kernel = decode if meta.decode_lens is not None else None
    return paged_attention(q, kv[0], kv[1], meta, scale, decode_kernel, prefill)


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, rotary: Rotary) -> bool:
    """q, k, v are consecutive column blocks of one contiguous float32 [T, (h + 2 kvh) d]."""
    t, heads, d = q.shape
    width = (heads + 2 * k.shape[1]) * d
    cos, sin = rotary
    return (
        q.dtype == cos.dtype == torch.float32 and kv[0].dtype in (torch.float32, torch.float16)
        and d % 16 == 0 and q.stride()[1:] == (d, 1)
        and (t == 1 or q.stride(0) == k.stride(0) == v.stride(0) == width)  # one row: any stride
        and k.data_ptr() == q.data_ptr() + heads * d * 4
        and v.data_ptr() == k.data_ptr() + k.shape[1] * d * 4
        and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
        and kv[0].is_contiguous() and kv[1].is_contiguous()
    )
