"""Response bodies and stream chunks (OpenAI-compatible shapes), as msgspec Structs.

render.py fills them and /openapi.json is generated from them, so what the server sends
and what it documents cannot drift apart. Fields with `omit_defaults` vanish when unset
(a chat delta carries only what changed; a chunk has no usage).
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "aborted", "error", "tool_calls"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    """`prompt_tokens_details` is known once the request ends (not in a stream's running usage)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    utf8: list[int] = msgspec.field(name="bytes")


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    utf8: list[int] = msgspec.field(name="bytes")
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    """Per token: its text, logprob, {text: logprob} of the top candidates, and its offset.
    With `echo` the prompt's tokens come first; the very first has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(msgspec.Struct):
    """vLLM's shape: a token's logprob, rank (1: the most likely) and text."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, {token id: logprob} of it and the top k (the
# first token: null).
PromptLogprobsOut = list[dict[int, PromptTokenLogprob] | None]


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(msgspec.Struct, omit_defaults=True):
    """A text completion, or one chunk of a streamed one (chunks have no usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    """`content` is null when the reply is only tool calls."""

    role: Literal["assistant"]
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None  # when the request asked (vLLM's)


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """The first chunk of a call has its index, id, type and name; later ones only the index
    and a fragment of the arguments (the fragments concatenate to the arguments string)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    """One event of a streamed chat completion; the last one has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class StreamError(msgspec.Struct):
    message: str
    type: str
    code: int


class StreamErrorEvent(msgspec.Struct):
    """An error after the stream's 200 was sent (malformed tool-call output), then [DONE]."""

    error: StreamError


class ErrorResponse(msgspec.Struct):
    object: Literal["error"]
    message: str
    type: str
    param: str | None
    code: int


class ModelPermission(msgspec.Struct):
    """vLLM's permission entry (clients that read `/v1/models` as vLLM serves it expect one)."""

    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the model it serves: the --model path
    parent: str | None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(msgspec.Struct):
    prompt: str


class Version(msgspec.Struct):
    version: str


class ReplicaHealth(msgspec.Struct, omit_defaults=True):
    engine: str  # the replica's `engine` metrics label
    status: Literal["ok", "error"]
    reason: str | None = None


class Health(msgspec.Struct, omit_defaults=True):
    status: Literal["ok", "error"]
    reason: str | None = None
    replicas: list[ReplicaHealth] | None = None  # with --dp above 1: each replica's state
