"""KV cache sizing and allocation: per layer, k and v [num_blocks, block_size, kv_heads, d]."""

from __future__ import annotations

import math
import mmap

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
    arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    # Zeros, not empty: padded context slots are masked, but 0 * NaN garbage would still be NaN.
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    zeros = lazy_zeros if device.type == "cpu" else torch.zeros
    return [(zeros(shape, dtype=dtype, device=device), zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_layers)]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in an anonymous mapping: the OS maps zero pages on first touch, so the cache
    costs resident memory only as blocks are used (torch.zeros writes every byte up front).
    Not numpy's calloc: numpy asks for transparent huge pages on large arrays, and then the
    first token written to a layer's cache made 2 MiB of it resident at once."""
    count = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, count, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)  # even where THP is "always"
    raw = torch.frombuffer(pages, dtype=torch.uint8)  # the tensor keeps the map alive
    return raw.view(dtype).view(shape)
