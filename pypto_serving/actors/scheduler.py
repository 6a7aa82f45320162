"""SchedulerActor: continuous batching for one replica, a thin shell around `Scheduler`.

Receives (messages/scheduler.py) `Submit`, `Abort` (from request streams), `StepResult` (from
the device worker), `WorkerDied`, `AbortAll` (from the engine).
Sends one `StepPlan` at a time to the device worker and `Tokens` to request streams.
State owned: the pure `Scheduler` (queues, sequences and, through its allocator, the KV
block tables), who to reply to per sequence, when each waiting sequence was submitted
(queue-time metric and trace spans).
Invariants: at most one step is in flight (two with async scheduling: the second planned
while the first runs, its sampled tokens placeholders); every sequence that ends has its blocks freed and
its request told, exactly once; after `AbortAll` or engine death every new submission ends
at once; a step's tokens reach the request streams after the next step has gone to the
device worker (their detokenizing and HTTP writes then overlap the device's work instead of
delaying it), and always before anything else is told about the same sequences.

Delivery under load: request streams are told at most `DELIVERY_SLICE` at a time per turn of
the event loop, the rest on the next turns, so a result the device sends meanwhile is planned
from without waiting for every stream's detokenizing and HTTP write. A sequence whose tokens
are still waiting when its next ones come gets them in one message (as vLLM merges outputs a
client has not taken yet; the stream still reads them one token at a time): when the API
process is the bottleneck (many streams on a fast device) each stream is woken once for
several tokens, and the device keeps stepping.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from pypto_serving.actors.base import Actor, FaultHandler, log_fault, unknown
from pypto_serving.core.scheduler import Scheduler, TokenEvent
from pypto_serving.core.sequence import Sequence
from pypto_serving.messages.mailbox import Mailbox
from pypto_serving.messages.request import Tokens
from pypto_serving.messages.scheduler import Abort, AbortAll, SchedulerInbox, Submit, WorkerDied
from pypto_serving.messages.worker import StepPlan, StepResult
from pypto_serving.telemetry.metrics import EngineMetrics
from pypto_serving.telemetry.observe import SequencePhases
from pypto_serving.telemetry.profiling import SpanRecorder, clock_us

# Request streams told per turn of the event loop (see the module's docstring).
DELIVERY_SLICE = 16


class StepRunner(Protocol):
    def send(self, plan: StepPlan) -> None: ...


class SchedulerActor(Actor[SchedulerInbox]):
    def __init__(self, scheduler: Scheduler, worker: StepRunner, metrics: EngineMetrics | None = None,
                 recorder: SpanRecorder | None = None, on_death: Callable[[str], None] | None = None,
                 on_fault: FaultHandler = log_fault):
        """`on_death(reason)` hears that the engine cannot go on (a failed step, a dead
        worker); without one the actor ends its own requests (`die`)."""
        super().__init__(on_fault)
        self.scheduler = scheduler
        self.worker = worker
        self.metrics = metrics or EngineMetrics("model")
        self.recorder = recorder or SpanRecorder("api")
        self.on_death = on_death or self.die
        self._reply_to: dict[int, Mailbox] = {}
        self._undelivered: list[TokenEvent] = []  # the last step's tokens, until the next is sent
        # seq_id -> (whom to tell, its tokens not yet told), in the order they became due
        self._untold: OrderedDict[int, tuple[Mailbox, Tokens]] = OrderedDict()
        self._telling = False  # a turn of _tell_slice is scheduled
        self._queued: dict[int, tuple[float, int | None]] = {}  # seq_id -> (submitted us, lane)
        self._sent_at: dict[int, float] = {}  # step id -> when it was sent (us)
        self._phases = SequencePhases(self.metrics)
        self.dead_reason: str | None = None
        self.closed_reason: str | None = None

    async def receive(self, msg: SchedulerInbox) -> None:
        match msg:
            case Submit():
                self._submit(msg)
            case Abort(seq_id, reason):
                self._abort(seq_id, reason)
            case StepResult(error=None):
                self._step_done(msg)
            case StepResult(error=error):
                self.on_death(f"device worker failed: {error}")
            case WorkerDied(reason):
                self.on_death(reason)
            case AbortAll(reason):
                self._abort_all(reason)
            case _:
                unknown(self, msg)

    def _submit(self, msg: Submit) -> None:
        if self.dead_reason is not None:
            msg.reply_to.tell(Tokens(msg.seq_id, (), "error", error=self.dead_reason))
            return
        if self.closed_reason is not None:
            msg.reply_to.tell(Tokens(msg.seq_id, (), self.closed_reason))
            return
        seq = Sequence(msg.seq_id, msg.prompt_ids, msg.max_tokens, msg.sampling, msg.stop_token_ids)
        self.scheduler.add(seq)
        self._reply_to[msg.seq_id] = msg.reply_to
        lane = self.recorder.acquire_lane() if self.recorder.active else None
        self._queued[msg.seq_id] = (clock_us(), lane)

    def drained(self) -> None:
        """Nothing in flight but work waiting (new submissions, blocks freed by an abort):
        one step for everything that arrived together."""
        if not self.scheduler.in_flight and self.scheduler.has_work and self.dead_reason is None:
            self._step(None)

    def _step_done(self, result: StepResult) -> None:
        if self.dead_reason is not None or self.closed_reason is not None:
            return  # the engine died (or every sequence was ended) while the step ran
        self.recorder.complete("step", "engine", self._sent_at.pop(result.step_id, clock_us()),
                               step_id=result.step_id, sampled=len(result.seq_ids))
        self._step(result)

    def _step(self, result: StepResult | None) -> None:
        """One engine step: plan the next step from the last one's result, send it (with
        async scheduling also the one after it, while the device runs the first), then
        deliver the last step's tokens."""
        start = clock_us()
        plan, events = self.scheduler.step(result)
        self._undelivered.extend(events)
        while plan is not None:
            self._send(plan, start)
            start = clock_us()
            plan = self.scheduler.schedule() if self.scheduler.can_plan_ahead else None
        self._deliver_tokens()

    def _send(self, plan: StepPlan, planned_from: float) -> None:
        self._sent_at[plan.step_id] = sent = clock_us()
        self.recorder.complete("schedule", "engine", planned_from, sent, step_id=plan.step_id,
                               seqs=len(plan.seqs))
        self._dequeue(s.seq_id for s in plan.seqs if s.reset)
        self.metrics.observe("iteration_tokens", sum(len(s.token_ids) for s in plan.seqs))
        self.worker.send(plan)

    def _abort(self, seq_id: int, reason: str) -> None:
        seq = self.scheduler.abort(seq_id, reason)
        if seq is not None:
            self._finish(seq)

    def _abort_all(self, reason: str) -> None:
        self.closed_reason = reason
        for seq in self.scheduler.fail_all(reason):
            self._finish(seq)

    def _dequeue(self, seq_ids: Iterable[int], scheduled: bool = True) -> None:
        """First scheduling (or the end) of waiting sequences: queue time and span."""
        now = clock_us()
        for seq_id in seq_ids:
            submitted, lane = self._queued.pop(seq_id, (None, None))
            if submitted is not None and scheduled:
                self.metrics.observe("queue_time", (now - submitted) / 1e6)
                self._phases.scheduled(seq_id, now / 1e6)
            if lane is not None:
                self.recorder.complete("queue", "request", submitted, now, tid=lane, seq_id=seq_id)
                self.recorder.release_lane(lane)

    def _deliver_tokens(self) -> None:
        events, self._undelivered = self._undelivered, []
        now = clock_us() / 1e6
        for event in events:
            seq_id = event.seq.seq_id
            ended = event.finish_reason is not None
            self._observe(event, now)
            reply_to = self._reply_to.pop(seq_id, None) if ended else self._reply_to.get(seq_id)
            if reply_to is not None:
                self._due(event, reply_to)
        if not self._telling:
            self._tell_slice()

    def _due(self, event: TokenEvent, reply_to: Mailbox) -> None:
        """Queues a token for its stream, in one message with its tokens not yet told."""
        seq = event.seq
        msg = Tokens(seq.seq_id, (event.token_id,), event.finish_reason, logprobs=(event.logprob,),
                     top_logprobs=(event.top_logprobs,), prompt_logprobs=event.prompt_logprobs,
                     num_cached_tokens=seq.num_cached_tokens or 0, num_cache_writes=self._cache_writes(event))
        untold = self._untold.get(seq.seq_id)
        self._untold[seq.seq_id] = (reply_to, msg if untold is None else _merged(untold[1], msg))

    def _cache_writes(self, event: TokenEvent) -> int:
        """So far, or in all once it ended (a reply a stop string ends takes the latest)."""
        seq = event.seq
        if event.finish_reason:
            return seq.num_cache_writes
        return self.scheduler.allocator.cache_writes(seq.seq_id)

    def _tell_slice(self) -> None:
        """Tells the next DELIVERY_SLICE streams their tokens; the rest on the loop's next turn."""
        self._telling = False
        for _ in range(min(DELIVERY_SLICE, len(self._untold))):
            _, (reply_to, msg) = self._untold.popitem(last=False)
            reply_to.tell(msg)
        if self._untold:
            self._telling = True
            asyncio.get_running_loop().call_soon(self._tell_slice)

    def _tell_now(self, seq_id: int) -> None:
        """A sequence's tokens not yet told, now: before anything else is told about it (the
        other streams keep their turn)."""
        self._deliver_tokens()
        untold = self._untold.pop(seq_id, None)
        if untold is not None:
            untold[0].tell(untold[1])

    def _observe(self, event: TokenEvent, now: float) -> None:
        self._phases.token(event.seq.seq_id, now)
        if event.finish_reason is not None:
            self._ended(event.seq, now)

    def _ended(self, seq: Sequence, now: float) -> None:
        computed = seq.num_prompt_tokens - (seq.num_cached_tokens or 0)
        self._phases.ended(seq.seq_id, now, seq.num_preemptions, computed)

    def _finish(self, seq: Sequence, error: str | None = None) -> None:
        """A sequence that ended outside a step result (abort, shutdown, death)."""
        self._tell_now(seq.seq_id)  # its earlier tokens first
        self._dequeue([seq.seq_id], scheduled=False)
        self._ended(seq, clock_us() / 1e6)  # a sequence never scheduled has no phases
        reply_to = self._reply_to.pop(seq.seq_id, None)
        if reply_to is not None:
            reply_to.tell(Tokens(seq.seq_id, (), seq.finish_reason,
                                 num_cached_tokens=seq.num_cached_tokens or 0,
                                 num_cache_writes=seq.num_cache_writes, error=error))

    def die(self, reason: str) -> None:
        """Engine death: every sequence ends with `error` and frees its blocks (the KV cache
        is gone or no longer trusted); every later submission ends at once."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for seq in self.scheduler.fail_all("error"):
            self._finish(seq, reason)


def _merged(earlier: Tokens, later: Tokens) -> Tokens:
    """One message for two of a sequence's in a row (the prompt's scores come with the first)."""
    return Tokens(earlier.seq_id, earlier.token_ids + later.token_ids, later.finish_reason,
                  logprobs=earlier.logprobs + later.logprobs,
                  top_logprobs=earlier.top_logprobs + later.top_logprobs,
                  prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs,
                  num_cached_tokens=later.num_cached_tokens, num_cache_writes=later.num_cache_writes,
                  error=later.error)
