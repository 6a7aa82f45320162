"""Paged attention over flattened varlen tokens, portable torch (SDPA on gathered pages).

Decode-like sequences (one query this step) run as one batched SDPA padded to the longest
context; each multi-token chunk (prefill, possibly after a cached prefix) runs its own SDPA
over its whole context, causal within the chunk. The metadata is built once per step.

A sliding-window layer (Gemma 3) attends to the last `window` positions only, itself
included (transformers' `kv_idx > q_idx - window`): `with_window` gives the step's metadata
for such layers, once per step; the KV cache still holds every position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pypto_serving.kernels.paged_kv import gather_kv

PREFILL_BLOCK = 128  # query rows per block of a prefill chunk's attention


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    start: int  # first row of the chunk in the flattened tokens
    end: int
    ctx_slots: torch.Tensor  # [L] slots of positions 0..L-1 (prefix + this chunk)


@dataclass(frozen=True, slots=True)
class BlockTables:
    """The step's block tables, for kernels that read the paged cache through them rather
    than through slots (the npu backend's fused attention); built once per step."""

    decode: torch.Tensor | None  # [Bd, max blocks] int32, the single-query rows' (padded with 0)
    decode_lens: tuple[int, ...]  # their context lengths, on the host
    prefills: tuple[torch.Tensor, ...]  # [1, blocks] int32 of each prefill segment, in order


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's k/v is written
    decode_rows: torch.Tensor | None  # [Bd] flattened row of each single-query sequence
    decode_slots: torch.Tensor | None  # [Bd, L] context slots, padded to the longest
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] True = a real context position
    prefills: tuple[PrefillSegment, ...]
    all_decode: bool  # every row is a single-query sequence, in order: no scatter needed
    decode_lens: torch.Tensor | None = None  # [Bd] context length of each single-query sequence
    window: int = 0  # keys a query sees, itself included (0: all); decode_mask already has it
    tables: BlockTables | None = None  # the same context as block tables (None: slots only)


def with_window(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` for a sliding-window layer: decode rows lose the keys older than the window
    (prefill chunks apply it in their kernel)."""
    if not window:
        return meta
    mask = meta.decode_mask
    if mask is not None:
        lens = mask.sum(dim=-1, keepdim=True)  # [Bd, 1, 1, 1]: real positions are 0 .. len - 1
        mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= lens - window)
    return dataclasses.replace(meta, decode_mask=mask, window=window)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
    prefill: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [T, heads, head_dim] attends to the cached context of its sequence -> [T, heads, d].

    `decode` (q rows of the single-query sequences -> their output) and `prefill` (a chunk's
    q rows and its context slots -> their output) replace the portable kernels, so a backend
    can give each kind of row one kernel in every kind of step."""
    if decode is None:
        def decode(dq: torch.Tensor) -> torch.Tensor:
            return decode_attention(dq, k_cache, v_cache, meta.decode_slots, meta.decode_mask, scale)
    if prefill is None:
        def prefill(pq: torch.Tensor, ctx_slots: torch.Tensor) -> torch.Tensor:
            return prefill_attention(pq, k_cache, v_cache, ctx_slots, scale, meta.window)

    if meta.all_decode:
        return decode(q)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = decode(q[meta.decode_rows])
    for seg in meta.prefills:
        out[seg.start : seg.end] = prefill(q[seg.start : seg.end], seg.ctx_slots)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: q [B, H, d], slots [B, L], mask [B, 1, 1, L] -> [B, H, d].

    Plain matmuls, not SDPA: with one query row and a mask, CPU SDPA is ~10x slower.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    # Query heads sharing a kv head become that head's query rows: GQA without copying K/V.
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    k = gather_kv(k_cache, slots).to(q.dtype).permute(0, 2, 3, 1)  # [B, kv_heads, d, L]
    v = gather_kv(v_cache, slots).to(q.dtype).transpose(1, 2)  # [B, kv_heads, L, d]
    scores = torch.matmul(qg, k).float() * scale  # [B, kv_heads, group, L]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(batch, heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_slots: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One chunk: q [q, H, d], the last q of its context slots [L] -> [q, H, d], causal
    (and within `window` positions, when given).

    Blocks of PREFILL_BLOCK query rows, each against the keys up to its last row only, so the
    masked-out half of a causal square is never computed (CPU SDPA computes all of it and ran
    at ~6 GFLOP/s on a 512-token chunk); query heads that share a kv head are one matmul's
    rows (GQA without copying K/V); scores and softmax in float32. The accelerators' backends
    use `sdpa_prefill_attention` instead.
    """
    n_q, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    start = ctx_slots.shape[0] - n_q  # cached tokens before this chunk
    keys = gather_kv(k_cache, ctx_slots).to(q.dtype).permute(1, 2, 0)  # [kv_heads, d, L]
    values = gather_kv(v_cache, ctx_slots).to(q.dtype).transpose(0, 1)  # [kv_heads, L, d]
    out = torch.empty_like(q)
    for s in range(0, n_q, PREFILL_BLOCK):
        e = min(n_q, s + PREFILL_BLOCK)
        rows, seen = e - s, start + e
        first = max(0, start + s - window + 1) if window else 0  # the block's oldest key
        qb = q[s:e].view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(qb.reshape(kv_heads, group * rows, head_dim), keys[:, :, first:seen])
        scores = scores.view(kv_heads, group, rows, seen - first).float().mul_(scale)
        # only the block's own columns (its square on the diagonal) hold future keys
        future = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., seen - first - rows :].masked_fill_(future, float("-inf"))
        if window:
            scores.masked_fill_(_too_old(start + s, rows, first, seen, window, q.device), float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype)
        block = torch.matmul(probs.view(kv_heads, group * rows, seen - first), values[:, first:seen])
        block = block.view(kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
        out[s:e] = block.reshape(rows, heads, head_dim)
    return out


def _too_old(first_query: int, rows: int, first_key: int, seen: int, window: int,
             device: torch.device) -> torch.Tensor:
    """[rows, seen - first_key] True where key position is window or more behind the query's."""
    query_pos = torch.arange(first_query, first_query + rows, device=device).unsqueeze(1)
    return torch.arange(first_key, seen, device=device) <= query_pos - window


def sdpa_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           ctx_slots: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """`prefill_attention`'s contract through SDPA over the chunk's whole context."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    start = ctx_slots.shape[0] - q.shape[0]
    k = gather_kv(k_cache, ctx_slots).to(q.dtype).repeat_interleave(heads // kv_heads, dim=1)
    v = gather_kv(v_cache, ctx_slots).to(q.dtype).repeat_interleave(heads // kv_heads, dim=1)
    mask = None
    if start or window:
        query_pos = torch.arange(start, ctx_slots.shape[0], device=q.device).unsqueeze(1)
        key_pos = torch.arange(ctx_slots.shape[0], device=q.device)
        mask = key_pos <= query_pos
        if window:
            mask &= key_pos > query_pos - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(0, 1)
