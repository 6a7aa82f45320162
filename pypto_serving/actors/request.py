"""RequestActor: one request's life, from prompt text to the last event.

Receives `Encoded`/`Rejected` (from the tokenizer actor) and `Tokens` (from the scheduler).
Sends `Encode` to the tokenizer, `Submit` and `Abort` to the scheduler, and yields
`Started`, `TextDelta` (with per-token logprobs when asked), `Finished` events to http/
(it is the edge: http/ iterates it).
State owned: the incremental detokenizer and the stop-string matcher of its sequence.
Invariants: no partial stop string and no broken UTF-8 character ever leaves; no token id
outside the vocabulary reaches the device; a request that goes away after `Submit` and
before finishing sends exactly one `Abort`, which frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import structlog

from pypto_serving.actors import scheduler as sched_msgs
from pypto_serving.actors import tokenizer as tok_msgs
from pypto_serving.actors.base import Actor, unknown
from pypto_serving.actors.device_worker import TopLogprob
from pypto_serving.logprobs import token_logprobs
from pypto_serving.requests import (
    Finished,
    GenerateRequest,
    InvalidRequest,
    Started,
    TextDelta,
    TokenLogprob,
)
from pypto_serving.sampling import SamplingParams
from pypto_serving.tokenizer.detokenizer import IncrementalDetokenizer
from pypto_serving.tokenizer.stop import StopMatcher
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Tokens:
    """New tokens of a sequence; `finish_reason` set on the last message about it."""

    seq_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] = ()
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    default_max_tokens: int


class RequestActor(Actor):
    def __init__(self, request: GenerateRequest, seq_id: int, tokenizer: Tokenizer,
                 tokenizer_actor: Actor, scheduler: Actor, limits: RequestLimits):
        super().__init__()
        self.request = request
        self.seq_id = seq_id
        self.tokenizer = tokenizer
        self.tokenizer_actor = tokenizer_actor
        self.scheduler = scheduler
        self.limits = limits
        self.log = log.bind(request_id=request.request_id)
        self._done = False

    async def events(self) -> AsyncIterator[Started | TextDelta | Finished]:
        """Raises InvalidRequest before the first event when the request cannot run."""
        prompt_ids = await self._encode()
        max_tokens = self._max_tokens(prompt_ids)
        self._check_token_ids(self.request.stop_token_ids, "stop_token_ids")
        self._submit(prompt_ids, max_tokens)
        try:  # from here on the sequence exists: closing the stream at any point aborts it
            yield Started(len(prompt_ids), max_tokens)
            async for event in self._generate(prompt_ids):
                yield event
        finally:
            if not self._done:  # the client went away, or the stream was closed early
                self.scheduler.tell(sched_msgs.Abort(self.seq_id, "aborted"))
                self.log.info("request aborted")

    async def _encode(self) -> tuple[int, ...]:
        prompt = self.request.prompt
        if isinstance(prompt, tuple):
            ids = prompt
        else:
            self.tokenizer_actor.tell(tok_msgs.Encode(prompt, self))
            match await self._inbox.get():
                case tok_msgs.Encoded(token_ids):
                    ids = token_ids
                case tok_msgs.Rejected(message):
                    raise InvalidRequest(message, "messages")
                case msg:
                    unknown(self, msg)
        self._check_token_ids(ids, "prompt")
        return self._non_empty(ids)

    def _check_token_ids(self, ids: tuple[int, ...], field: str) -> None:
        # An id outside the vocabulary would fail inside the device worker, for every request.
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequest(f"'{field}' has token id {bad[0]}, outside this model's "
                                 f"vocabulary: token ids must be in 0..{vocab - 1}", field)

    def _non_empty(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        if ids:
            return ids
        if self.tokenizer.bos_token_id is None:
            raise InvalidRequest("the prompt is empty and this model's tokenizer has no BOS token "
                                 "to start from: send a non-empty prompt", "prompt")
        return (self.tokenizer.bos_token_id,)

    def _max_tokens(self, prompt_ids: tuple[int, ...]) -> int:
        room = self.limits.max_model_len - len(prompt_ids)
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens but --max-model-len is "
                f"{self.limits.max_model_len}: shorten the prompt to at most "
                f"{self.limits.max_model_len - 1} tokens", "prompt")
        wanted = self.request.max_tokens
        wanted = self.limits.default_max_tokens if wanted is None else wanted
        if wanted > room:
            self.log.info("max_tokens capped to the room left in the context",
                          requested=wanted, capped=room)
        return min(wanted, room)

    def _submit(self, prompt_ids: tuple[int, ...], max_tokens: int) -> None:
        stops = set(self.request.stop_token_ids)
        if not self.request.ignore_eos:
            stops |= self.tokenizer.eos_token_ids
        self.scheduler.tell(sched_msgs.Submit(
            self.seq_id, prompt_ids, max_tokens, self._sampling(max_tokens), frozenset(stops), self))

    def _sampling(self, max_tokens: int) -> SamplingParams:
        """The request's sampling, with what min_tokens needs to mask: EOS (even when it is
        ignored) and the stop token ids, for at most the tokens this sequence may produce."""
        sampling = self.request.sampling
        if sampling.min_tokens <= 0:
            return sampling
        banned = self.tokenizer.eos_token_ids | set(self.request.stop_token_ids)
        return msgspec.structs.replace(sampling, min_tokens=min(sampling.min_tokens, max_tokens),
                                       eos_token_ids=tuple(sorted(banned)))

    async def _generate(self, prompt_ids: tuple[int, ...]) -> AsyncIterator[TextDelta | Finished]:
        detok = IncrementalDetokenizer(self.tokenizer, list(prompt_ids))
        stop = StopMatcher(list(self.request.stop))
        count = 0
        while True:
            msg = await self._inbox.get()
            if not isinstance(msg, Tokens):
                unknown(self, msg)
            count += len(msg.token_ids)
            text, stopped = stop.push(detok.push(list(msg.token_ids)))
            if msg.finish_reason is not None and not stopped:
                more, stopped = self._flush(detok, stop)
                text += more
            if text or msg.token_ids:
                yield TextDelta(text, msg.token_ids, self._logprobs(msg))
            if stopped or msg.finish_reason is not None:
                yield self._finish(msg, len(prompt_ids), count, stopped)
                return

    @staticmethod
    def _flush(detok: IncrementalDetokenizer, stop: StopMatcher) -> tuple[str, bool]:
        """The text still held at the end; a held match can turn out to be the stop."""
        text, stopped = stop.push(detok.flush())
        if not stopped:
            text += stop.flush()
        return text, stop.stopped

    def _logprobs(self, msg: Tokens) -> tuple[TokenLogprob, ...]:
        if self.request.sampling.logprobs is None or not msg.token_ids:
            return ()
        return token_logprobs(self.tokenizer, msg.token_ids, msg.logprobs, msg.top_logprobs)

    def _finish(self, msg: Tokens, prompt_tokens: int, count: int, stopped: bool) -> Finished:
        self._done = True
        reason = "stop" if stopped else msg.finish_reason
        if stopped and msg.finish_reason is None:
            self.scheduler.tell(sched_msgs.Abort(self.seq_id, "stop"))
        return Finished(reason, prompt_tokens, count, msg.num_cached_tokens, msg.error)
