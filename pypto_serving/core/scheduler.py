"""Continuous batching policy: no prefill or decode phase, just counters.

Pure: no asyncio, torch or I/O. The SchedulerActor wraps it. One step is three calls:
`propose()` turns the token budget into `Demand`s (running sequences first, then waiting
ones in arrival order), the block allocator answers with an `Allocation`, `commit()`
turns that into a `StepPlan` for the device worker, and `on_result()` applies the sampled
tokens. Every scheduled sequence gets `min(pending tokens, budget left, chunk cap)`
tokens, so prefill, chunked prefill and decode are one rule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pypto_serving.actors.device_worker import ScheduledSeq, StepPlan, StepResult
from pypto_serving.core.block_allocator import Allocation, Demand, Grant
from pypto_serving.core.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 1024


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token sampled for a sequence; `finish_reason` set when it was the last one."""

    seq: Sequence
    token_id: int
    finish_reason: str | None
    logprob: float = 0.0
    top_logprobs: tuple = ()


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}
        self._planned: dict[int, int] = {}  # seq_id -> tokens computed by the step in flight
        self._dropped: list[int] = []  # sequences the worker may forget
        self._step_id = 0
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (cache hits excluded, recomputes included)

    # -- intake ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def abort(self, seq_id: int, reason: str) -> Sequence | None:
        """Removes a sequence wherever it is; the caller frees its blocks."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._dropped.append(seq_id)
        else:
            self.waiting.remove(seq)
        seq.finish(reason)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- a step --------------------------------------------------------------------
    def propose(self) -> list[Demand]:
        budget = self.config.max_num_batched_tokens
        demands = []
        for seq in self.running:
            n = min(seq.num_pending, budget, self._chunk_cap(seq))
            budget -= n
            demands.append(Demand(seq.seq_id, seq.num_computed + n, seq.num_computed))
        slots = self.config.max_num_seqs - len(self.running)
        for seq in list(self.waiting)[:max(slots, 0)]:
            n = min(seq.num_tokens, budget, self._chunk_cap(seq))
            if n <= 0 or (not self.config.enable_chunked_prefill and n < seq.num_tokens):
                break
            budget -= n
            demands.append(Demand(seq.seq_id, n, 0, seq.prompt_ids, seq.num_tokens))
        return demands

    def _chunk_cap(self, seq: Sequence) -> int:
        if not self.config.enable_chunked_prefill or seq.num_pending <= 1:
            return seq.num_pending
        return self.config.long_prefill_token_threshold

    def commit(self, demands: list[Demand], allocation: Allocation) -> StepPlan | None:
        """Applies the allocator's answer; None when nothing can run this step."""
        for seq_id in allocation.preempted:
            if seq_id in self._by_id:  # skip sequences aborted while allocating
                self._preempt(self._by_id[seq_id])
        wanted = {d.seq_id: d for d in demands}
        grants = [g for g in allocation.grants if g.seq_id in self._by_id]
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
            seq.admit(list(grant.block_ids), grant.num_cached)
            n = min(seq.num_pending, demand.num_tokens)
        else:
            seq.block_ids = list(grant.block_ids)
            n = demand.num_tokens - seq.num_computed
        if n <= 0:
            return None
        self.num_prefill_tokens += max(0, min(seq.num_computed + n, seq.num_prompt_tokens) - seq.num_computed)
        self._planned[seq.seq_id] = n
        return self._chunk(seq, n)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledSeq:
        start, reset = seq.num_computed, seq.needs_reset
        new_blocks = seq.block_ids[seq.num_sent_blocks:]
        seq.num_sent_blocks, seq.needs_reset = len(seq.block_ids), False
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, start + n),
            start_pos=start,
            new_block_ids=new_blocks,
            sample=start + n == seq.num_tokens,
            reset=reset,
            prefix_ids=seq.token_slice(0, start) if reset else [],
            num_prompt_tokens=seq.num_prompt_tokens if reset else 0,
            sampling=seq.sampling if reset else None,
        )

    def on_result(self, result: StepResult) -> tuple[list[TokenEvent], list[Sequence]]:
        """Applies a step's tokens; returns the token events and the sequences that ended."""
        planned, self._planned = self._planned, {}
        for seq_id, n in planned.items():
            seq = self._by_id.get(seq_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:
                seq.num_computed += n
        events, ended = [], []
        for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids, strict=True)):
            seq = self._by_id.get(seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            event = self._append(seq, token, result, i)
            events.append(event)
            if event.finish_reason is not None:
                ended.append(seq)
        return events, ended

    def _append(self, seq: Sequence, token: int, result: StepResult, i: int) -> TokenEvent:
        seq.append_token(token)
        reason = seq.stop_reason(self.config.max_model_len)
        if reason is not None:
            self._end(seq, reason)
        logprob = result.logprobs[i] if result.logprobs else 0.0
        top = tuple(result.top_logprobs[i]) if result.top_logprobs else ()
        return TokenEvent(seq, token, reason, logprob, top)

    def _end(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        del self._by_id[seq.seq_id]
        self._dropped.append(seq.seq_id)
        seq.finish(reason)

    def fail_all(self, reason: str) -> list[Sequence]:
        """Ends every sequence (worker death); returns them for their requests."""
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self.abort(seq.seq_id, reason)
        return seqs
