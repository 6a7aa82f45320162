"""A sequence as the scheduler sees it: token ids and counters.

Its block table lives in the `BlockAllocator` (the one place on the main side); the sequence
counts how much of it the device worker has already been sent."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.core.speculative import NgramIndex
from pypto_serving.messages.worker import PLACEHOLDER


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation stream. `num_computed` tokens have their KV in the cache; the rest
    (`num_pending`) still have to go through the model. Changes only through the methods."""

    seq_id: int
    prompt_ids: tuple[int, ...]
    max_tokens: int  # new tokens allowed (already capped to the context room)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_sent_blocks: int = 0  # block-table prefix the device worker already has
    needs_reset: bool = True  # the worker must (re)start this sequence on its next chunk
    num_cached_tokens: int | None = None  # prefix-cache hit on first admission
    num_cache_writes: int = 0  # prompt tokens it put into the prefix cache (known at its end)
    num_preemptions: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # (logprob, rank, top-k) of prompt tokens 1, 2, ... as steps score them, until the first
    # output token takes them along
    prompt_scores: list[tuple[float, int, list]] = field(default_factory=list)
    ngrams: NgramIndex | None = None  # with n-gram speculation: where its next tokens come from
    inflight: int = 0  # tokens that steps in flight will sample for it (async scheduling: up to 2)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt is still being scored: the request asked and no token came yet."""
        return self.sampling.prompt_logprobs is not None and not self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to go through the model, counting those steps in flight will sample."""
        return self.num_tokens + self.inflight - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def work_left(self) -> int:
        """Tokens the model still runs for it at most: those not computed (all of them again
        after a preemption) plus the outputs it may still produce."""
        return self.num_tokens - self.num_computed + self.max_tokens - self.num_output_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start .. end - 1; PLACEHOLDER where a step in flight will sample one."""
        prompt_len = len(self.prompt_ids)
        if start >= prompt_len:  # outputs only (a decode step: a third of the general path's time)
            num_tokens = prompt_len + len(self.output_ids)
            tail = self.output_ids[start - prompt_len:end - prompt_len]
            return tail + [PLACEHOLDER] * (end - max(start, num_tokens)) if end > num_tokens else tail
        head = list(self.prompt_ids[start:min(end, prompt_len)])
        tail = self.output_ids[max(start - prompt_len, 0):max(end - prompt_len, 0)]
        return head + tail + [PLACEHOLDER] * (end - max(start, self.num_tokens))

    def at_limit(self, max_model_len: int) -> bool:
        """The tokens steps in flight will sample end it (max_tokens or the context)."""
        return self.inflight > 0 and self._at_length(self.inflight, max_model_len)

    def _at_length(self, more: int, max_model_len: int) -> bool:
        """`more` tokens on, it has its max_tokens or fills the context."""
        outputs = len(self.output_ids) + more  # (a step's hot path: no properties)
        return outputs >= self.max_tokens or len(self.prompt_ids) + outputs >= max_model_len

    def admit(self, num_cached: int) -> None:
        self.status = SeqStatus.RUNNING
        self.num_computed = num_cached
        self.num_sent_blocks = 0
        self.needs_reset = True
        if self.num_cached_tokens is None:
            self.num_cached_tokens = num_cached

    def preempt(self) -> None:
        """Back to waiting; its KV is dropped and recomputed on re-admission."""
        self.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self.num_computed = 0
        self.num_sent_blocks = 0
        self.needs_reset = True

    def sent(self, num_blocks: int) -> tuple[int, bool]:
        """The worker now has `num_blocks` of the block table: (how many it had before,
        whether this chunk (re)starts the sequence there)."""
        before, reset = self.num_sent_blocks, self.needs_reset
        self.num_sent_blocks, self.needs_reset = num_blocks, False
        return before, reset

    def computed(self, n: int) -> None:
        """`n` more tokens have their KV in the cache (a step ran)."""
        self.num_computed += n

    def score_prompt(self, first: int, scores: list[tuple[float, int, list]]) -> None:
        """Scores of prompt tokens `first`, `first + 1`, ...; those already known (a
        preempted sequence being recomputed) are skipped."""
        skip = 1 + len(self.prompt_scores) - first
        if 0 <= skip < len(scores):
            self.prompt_scores.extend(scores[skip:])

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        if self.ngrams is not None:
            self.ngrams.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason

    def stop_reason(self, max_model_len: int) -> str | None:
        """Why the sequence ends after its newest token, or None to go on."""
        if self.output_ids and self.output_ids[-1] in self.stop_token_ids:
            return "eos"  # http/ reports it as "stop"; offline mode prints "eos"
        if self._at_length(0, max_model_len):
            return "length"
        return None
