"""Continuous batching policy: no prefill or decode phase, just counters.

Pure: no asyncio, torch or I/O. The SchedulerActor wraps it. One engine step is one call,
`plan, events = scheduler.step(result)`: apply the last step's sampled tokens (ended
sequences give their blocks back), then plan the next step: `_propose` turns the token
budget into `Demand`s (running sequences first, then waiting ones in arrival order), the
block allocator this scheduler owns answers with an `Allocation` (preempting by recompute
when blocks run out), and `_commit` turns that into the `StepPlan` for the device worker.
Every scheduled sequence gets `min(pending tokens, budget left, chunk cap)` tokens, so
prefill, chunked prefill and decode are one rule. At most one plan is in flight. When the
last sequence is gone, the allocator's integrity is checked (every block free or cached).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec

from pypto_serving.core.block_allocator import Allocation, BlockAllocator, Demand, Grant
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.core.sequence import SeqStatus, Sequence
from pypto_serving.core.speculative import LOOKBACK, NgramIndex, SpeculativeConfig, can_speculate
from pypto_serving.messages.worker import ScheduledSeq, StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 1024
    speculative: SpeculativeConfig | None = None  # n-gram proposals for decode steps
    # Plan the next step while one runs (its sampled tokens are placeholders the worker fills
    # in); not with speculation, whose steps sample a varying number of tokens.
    async_scheduling: bool = False

    @property
    def max_in_flight(self) -> int:
        return 2 if self.async_scheduling and self.speculative is None else 1


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculation so far (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # decode steps of a sequence that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: proposals kept at offset i

    def count(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class TokenEvent(msgspec.Struct, frozen=True):
    """A token sampled for a sequence; `finish_reason` set when it was the last one."""

    seq: Sequence
    token_id: int
    finish_reason: str | None
    logprob: float = 0.0
    top_logprobs: tuple = ()
    prompt_logprobs: tuple = ()  # with a sequence's first token: its prompt's scores, when asked


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}
        self._sampled: dict[int, list[int]] = {}  # step id -> the sequences it samples for
        self._drafts: dict[int, list[int]] = {}  # seq_id -> its proposals in the step in flight
        self.spec = SpecDecodeStats()
        self._dropped: list[int] = []  # sequences the worker may forget
        self._flight: deque[int] = deque()  # step ids of the plans the worker has, oldest first
        self._step_id = 0
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (cache hits excluded, recomputes included)

    # -- intake ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        spec = self.config.speculative
        if spec is not None and can_speculate(seq.sampling):
            seq.ngrams = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                    (*seq.prompt_ids, *seq.output_ids)[-LOOKBACK:])
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def abort(self, seq_id: int, reason: str) -> Sequence | None:
        """Removes a sequence wherever it is and frees its blocks."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.num_cached_tokens is not None:  # admitted once (maybe preempted since): the
            self._dropped.append(seq_id)  # worker holds its state
        self._free(seq)
        seq.finish(reason)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def in_flight(self) -> bool:
        """A plan was handed out and its result has not come back."""
        return bool(self._flight)

    @property
    def can_plan_ahead(self) -> bool:
        """Another plan may go out before the last one's result (async scheduling)."""
        return bool(self._flight) and len(self._flight) < self.config.max_in_flight and self.has_work

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._by_id

    @property
    def pending_tokens(self) -> int:
        """The work queued here, in tokens: every sequence's `work_left` (a data-parallel
        router's load measure; one pass over the sequences)."""
        return sum(seq.work_left for seq in self._by_id.values())

    # -- a step --------------------------------------------------------------------
    def step(self, result: StepResult | None = None) -> tuple[StepPlan | None, list[TokenEvent]]:
        """The last step's result (None when no step was in flight) -> the next plan (None
        when nothing can run) and the token events to deliver."""
        events = self.apply(result) if result is not None else []
        return self.schedule(), events

    def schedule(self) -> StepPlan | None:
        """The next step's plan, now in flight; None when nothing can run. With a step in
        flight (async scheduling) only a plan that needs no preemption goes out."""
        if len(self._flight) >= self.config.max_in_flight:
            raise RuntimeError(f"step {self._flight[-1]} is still in flight")
        plan = self._plan(ahead=bool(self._flight))
        if plan is not None:
            self._flight.append(plan.step_id)
        if not self.has_work and not self._flight:
            self._check_idle()
        return plan

    def _plan(self, ahead: bool = False) -> StepPlan | None:
        """Retries while the allocator preempted someone: the freed blocks may fit a step.
        `ahead`: a step is in flight; preempting now would take blocks it writes, so a plan
        that does not fit the free blocks waits for its result instead."""
        while self.has_work:
            demands = self._propose()
            if ahead and not self.allocator.fits(demands):
                return None
            allocation = self.allocator.allocate(demands)
            plan = self._commit(demands, allocation)
            if plan is not None or not allocation.preempted:
                return plan
        return None

    def _check_idle(self) -> None:
        """No sequence left: every block must be free or cached, none owned."""
        self.allocator.check_integrity()
        if self.allocator.num_owners:
            raise AssertionError(f"{self.allocator.num_owners} block tables outlived their sequences")
        if self.allocator.num_counting_writes:
            raise AssertionError(
                f"{self.allocator.num_counting_writes} cache-write counts outlived their sequences")

    def _propose(self) -> list[Demand]:
        budget = self.config.max_num_batched_tokens
        demands = []
        self._drafts = {}
        speculating = self._speculating()
        max_model_len = self.config.max_model_len
        for seq in self.running:
            if seq.at_limit(max_model_len):
                continue  # the token a step in flight samples is its last
            pending = seq.num_pending
            n = min(pending, budget, self._chunk_cap(pending))
            if speculating and n == pending == 1 and seq.ngrams is not None:
                draft = seq.ngrams.propose(self._draft_room(seq, budget))
                if draft:
                    self._drafts[seq.seq_id] = draft
                    n += len(draft)
            budget -= n
            demands.append(Demand(seq.seq_id, seq.num_computed + n, seq.num_computed))
        slots = self.config.max_num_seqs - len(self.running)
        for seq in list(self.waiting)[:max(slots, 0)]:
            n = min(seq.num_tokens, budget, self._chunk_cap(seq.num_pending))
            if n <= 0 or (not self.config.enable_chunked_prefill and n < seq.num_tokens):
                break
            budget -= n
            demands.append(Demand(seq.seq_id, n, 0, seq.prompt_ids, seq.num_tokens,
                                  use_cache=not seq.wants_prompt_logprobs))
        return demands

    def _speculating(self) -> bool:
        spec = self.config.speculative
        return spec is not None and (spec.disable_by_batch_size is None
                                     or len(self.running) < spec.disable_by_batch_size)

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """How many proposals fit: the step's budget, and the tokens the sequence may still
        produce (the proposals and the token sampled after them), in max_tokens and the
        context; none while min_tokens still masks EOS."""
        if seq.num_output_tokens < seq.sampling.min_tokens:
            return 0
        return min(self.config.speculative.num_speculative_tokens, budget - 1,
                   seq.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - seq.num_tokens - 1)

    def _chunk_cap(self, pending: int) -> int:
        """The most of a sequence's `pending` tokens one step computes."""
        if not self.config.enable_chunked_prefill or pending <= 1:
            return pending
        return self.config.long_prefill_token_threshold

    def _commit(self, demands: list[Demand], allocation: Allocation) -> StepPlan | None:
        """Applies the allocator's answer; None when nothing can run this step."""
        for seq_id in allocation.preempted:
            self._preempt(self._by_id[seq_id])
        grants = allocation.grants
        if len(grants) == len(demands):  # every demand granted, in order (the usual step)
            scheduled = [self._schedule(g, d) for g, d in zip(grants, demands, strict=True)]
        else:
            wanted = {d.seq_id: d for d in demands}
            scheduled = [self._schedule(g, wanted[g.seq_id]) for g in grants]
        scheduled = [s for s in scheduled if s is not None]
        if not scheduled:
            return None
        self._step_id += 1
        finished, self._dropped = self._dropped, []
        return StepPlan(self._step_id, scheduled, finished)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _schedule(self, grant: Grant, demand: Demand) -> ScheduledSeq | None:
        seq = self._by_id[grant.seq_id]
        if demand.prompt_ids is not None:
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.admit(grant.num_cached)
            n = min(seq.num_pending, demand.num_tokens)
        else:
            n = demand.num_tokens - seq.num_computed
        if n <= 0:
            return None
        if seq.num_computed < seq.num_prompt_tokens:
            self.num_prefill_tokens += min(seq.num_computed + n, seq.num_prompt_tokens) - seq.num_computed
        chunk = self._chunk(seq, n)
        # Counted as computed now: the worker runs plans in order, so every later plan finds
        # this KV written (proposals count once the worker has kept them).
        seq.computed(n - chunk.num_draft)
        if chunk.sample:
            seq.inflight += 1
            self._sampled.setdefault(self._step_id + 1, []).append(seq.seq_id)
        return chunk

    def _chunk(self, seq: Sequence, n: int) -> ScheduledSeq:
        start, table = seq.num_computed, self.allocator.block_table(seq.seq_id)
        sent, reset = seq.sent(len(table))
        draft = self._drafts.get(seq.seq_id, [])
        known = n - len(draft)
        token_ids = seq.token_slice(start, start + known)
        sample = start + known == seq.num_tokens + seq.inflight
        if not reset and not draft:  # the usual decode chunk
            return ScheduledSeq(seq.seq_id, token_ids, start, table[sent:], sample)
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=token_ids + draft,
            start_pos=start,
            new_block_ids=table[sent:],
            sample=sample,
            reset=reset,
            prefix_ids=seq.token_slice(0, start) if reset else [],
            num_prompt_tokens=seq.num_prompt_tokens if reset else 0,
            sampling=self._sampling(seq) if reset else None,
            num_draft=len(draft),
        )

    @staticmethod
    def _sampling(seq: Sequence) -> SamplingParams:
        """A recomputed prompt is not scored again once its scores are out."""
        if seq.sampling.prompt_logprobs is None or seq.wants_prompt_logprobs:
            return seq.sampling
        return msgspec.structs.replace(seq.sampling, prompt_logprobs=None)

    def apply(self, result: StepResult) -> list[TokenEvent]:
        """Applies the oldest step in flight's tokens; sequences that ended free their blocks."""
        if not self._flight or result.step_id != self._flight[0]:
            oldest = self._flight[0] if self._flight else None
            raise RuntimeError(f"result of step {result.step_id}, but {oldest} is in flight")
        self._flight.popleft()
        drafts, self._drafts = self._drafts, {}  # (speculation: one step in flight at most)
        got = Counter(result.seq_ids) if drafts else {}
        for seq_id in self._sampled.pop(result.step_id, []):
            seq = self._by_id.get(seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            seq.inflight -= 1
            if seq_id in drafts:  # the kept proposals' KV counts as computed
                accepted = got.get(seq_id, 1) - 1
                seq.computed(accepted)
                self.spec.count(len(drafts[seq_id]), accepted)
        for scored in result.prompt_logprobs:
            seq = self._by_id.get(scored.seq_id)
            if seq is not None and seq.status is SeqStatus.RUNNING and seq.wants_prompt_logprobs:
                seq.score_prompt(scored.first, list(zip(scored.logprobs, scored.ranks, scored.top,
                                                        strict=True)))
        events = []
        for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids, strict=True)):
            seq = self._by_id.get(seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            events.append(self._append(seq, token, result, i))
        return events

    def _append(self, seq: Sequence, token: int, result: StepResult, i: int) -> TokenEvent:
        seq.append_token(token)
        reason = seq.stop_reason(self.config.max_model_len)
        if reason is not None:
            self._end(seq, reason)
        logprob = result.logprobs[i] if result.logprobs else 0.0
        top = tuple(result.top_logprobs[i]) if result.top_logprobs else ()
        prompt = ()
        if seq.prompt_scores:
            prompt, seq.prompt_scores = tuple(seq.prompt_scores), []
        return TokenEvent(seq, token, reason, logprob, top, prompt)

    def _end(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        del self._by_id[seq.seq_id]
        self._dropped.append(seq.seq_id)
        self._free(seq)
        seq.finish(reason)

    def _free(self, seq: Sequence) -> None:
        """An ending sequence's blocks back (its computed prompt blocks stay cached), and the
        count of what its prompt put into the prefix cache taken."""
        self.allocator.free(seq.seq_id, seq.num_computed)
        seq.num_cache_writes = self.allocator.take_cache_writes(seq.seq_id)

    def fail_all(self, reason: str) -> list[Sequence]:
        """Ends every sequence (shutdown, engine death) and frees its blocks; returns them
        for their requests. A step still in flight is forgotten: its result is not awaited."""
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self.abort(seq.seq_id, reason)
        self._sampled, self._drafts = {}, {}
        self._flight.clear()
        return seqs
