"""SchedulerActor with a fake worker: shutdown aborts, worker death, queue-time samples."""

from __future__ import annotations

import asyncio

from pypto_serving.actors.base import Actor
from pypto_serving.actors.scheduler import DELIVERY_SLICE, SchedulerActor
from pypto_serving.core.block_allocator import BlockAllocator
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.messages.request import Tokens
from pypto_serving.messages.scheduler import Abort, AbortAll, Submit, WorkerDied
from pypto_serving.messages.worker import StepPlan, StepResult
from pypto_serving.telemetry.metrics import EngineMetrics


class Inbox(Actor):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[Tokens] = []

    async def receive(self, msg: object) -> None:
        self.received.append(msg)


class FakeWorker:
    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def send(self, plan: StepPlan) -> None:
        self.plans.append(plan)  # never answers: the step stays in flight


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def started(max_num_seqs: int = 1) -> tuple[SchedulerActor, BlockAllocator, EngineMetrics]:
    alloc, metrics = BlockAllocator(16, 4), EngineMetrics("tiny")
    policy = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=64), alloc)
    actor = SchedulerActor(policy, FakeWorker(), metrics)
    metrics.bind(policy, alloc)
    actor.start()
    return actor, alloc, metrics


async def stop(actor: SchedulerActor, inbox: Inbox) -> None:
    for each in (actor, inbox):
        await each.stop()


def submit(actor: SchedulerActor, inbox: Inbox, seq_id: int) -> None:
    actor.tell(Submit(seq_id, tuple(range(10)), 8, SamplingParams(), frozenset(), inbox))


async def test_abort_all_ends_running_and_waiting_and_later_submissions():
    actor, alloc, metrics = await started(max_num_seqs=1)
    inbox = Inbox()
    inbox.start()
    submit(actor, inbox, 0)
    submit(actor, inbox, 1)
    await settle()
    assert metrics.gauges()["running"] == 1 and metrics.gauges()["waiting"] == 1
    assert metrics.histograms["queue_time"].count == 1  # only the running one was scheduled
    actor.tell(AbortAll("aborted"))
    submit(actor, inbox, 2)
    await settle()
    assert sorted((m.seq_id, m.finish_reason) for m in inbox.received) == [
        (0, "aborted"), (1, "aborted"), (2, "aborted")]
    assert metrics.gauges() == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
    alloc.check_integrity()
    await stop(actor, inbox)


async def test_results_of_steps_that_ran_past_abort_all_are_ignored():
    """The worker still answers the steps in flight when every sequence was ended (shutdown)."""
    faults = []
    alloc = BlockAllocator(16, 4)
    worker = FakeWorker()
    policy = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64, async_scheduling=True), alloc)
    actor = SchedulerActor(policy, worker, on_fault=lambda a, m, e: faults.append(e))
    actor.start()
    inbox = Inbox()
    inbox.start()
    submit(actor, inbox, 0)
    await settle()
    assert len(worker.plans) == 2  # a prefill and, planned ahead, the decode after it
    actor.tell(AbortAll("aborted"))
    for plan in worker.plans:
        actor.tell(StepResult(plan.step_id, [0], [7]))
    await settle()
    assert faults == [] and [m.finish_reason for m in inbox.received] == ["aborted"]
    alloc.check_integrity()
    await stop(actor, inbox)


async def test_worker_death_errors_every_request_and_frees_its_blocks():
    actor, alloc, metrics = await started(max_num_seqs=4)
    inbox = Inbox()
    inbox.start()
    for seq_id in range(3):
        submit(actor, inbox, seq_id)
    await settle()
    assert alloc.usage > 0
    actor.tell(WorkerDied("device worker cpu died (exit code -9)"))
    submit(actor, inbox, 3)
    await settle()
    assert [m.finish_reason for m in inbox.received] == ["error"] * 4
    assert all("died" in m.error for m in inbox.received)
    assert alloc.usage == 0.0 and actor.dead_reason is not None
    alloc.check_integrity()
    await stop(actor, inbox)


