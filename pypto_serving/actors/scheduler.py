"""SchedulerActor: continuous batching for one replica.

Receives `Submit`, `Abort` (from request actors), `Allocated` (from the KV allocator),
`StepResult` (from the device worker), `WorkerDied`, `AbortAll` (from the engine at shutdown).
Sends `Allocate`/`Free` to the KV allocator, one `StepPlan` at a time to the device worker,
`Tokens` to request actors.
State owned: a pure `Scheduler` (queues and sequences), who to reply to per sequence, when
each waiting sequence was submitted (queue-time metric and trace spans).
Invariants: at most one step is being allocated or executed at a time; every sequence
that ends has its blocks freed and its request told, exactly once; after `AbortAll` or a
worker death every new submission ends at once; a step's tokens reach the request actors
after the next step has gone to the device worker (their detokenizing and HTTP writes then
overlap the device's work instead of delaying it), and always before anything else is told
about the same sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from pypto_serving.actors import request as request_msgs
from pypto_serving.actors.base import Actor, unknown
from pypto_serving.actors.device_worker import StepPlan, StepResult
from pypto_serving.actors.kv_allocator import Allocate, Allocated, Free
from pypto_serving.core.scheduler import Scheduler, TokenEvent
from pypto_serving.core.sequence import Sequence
from pypto_serving.metrics import EngineMetrics
from pypto_serving.profiling import SpanRecorder, clock_us
from pypto_serving.sampling import SamplingParams

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Submit:
    seq_id: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    reply_to: Actor


@dataclass(frozen=True, slots=True)
class Abort:
    seq_id: int
    reason: str  # "aborted" (client gone), "stop" (stop string), "error" (malformed tool call)


@dataclass(frozen=True, slots=True)
class WorkerDied:
    reason: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    reason: str  # "aborted": the shutdown timeout ran out


class StepRunner(Protocol):
    def send(self, plan: StepPlan) -> None: ...


class SchedulerActor(Actor):
    def __init__(self, scheduler: Scheduler, kv: Actor, worker: StepRunner,
                 metrics: EngineMetrics | None = None, recorder: SpanRecorder | None = None):
        super().__init__()
        self.scheduler = scheduler
        self.kv = kv
        self.worker = worker
        self.metrics = metrics or EngineMetrics("model")
        self.recorder = recorder or SpanRecorder("api")
        self._reply_to: dict[int, Actor] = {}
        self._undelivered: list[TokenEvent] = []  # the last step's tokens, until the next is sent
        self._queued: dict[int, tuple[float, int | None]] = {}  # seq_id -> (submitted us, lane)
        self._busy = False  # an Allocate or a StepPlan is outstanding
        self._phase_start = 0.0  # when the outstanding Allocate or StepPlan was sent (us)
        self.dead_reason: str | None = None
        self.closed_reason: str | None = None

    async def receive(self, msg: object) -> None:
        match msg:
            case Submit():
                self._submit(msg)
            case Abort(seq_id, reason):
                self._abort(seq_id, reason)
            case Allocated(demands, allocation):
                self._busy = False
                self._run_step(self.scheduler.commit(list(demands), allocation), allocation)
                self._deliver_tokens()
            case StepResult():
                self._busy = False
                self.recorder.complete("step", "engine", self._phase_start, step_id=msg.step_id,
                                       sampled=len(msg.seq_ids))
                self._apply(msg)
            case WorkerDied(reason):
                self._die(reason)
            case AbortAll(reason):
                self._abort_all(reason)
            case _:
                unknown(self, msg)

    def _submit(self, msg: Submit) -> None:
        if self.dead_reason is not None:
            msg.reply_to.tell(request_msgs.Tokens(msg.seq_id, (), "error", error=self.dead_reason))
            return
        if self.closed_reason is not None:
            msg.reply_to.tell(request_msgs.Tokens(msg.seq_id, (), self.closed_reason))
            return
        seq = Sequence(msg.seq_id, msg.prompt_ids, msg.max_tokens, msg.sampling, msg.stop_token_ids)
        self.scheduler.add(seq)
        self._reply_to[msg.seq_id] = msg.reply_to
        lane = self.recorder.acquire_lane() if self.recorder.active else None
        self._queued[msg.seq_id] = (clock_us(), lane)
        self._kick()

    def _abort(self, seq_id: int, reason: str) -> None:
        seq = self.scheduler.abort(seq_id, reason)
        if seq is not None:
            self._finish(seq)

    def _abort_all(self, reason: str) -> None:
        self.closed_reason = reason
        for seq in self.scheduler.fail_all(reason):
            self._finish(seq)

    def _kick(self) -> None:
        if self._busy or not self.scheduler.has_work or self.dead_reason is not None:
            return
        self._busy = True
        self._phase_start = clock_us()
        self.kv.tell(Allocate(tuple(self.scheduler.propose()), self))

    def _run_step(self, plan: StepPlan | None, allocation) -> None:
        if plan is not None:
            self._busy = True
            now = clock_us()
            self.recorder.complete("schedule", "engine", self._phase_start, now,
                                   step_id=plan.step_id, seqs=len(plan.seqs))
            self._phase_start = now
            self._dequeue(s.seq_id for s in plan.seqs if s.reset)
            self.worker.send(plan)
        elif allocation.preempted:
            self._kick()  # blocks were freed: someone can run now

    def _dequeue(self, seq_ids: Iterable[int], scheduled: bool = True) -> None:
        """First scheduling (or the end) of waiting sequences: queue time and span."""
        now = clock_us()
        for seq_id in seq_ids:
            submitted, lane = self._queued.pop(seq_id, (None, None))
            if submitted is not None and scheduled:
                self.metrics.observe("queue_time", (now - submitted) / 1e6)
            if lane is not None:
                self.recorder.complete("queue", "request", submitted, now, tid=lane, seq_id=seq_id)
                self.recorder.release_lane(lane)

    def _apply(self, result: StepResult) -> None:
        if result.error is not None:
            self._die(f"device worker failed: {result.error}")
            return
        events, ended = self.scheduler.on_result(result)
        self._undelivered.extend(events)
        for seq in ended:
            self._finish(seq, told=True)
        self._kick()
        if not self._busy:  # no next step to send first
            self._deliver_tokens()

    def _deliver_tokens(self) -> None:
        events, self._undelivered = self._undelivered, []
        for event in events:
            seq_id = event.seq.seq_id
            ended = event.finish_reason is not None
            reply_to = self._reply_to.pop(seq_id, None) if ended else self._reply_to.get(seq_id)
            if reply_to is not None:
                reply_to.tell(request_msgs.Tokens(
                    event.seq.seq_id, (event.token_id,), event.finish_reason,
                    logprobs=(event.logprob,), top_logprobs=(event.top_logprobs,),
                    num_cached_tokens=event.seq.num_cached_tokens or 0))

    def _finish(self, seq: Sequence, told: bool = False) -> None:
        if not told:
            self._deliver_tokens()  # its earlier tokens first
        self._dequeue([seq.seq_id], scheduled=False)
        self.kv.tell(Free(seq.seq_id, seq.num_computed))
        if told:  # its last token event, still to be delivered, says that it ended
            return
        reply_to = self._reply_to.pop(seq.seq_id, None)
        if reply_to is not None:
            reply_to.tell(request_msgs.Tokens(seq.seq_id, (), seq.finish_reason,
                                 num_cached_tokens=seq.num_cached_tokens or 0))

    def _die(self, reason: str) -> None:
        self._deliver_tokens()
        log.error("engine stopped", reason=reason)
        self.dead_reason = reason
        for seq in self.scheduler.fail_all("error"):
            self._dequeue([seq.seq_id], scheduled=False)
            self.kv.tell(Free(seq.seq_id, 0))  # the KV cache died with the worker
            reply_to = self._reply_to.pop(seq.seq_id, None)
            if reply_to is not None:
                reply_to.tell(request_msgs.Tokens(seq.seq_id, (), "error", error=reason))
