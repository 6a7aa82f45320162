"""Wires the actors of one replica together and hands out request streams.

The engine is built once from the CLI's frozen configs; http/ and offline mode both use
`generate()`, which runs one RequestStream per request and observes its events (metrics,
the per-request log lines, trace events) in one place. It also knows which requests are
in flight, so a graceful shutdown can wait for them or abort them.

One fault policy: an exception inside any engine actor, a failed step or a dead device worker
is engine death (`_die`): the traceback is logged with the request ids in flight, every
in-flight request ends with `error` (its KV blocks freed), `dead_reason` says why (/health
answers 503 with it) and every later request ends with `error` at once. With
`restart_worker` the engine then starts a new device worker and new actors (after a backoff
that grows while deaths come quickly) and serves again.

Bounds (`Admission`): a request that arrives while a full batch runs and `max_queue_len`
requests already wait is refused at once (`Refused`, HTTP 503 with Retry-After); one that
runs past `request_timeout` seconds ends with `error` (type `timeout`) and frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import structlog

from pypto_serving.actors.base import Actor
from pypto_serving.actors.device_client import DeviceWorkerClient, WorkerStartError
from pypto_serving.actors.request import RequestLimits, RequestStream
from pypto_serving.actors.scheduler import SchedulerActor
from pypto_serving.actors.tokenizer import TokenizerActor
from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.request import (
    Finished,
    GenerateRequest,
    Refused,
    Started,
    TextDelta,
    estimated_tokens,
)
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.messages.request import EngineDied, TimedOut
from pypto_serving.messages.scheduler import AbortAll
from pypto_serving.messages.worker import GrammarConfig, WorkerConfig, WorkerReady
from pypto_serving.parsers.grammar import Grammars
from pypto_serving.telemetry.metrics import EngineMetrics
from pypto_serving.telemetry.observe import RequestObserver
from pypto_serving.telemetry.profiling import SpanRecorder
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()

Event = Started | TextDelta | Finished
RESTART_BACKOFF_S = 0.5  # before the first restart; doubles with each death in RESTART_WINDOW_S
RESTART_BACKOFF_MAX_S = 30.0
RESTART_WINDOW_S = 300.0
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool


@dataclass(frozen=True, slots=True)
class Admission:
    max_queue_len: int | None = None  # waiting requests beyond which new ones get 503; None: no bound
    request_timeout: float | None = None  # seconds from arrival to the last token; None: no limit


@dataclass(frozen=True, slots=True)
class EngineConfig:
    worker: WorkerConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    limits: RequestLimits
    admission: Admission = Admission()
    restart_worker: bool = False  # start the device worker again after engine death
    log_requests: bool = False  # prompts and outputs in the request log lines
    max_log_len: int | None = None  # ... cut to this many characters


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
        self._in_flight: dict[int, RequestStream] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.worker: DeviceWorkerClient | None = None
        self.ready: WorkerReady | None = None
        self.allocator: BlockAllocator | None = None
        self.scheduler: SchedulerActor | None = None
        self.tokenizer_actor: TokenizerActor | None = None
        self._dead_reason: str | None = None
        self._stopping = False
        self._restart_task: asyncio.Task | None = None
        self._deaths: list[float] = []  # when the engine died, within RESTART_WINDOW_S
        self._tokenizer_json = tokenizer.tokenizers_json()
        self.grammars = Grammars(self._tokenizer_json, config.worker.model.arch.vocab_size,
                                 tokenizer.eos_token_id)

    async def start(self) -> WorkerReady:
        """Starts the device worker (loads weights), then the actors around it."""
        # The worker indexes the vocabulary for constrained decoding from the same tokenizer.
        grammar = GrammarConfig(self._tokenizer_json or "", self.tokenizer.eos_token_id)
        worker_config = msgspec.structs.replace(self.config.worker, grammar=grammar)
        self.worker = self._worker_factory(worker_config, self._on_result, self._die)
        self.ready = await self.worker.start()
        self.allocator = BlockAllocator(self.ready.num_blocks, self.config.cache.block_size,
                                        self.config.cache.enable_prefix_caching)
        policy = Scheduler(self.config.scheduler, self.allocator)
        self.scheduler = SchedulerActor(policy, self.worker, self.metrics, self.recorder,
                                        on_death=self._die, on_fault=self._fault)
        self.metrics.bind(policy, self.allocator)
        self.metrics.cache_info = self._cache_info()
        self.tokenizer_actor = TokenizerActor(self.tokenizer, on_fault=self._fault,
                                              max_model_len=self.config.limits.max_model_len)
        for actor in self._actors:
            actor.start()
        return self.ready

    def _cache_info(self) -> dict[str, str]:
        """vLLM's cache_config_info labels that have a meaning here, as strings like vLLM's."""
        worker, cache = self.config.worker, self.config.cache
        return {"block_size": str(cache.block_size), "cache_dtype": str(worker.device.kv_cache_dtype),
                "enable_prefix_caching": str(cache.enable_prefix_caching),
                "gpu_memory_utilization": str(worker.kv_cache.gpu_memory_utilization),
                "num_gpu_blocks": str(self.ready.num_blocks), "num_cpu_blocks": "None"}

    @property
    def _actors(self) -> tuple:
        return (self.scheduler, self.tokenizer_actor)

    @property
    def workers(self) -> list[DeviceWorkerClient]:
        return [self.worker]

    def _on_result(self, result: object) -> None:
        self.scheduler.tell(result)

    def _fault(self, actor: Actor, msg: object, exc: Exception) -> None:
        """An actor's exception: logged with its traceback, then engine death."""
        reason = f"{type(actor).__name__} failed on {type(msg).__name__}: {type(exc).__name__}: {exc}"
        log.error("engine actor failed", actor=type(actor).__name__, message=type(msg).__name__,
                  request_ids=self._request_ids(), exc_info=exc)
        self._die(reason)

    def _die(self, reason: str) -> None:
        """Engine death: see the module docstring. A second death (a fault after the first)
        only ends the requests in flight again: the one it interrupted must hear of it."""
        if self._dead_reason is None:
            self._dead_reason = reason
            log.error("engine stopped", reason=reason, engine=self.metrics.engine,
                      request_ids=self._request_ids())
            try:
                self.scheduler.die(reason)  # ends its sequences and frees their blocks
            except Exception:  # a broken scheduler: the requests still hear of it below
                log.exception("the scheduler could not end its sequences")
            if self.config.restart_worker and not self._stopping:
                self._restart_task = asyncio.get_running_loop().create_task(self._restart(reason))
        for stream in self._in_flight.values():
            stream.tell(EngineDied(self._dead_reason))  # those the scheduler was not told of

    async def _restart(self, reason: str) -> None:
        """After engine death: a new device worker and new actors, until one starts."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        delay = RESTART_BACKOFF_S * 2 ** (len(self._deaths) - 1)
        while not self._stopping:
            delay = min(delay, RESTART_BACKOFF_MAX_S)
            log.info("restarting the device worker", after=reason, in_seconds=delay,
                     engine=self.metrics.engine)
            await asyncio.sleep(delay)
            await self._stop_parts()
            try:
                await self.start()
            except Exception as exc:  # anything: a half-started worker is stopped, and again
                log.error("the device worker could not start again", error=str(exc),
                          exc_info=None if isinstance(exc, WorkerStartError) else exc)
                delay *= 2
                continue
            self.metrics.worker_restarts += 1
            self._dead_reason = None
            log.info("engine restarted", after=reason, engine=self.metrics.engine,
                     restarts=self.metrics.worker_restarts,
                     worker_pids=[w.process.pid for w in self.workers])
            return

    def _request_ids(self) -> list[str]:
        return [s.request.request_id for s in self._in_flight.values()]

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve: engine death, or a stopped actor loop."""
        if self._dead_reason is not None and self.restarting:
            return f"{self._dead_reason} (restarting)"
        if self._dead_reason is not None or self.scheduler is None:
            return self._dead_reason
        stopped = [type(a).__name__ for a in self._actors if not a.alive]
        return f"engine loop stopped: {', '.join(stopped)}" if stopped else None

    def _admit(self) -> None:
        """Refuses a request that would wait behind `max_queue_len` others: in flight are at
        most a full running batch and that many waiting (being tokenized counts as waiting)."""
        limit = self.config.admission.max_queue_len
        if limit is None:
            return
        running = self.config.scheduler.max_num_seqs
        if len(self._in_flight) >= running + limit:
            self.metrics.rejected("queue_full")
            raise Refused(f"the server is at capacity: {len(self._in_flight)} requests in flight "
                          f"(--max-num-seqs {running} running, --max-queue-len {limit} waiting); "
                          "retry later", 503, "overloaded", retry_after=RETRY_AFTER_S)

    def _time_out(self, stream: RequestStream, timeout: float) -> None:
        if stream.seq_id in self._in_flight:  # not one that finished in the same tick
            self.metrics.rejected("timeout")
            stream.tell(TimedOut(timeout))

    @property
    def restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._observed(request)

    async def _observed(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Admission and the actors are looked at when the caller first asks for an event
        (a restart may have replaced the actors since `generate`)."""
        if self._dead_reason is not None and self.restarting:
            raise Refused(f"the engine is restarting after: {self._dead_reason}", 503, "unavailable",
                          retry_after=RETRY_AFTER_S)
        self._admit()
        seq_id = next(self._seq_ids)
        stream = RequestStream(request, seq_id, self.tokenizer, self.tokenizer_actor,
                               self.scheduler, self.config.limits, self.grammars)
        observer = RequestObserver(request.request_id, self.metrics, self.recorder,
                                   0 if request.score_only else request.max_tokens,  # as the client sent it
                                   score_only=request.score_only)
        if self.config.log_requests:
            observer.log_content(request.prompt, self.config.max_log_len)
        events = stream.events()
        self._in_flight[seq_id] = stream
        self._idle.clear()
        if self._dead_reason is not None:  # ends before the (maybe broken) actors see it
            stream.tell(EngineDied(self._dead_reason))
        timeout = self.config.admission.request_timeout
        timer = None if timeout is None else asyncio.get_running_loop().call_later(
            timeout, self._time_out, stream, timeout)
        try:
            async for event in events:
                observer.on_event(event)
                yield event
        finally:
            if timer is not None:
                timer.cancel()
            await events.aclose()  # a request closed early sends its Abort now
            observer.close()
            self._in_flight.pop(seq_id, None)
            if not self._in_flight:
                self._idle.set()

    @property
    def pending_tokens(self) -> int:
        """The load a data-parallel router weighs (actors/replicas.py): the scheduler's
        `pending_tokens`, plus a guess for each request it does not hold yet (being tokenized)."""
        policy = None if self.scheduler is None else self.scheduler.scheduler
        limits = self.config.limits
        unseen = sum(estimated_tokens(s.request, limits.default_max_tokens, limits.max_model_len)
                     for s in self._in_flight.values()
                     if not s.done and (policy is None or not policy.holds(s.seq_id)))
        return unseen + (0 if policy is None else policy.pending_tokens)

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
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        await self._stop_parts()

    async def _stop_parts(self) -> None:
        """The actors and the device worker (gone already after its death)."""
        for actor in self._actors:
            if actor is not None:
                await actor.stop()
        if self.worker is not None:
            await self.worker.stop()
