"""The typed request that http/ builds and the events a request produces.

No JSON below http/: handlers turn bodies into `GenerateRequest`, the engine answers with
`Started`, `TextDelta` and `Finished` events that handlers render as JSON or SSE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.parsers.reply import ReplyFormat
from pypto_serving.parsers.tool_calls import ToolCall, ToolCallDelta


class InvalidRequest(ValueError):
    """Bad input: becomes an HTTP 400 whose message says what to change."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class Refused(Exception):
    """The request cannot run now or here, through no fault in its body: an HTTP error other
    than 400 (503 with Retry-After when the queue is full, 500 when preparing it failed)."""

    def __init__(self, message: str, status: int, kind: str, retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.retry_after = retry_after


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Refuses an id outside the vocabulary, which would otherwise fail deep inside the device
    worker (for every request of its step) or the detokenizer."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InvalidRequest(f"'{field}' has token id {bad[0]}, outside this model's "
                             f"vocabulary: token ids must be in 0..{vocab_size - 1}", field)


@dataclass(frozen=True, slots=True)
class ChatInput:
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One generation. `prompt` is text or token ids (completions) or a `ChatInput`."""

    request_id: str
    prompt: str | tuple[int, ...] | ChatInput
    max_tokens: int | None  # None: up to the context limit
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    reply: ReplyFormat = ReplyFormat()  # reasoning and tool-call parsing of the output
    grammar_param: str | None = None  # the field that asked for `sampling.grammar`
    echo: bool = False  # the prompt's text comes back first (`Echo`)
    score_only: bool = False  # echo with max_tokens 0: the one token sampled is not an output


CHARS_PER_TOKEN = 4  # about what BPE tokenizers average on English text


def estimated_tokens(request: GenerateRequest, default_max_tokens: int, max_model_len: int) -> int:
    """A guess at a request's work before its prompt is tokenized: the prompt's tokens (its
    characters / 4 for text) plus the outputs it may produce, at most the context."""
    prompt = request.prompt
    if isinstance(prompt, tuple):
        prompt_tokens = len(prompt)
    elif isinstance(prompt, str):
        prompt_tokens = len(prompt) // CHARS_PER_TOKEN
    else:
        prompt_tokens = sum(len(str(m.get("content") or "")) for m in prompt.messages) // CHARS_PER_TOKEN
    wanted = default_max_tokens if request.max_tokens is None else request.max_tokens
    return min(prompt_tokens + wanted, max_model_len)


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Candidate:
    """A token the sampler could have picked: its id, text, exact UTF-8 bytes and logprob."""

    token_id: int
    text: str
    utf8: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's logprob and the most likely alternatives at its position."""

    chosen: Candidate
    top: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token and how likely the model found it after the tokens before it: its
    logprob, its rank among all tokens (1: the most likely) and the top candidates there.
    The first token has nothing before it: logprob and rank None."""

    token_id: int
    text: str
    utf8: bytes
    logprob: float | None
    rank: int | None
    top: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True)
class Echo:
    """Before the first generated text, when the request asked for `echo` or prompt logprobs:
    the prompt's text and (with prompt logprobs) one entry per prompt token."""

    text: str
    logprobs: tuple[PromptLogprob, ...] = ()


class TextDelta(msgspec.Struct, frozen=True):
    """New text and the tokens that produced it; the two need not line up: text can be
    held back (stop strings, split characters) while its tokens are already reported.
    `logprobs` has one entry per token when the request asked for logprobs."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    reasoning: str = ""  # set by a reasoning parser, for models that have one
    tool_calls: tuple[ToolCallDelta, ...] = ()  # set by a tool-call parser


INVALID_MODEL_OUTPUT = "invalid_model_output"  # Finished.error_type of unparsable tool calls
TIMEOUT = "timeout"  # Finished.error_type of a request that ran past --request-timeout


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # stop, eos, length, aborted, error, tool_calls
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: str | None = None
    error_type: str = "engine_error"  # or invalid_model_output (unparsable tool calls), timeout
    tool_calls: tuple[ToolCall, ...] = ()  # the complete calls, with finish_reason tool_calls
    cut_call: str = ""  # the text of a call max_tokens cut off: content in a reply not streamed
    cache_writes: int = 0  # prompt tokens the request put into the prefix cache
