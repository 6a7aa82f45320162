"""RequestStream: one request's life, from prompt text to the last event.

Not an actor with a loop of its own: it is the edge, an async iterator that http/ (or offline
mode) drives, with a mailbox others `tell`. Receives (messages/request.py) `Encoded`/`Rejected`
(from the tokenizer actor), `Tokens` (from the scheduler), `EngineDied` and `TimedOut` (from
the engine; a timeout also aborts the sequence), all through one dispatch point
(`_receive`). Sends `Encode` to the tokenizer, `Submit` and `Abort` to the scheduler, and
yields `Started`, `Echo` (the prompt, when asked), `TextDelta` (with per-token logprobs when
asked), `Finished` events.
State owned: the incremental detokenizer, the stop-string matcher and the reply parser
(reasoning, tool calls) of its sequence.
Invariants: no partial stop string, tag or broken UTF-8 character ever leaves; no token id
outside the vocabulary reaches the device; a request that goes away after `Submit` and
before finishing sends exactly one `Abort`, which frees its KV blocks; so does a reply whose
tool-call output turned out malformed (it ends at once with `invalid_model_output`).
Engine death ends the stream with `error` wherever it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import structlog

from pypto_serving.actors.base import unknown
from pypto_serving.core.request import (
    INVALID_MODEL_OUTPUT,
    TIMEOUT,
    Echo,
    Finished,
    GenerateRequest,
    InvalidRequest,
    Refused,
    Started,
    TextDelta,
    TokenLogprob,
    check_token_ids,
)
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.mailbox import Mailbox
from pypto_serving.messages.request import Encoded, EngineDied, Rejected, RequestInbox, TimedOut, Tokens
from pypto_serving.messages.scheduler import Abort, Submit
from pypto_serving.messages.tokenizer import Encode
from pypto_serving.parsers.grammar import Grammars
from pypto_serving.parsers.reply import ReplyDelta, ReplyEnd, ReplyParser
from pypto_serving.tokenizer.detokenizer import IncrementalDetokenizer
from pypto_serving.tokenizer.encode import too_long_message
from pypto_serving.tokenizer.logprobs import prompt_logprobs, token_logprobs
from pypto_serving.tokenizer.stop import StopMatcher
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()
ENGINE_ENDINGS = ("error", "aborted")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    default_max_tokens: int


class RequestStream:
    def __init__(self, request: GenerateRequest, seq_id: int, tokenizer: Tokenizer,
                 tokenizer_actor: Mailbox, scheduler: Mailbox, limits: RequestLimits,
                 grammars: Grammars | None = None):
        self._mailbox: asyncio.Queue[RequestInbox] = asyncio.Queue()
        self.request = request
        self.seq_id = seq_id
        self.tokenizer = tokenizer
        self.tokenizer_actor = tokenizer_actor
        self.scheduler = scheduler
        self.limits = limits
        self.grammars = grammars
        self.log = log.bind(request_id=request.request_id)
        self._done = False
        self._generated = 0  # tokens received so far
        self._error_type = "engine_error"  # of a finish with `error`: timeout when it timed out

    @property
    def done(self) -> bool:
        """It has its last event (or the engine's last word)."""
        return self._done

    def tell(self, msg: RequestInbox) -> None:
        self._mailbox.put_nowait(msg)

    async def _receive(self) -> Encoded | Rejected | Tokens:
        """The next message; engine death comes back as the sequence's last `Tokens`."""
        match await self._mailbox.get():
            case EngineDied(reason):
                return Tokens(self.seq_id, (), "error", error=reason)
            case TimedOut(timeout_s):
                self.scheduler.tell(Abort(self.seq_id, "error"))  # frees its blocks, if any
                self._error_type = TIMEOUT
                where = " while it waited to be scheduled" if not self._generated else ""
                return Tokens(self.seq_id, (), "error",
                              error=f"the request ran past --request-timeout ({timeout_s:g} s){where}")
            case Encoded() | Rejected() | Tokens() as msg:
                return msg
            case msg:
                unknown(self, msg)

    async def events(self) -> AsyncIterator[Started | Echo | TextDelta | Finished]:
        """Raises InvalidRequest before the first event when the request cannot run."""
        await self._check_grammar()
        encoded = await self._encode()
        if isinstance(encoded, Tokens):  # the engine died (or time ran out) during encoding
            self._done = True
            yield Started(0, 0)
            yield Finished("error", 0, 0, 0, encoded.error, self._error_type)
            return
        prompt_text, prompt_ids = encoded
        max_tokens = self._max_tokens(prompt_ids)
        check_token_ids(self.request.stop_token_ids, self.tokenizer.vocab_size, "stop_token_ids")
        self._submit(prompt_ids, max_tokens)
        try:  # from here on the sequence exists: closing the stream at any point aborts it
            yield Started(len(prompt_ids), max_tokens)
            async for event in self._generate(prompt_ids, prompt_text,
                                              ReplyParser(self.request.reply, prompt_text)):
                yield event
        finally:
            if not self._done:  # the client went away, or the stream was closed early
                self.scheduler.tell(Abort(self.seq_id, "aborted"))
                self.log.info("request aborted")

    async def _check_grammar(self) -> None:
        grammar = self.request.sampling.grammar
        if grammar is None:
            return
        param = self.request.grammar_param or "response_format"
        if self.grammars is None:
            raise InvalidRequest(f"'{param}' needs constrained decoding, which this engine "
                                 "does not offer", param)
        await self.grammars.check(grammar, param)

    async def _encode(self) -> tuple[str, tuple[int, ...]] | Tokens:
        """The prompt as text (empty for token ids) and as token ids; the engine's last word
        instead when it died meanwhile."""
        prompt = self.request.prompt
        if isinstance(prompt, tuple):
            text, ids = "", prompt
        else:
            self.tokenizer_actor.tell(Encode(prompt, self))
            reply = await self._receive()
            if isinstance(reply, Tokens):
                return reply
            if isinstance(reply, Rejected) and reply.status != 400:
                kind = "unavailable" if reply.status == 503 else "internal_error"
                raise Refused(reply.message, reply.status, kind,
                              retry_after=1 if reply.status == 503 else None)
            if isinstance(reply, Rejected):
                raise InvalidRequest(reply.message, reply.param or
                                     ("prompt" if isinstance(prompt, str) else "messages"))
            text, ids = reply.text, reply.token_ids
        check_token_ids(ids, self.tokenizer.vocab_size, "prompt")
        return text, self._non_empty(ids)

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
            raise InvalidRequest(too_long_message(len(prompt_ids), self.limits.max_model_len), "prompt")
        wanted = self.request.max_tokens
        wanted = self.limits.default_max_tokens if wanted is None else wanted
        if wanted > room:
            self.log.info("max_tokens capped to the room left in the context",
                          requested=wanted, capped=room)
        return min(wanted, room)

    def _submit(self, prompt_ids: tuple[int, ...], max_tokens: int) -> None:
        stops = set(self.request.stop_token_ids)
        # A complete grammar allows only EOS: it must end the reply even with ignore_eos.
        if not self.request.ignore_eos or self.request.sampling.grammar is not None:
            stops |= self.tokenizer.eos_token_ids
        self.scheduler.tell(Submit(
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

    async def _generate(self, prompt_ids: tuple[int, ...], prompt_text: str,
                        parser: ReplyParser) -> AsyncIterator[Echo | TextDelta | Finished]:
        detok = IncrementalDetokenizer(self.tokenizer, list(prompt_ids))
        stop = StopMatcher(list(self.request.stop))
        # As in vLLM, no stop string ends in the text of a reply's first min_tokens tokens (one
        # token a message until then: speculation waits for min_tokens)
        unchecked = self.request.sampling.min_tokens
        count = 0
        while True:
            msg = await self._receive()
            if not isinstance(msg, Tokens):
                unknown(self, msg)
            if count == 0 and (self.request.echo or self.request.sampling.prompt_logprobs is not None):
                yield self._echo(prompt_ids, prompt_text, msg)
            # A message can carry several tokens (a stream's tokens not yet told go out together
            # under load, and speculation keeps several a step): each goes through the
            # detokenizer, the stop strings and the parser on its own, so a reply ends at the
            # very token it would end at alone; the tokens taken go out as one delta.
            pieces = [msg.token_ids[i:i + 1] for i in range(len(msg.token_ids))] or [()]
            delta, stopped, taken, start = _NOTHING, False, 0, 0
            for i, piece in enumerate(pieces):
                count += len(piece)
                taken += len(piece)
                search = count > unchecked
                text, stopped = stop.push(detok.push(list(piece)), search)
                if i == len(pieces) - 1 and msg.finish_reason is not None and not stopped:
                    more, stopped = self._flush(detok, stop, search)
                    text += more
                step = parser.push(text)
                if delta.tool_calls and (step.content or step.reasoning):
                    # text after a call goes out after it, as it would a token at a time (a
                    # delta does not say which of its text and calls came first)
                    yield _text_delta(delta, msg.token_ids[start:i], self._logprobs(msg)[start:i])
                    delta, start = _NOTHING, i
                delta = _extended(delta, step)
                if stopped or step.error is not None:
                    break
            self._generated = count
            if taken < len(msg.token_ids):  # ended before its last token: the rest never happened
                msg = _first(msg, taken)
            ending = stopped or msg.finish_reason is not None or delta.error is not None
            done = self._finish(msg, len(prompt_ids), count, stopped) if ending else None
            if done is not None and delta.error is None:
                # The engine ending a reply (error, abort) cuts it off like a length limit:
                # a call it interrupted is not the model's malformed output.
                engine_end = done.finish_reason in ENGINE_ENDINGS
                tail, end = parser.finish("length" if engine_end else done.finish_reason)
                delta = _joined(delta, tail)
                done = done if engine_end else self._parsed(done, end, delta.error)
            if msg.token_ids[start:] or delta.content or delta.reasoning or delta.tool_calls:
                yield _text_delta(delta, msg.token_ids[start:], self._logprobs(msg)[start:])
            if done is not None:
                yield done if delta.error is None else self._malformed(done, delta.error)
                return

    @staticmethod
    def _flush(detok: IncrementalDetokenizer, stop: StopMatcher, search: bool = True) -> tuple[str, bool]:
        """The text still held at the end; a held match can turn out to be the stop."""
        text, stopped = stop.push(detok.flush(), search)
        if not stopped:
            text += stop.flush()
        return text, stop.stopped

    def _echo(self, prompt_ids: tuple[int, ...], prompt_text: str, msg: Tokens) -> Echo:
        """The prompt as text (decoded when it came as token ids) and its logprobs."""
        if isinstance(self.request.prompt, tuple):
            prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        if self.request.sampling.prompt_logprobs is None:
            return Echo(prompt_text)
        return Echo(prompt_text, prompt_logprobs(self.tokenizer, prompt_ids, msg.prompt_logprobs))

    def _logprobs(self, msg: Tokens) -> tuple[TokenLogprob, ...]:
        if self.request.sampling.logprobs is None or not msg.token_ids:
            return ()
        return token_logprobs(self.tokenizer, msg.token_ids, msg.logprobs, msg.top_logprobs)

    def _finish(self, msg: Tokens, prompt_tokens: int, count: int, stopped: bool) -> Finished:
        self._done = True
        reason = "stop" if stopped else msg.finish_reason or "error"
        if msg.finish_reason is None:  # a stop string, or malformed tool-call output
            self.scheduler.tell(Abort(self.seq_id, reason))
        return Finished(reason, prompt_tokens, count, msg.num_cached_tokens, msg.error, self._error_type,
                        cache_writes=msg.num_cache_writes)

    @staticmethod
    def _parsed(done: Finished, end: ReplyEnd, error: str | None) -> Finished:
        """The finish as parsed: complete calls are reported even when the reply went on
        until the length limit (and stays `length`); a call cut off is never among them."""
        if error is not None:
            return done
        return dataclasses.replace(done, finish_reason=end.finish_reason, tool_calls=end.tool_calls,
                                   cut_call=end.cut_call)

    def _malformed(self, done: Finished, error: str) -> Finished:
        self.log.info("invalid model output", error=error)
        return dataclasses.replace(done, finish_reason="error", error=error,
                                   error_type=INVALID_MODEL_OUTPUT)


_NOTHING = ReplyDelta()


def _extended(a: ReplyDelta, b: ReplyDelta) -> ReplyDelta:
    """One token's delta `a` and the next one's `b` as one delta; argument fragments of the
    same call that follow one another become one fragment."""
    if a == _NOTHING:
        return b
    calls = a.tool_calls
    for call in b.tool_calls:
        if calls and call.id is None and call.name is None and calls[-1].index == call.index:
            joined = calls[-1].arguments + call.arguments
            calls = (*calls[:-1], dataclasses.replace(calls[-1], arguments=joined))
        else:
            calls = (*calls, call)
    return ReplyDelta(a.reasoning + b.reasoning, a.content + b.content, calls, b.error or a.error)


def _first(msg: Tokens, n: int) -> Tokens:
    """The message's first `n` tokens, not its last: no finish_reason."""
    return Tokens(msg.seq_id, msg.token_ids[:n], None, logprobs=msg.logprobs[:n],
                  top_logprobs=msg.top_logprobs[:n], prompt_logprobs=msg.prompt_logprobs,
                  num_cached_tokens=msg.num_cached_tokens)


def _joined(a: ReplyDelta, b: ReplyDelta) -> ReplyDelta:
    return ReplyDelta(a.reasoning + b.reasoning, a.content + b.content,
                      a.tool_calls + b.tool_calls, b.error or a.error)


def _text_delta(delta: ReplyDelta, token_ids: tuple[int, ...],
                logprobs: tuple[TokenLogprob, ...]) -> TextDelta:
    return TextDelta(delta.content, token_ids, logprobs, delta.reasoning, delta.tool_calls)
