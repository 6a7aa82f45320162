"""Paged decode attention in Triton: one query per sequence against its cached context, read
through the step's slot table straight from the paged KV cache (no gathered, padded copy).

One program per (sequence, KV head): the query heads that share the KV head (GQA) are the rows
of one tile, so each key and value vector is read once for all of them. Keys come in tiles of
BLOCK_N; softmax is online (running max and sum, float32), so the context can be any length.
Heads wider than a power of two, and groups smaller than 16 rows (tl.dot's minimum on tensor
cores), are padded with masked lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, out_ptr, scale,
                   stride_qb, stride_qh, stride_sb, kv_row, stride_ob, stride_oh,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK: tl.constexpr, LOW_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = dd < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dd[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    n = tl.load(lens_ptr + b)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        n_ok = offs < n
        slot = tl.load(slots_ptr + b * stride_sb + offs, mask=n_ok, other=0).to(tl.int64)
        kv = slot[:, None] * kv_row + kvh * D + dd[None, :]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)
        if LOW_PRECISION:  # bf16/fp16 tensor cores, float32 accumulation
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        else:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)
        if LOW_PRECISION:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, lens: torch.Tensor, scale: float,
                           tensor_cores: bool = False) -> torch.Tensor:
    """q [B, heads, d] (rows may be strided; heads contiguous), caches [blocks, block_size,
    kv_heads, d] (contiguous), slots [B, L] (each sequence's context slots, padded), lens [B]
    -> [B, heads, d] in q's dtype. Every sequence needs at least one key. `tensor_cores`:
    bf16/fp16 caches are multiplied in their own dtype (float32 accumulation), not in float32."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads or k_cache.shape[3] != d or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"paged_decode_attention: {heads} query heads over caches {tuple(k_cache.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    slots, lens = slots.contiguous(), lens.contiguous()
    out = torch.empty(b, heads, d, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    low = tensor_cores and k_cache.dtype in (torch.bfloat16, torch.float16)
    pad_g, pad_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    _decode_kernel[(b, kv_heads)](
        q, k_cache, v_cache, slots, lens, out, scale,
        q.stride(0), q.stride(1), slots.stride(0), kv_heads * d, out.stride(0), out.stride(1),
        GROUP=group, G_PAD=pad_g, D=d, D_PAD=pad_d, BLOCK=BLOCK_N, LOW_PRECISION=low)
    return out
