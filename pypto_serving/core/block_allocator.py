"""Paged KV block allocation with a hash-chained prefix cache of full prompt blocks.

Pure: no asyncio, torch or I/O. The `Scheduler` owns one; it keeps every sequence's block
table (the one place on the main side: `block_table(seq_id)`).

Every block is in exactly one of three places: the free list, the evictable LRU (cached
content, no owner) or in use (reference count > 0). A full prompt block, once its KV is
computed, is registered under a hash that chains all tokens before it, so a later prompt
with the same prefix reuses it instead of recomputing it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec


class Demand(msgspec.Struct, frozen=True):
    """What one sequence asks of a step, in priority order within one `allocate` call.

    Running sequences (`prompt_ids` None) need room for `num_tokens` tokens in total and
    report `num_computed` so computed prompt blocks get registered in the prefix cache.
    New sequences carry their prompt (for prefix matching) and the most tokens
    `num_tokens` the scheduler may compute for them this step.
    """

    seq_id: int
    num_tokens: int
    num_computed: int = 0
    prompt_ids: tuple[int, ...] | None = None
    total_tokens: int = 0  # new sequences: every known token (prompt plus earlier outputs)
    # new sequences: whether cached blocks may stand in for computing (not when every prompt
    # position's logits are wanted)
    use_cache: bool = True


class Grant(msgspec.Struct, frozen=True):
    seq_id: int
    num_cached: int  # tokens served from the prefix cache (new sequences only)


class Allocation(msgspec.Struct, frozen=True):
    grants: tuple[Grant, ...]
    preempted: tuple[int, ...]  # running sequences whose blocks were taken back
    denied: tuple[int, ...]  # new sequences that did not fit this step


@dataclass(slots=True)
class _Owner:
    block_ids: list[int] = field(default_factory=list)
    prompt_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # prompt blocks already offered to the cache


def chain_hashes(token_ids: tuple[int, ...], block_size: int) -> list[bytes]:
    """One hash per full block; each covers the block and every token before it."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.blake2b(parent + repr(block).encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._owners: dict[int, _Owner] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of which found
        self._written: dict[int, int] = {}  # seq id -> prompt tokens it put into the cache

    # -- queries -------------------------------------------------------------
    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        used = self.num_blocks - self.num_available
        return used / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def owns(self, seq_id: int) -> bool:
        return seq_id in self._owners

    @property
    def num_owners(self) -> int:
        return len(self._owners)

    @property
    def num_counting_writes(self) -> int:
        """Sequences whose prefix-cache writes are counted and not yet taken."""
        return len(self._written)

    def cache_writes(self, seq_id: int) -> int:
        """The prompt tokens a sequence has put into the prefix cache so far (blocks no other
        sequence had registered), over all its admissions."""
        return self._written.get(seq_id, 0)

    def take_cache_writes(self, seq_id: int) -> int:
        """`cache_writes`, forgotten: asked once, when the sequence ends."""
        return self._written.pop(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in position order (read only: the allocator's own list)."""
        return self._owners[seq_id].block_ids

    def fits(self, demands: list[Demand]) -> bool:
        """Whether `allocate(demands)` surely needs no preemption: the free and evictable
        blocks cover every running sequence's growth and every new one's whole known tokens."""
        need = 0
        for d in demands:
            if d.prompt_ids is None:
                need += max(0, self.blocks_for(d.num_tokens) - len(self._owners[d.seq_id].block_ids))
            else:
                need += self.blocks_for(d.total_tokens)
        return need <= self.num_available

    # -- one step --------------------------------------------------------------
    def allocate(self, demands: list[Demand]) -> Allocation:
        grants, preempted, denied = [], [], []
        running = [d.seq_id for d in demands if d.prompt_ids is None]
        admitting = True
        for demand in demands:
            if demand.seq_id in preempted:
                continue
            if demand.prompt_ids is None:
                grant = self._grow(demand, running, preempted)
            elif admitting:
                grant = self._admit(demand)
                admitting = grant is not None  # FIFO: nobody overtakes a denied one
            else:
                grant = None
            if grant is not None:
                grants.append(grant)
            elif demand.prompt_ids is not None:
                denied.append(demand.seq_id)
        return Allocation(tuple(grants), tuple(preempted), tuple(denied))

    def _grow(self, demand: Demand, running: list[int], preempted: list[int]) -> Grant | None:
        owner = self._owners[demand.seq_id]
        self._register(demand.seq_id, owner, demand.num_computed)
        need = self.blocks_for(demand.num_tokens) - len(owner.block_ids)
        while need > self.num_available:
            victim = self._pick_victim(running, preempted)
            preempted.append(victim)
            self.free(victim)
            if victim == demand.seq_id:
                return None
        if need > 0:
            owner.block_ids.extend([self._take() for _ in range(need)])
        return Grant(demand.seq_id, 0)

    def _pick_victim(self, running: list[int], preempted: list[int]) -> int:
        """The lowest-priority running sequence not yet preempted (possibly the asker)."""
        return next(s for s in reversed(running) if s not in preempted)

    def _admit(self, demand: Demand) -> Grant | None:
        hashes = chain_hashes(demand.prompt_ids, self.block_size)
        hits = self._match(hashes, demand.total_tokens) if demand.use_cache else []
        num_cached = len(hits) * self.block_size
        end = min(demand.total_tokens, num_cached + demand.num_tokens)
        need = self.blocks_for(end) - len(hits)
        reusable = sum(1 for b in hits if self._refs[b] == 0)
        if need + reusable > self.num_available:
            return None
        self._count_queries(demand, num_cached)
        for block in hits:
            self._ref(block)
        blocks = hits + [self._take() for _ in range(need)]
        self._owners[demand.seq_id] = _Owner(blocks, hashes, len(hits))
        return Grant(demand.seq_id, num_cached)

    def _count_queries(self, demand: Demand, num_cached: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += len(demand.prompt_ids)
            self.prefix_hits += num_cached

    def _match(self, hashes: list[bytes], total_tokens: int) -> list[int]:
        """Cached blocks for the longest matching prefix, always leaving one token to compute."""
        if not self.enable_prefix_caching:
            return []
        usable = (total_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:usable]:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _register(self, seq_id: int, owner: _Owner, num_computed: int) -> None:
        if not self.enable_prefix_caching or owner.num_registered >= len(owner.prompt_hashes):
            return  # nothing to register, or every prompt block registered already
        full = min(num_computed // self.block_size, len(owner.prompt_hashes))
        for i in range(owner.num_registered, full):
            block_hash, block = owner.prompt_hashes[i], owner.block_ids[i]
            if block_hash not in self._block_of and block not in self._hash_of:
                self._block_of[block_hash] = block
                self._hash_of[block] = block_hash
                self._written[seq_id] = self._written.get(seq_id, 0) + self.block_size
        owner.num_registered = max(owner.num_registered, full)

    # -- block bookkeeping ----------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def free(self, seq_id: int, num_computed: int = 0) -> None:
        """Drops a sequence's blocks; computed prompt blocks stay reusable until evicted."""
        owner = self._owners.pop(seq_id, None)
        if owner is None:
            return
        self._register(seq_id, owner, num_computed)
        for block in reversed(owner.block_ids):  # tail blocks evicted first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._release(block)

    def _release(self, block: int) -> None:
        if block in self._hash_of:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def check_integrity(self) -> None:
        """Raises AssertionError when any block is lost, doubly owned or miscounted."""
        in_use = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        places = len(self._free) + len(self._evictable) + len(in_use)
        assert places == self.num_blocks, f"{places} blocks accounted for, {self.num_blocks} exist"
        assert not (set(self._free) & set(self._evictable)), "block both free and cached"
        assert not (in_use & (set(self._free) | set(self._evictable))), "used block on a free list"
        counted = [0] * self.num_blocks
        for owner in self._owners.values():
            for block in owner.block_ids:
                counted[block] += 1
        assert counted == self._refs, "reference counts differ from owners' block tables"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash map out of sync"
