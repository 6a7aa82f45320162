"""Wires the actors of one replica together and hands out request streams.

The engine is built once from the CLI's frozen configs; http/ and offline mode both use
`generate()`, which runs one RequestActor per request.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from pypto_serving.actors.device_worker import DeviceWorkerClient, WorkerConfig, WorkerReady
from pypto_serving.actors.kv_allocator import KVAllocatorActor
from pypto_serving.actors.request import RequestActor, RequestLimits
from pypto_serving.actors.scheduler import SchedulerActor, WorkerDied
from pypto_serving.actors.tokenizer import TokenizerActor
from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.requests import Finished, GenerateRequest, Started, TextDelta
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool


@dataclass(frozen=True, slots=True)
class EngineConfig:
    worker: WorkerConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    limits: RequestLimits


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self._seq_ids = itertools.count()
        self.ready: WorkerReady | None = None
        self.allocator: BlockAllocator | None = None
        self.scheduler: SchedulerActor | None = None

    async def start(self) -> WorkerReady:
        """Starts the device worker (loads weights), then the actors around it."""
        self.worker = DeviceWorkerClient(self.config.worker, self._on_result, self._on_death)
        self.ready = await self.worker.start()
        self.allocator = BlockAllocator(self.ready.num_blocks, self.config.cache.block_size,
                                        self.config.cache.enable_prefix_caching)
        self.kv = KVAllocatorActor(self.allocator)
        self.scheduler = SchedulerActor(Scheduler(self.config.scheduler), self.kv, self.worker)
        self.tokenizer_actor = TokenizerActor(self.tokenizer)
        for actor in (self.kv, self.scheduler, self.tokenizer_actor):
            actor.start()
        return self.ready

    def _on_result(self, result: object) -> None:
        self.scheduler.tell(result)

    def _on_death(self, reason: str) -> None:
        self.scheduler.tell(WorkerDied(reason))

    @property
    def dead_reason(self) -> str | None:
        return None if self.scheduler is None else self.scheduler.dead_reason

    def generate(self, request: GenerateRequest) -> AsyncIterator[Started | TextDelta | Finished]:
        actor = RequestActor(request, next(self._seq_ids), self.tokenizer, self.tokenizer_actor,
                             self.scheduler, self.config.limits)
        return actor.events()

    async def shutdown(self) -> None:
        for actor in (self.tokenizer_actor, self.scheduler, self.kv):
            await actor.stop()
        await self.worker.stop()
