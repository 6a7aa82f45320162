"""Wires the actors of one replica together and hands out request streams.

The engine is built once from the CLI's frozen configs; http/ and offline mode both use
`generate()`, which runs one RequestActor per request and observes its events (metrics,
the per-request log lines, trace events) in one place. It also knows which requests are
in flight, so a graceful shutdown can wait for them or abort them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import structlog

from pypto_serving.actors.device_client import DeviceWorkerClient
from pypto_serving.actors.device_worker import WorkerConfig, WorkerReady
from pypto_serving.actors.kv_allocator import KVAllocatorActor
from pypto_serving.actors.request import RequestActor, RequestLimits
from pypto_serving.actors.scheduler import AbortAll, SchedulerActor, WorkerDied
from pypto_serving.actors.tokenizer import TokenizerActor
from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.grammar import Grammars
from pypto_serving.metrics import EngineMetrics
from pypto_serving.observe import RequestObserver
from pypto_serving.profiling import SpanRecorder
from pypto_serving.requests import Finished, GenerateRequest, Started, TextDelta
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()

Event = Started | TextDelta | Finished


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
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 metrics: EngineMetrics | None = None, recorder: SpanRecorder | None = None,
                 worker_factory: Callable[..., DeviceWorkerClient] = DeviceWorkerClient):
        """`worker_factory(config, on_result, on_death)` makes the device worker's client."""
        self.config = config
        self._worker_factory = worker_factory
        self.tokenizer = tokenizer
        self.metrics = metrics or EngineMetrics("model", config.limits.max_model_len)
        self.recorder = recorder or SpanRecorder("api-server")
        self._seq_ids = itertools.count()
        self._in_flight: set[int] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.worker: DeviceWorkerClient | None = None
        self.ready: WorkerReady | None = None
        self.allocator: BlockAllocator | None = None
        self.scheduler: SchedulerActor | None = None
        self._tokenizer_json = tokenizer.tokenizers_json()
        self.grammars = Grammars(self._tokenizer_json, config.worker.arch.vocab_size,
                                 tokenizer.eos_token_id)

    async def start(self) -> WorkerReady:
        """Starts the device worker (loads weights), then the actors around it."""
        # The worker indexes the vocabulary for constrained decoding from the same tokenizer.
        worker_config = msgspec.structs.replace(
            self.config.worker, tokenizer_json=self._tokenizer_json or "",
            eos_token_id=self.tokenizer.eos_token_id)
        self.worker = self._worker_factory(worker_config, self._on_result, self._on_death)
        self.ready = await self.worker.start()
        self.allocator = BlockAllocator(self.ready.num_blocks, self.config.cache.block_size,
                                        self.config.cache.enable_prefix_caching)
        self.kv = KVAllocatorActor(self.allocator)
        policy = Scheduler(self.config.scheduler)
        self.scheduler = SchedulerActor(policy, self.kv, self.worker, self.metrics, self.recorder)
        self.metrics.bind(policy, self.allocator)
        self.tokenizer_actor = TokenizerActor(self.tokenizer)
        for actor in self._actors:
            actor.start()
        return self.ready

    @property
    def _actors(self) -> tuple:
        return (self.kv, self.scheduler, self.tokenizer_actor)

    @property
    def workers(self) -> list[DeviceWorkerClient]:
        return [self.worker]

    def _on_result(self, result: object) -> None:
        self.scheduler.tell(result)

    def _on_death(self, reason: str) -> None:
        self.scheduler.tell(WorkerDied(reason))

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve: a dead device worker or a stopped actor loop."""
        if self.scheduler is None:
            return None
        if self.scheduler.dead_reason is not None:
            return self.scheduler.dead_reason
        stopped = [type(a).__name__ for a in self._actors if not a.alive]
        return f"engine loop stopped: {', '.join(stopped)}" if stopped else None

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        seq_id = next(self._seq_ids)
        actor = RequestActor(request, seq_id, self.tokenizer, self.tokenizer_actor,
                             self.scheduler, self.config.limits, self.grammars)
        observer = RequestObserver(request.request_id, self.metrics, self.recorder)
        return self._observed(seq_id, actor.events(), observer)

    async def _observed(self, seq_id: int, events: AsyncIterator[Event],
                        observer: RequestObserver) -> AsyncIterator[Event]:
        self._in_flight.add(seq_id)
        self._idle.clear()
        try:
            async for event in events:
                observer.on_event(event)
                yield event
        finally:
            await events.aclose()  # a request closed early sends its Abort now
            observer.close()
            self._in_flight.discard(seq_id)
            if not self._in_flight:
                self._idle.set()

    # -- shutdown ------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def drain(self, timeout: float) -> bool:
        """Waits until no request is in flight; False when `timeout` seconds were not enough."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_all(self) -> None:
        """Ends every in-flight request with `aborted`, and any submitted after this."""
        self.scheduler.tell(AbortAll("aborted"))

    def kill(self) -> None:
        """Kills the device workers at once (a second shutdown signal)."""
        if self.worker is not None:
            self.worker.kill()

    async def shutdown(self) -> None:
        for actor in (self.tokenizer_actor, self.scheduler, self.kv):
            await actor.stop()
        await self.worker.stop()
