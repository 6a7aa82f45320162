"""KV cache sizing and allocation: per layer, k and v [num_blocks, block_size, kv_heads, d]
(DeepSeek V4: one `CompressedLayerCache` per layer, kernels/compressed_kv.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pypto_serving.kernels.compressed_kv import CompressedLayerCache, LayerShape
from pypto_serving.loader.arch import ModelArch

KVCache = tuple[torch.Tensor, torch.Tensor]
LayerCache = KVCache | CompressedLayerCache


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype,
                    state_dtype: torch.dtype | None = None) -> int:
    """k and v of every layer for one block (and compressed state, kept in `state_dtype`,
    the model's)."""
    if arch.deepseek_v4 is not None:
        layers = _compressed_layers(arch, block_size)
        return sum(layer.block_bytes(dtype, state_dtype or dtype) for layer in layers)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_token * block_size


def _compressed_layers(arch: ModelArch, block_size: int) -> list[LayerShape]:
    """Each DeepSeek V4 layer's state: an hca layer's tokens keep kv and gate projections, a
    csa layer's two series of each, and its indexer's."""
    shape, d = arch.deepseek_v4, arch.head_dim
    index = shape.index_head_dim
    widths = {"sliding": (0, 0), "hca": (2 * d, 0), "csa": (4 * d, 4 * index)}
    return [LayerShape(block_size, d, shape.rate(i), widths[kind], index)
            for i, kind in enumerate(shape.attention)]


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
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], state_dtype: torch.dtype | None = None,
) -> list[LayerCache]:
    """`zeros(shape, dtype)` is the backend's storage (zeros: padded slots are masked, but
    0 * NaN garbage would still be NaN)."""
    if arch.deepseek_v4 is not None:
        return [layer.allocate(num_blocks, dtype, state_dtype or dtype, zeros)
                for layer in _compressed_layers(arch, block_size)]
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(arch.num_layers)]


def forget_blocks(caches: list[LayerCache], blocks: list[int]) -> None:
    """Blocks handed to a sequence afresh: the compressed state they held is no one's now."""
    if blocks and caches and isinstance(caches[0], CompressedLayerCache):
        index = torch.tensor(blocks, dtype=torch.int64, device=caches[0].kv.device)
        for cache in caches:
            cache.forget(index)
