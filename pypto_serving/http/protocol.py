"""From decoded request bodies to `GenerateRequest`: the rules msgspec cannot express.

bodies.py has checked types and ranges; here are the cross-field rules, the server defaults
(`--generate-config`: a field present in the request wins, even when null; `max_tokens: null`
means the server default, as the documents say) and the refusal of options this server does
not implement. Every failure is an `InvalidRequest` naming the field and what is allowed.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from pypto_serving.generate_config import GenerateDefaults
from pypto_serving.http.bodies import (
    REASONING_EFFORTS,
    ROLES,
    UNIMPLEMENTED_DEFAULTS,
    ChatBody,
    CompletionBody,
    GenerateFields,
    Message,
)
from pypto_serving.requests import ChatInput, GenerateRequest, InvalidRequest
from pypto_serving.sampling import SamplingParams

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})
# Below this a temperature only amplifies float noise: it is treated as greedy (as vLLM does).
GREEDY_BELOW = 1e-5
# Any top_k at least this large keeps the whole vocabulary; the cap keeps it an int64.
TOP_K_CAP = 1 << 30
_ENUMS = {"role": ROLES, "reasoning_effort": REASONING_EFFORTS,
          "tool_choice": ("none", "auto", "required", "an object"), "type": ("function",)}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request: what to generate, how many choices, and whether to stream."""

    request: GenerateRequest
    n: int
    stream: bool


def decode_body(raw: bytes, body_type: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {_explain(str(exc))}", _field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _path(message: str) -> list[str]:
    """The field names in a msgspec error's location ("... - at `$.messages[0].role`")."""
    _, at, path = message.rpartition(" - at ")
    return re.findall(r"\.(\w+)", path) if at else []


def _field_of(message: str) -> str | None:
    names = _path(message) or re.findall(r"field `(\w+)`", message)
    return names[0] if names else None


def _explain(message: str) -> str:
    # msgspec names the field of a bad enum value but not the values it allows.
    names = _path(message)
    allowed = _ENUMS.get(names[-1]) if names and message.startswith("Invalid enum value") else None
    return message if allowed is None else f"{message}; allowed: {', '.join(allowed)}"


def _pick(value: Any, default: Any) -> Any:
    return default if value is UNSET else value


def _or(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _check_options(body: GenerateFields, defaults: GenerateDefaults) -> tuple[int, bool]:
    """(number of choices, whether to stream), refusing what this server cannot honour."""
    _refuse_unimplemented(body)
    n = _or(body.n, 1)
    if body.best_of not in (None, n):
        raise InvalidRequest(f"'best_of' must equal 'n' ({n}): ranking extra candidates is not "
                             "supported", "best_of")
    return n, _wants_stream(body, defaults)


def _refuse_unimplemented(body: GenerateFields) -> None:
    for field, allowed in UNIMPLEMENTED_DEFAULTS.items():
        if field != "best_of" and getattr(body, field, None) not in allowed:
            default = msgspec.json.encode(allowed[-1]).decode()
            raise InvalidRequest(f"'{field}' is not supported by this server; remove it or set "
                                 f"it to {default}", field)


def _wants_stream(body: GenerateFields, defaults: GenerateDefaults) -> bool:
    stream = bool(_pick(body.stream, defaults.stream))
    options = body.stream_options
    if options is not None and not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true",
                             "stream_options")
    if options is not None and options.continuous_usage_stats:
        raise InvalidRequest("'stream_options.continuous_usage_stats' is not supported; the "
                             "usage event ends every stream", "stream_options")
    return stream


def _sampling(body: GenerateFields, defaults: GenerateDefaults, logprobs: int | None) -> SamplingParams:
    temperature = _or(_pick(body.temperature, defaults.temperature), 1.0)
    top_k = _or(_pick(body.top_k, defaults.top_k), 0)
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=_or(_pick(body.top_p, defaults.top_p), 1.0),
        top_k=min(top_k, TOP_K_CAP),
        min_p=_or(body.min_p, 0.0),
        seed=_pick(body.seed, defaults.seed),
        presence_penalty=_or(body.presence_penalty, 0.0),
        frequency_penalty=_or(body.frequency_penalty, 0.0),
        repetition_penalty=_or(body.repetition_penalty, 1.0),
        min_tokens=_or(body.min_tokens, 0),
        logprobs=logprobs,
    )


