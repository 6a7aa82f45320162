"""Request bodies of the generation endpoints, as msgspec Structs.

msgspec checks types and ranges while decoding, and its message names the field ("Expected
`int` >= 1 - at `$.max_tokens`"); the same Structs generate /openapi.json. `UNSET` marks a
field the client left out: a field that is present wins over the server default, even when
null. Unknown fields are ignored. The `Unimplemented` fields are known OpenAI/vLLM options
this server does not implement: they are decoded only so that a non-default value can be
refused with a 400 instead of silently ignored.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, get_args

import msgspec
import msgspec.inspect as mi
from msgspec import UNSET, Meta, UnsetType

from pypto_serving.core.generate_config import MAX_STOP_LENGTH, MAX_STOP_STRINGS

MAX_CHOICES = 16
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
# Names a chat template reads from request fields of their own: not chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})


def whole(**bounds: int) -> Any:
    """An integer field. JSON Schema's `integer` includes 13.0, so a whole float is taken too
    (vLLM's pydantic takes it as well) and `ints` turns it into the int it spells; 13.5 and
    "13" are refused. /openapi.json shows the pair as one `integer`."""
    return Annotated[int, Meta(**bounds)] | Annotated[float, Meta(multiple_of=1, **bounds)]


Positive = whole(ge=1)
TopK = whole(ge=-1)
NonNegative = whole(ge=0)
Int64 = whole(ge=-(2**63), le=2**63 - 1)
Choices = whole(ge=1, le=MAX_CHOICES)
LogprobCount = whole(ge=0, le=MAX_LOGPROBS)
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
StopList = Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
TokenIdList = Annotated[list[NonNegative], Meta(max_length=MAX_STOP_TOKEN_IDS)]
Role = Literal["system", "developer", "user", "assistant", "tool"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ROLES: tuple[str, ...] = get_args(Role)
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)


class StreamOptions(msgspec.Struct, kw_only=True):
    """The usage event ends a stream unless `include_usage` is false; with
    `continuous_usage_stats` every chunk carries its choice's usage so far."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class Unimplemented(msgspec.Struct, kw_only=True):
    """Known options this server does not implement; see UNIMPLEMENTED_DEFAULTS."""

    best_of: Choices | None = None  # must equal n
    logit_bias: Any = None
    use_beam_search: Any = None
    include_stop_str_in_output: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    truncate_prompt_tokens: Any = None
    skip_special_tokens: Any = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """json_object and json_schema are enforced token by token (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerateFields(Unimplemented, kw_only=True):
    """Fields both generation endpoints take."""

    model: str | None = None
    max_tokens: Positive | None | UnsetType = UNSET
    temperature: Annotated[float, Meta(ge=0.0)] | None | UnsetType = UNSET
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None | UnsetType = UNSET
    top_k: TopK | None | UnsetType = UNSET  # 0 and -1: no cut, as vLLM takes them
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    seed: Int64 | None | UnsetType = UNSET
    stop: StopString | StopList | None | UnsetType = UNSET
    stop_token_ids: TokenIdList | None = None
    min_tokens: NonNegative | None = None
    n: Choices | None = None
    stream: bool | None | UnsetType = UNSET
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's: the prompt tokens' logprobs and top k (not with stream)
    prompt_logprobs: LogprobCount | None = None


class CompletionBody(GenerateFields, kw_only=True):
    """POST /v1/completions. EOS never ends a text completion. `echo` puts the prompt before
    the completion (in `logprobs` too); with it `max_tokens` may be 0: the prompt is only
    scored."""

    prompt: str | list[NonNegative | str] = ""  # strings: a batch, refused by name
    max_tokens: NonNegative | None | UnsetType = UNSET
    logprobs: LogprobCount | None = None
    echo: bool | None = None
    suffix: Any = None


class FunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Content is a string, null, or a list of text parts (joined with newlines); other
    (multimodal) parts are refused."""

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """tool_choice naming one declared function: the reply is a call to it."""

    type: Literal["function"]
    function: FunctionName


class ChatBody(GenerateFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: Positive | None = None
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # known, not implemented
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None
    echo: Any = None  # vLLM's chat echo (of the last message)
    store: Any = None  # OpenAI's stored completions
    service_tier: Any = None
    verbosity: Any = None  # OpenAI's reply length control for its reasoning models


class TokenizeBody(msgspec.Struct, kw_only=True):
    """POST /tokenize (vLLM's shape): a `prompt`, or chat `messages` rendered with the model's
    chat template first; exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[NonNegative]


def ints(body: msgspec.Struct) -> msgspec.Struct:
    """`body` with each whole float of a `whole` field (or list of them) as an int."""
    for name in whole_fields(type(body)):
        value = getattr(body, name)
        if isinstance(value, float):
            setattr(body, name, int(value))
        elif isinstance(value, list) and float in set(map(type, value)):  # (a C-speed look)
            setattr(body, name, [int(v) if isinstance(v, float) else v for v in value])
    return body


@functools.cache
def whole_fields(cls: type) -> tuple[str, ...]:
    """The fields of Struct `cls` that are `whole` numbers or lists of them."""
    return tuple(f.name for f in mi.type_info(cls).fields if _takes_whole_floats(f.type))


def _takes_whole_floats(t: mi.Type) -> bool:
    match t:
        case mi.FloatType(multiple_of=1):
            return True
        case mi.UnionType(types=types):
            return any(_takes_whole_floats(u) for u in types)
        case mi.ListType(item_type=item):
            return _takes_whole_floats(item)
    return False


# Values an unimplemented field may take: the defaults, which ask for nothing we lack.
UNIMPLEMENTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "verbosity": (None, "medium"),
}

# Fields of UNIMPLEMENTED_DEFAULTS that one body implements after all.
IMPLEMENTED_BY: dict[str, frozenset[str]] = {"CompletionBody": frozenset({"echo"})}


def unimplemented_defaults(body_type: type) -> dict[str, tuple[Any, ...]]:
    """UNIMPLEMENTED_DEFAULTS as `body_type` refuses them."""
    implemented = IMPLEMENTED_BY.get(body_type.__name__, frozenset())
    return {f: allowed for f, allowed in UNIMPLEMENTED_DEFAULTS.items() if f not in implemented}
