"""Scheduler + block allocator, driven synchronously with a fake device worker."""

from __future__ import annotations

import pytest

from pypto_serving.core.block_allocator import BlockAllocator, Demand
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
from pypto_serving.core.sequence import Sequence
from pypto_serving.messages.worker import PLACEHOLDER, PromptLogprobs, StepPlan, StepResult

EOS = 99


def make_sequences(n: int, prompt_len: int = 8, max_tokens: int = 4, start: int = 0) -> list[Sequence]:
    return [
        Sequence(seq_id=start + i, prompt_ids=tuple(range(10 * i, 10 * i + prompt_len)),
                 max_tokens=max_tokens, stop_token_ids=frozenset({EOS}))
        for i in range(n)
    ]


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, prefix: bool = True, **cfg):
        self.alloc = BlockAllocator(num_blocks, block_size, prefix)
        self.sched = Scheduler(SchedulerConfig(**cfg), self.alloc)
        self.plans: list[StepPlan] = []
        self.next_token = lambda seq_id: 7

    def step(self) -> StepPlan | None:
        plan = self.sched.schedule()
        if plan is None:
            return None
        self.plans.append(plan)
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        result = StepResult(plan.step_id, sampled, [self.next_token(s) for s in sampled])
        self.sched.apply(result)
        self.alloc.check_integrity()
        return plan

    def run(self, limit: int = 500) -> int:
        steps = 0
        while self.sched.has_work and steps < limit:
            assert self.step() is not None, "scheduler stalled with work left"
            steps += 1
        return steps


