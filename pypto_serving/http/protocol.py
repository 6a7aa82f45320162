"""Request bodies of the generation endpoints and their translation to `GenerateRequest`.

msgspec checks the types (its message names the field, e.g. `at $.max_tokens`); the rules
msgspec cannot express live here. A field that is present wins over the server default
even when null; `UNSET` marks a field the client left out.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from pypto_serving.generate_config import GenerateDefaults
from pypto_serving.requests import ChatInput, GenerateRequest, InvalidRequest
from pypto_serving.sampling import SamplingParams

MAX_STOP_STRINGS = 32
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})
ROLES = ("system", "developer", "user", "assistant", "tool")


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None | UnsetType = UNSET
    temperature: float | None | UnsetType = UNSET
    top_p: float | None | UnsetType = UNSET
    top_k: int | None | UnsetType = UNSET
    seed: int | None | UnsetType = UNSET
    stop: str | list[str] | None | UnsetType = UNSET
    stream: bool | None | UnsetType = UNSET
    n: int | None = None
    logprobs: Any = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict | None = None


class CompletionBody(_SamplingFields, kw_only=True):
    prompt: str | list[int | str] = ""


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Any] | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatBody(_SamplingFields, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    top_logprobs: int | None = None


def decode_body(raw: bytes, body_type: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _pick(value: Any, default: Any) -> Any:
    return default if value is UNSET else value


def wants_stream(body: _SamplingFields, defaults: GenerateDefaults) -> bool:
    return bool(_pick(body.stream, defaults.stream))


def _reject_unsupported(body: _SamplingFields) -> None:
    checks = {
        "n": body.n not in (None, 1),
        "logprobs": body.logprobs not in (None, False),
        "echo": bool(body.echo),
        "best_of": body.best_of not in (None, 1),
        "suffix": bool(body.suffix),
        "logit_bias": bool(body.logit_bias),
    }
    for field, bad in checks.items():
        if bad:
            raise InvalidRequest(f"'{field}' is not supported by this server yet; "
                                 "remove it or set it to its default", field)


def _sampling(body: _SamplingFields, defaults: GenerateDefaults, **extra: Any) -> SamplingParams:
    temperature = _pick(body.temperature, defaults.temperature)
    top_p = _pick(body.top_p, defaults.top_p)
    top_k = _pick(body.top_k, defaults.top_k)
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    if temperature < 0:
        raise InvalidRequest("'temperature' must be >= 0 (0 means greedy)", "temperature")
    if not 0 < top_p <= 1:
        raise InvalidRequest("'top_p' must be in (0, 1]", "top_p")
    if top_k is not None and top_k < 1:
        raise InvalidRequest("'top_k' must be a positive integer or null", "top_k")
    seed = _pick(body.seed, defaults.seed)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k or 0, seed=seed,
                          **extra)


def _stops(body: _SamplingFields, defaults: GenerateDefaults) -> tuple[str, ...]:
    stop = _pick(body.stop, defaults.stop)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} "
                             "are allowed", "stop")
    if any(s == "" for s in stops):
        raise InvalidRequest("'stop' strings must not be empty", "stop")
    return tuple(stops)


def _positive(value: int | None, field: str) -> int | None:
    if value is not None and value < 1:
        raise InvalidRequest(f"'{field}' must be a positive integer when set, got {value}", field)
    return value


def completion_request(body: CompletionBody, defaults: GenerateDefaults) -> GenerateRequest:
    _reject_unsupported(body)
    prompt = body.prompt
    if isinstance(prompt, list) and not all(type(t) is int for t in prompt):
        raise InvalidRequest("'prompt' must be one string or one list of token ids; "
                             "batches of prompts are not supported", "prompt")
    max_tokens = _positive(_pick(body.max_tokens, defaults.max_new_tokens), "max_tokens")
    return GenerateRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt=tuple(prompt) if isinstance(prompt, list) else prompt,
        max_tokens=max_tokens,
        sampling=_sampling(body, defaults),
        stop=_stops(body, defaults),
        ignore_eos=True,  # text completions run to max_tokens, a stop string or the context end
    )


def chat_request(body: ChatBody, defaults: GenerateDefaults) -> GenerateRequest:
    _reject_unsupported(body)
    if body.tools:
        raise InvalidRequest("'tools' is not supported for this model: it has no tool-call "
                             "parser", "tools")
    if body.top_logprobs not in (None, 0):
        raise InvalidRequest("'top_logprobs' is not supported by this server yet", "top_logprobs")
    max_tokens = _chat_max_tokens(body, defaults)
    min_tokens = body.min_tokens or 0
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise InvalidRequest(f"'min_tokens' must be between 0 and the maximum new tokens "
                             f"({max_tokens}), got {min_tokens}", "min_tokens")
    ignore_eos = defaults.ignore_eos if body.ignore_eos is None else body.ignore_eos
    reserved = RESERVED_TEMPLATE_KWARGS & set(body.chat_template_kwargs or {})
    if reserved:
        raise InvalidRequest(f"'chat_template_kwargs' must not set {', '.join(sorted(reserved))}: "
                             "use the request fields of the same name", "chat_template_kwargs")
    return GenerateRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt=ChatInput(_messages(body.messages), None, dict(body.chat_template_kwargs or {}),
                         body.add_generation_prompt),
        max_tokens=max_tokens,
        sampling=_sampling(body, defaults, min_tokens=min_tokens),
        stop=_stops(body, defaults),
        ignore_eos=ignore_eos,
    )


def _chat_max_tokens(body: ChatBody, defaults: GenerateDefaults) -> int | None:
    if body.max_completion_tokens is not None:
        return _positive(body.max_completion_tokens, "max_completion_tokens")
    return _positive(_pick(body.max_tokens, defaults.max_new_tokens), "max_tokens")


def _messages(messages: list[Message]) -> tuple[dict, ...]:
    if not messages:
        raise InvalidRequest("'messages' must contain at least one message", "messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


def _message(i: int, m: Message) -> dict:
    if m.role not in ROLES:
        raise InvalidRequest(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                             "messages")
    if isinstance(m.content, list):
        raise InvalidRequest(f"messages[{i}].content is a list of parts: multimodal message "
                             "parts are not supported; send the text as a string", "messages")
    out = {f: getattr(m, f) for f in Message.__struct_fields__ if getattr(m, f) is not None}
    out.setdefault("content", None if m.tool_calls else "")
    return out