class AnsweringWorker(FakeWorker):
    """Answers every plan with token 7 per sampled sequence, and notes how many tokens the
    request had been told about when each plan went out."""

    def __init__(self, actor_ref: list, inbox: Inbox) -> None:
        super().__init__()
        self.actor_ref, self.inbox = actor_ref, inbox
        self.told_when_sent: list[int] = []

    def send(self, plan: StepPlan) -> None:
        super().send(plan)
        told = [*self.inbox.received, *self.inbox._inbox._queue]  # handled or waiting
        self.told_when_sent.append(sum(len(m.token_ids) for m in told))
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        self.actor_ref[0].tell(StepResult(plan.step_id, sampled, [7] * len(sampled)))


async def test_next_step_goes_out_before_the_last_tokens_are_delivered():
    alloc = BlockAllocator(16, 4)
    policy = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64), alloc)
    inbox, ref = Inbox(), []
    worker = AnsweringWorker(ref, inbox)
    actor = SchedulerActor(policy, worker)
    ref.append(actor)
    for each in (actor, inbox):
        each.start()
    submit(actor, inbox, 0)  # max_tokens 8
    for _ in range(10):
        await settle()
    # Plan k + 1 (k >= 0) left before token k was told to the request.
    assert worker.told_when_sent == [0, 0, 1, 2, 3, 4, 5, 6]
    assert [m.token_ids for m in inbox.received] == [(7,)] * 8
    assert inbox.received[-1].finish_reason == "length" and len(worker.plans) == 8
    alloc.check_integrity()
    await stop(actor, inbox)


class Recorder:
    """A mailbox that notes every message told to it, in one list shared by all of them."""

    def __init__(self, log: list[tuple[int, tuple[int, ...], str | None]]) -> None:
        self.log = log

    def tell(self, msg: Tokens) -> None:
        self.log.append((msg.seq_id, msg.token_ids, msg.finish_reason))


async def test_streams_are_told_a_slice_per_loop_turn_and_untold_tokens_merge():
    """Under load (two results handled before the loop turns) the first DELIVERY_SLICE streams
    hear of step 1 at once and the rest a slice per turn of the loop, those not yet told
    getting steps 1 and 2 in one message. An abort first tells that sequence's untold tokens;
    the others keep their turn."""
    n = DELIVERY_SLICE + 4
    alloc = BlockAllocator(4 * n, 4)
    worker = FakeWorker()
    policy = Scheduler(SchedulerConfig(max_num_seqs=n, max_model_len=64, async_scheduling=True), alloc)
    actor = SchedulerActor(policy, worker)
    log: list = []
    for seq_id in range(n):
        actor.tell(Submit(seq_id, tuple(range(10)), 8, SamplingParams(), frozenset(), Recorder(log)))
    actor.start()
    await settle()
    assert [len(p.seqs) for p in worker.plans] == [n, n]  # the prefill and the decode planned ahead
    for plan, token in zip(worker.plans[:2], (7, 8), strict=True):
        actor.tell(StepResult(plan.step_id, list(range(n)), [token] * n))
    told = []
    for _ in range(4):
        await asyncio.sleep(0)
        told.append(len(log))
    rest = n - DELIVERY_SLICE
    assert told == [DELIVERY_SLICE, 2 * DELIVERY_SLICE, 2 * n - rest, 2 * n - rest]  # rest merged
    assert log == [(s, (7,), None) for s in range(DELIVERY_SLICE)] + [
        (s, (7, 8), None) for s in range(DELIVERY_SLICE, n)] + [
        (s, (8,), None) for s in range(DELIVERY_SLICE)]
    del log[:]
    assert len(worker.plans) == 4
    actor.tell(StepResult(worker.plans[2].step_id, list(range(n)), [9] * n))
    actor.tell(Abort(n - 2, "aborted"))  # handled with the result, before the loop turns
    await settle()
    assert log == [(s, (9,), None) for s in range(DELIVERY_SLICE)] + [
        (n - 2, (9,), None), (n - 2, (), "aborted")] + [
        (s, (9,), None) for s in range(DELIVERY_SLICE, n) if s != n - 2]
    await actor.stop()
