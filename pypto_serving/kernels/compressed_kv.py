"""The paged state of a layer that keeps compressed entries beside its keys (DeepSeek V4).

It lives in the KV cache's own blocks, so the block allocator's tables, prefix caching,
preemption and freeing cover it with no bookkeeping of their own:
- `kv` [blocks, block_size, 1, d]: each token's key, which is also its value (K = V);
- `inputs` [blocks, block_size, width]: each token's compressor projections (kv, then gate),
  which the entry of its window is computed from once the window is complete;
- `entries` [blocks, per_block, d]: one compressed entry per `rate` tokens, kept in the block
  that holds the window's last token. `per_block` is block_size / rate, or 1 when a window
  spans blocks. A full block (one the prefix cache may share) so holds only entries whose
  tokens it or the blocks before it hold.
- the indexer's own `index_inputs` and `index_entries` (csa layers);
- `written` [blocks, per_block] int32: which window (index + 1) each entry slot holds, 0 if
  none. `forget` zeroes the slots of blocks handed to a sequence afresh. Every read checks
  that each entry it takes holds the window it should: a missing or stale entry is an error
  (`CompressedStateError`), never a silently wrong attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


class CompressedStateError(RuntimeError):
    """An entry read is not the one its window wrote."""


def entry_slots(block_size: int, rate: int) -> int:
    """Entry slots per block; ValueError unless the rate divides the block size or the block
    size divides the rate."""
    if block_size % rate and rate % block_size:
        raise ValueError(
            f"--block-size {block_size} must divide or be a multiple of the compression rate {rate}"
        )
    return max(1, block_size // rate)


@dataclass(eq=False, slots=True)
class CompressedLayerCache:
    kv: torch.Tensor
    rate: int = 0  # tokens per entry; 0: a layer that keeps no entries (the rest stay None)
    inputs: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    index_inputs: torch.Tensor | None = None
    index_entries: torch.Tensor | None = None
    written: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.kv.shape[1]

    def store_inputs(
        self, slot_mapping: torch.Tensor, inputs: torch.Tensor, index_inputs: torch.Tensor | None
    ) -> None:
        """Each token's projections [T, width] at its slot [T]."""
        self.inputs.view(-1, self.inputs.shape[-1]).index_copy_(0, slot_mapping, inputs.to(self.inputs.dtype))
        if index_inputs is not None:
            flat = self.index_inputs.view(-1, self.index_inputs.shape[-1])
            flat.index_copy_(0, slot_mapping, index_inputs.to(flat.dtype))

    def window_inputs(self, ctx_slots: torch.Tensor, start: int, end: int, index: bool) -> torch.Tensor:
        """The projections of windows start .. end - 1 of a sequence: [W, rate, width]."""
        store = self.index_inputs if index else self.inputs
        slots = ctx_slots[start * self.rate : end * self.rate]
        return store.view(-1, store.shape[-1])[slots].view(end - start, self.rate, -1)

    def store_entries(self, ctx_slots: torch.Tensor, start: int, entries: torch.Tensor, index: bool) -> None:
        """Entries [W, d] of windows start .. start + W - 1."""
        where = self._where(ctx_slots, start, start + entries.shape[0])
        store = self.index_entries if index else self.entries
        store.view(-1, store.shape[-1]).index_copy_(0, where, entries.to(store.dtype))
        windows = torch.arange(
            start + 1, start + 1 + entries.shape[0], dtype=torch.int32, device=where.device
        )
        self.written.view(-1).index_copy_(0, where, windows)

    def entries_of(self, ctx_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every complete window's entry of a sequence of len(ctx_slots) tokens, [E, d] (and
        the indexer's, or None); CompressedStateError if a slot holds another window's."""
        count = ctx_slots.shape[0] // self.rate
        where = self._where(ctx_slots, 0, count)
        held = self.written.view(-1)[where]
        expected = torch.arange(1, count + 1, dtype=held.dtype, device=held.device)
        if not torch.equal(held, expected):
            window = int((held != expected).nonzero()[0])
            first, last = window * self.rate, (window + 1) * self.rate - 1
            holds = "no window" if held[window] == 0 else f"window {int(held[window]) - 1}"
            raise CompressedStateError(
                f"compressed KV entry of window {window} (tokens {first}..{last}) is missing: "
                f"its slot holds {holds}"
            )
        entries = self.entries.view(-1, self.entries.shape[-1])[where]
        if self.index_entries is None:
            return entries, None
        return entries, self.index_entries.view(-1, self.index_entries.shape[-1])[where]

    def forget(self, blocks: torch.Tensor) -> None:
        """Blocks given to a sequence afresh hold no entry of its windows yet."""
        if self.written is not None:
            self.written[blocks] = 0

    def _where(self, ctx_slots: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The flat entry slot of windows start .. end - 1: in the block of each one's last token."""
        last = ctx_slots[(torch.arange(start, end, device=ctx_slots.device) + 1) * self.rate - 1]
        per_block = self.written.shape[1]
        return last // self.block_size * per_block + last % self.block_size // self.rate


@dataclass(frozen=True, slots=True)
class LayerShape:
    """What one layer keeps per block; `widths`: the compressor's and the indexer's per-token
    projections (0: none)."""

    block_size: int
    head_dim: int
    rate: int = 0
    widths: tuple[int, int] = (0, 0)
    index_dim: int = 0

    def fields(
        self, kv_dtype: torch.dtype, state_dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each of `CompressedLayerCache`'s tensors: its shape per block, its dtype."""
        fields = {"kv": ((self.block_size, 1, self.head_dim), kv_dtype)}
        if not self.rate:
            return fields
        per_block = entry_slots(self.block_size, self.rate)
        inputs, index = self.widths
        fields |= {
            "inputs": ((self.block_size, inputs), state_dtype),
            "entries": ((per_block, self.head_dim), kv_dtype),
            "written": ((per_block,), torch.int32),
        }
        if index:
            fields |= {
                "index_inputs": ((self.block_size, index), state_dtype),
                "index_entries": ((per_block, self.index_dim), kv_dtype),
            }
        return fields

    def block_bytes(self, kv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        return sum(
            math.prod(shape) * dtype.itemsize for shape, dtype in self.fields(kv_dtype, state_dtype).values()
        )

    def allocate(
        self,
        num_blocks: int,
        kv_dtype: torch.dtype,
        state_dtype: torch.dtype,
        zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    ) -> CompressedLayerCache:
        """`zeros(shape, dtype)`: the backend's storage."""
        tensors = {
            name: zeros((num_blocks, *shape), dtype)
            for name, (shape, dtype) in self.fields(kv_dtype, state_dtype).items()
        }
        return CompressedLayerCache(rate=self.rate, **tensors)
