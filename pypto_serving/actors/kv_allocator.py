"""KVAllocatorActor: the owner of the paged KV block table.

Receives `Allocate` (one per scheduler step), `Free` (finished, aborted sequences).
Sends `Allocated` back to the asking scheduler.
State owned: a pure `BlockAllocator` (free list, reference counts, prefix cache).
Invariant: messages are handled in arrival order, so a `Free` told before an `Allocate`
is visible to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pypto_serving.actors.base import Actor, unknown
from pypto_serving.core.block_allocator import Allocation, BlockAllocator, Demand


@dataclass(frozen=True, slots=True)
class Allocate:
    demands: tuple[Demand, ...]
    reply_to: Actor


@dataclass(frozen=True, slots=True)
class Free:
    seq_id: int
    num_computed: int  # tokens whose KV is complete: their full prompt blocks become cacheable


@dataclass(frozen=True, slots=True)
class Allocated:
    demands: tuple[Demand, ...]
    allocation: Allocation


class KVAllocatorActor(Actor):
    def __init__(self, allocator: BlockAllocator):
        super().__init__()
        self.allocator = allocator

    async def receive(self, msg: object) -> None:
        match msg:
            case Allocate(demands, reply_to):
                reply_to.tell(Allocated(demands, self.allocator.allocate(list(demands))))
            case Free(seq_id, num_computed):
                self.allocator.free(seq_id, num_computed)
            case _:
                unknown(self, msg)
