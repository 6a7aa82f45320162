"""Paged KV cache: per layer, k and v of shape [num_blocks, block_size, num_kv_heads, head_dim].

A token's slot is `block_id * block_size + offset`; the cache viewed as
[num_blocks * block_size, num_kv_heads, head_dim] is indexed by slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, kv_heads, head_dim] of the step's tokens at `slot_mapping` [T]."""
    kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """slots [...] -> the cached vectors [..., kv_heads, head_dim]."""
    kv_heads, head_dim = cache.shape[2:]
    return cache.view(-1, kv_heads, head_dim)[slots]


def token_slots(block_tables: list[list[int]], spans: Sequence[Iterable[int]], block_size: int) -> list[int]:
    """Slot of each position of each row's span, in order: tables [B][blocks], spans [B]. On
    the host: one list for one transfer, where the same arithmetic on tensors took ~8 small ops
    per step (prepare's main cost at batch 1)."""
    return [table[p // block_size] * block_size + p % block_size
            for table, span in zip(block_tables, spans, strict=True) for p in span]


def context_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Slots of positions 0..length-1 for every row: [B, max_blocks] -> [B, length]."""
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = block_tables.unsqueeze(-1) * block_size + offsets
    return slots.flatten(1)[:, :length]