def _stops(body: GenerateFields, defaults: GenerateDefaults) -> tuple[str, ...]:
    stop = _pick(body.stop, defaults.stop)
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _check_min_tokens(body: GenerateFields, max_tokens: int | None) -> None:
    min_tokens = _or(body.min_tokens, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"'min_tokens' ({min_tokens}) must not exceed the maximum new tokens "
                             f"({max_tokens}): lower it or raise max_tokens", "min_tokens")


def _generate_request(prefix: str, prompt: Any, body: GenerateFields, defaults: GenerateDefaults,
                      max_tokens: int | None, logprobs: int | None, ignore_eos: bool) -> GenerateRequest:
    _check_min_tokens(body, max_tokens)
    return GenerateRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=_sampling(body, defaults, logprobs),
        stop=_stops(body, defaults),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=ignore_eos,
    )


def parse_completion(body: CompletionBody, defaults: GenerateDefaults) -> Parsed:
    n, stream = _check_options(body, defaults)
    prompt = body.prompt
    if isinstance(prompt, list) and not all(type(t) is int for t in prompt):
        raise InvalidRequest("'prompt' must be one string or one list of token ids; "
                             "batches of prompts are not supported", "prompt")
    max_tokens = _max_tokens(body, defaults)
    # Text completions run to max_tokens, a stop string or the context end: EOS is ignored.
    request = _generate_request("cmpl", tuple(prompt) if isinstance(prompt, list) else prompt,
                                body, defaults, max_tokens, body.logprobs, ignore_eos=True)
    return Parsed(request, n, stream)


def parse_chat(body: ChatBody, defaults: GenerateDefaults) -> Parsed:
    n, stream = _check_options(body, defaults)
    _check_tools(body)
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = _or(body.top_logprobs, 0) if body.logprobs else None
    chat = ChatInput(tuple(_message(i, m) for i, m in enumerate(body.messages)), None,
                     _template_kwargs(body), body.add_generation_prompt)
    request = _generate_request("chatcmpl", chat, body, defaults, _chat_max_tokens(body, defaults),
                                logprobs, _or(body.ignore_eos, defaults.ignore_eos))
    return Parsed(request, n, stream)


def _chat_max_tokens(body: ChatBody, defaults: GenerateDefaults) -> int | None:
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return _max_tokens(body, defaults)


def _max_tokens(body: GenerateFields, defaults: GenerateDefaults) -> int | None:
    """The request's max_tokens; omitted or null, the server default."""
    return _or(_pick(body.max_tokens, None), defaults.max_new_tokens)


def _check_tools(body: ChatBody) -> None:
    if body.tools:
        raise InvalidRequest("'tools' is not supported for this model: it has no tool-call "
                             "parser", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequest("'tool_choice' can only be 'none' or 'auto' for this model: it has "
                             "no tool-call parser", "tool_choice")


def _template_kwargs(body: ChatBody) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = RESERVED_TEMPLATE_KWARGS & set(kwargs)
    if reserved:
        raise InvalidRequest(f"'chat_template_kwargs' must not set {', '.join(sorted(reserved))}: "
                             "use the request fields of the same name", "chat_template_kwargs")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if body.reasoning_effort == "none":  # Qwen3-style templates read enable_thinking
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def _message(i: int, m: Message) -> dict:
    if isinstance(m.content, list):
        raise InvalidRequest(f"messages[{i}].content is a list of parts: multimodal message "
                             "parts are not supported; send the text as a string", "messages")
    out = msgspec.to_builtins(m)
    out.setdefault("content", None if m.tool_calls else "")
    return out
