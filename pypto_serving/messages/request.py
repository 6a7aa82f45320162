"""What a request stream receives: `Encoded`/`Rejected` from the tokenizer, `Tokens` from the
scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pypto_serving.messages.worker import TopLogprob


@dataclass(frozen=True, slots=True)
class Encoded:
    token_ids: tuple[int, ...]
    text: str  # the prompt as the model reads it (a chat prompt after its template)


@dataclass(frozen=True, slots=True)
class Rejected:
    """The prompt cannot be prepared: bad input (400), or a failure preparing it (500)."""

    message: str
    status: int = 400
    param: str | None = None  # the field to name in a 400 (default: the prompt's)


class Tokens(msgspec.Struct, frozen=True):
    """New tokens of a sequence; `finish_reason` set on the last message about it."""

    seq_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] = ()
    # with the first token, when asked: (logprob, rank, top-k) of prompt tokens 1, 2, ...
    prompt_logprobs: tuple[tuple[float, int, list[TopLogprob]], ...] = ()
    num_cached_tokens: int = 0
    num_cache_writes: int = 0  # prompt tokens put into the prefix cache so far (all of them on the last)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineDied:
    """From the engine: it cannot serve any more (a fault, a dead worker); end now."""

    reason: str


@dataclass(frozen=True, slots=True)
class TimedOut:
    """From the engine: the request ran past --request-timeout; end now, freeing its blocks."""

    timeout_s: float


# Everything a request stream receives.
RequestInbox = Encoded | Rejected | Tokens | EngineDied | TimedOut
