"""KV cache sizing and allocation: per layer, k and v [num_blocks, block_size, kv_heads, d]."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pypto_serving.loader.arch import ModelArch

KVCache = tuple[torch.Tensor, torch.Tensor]


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """k and v of every layer for one block."""
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_token * block_size


def num_kv_blocks(budget_bytes: int, block_bytes: int, max_blocks: int) -> int:
    """As many blocks as the budget holds, capped; a budget under one block is an error."""
    blocks = min(max_blocks, budget_bytes // block_bytes)
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_bytes} bytes; "
            "give the KV cache more memory or use a smaller --block-size or --max-model-len"
        )
    return blocks


def allocate_kv_cache(
    arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
) -> list[KVCache]:
    """`zeros(shape, dtype)` is the backend's storage (zeros: padded slots are masked, but
    0 * NaN garbage would still be NaN)."""
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(arch.num_layers)]