class AsyncHarness(Harness):
    """Two plans in flight: each result comes back after the next plan went out, as the
    device worker answers them in order; tokens are decided by `next_token(seq_id, step)`."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, prefix: bool = True, **cfg):
        super().__init__(num_blocks, block_size, prefix, **cfg)
        self.sched = Scheduler(SchedulerConfig(async_scheduling=True, **cfg), self.alloc)
        self.flight: list[StepPlan] = []
        self.next_token = lambda seq_id: 7

    def step(self) -> StepPlan | None:
        while self.sched.in_flight is False or self.sched.can_plan_ahead:
            plan = self.sched.schedule()
            if plan is None:
                break
            self.plans.append(plan)
            self.flight.append(plan)
        if not self.flight:
            return None
        plan = self.flight.pop(0)
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        self.sched.apply(StepResult(plan.step_id, sampled, [self.next_token(s) for s in sampled]))
        self.alloc.check_integrity()
        return plan


def test_prefill_then_decode_to_max_tokens():
    h = Harness()
    seqs = make_sequences(3)
    for s in seqs:
        h.sched.add(s)
    h.run()
    assert all(s.output_ids == [7] * 4 and s.finish_reason == "length" for s in seqs)
    first = h.plans[0]
    assert [len(s.token_ids) for s in first.seqs] == [8, 8, 8]
    assert all(len(s.token_ids) == 1 for p in h.plans[1:] for s in p.seqs)
    assert h.alloc.num_available == h.alloc.num_blocks


def test_token_budget_and_chunked_prefill():
    h = Harness(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    seqs = make_sequences(2, prompt_len=13, max_tokens=2)
    for s in seqs:
        h.sched.add(s)
    h.run()
    for plan in h.plans:
        assert sum(len(s.token_ids) for s in plan.seqs) <= 10
        assert all(len(s.token_ids) <= 6 for s in plan.seqs)
    chunks = [s.token_ids for p in h.plans for s in p.seqs if s.seq_id == 0]
    assert sum(chunks[:3], []) == list(range(13))  # 6 + 6 + 1, in order
    assert all(s.output_ids == [7, 7] for s in seqs)


def test_without_chunked_prefill_prompt_goes_whole():
    h = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    for s in make_sequences(3, prompt_len=9, max_tokens=1):
        h.sched.add(s)
    h.run()
    assert [len(s.token_ids) for s in h.plans[0].seqs] == [9]  # second one would not fit whole
    assert all(len(s.token_ids) in (9,) for p in h.plans for s in p.seqs)


def test_max_num_seqs_caps_running():
    h = Harness(max_num_seqs=2)
    for s in make_sequences(5):
        h.sched.add(s)
    while h.sched.has_work:
        h.step()
        assert h.sched.num_running <= 2
    assert len(h.plans) > 5


def test_eos_finishes_with_stop():
    h = Harness()
    seq = make_sequences(1, max_tokens=10)[0]
    h.sched.add(seq)
    h.next_token = lambda _: EOS
    h.run()
    assert seq.output_ids == [EOS] and seq.finish_reason == "eos"


def test_max_model_len_finishes_with_length():
    h = Harness(max_model_len=10)
    seq = make_sequences(1, prompt_len=8, max_tokens=100)[0]
    h.sched.add(seq)
    h.run()
    assert seq.num_tokens == 10 and seq.finish_reason == "length"


@pytest.mark.parametrize("harness", [Harness, AsyncHarness])
def test_preemption_by_recompute_when_blocks_run_out(harness: type[Harness]):
    """(With async scheduling a plan made ahead never preempts: the step waits for the
    result, and no reset ever carries a placeholder.)"""
    h = harness(num_blocks=6, block_size=4)  # 24 token slots for 2 x (8 + 8) tokens
    seqs = make_sequences(2, prompt_len=8, max_tokens=8)
    for s in seqs:
        h.sched.add(s)
    h.next_token = lambda seq_id: 50 + seq_id
    h.run()
    assert h.sched.num_preemptions >= 1
    assert [s.output_ids for s in seqs] == [[50] * 8, [51] * 8]
    resets = [s for p in h.plans for s in p.seqs if s.reset and s.seq_id == 1]
    assert len(resets) >= 2
    assert (resets[-1].prefix_ids + resets[-1].token_ids)[:8] == list(range(10, 18))
    assert all(PLACEHOLDER not in s.token_ids + s.prefix_ids for p in h.plans for s in p.seqs if s.reset)
    assert h.alloc.num_available == 6


def test_preempted_sequence_keeps_its_outputs_on_recompute():
    h = Harness(num_blocks=5, block_size=4, prefix=False)
    seqs = make_sequences(2, prompt_len=6, max_tokens=6)
    for s in seqs:
        h.sched.add(s)
    h.run()
    resumed = [s for p in h.plans for s in p.seqs if s.reset and s.start_pos == 0 and len(s.token_ids) > 6]
    assert resumed, "a preempted sequence must be recomputed with its earlier outputs"
    assert resumed[0].num_prompt_tokens == 6


def test_prefix_cache_reuse_across_requests():
    h = Harness(block_size=4)
    first = Sequence(0, tuple(range(100, 114)), 2)
    h.sched.add(first)
    h.run()
    second = Sequence(1, tuple(range(100, 112)) + (5, 6, 7), 2)
    h.sched.add(second)
    h.run()
    reset = next(s for s in h.plans[-2].seqs if s.seq_id == 1)
    assert reset.start_pos == 12 and reset.prefix_ids == list(range(100, 112))
    assert reset.token_ids == [5, 6, 7]
    assert second.num_cached_tokens == 12
    assert h.alloc.prefix_hits == 12 and h.alloc.prefix_queries == 14 + 15


def test_a_sequence_counts_the_prompt_blocks_it_put_into_the_prefix_cache():
    h = Harness(block_size=4)
    first = Sequence(0, tuple(range(100, 114)), 2)  # 14 tokens: 3 full blocks
    h.sched.add(first)
    h.run()
    second = Sequence(1, tuple(range(100, 112)) + (5, 6, 7, 8, 9), 2)  # 3 blocks cached, 1 new
    twin = Sequence(2, tuple(range(100, 114)), 2)  # all of first's blocks, nothing new
    h.sched.add(second)
    h.sched.add(twin)
    h.run()
    assert (first.num_cache_writes, second.num_cache_writes, twin.num_cache_writes) == (12, 4, 0)
    assert second.num_cached_tokens == 12 and twin.num_cached_tokens == 12
    off = Harness(block_size=4, prefix=False)
    alone = Sequence(0, tuple(range(100, 114)), 2)
    off.sched.add(alone)
    off.run()
    assert alone.num_cache_writes == 0


def test_identical_prompt_leaves_one_token_to_compute():
    h = Harness(block_size=4)
    for i in range(2):
        h.sched.add(Sequence(i, tuple(range(8)), 1))
        h.run()
    reset = next(s for s in h.plans[-1].seqs if s.seq_id == 1)
    assert reset.start_pos == 4 and reset.token_ids == [4, 5, 6, 7]


def test_prefix_cache_disabled_never_hits():
    h = Harness(prefix=False)
    for i in range(2):
        h.sched.add(Sequence(i, tuple(range(12)), 1))
        h.run()
    assert all(s.start_pos == 0 for p in h.plans for s in p.seqs if s.reset)
    assert h.alloc.prefix_hits == 0


def test_cached_blocks_are_evicted_lru_when_needed():
    h = Harness(num_blocks=4, block_size=4)
    h.sched.add(Sequence(0, tuple(range(9)), 1))
    h.run()
    assert h.alloc.num_available == 4  # 2 cached-evictable + 2 free
    h.sched.add(Sequence(1, tuple(range(50, 63)), 3))  # needs all 4 blocks
    h.run()
    h.sched.add(Sequence(2, tuple(range(9)), 1))
    h.run()
    assert h.plans[-1].seqs[0].start_pos == 0, "evicted prefix must not be served from cache"


def test_abort_running_and_waiting_frees_blocks():
    h = Harness(max_num_seqs=1)
    a, b = make_sequences(2, max_tokens=50)
    h.sched.add(a)
    h.sched.add(b)
    h.step()
    assert h.sched.abort(a.seq_id, "aborted") is a
    h.alloc.free(a.seq_id)
    assert h.sched.abort(b.seq_id, "aborted") is b
    assert not h.sched.has_work and a.finish_reason == "aborted"
    h.alloc.check_integrity()
    assert h.alloc.num_available == h.alloc.num_blocks


def test_finished_and_aborted_sequences_are_reported_to_worker():
    h = Harness()
    a, b = make_sequences(2, max_tokens=3)
    h.sched.add(a)
    h.sched.add(b)
    h.step()
    h.sched.abort(a.seq_id, "aborted")
    h.alloc.free(a.seq_id)
    plan = h.step()
    assert a.seq_id in plan.finished and a.seq_id not in [s.seq_id for s in plan.seqs]


def test_result_for_aborted_sequence_is_ignored():
    h = Harness()
    a, b = make_sequences(2)
    h.sched.add(a)
    h.sched.add(b)
    plan = h.sched.schedule()
    h.sched.abort(a.seq_id, "aborted")
    h.alloc.free(a.seq_id)
    events = h.sched.apply(StepResult(plan.step_id, [0, 1], [7, 7]))
    assert [e.seq.seq_id for e in events] == [1] and a.output_ids == []


def test_block_table_deltas():
    h = Harness(block_size=4)
    seq = make_sequences(1, prompt_len=4, max_tokens=6)[0]
    h.sched.add(seq)
    h.run()
    tables = [s.new_block_ids for p in h.plans for s in p.seqs]
    assert len(tables[0]) == 1 and sum(len(t) for t in tables) == len(set(sum(tables, [])))
    assert sum(len(t) for t in tables) == 3  # 4 prompt + 5 computed outputs -> 9 slots


@pytest.mark.parametrize("num_blocks", [3, 5, 8, 13])
def test_random_workload_never_leaks(num_blocks: int):
    import random

    rng = random.Random(num_blocks)
    h = Harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12,
                long_prefill_token_threshold=5, max_num_seqs=4)
    next_id = 0
    for _ in range(60):
        if rng.random() < 0.4:
            prompt = tuple(rng.choice([1, 2]) for _ in range(rng.randint(1, 8)))
            h.sched.add(Sequence(next_id, prompt, rng.randint(1, 3)))
            next_id += 1
        if rng.random() < 0.1 and h.sched.running:
            victim = rng.choice(h.sched.running).seq_id
            h.sched.abort(victim, "aborted")
            h.alloc.free(victim)
        if h.sched.has_work:
            h.step()
        h.alloc.check_integrity()
    h.run()
    assert h.alloc.num_available == num_blocks


def test_the_idle_scheduler_checks_that_no_block_outlived_its_sequence():
    """When the last sequence is gone, a block still owned is a leak: it fails loudly (the
    engine's fault policy then ends the engine) instead of shrinking the cache for good."""
    h = Harness()
    h.sched.add(make_sequences(1)[0])
    h.run()
    assert h.sched.schedule() is None  # idle, nothing leaked: the check passes
    h.alloc.allocate([Demand(99, 4, 0, (1, 2, 3, 4), 4)])  # a table no sequence owns
    with pytest.raises(AssertionError, match="outlived"):
        h.sched.schedule()


def test_a_result_must_answer_the_step_in_flight():
    h = Harness()
    h.sched.add(make_sequences(1)[0])
    plan = h.sched.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        h.sched.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        h.sched.apply(StepResult(plan.step_id + 1, [], []))


def _scoring_harness(**cfg) -> tuple[Harness, list]:
    """A harness whose fake worker scores prompt tokens as the real one does (token t gets
    logprob -t), and that keeps every token event."""
    h, events = Harness(**cfg), []

    def step() -> StepPlan | None:
        plan = h.sched.schedule()
        if plan is None:
            return None
        h.plans.append(plan)
        prompt = []
        for s in plan.seqs:
            seq = h.sched._by_id[s.seq_id]
            if s.reset:
                h.asked[s.seq_id] = s.sampling.prompt_logprobs
                h.resets.append((bool(seq.output_ids), s.sampling.prompt_logprobs))
            end = min(s.start_pos + len(s.token_ids), seq.num_prompt_tokens)
            targets = list(range(max(s.start_pos, 1), end))
            if h.asked[s.seq_id] is not None and targets:
                prompt.append(PromptLogprobs(s.seq_id, targets[0], [-float(t) for t in targets],
                                             [1] * len(targets), [[] for _ in targets]))
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        events.extend(h.sched.apply(StepResult(plan.step_id, sampled, [7] * len(sampled),
                                               prompt_logprobs=prompt)))
        return plan

    h.asked, h.resets = {}, []
    h.step = step
    return h, events


def test_prompt_scores_come_with_the_first_token_once_even_through_preemption():
    h, events = _scoring_harness(num_blocks=6, block_size=4, long_prefill_token_threshold=3)
    seqs = make_sequences(2, prompt_len=8, max_tokens=8)
    for s in seqs:
        s.sampling = SamplingParams(prompt_logprobs=0)
        h.sched.add(s)
    h.run()
    assert h.sched.num_preemptions >= 1
    for s in seqs:
        mine = [e for e in events if e.seq is s]
        assert mine[0].prompt_logprobs == tuple((-float(t), 1, []) for t in range(1, 8))
        assert all(e.prompt_logprobs == () for e in mine[1:]) and len(mine) == 8
    # A prompt recomputed after its scores went out is not scored again.
    late = [asked for had_outputs, asked in h.resets if had_outputs]
    assert late and all(asked is None for asked in late)
    assert all(asked == 0 for had_outputs, asked in h.resets if not had_outputs)


def test_a_scored_prompt_is_computed_even_when_cached():
    h, _ = _scoring_harness(block_size=4)
    h.sched.add(Sequence(0, tuple(range(100, 114)), 2))
    h.run()
    scored = Sequence(1, tuple(range(100, 114)), 2, SamplingParams(prompt_logprobs=0))
    plain = Sequence(2, tuple(range(100, 114)), 2)
    h.sched.add(scored)
    h.sched.add(plain)
    h.run()
    assert scored.num_cached_tokens == 0 and plain.num_cached_tokens == 12


def test_async_scheduling_plans_ahead_with_placeholders_and_gives_the_same_tokens():
    counts: dict[int, int] = {}

    def token(seq_id: int) -> int:  # a different token each time, EOS on seq 1's 5th
        counts[seq_id] = counts.get(seq_id, 0) + 1
        return EOS if (seq_id, counts[seq_id]) == (1, 5) else 20 + counts[seq_id]

    outputs = {}
    for harness in (Harness, AsyncHarness):
        counts.clear()
        h = harness(max_num_batched_tokens=10, long_prefill_token_threshold=6)
        h.next_token = token
        seqs = make_sequences(3, prompt_len=8, max_tokens=7)
        for s in seqs:
            h.sched.add(s)
        h.run()
        outputs[harness] = [(s.output_ids, s.finish_reason) for s in seqs]
        assert h.alloc.num_available == h.alloc.num_blocks and not h.sched.in_flight
        if harness is AsyncHarness:
            ahead = [s for p in h.plans for s in p.seqs if s.token_ids == [PLACEHOLDER]]
            assert ahead and all(not s.reset for s in ahead)
    assert outputs[Harness] == outputs[AsyncHarness]
    assert outputs[Harness][1] == ([21, 22, 23, 24, EOS], "eos")
    assert outputs[Harness][0] == ([21, 22, 23, 24, 25, 26, 27], "length")


def test_a_preempted_sequence_aborted_while_waiting_is_dropped_by_the_worker():
    h = Harness(num_blocks=6, block_size=4)  # 24 token slots for 2 x (8 + 8) tokens
    seqs = make_sequences(2, prompt_len=8, max_tokens=8)
    for s in seqs:
        h.sched.add(s)
    while not any(s.num_preemptions and s in h.sched.waiting for s in seqs):
        assert h.step() is not None
    victim = next(s for s in seqs if s in h.sched.waiting)
    h.sched.abort(victim.seq_id, "aborted")
    plan = h.step()
    assert victim.seq_id in plan.finished  # the worker forgets its state (it had been admitted)


def test_pending_tokens_are_every_sequences_uncomputed_tokens_and_outputs_left():
    h = Harness(num_blocks=6, block_size=4)  # 24 token slots: the two sequences preempt
    seqs = make_sequences(2, prompt_len=8, max_tokens=8)
    for s in seqs:
        h.sched.add(s)
    assert h.sched.pending_tokens == 2 * (8 + 8) and h.sched.holds(0) and not h.sched.holds(7)
    h.step()  # both prefilled, one token each
    assert [s.work_left for s in seqs] == [1 + 7, 1 + 7] and h.sched.pending_tokens == 16
    while not any(s.num_preemptions for s in seqs):
        assert h.step() is not None
    victim = next(s for s in seqs if s.num_preemptions)  # its KV is gone: all of it again
    assert victim.work_left == victim.num_tokens + victim.max_tokens - victim.num_output_tokens
    h.run()
    assert h.sched.pending_tokens == 0 and not h.sched.holds(0)
