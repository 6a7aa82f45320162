"""From decoded request bodies to `GenerateRequest`: the rules msgspec cannot express.

bodies.py has checked types and ranges; here are the cross-field rules, the server defaults
(`--generate-config`: a field present in the request wins, even when null; `max_tokens: null`
means the server default, as the documents say) and the refusal of options this server does
not implement. Every failure is an `InvalidRequest` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from pypto_serving.core.generate_config import GenerateDefaults
from pypto_serving.core.request import ChatInput, GenerateRequest, InvalidRequest
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.http.bodies import (
    REASONING_EFFORTS,
    RESERVED_TEMPLATE_KWARGS,
    ROLES,
    ChatBody,
    CompletionBody,
    GenerateFields,
    Message,
    NamedToolChoice,
    TokenizeBody,
    ints,
    unimplemented_defaults,
    whole_fields,
)
from pypto_serving.http.bodies import ToolCall as MessageToolCall
from pypto_serving.parsers.grammar import response_format_grammar, tool_choice_grammar
from pypto_serving.parsers.reasoning import ReasoningFormat
from pypto_serving.parsers.reply import ReplyFormat
from pypto_serving.parsers.tool_calls import ToolParser

# Below this a temperature only amplifies float noise: it is treated as greedy (as vLLM does).
GREEDY_BELOW = 1e-5
# Any top_k at least this large keeps the whole vocabulary; the cap keeps it an int64.
TOP_K_CAP = 1 << 30
# Nesting levels a body may have, its own object included: a tool or a response_format schema
# needs a dozen, and deeper input would reach msgspec's, Jinja's or llguidance's recursion.
MAX_JSON_DEPTH = 64
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [1 if b in b"[{" else -1 for b in range(256)]
_ENUMS = {"role": ROLES, "reasoning_effort": REASONING_EFFORTS,
          "tool_choice": ("none", "auto", "required", "an object"), "type": ("function",),
          "response_format.type": ("text", "json_object", "json_schema")}


@dataclass(frozen=True, slots=True)
class ModelParsers:
    """The served model's output parsers (from its family or --reasoning-parser and
    --tool-call-parser); None: the model has none."""

    reasoning: ReasoningFormat | None = None
    tool_parser: Callable[..., ToolParser] | None = None
    tool_parser_name: str = "none"  # as chosen (hermes and qwen are one parser)
    # tool_choice "none": the template still renders the tools (vLLM's default), unless this
    # (--exclude-tools-when-tool-choice-none) leaves them out
    exclude_tools_when_none: bool = False


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request: what to generate, how many choices, and whether to stream."""

    request: GenerateRequest
    n: int
    stream: bool
    final_usage: bool = True  # a stream ends with a usage event (`include_usage: false`: not)
    running_usage: bool = False  # every chunk carries usage (`continuous_usage_stats`)
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field is in the response

    @property
    def echo_only(self) -> bool:
        """`echo` with max_tokens 0: the prompt, scored, and no completion."""
        return self.request.score_only


def decode_body(raw: bytes, body_type: type) -> Any:
    """The one way handlers decode a body; every failure is an InvalidRequest."""
    _check_depth(raw)
    try:
        return ints(msgspec.json.decode(raw, type=body_type))
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise InvalidRequest(f"invalid request: {_explain(message, body_type)}", _field_of(message)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # the bound above leaves room, but never a 500
        raise InvalidRequest("the request body is nested too deeply to decode") from None


def _check_depth(raw: bytes) -> None:
    """Refuses nesting deeper than MAX_JSON_DEPTH before anything recursive reads the body.
    Every step runs in C (bytes.replace, split, translate), so a prompt of megabytes costs a
    few copies, not a Python step per byte: the escaped backslashes and quotes go, then the
    strings (every other piece between quotes), then all but the brackets."""
    if len(raw.translate(None, _NOT_BRACKET)) <= 2 * MAX_JSON_DEPTH:  # too few to nest that deep
        return
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(None, _NOT_BRACKET)
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH:
        field = _deep_field(raw)
        where = f"'{field}'" if field else "the request body"
        raise InvalidRequest(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep (the "
                             "body's own object counts as one): flatten it", field)


def _deep_field(raw: bytes) -> str | None:
    """The top-level key under which the nesting first goes too deep (on the error path only:
    a Python step per string and bracket)."""
    depth, key, field = 0, None, None
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token[:1] == b'"':
            key = token if depth == 1 and key is not None else key
            continue
        opens = token in b"[{"
        depth += 1 if opens else -1
        if depth == 1 and opens:
            key = b"" if token == b"{" else None  # an array body has no keys
        elif depth == 2 and opens:  # a value: the last string seen at depth 1 was its key
            field = _key(key)
        elif depth > MAX_JSON_DEPTH:
            return field
    return None


def _key(token: bytes | None) -> str | None:
    try:
        return json.loads(token) if token else None
    except ValueError:
        return None


def _path(message: str) -> list[str]:
    """The field names in a msgspec error's location ("... - at `$.messages[0].role`")."""
    _, at, path = message.rpartition(" - at ")
    return re.findall(r"\.(\w+)", path) if at else []


def _field_of(message: str) -> str | None:
    names = _path(message) or re.findall(r"field `(\w+)`", message)
    return names[0] if names else None


def _explain(message: str, body_type: type) -> str:
    names = _path(message)
    # An integer field is int | whole float (bodies.whole); the client need not hear of that.
    if names and names[0] in whole_fields(body_type):
        message = message.replace("`float` that's a multiple of 1.0", "an integer")
        message = re.sub(r"`float` ([<>]=?) (-?\d+)\.0\b", r"`int` \1 \2", message)
        message = message.replace("`int | float", "`int")
    # msgspec names the field of a bad enum value but not the values it allows.
    enum = names and message.startswith("Invalid enum value")
    allowed = _ENUMS.get(".".join(names[-2:]), _ENUMS.get(names[-1])) if enum else None
    return message if allowed is None else f"{message}; allowed: {', '.join(allowed)}"


def _pick(value: Any, default: Any) -> Any:
    return default if value is UNSET else value


def _or(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _check_options(body: GenerateFields, defaults: GenerateDefaults) -> dict[str, Any]:
    """Parsed's n, stream and usage fields, refusing what this server cannot honour."""
    _refuse_unimplemented(body)
    n = _or(body.n, 1)
    if body.best_of not in (None, n):
        raise InvalidRequest(f"'best_of' must equal 'n' ({n}): ranking extra candidates is not "
                             "supported", "best_of")
    options = body.stream_options
    return {"n": n, "stream": _wants_stream(body, defaults),
            # the usage event ends a stream unless the client says no (OpenAI's SDK may)
            "final_usage": options is None or options.include_usage is not False,
            "running_usage": options is not None and bool(options.continuous_usage_stats)}


def _refuse_unimplemented(body: GenerateFields) -> None:
    defaults = unimplemented_defaults(type(body))
    refuse_unimplemented(body, {f: allowed for f, allowed in defaults.items() if f != "best_of"})


def refuse_unimplemented(body: msgspec.Struct, defaults: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first of `defaults`' fields (known, not implemented) that `body` sets
    to a value other than the defaults listed for it."""
    for field, allowed in defaults.items():
        value = getattr(body, field, None)
        if not any(_same(value, a) for a in allowed):
            default = msgspec.json.encode(allowed[-1]).decode()
            raise InvalidRequest(f"'{field}' is not supported by this server; remove it or set "
                                 f"it to {default}", field)


def _same(value: Any, default: Any) -> bool:
    """JSON equality, as /openapi.json's enum of the defaults means it: 1.0 is 1, 0 is not false."""
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def _wants_stream(body: GenerateFields, defaults: GenerateDefaults) -> bool:
    stream = bool(_pick(body.stream, defaults.stream))
    options = body.stream_options
    if options is not None and not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true",
                             "stream_options")
    return stream


def _sampling(body: GenerateFields, defaults: GenerateDefaults, logprobs: int | None,
              prompt_logprobs: int | None) -> SamplingParams:
    temperature = _or(_pick(body.temperature, defaults.temperature), 1.0)
    top_k = _or(_pick(body.top_k, defaults.top_k), 0)
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=_or(_pick(body.top_p, defaults.top_p), 1.0),
        top_k=min(max(top_k, 0), TOP_K_CAP),  # -1 (vLLM's old default) and 0: no cut
        min_p=_or(body.min_p, 0.0),
        seed=_pick(body.seed, defaults.seed),
        presence_penalty=_or(body.presence_penalty, 0.0),
        frequency_penalty=_or(body.frequency_penalty, 0.0),
        repetition_penalty=_or(body.repetition_penalty, 1.0),
        min_tokens=_or(body.min_tokens, 0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
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
                      max_tokens: int | None, logprobs: int | None, ignore_eos: bool,
                      forced: tuple[str, str] | None = None,
                      prompt_logprobs: int | None = None) -> GenerateRequest:
    """`forced`: (grammar, field) when a field other than response_format constrains the output."""
    _check_min_tokens(body, max_tokens)
    grammar, param = forced or (_response_format(body), "response_format")
    sampling = _sampling(body, defaults, logprobs, _or(prompt_logprobs, body.prompt_logprobs))
    return GenerateRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=msgspec.structs.replace(sampling, grammar=grammar),
        stop=_stops(body, defaults),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=ignore_eos,
        grammar_param=param if grammar is not None else None,
    )


def _response_format(body: GenerateFields) -> str | None:
    if body.response_format is None:
        return None
    return response_format_grammar(msgspec.to_builtins(body.response_format))


def parse_completion(body: CompletionBody, defaults: GenerateDefaults) -> Parsed:
    options = _check_options(body, defaults)
    prompt = body.prompt
    if isinstance(prompt, list) and not all(type(t) is int for t in prompt):
        raise InvalidRequest("'prompt' must be one string or one list of token ids; "
                             "batches of prompts are not supported", "prompt")
    max_tokens, echo = _max_tokens(body, defaults), bool(body.echo)
    if max_tokens == 0 and not echo:
        raise InvalidRequest("'max_tokens' must be at least 1 (0 only scores the prompt, with "
                             "'echo': true)", "max_tokens")
    _check_prompt_logprobs(body, options["stream"])
    # With echo, `logprobs` covers the prompt's tokens too.
    scored = max((k for k in (body.prompt_logprobs, body.logprobs if echo else None) if k is not None),
                 default=None)
    # Text completions run to max_tokens, a stop string or the context end: EOS is ignored.
    # Scoring only still samples one token (the step that scores the prompt's end samples).
    request = _generate_request("cmpl", tuple(prompt) if isinstance(prompt, list) else prompt,
                                body, defaults, max_tokens or 1, body.logprobs, ignore_eos=True,
                                prompt_logprobs=scored)
    return Parsed(dataclasses.replace(request, echo=echo, score_only=max_tokens == 0), **options,
                  prompt_logprobs=body.prompt_logprobs)


def _check_prompt_logprobs(body: GenerateFields, stream: bool) -> None:
    if body.prompt_logprobs is not None and stream:
        raise InvalidRequest("'prompt_logprobs' is not available with 'stream': true (with "
                             "'echo', completions stream the prompt's logprobs in 'logprobs')",
                             "prompt_logprobs")


def with_request_id(parsed: Parsed, rid: str | None) -> Parsed:
    """`parsed` with the edge's request id (the client's X-Request-Id, or a fresh one) in its
    response id and the engine's log lines, as vLLM does: `cmpl-<X-Request-Id>`; None (an app
    without the edge, in tests): as it is."""
    if rid is None:
        return parsed
    prefix = parsed.request.request_id.split("-", 1)[0]
    request = dataclasses.replace(parsed.request, request_id=f"{prefix}-{rid}")
    return dataclasses.replace(parsed, request=request)


def parse_chat(body: ChatBody, defaults: GenerateDefaults, parsers: ModelParsers | None = None) -> Parsed:
    parsers = parsers or ModelParsers()
    options = _check_options(body, defaults)
    tools, callable_tools = _tools(body, parsers)
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = _or(body.top_logprobs, 0) if body.logprobs else None
    _check_prompt_logprobs(body, options["stream"])
    chat = ChatInput(_messages(body.messages), tuple(tools) or None, _template_kwargs(body),
                     body.add_generation_prompt)
    request = _generate_request("chatcmpl", chat, body, defaults, _chat_max_tokens(body, defaults),
                                logprobs, _or(body.ignore_eos, defaults.ignore_eos),
                                _forced_call(body, callable_tools))
    reply = ReplyFormat(
        reasoning=parsers.reasoning, include_reasoning=body.include_reasoning,
        tool_parser=parsers.tool_parser if callable_tools else None,
        tool_names=frozenset(t["function"]["name"] for t in callable_tools),
        parallel_tool_calls=_or(body.parallel_tool_calls, True))
    return Parsed(dataclasses.replace(request, reply=reply), **options,
                  prompt_logprobs=body.prompt_logprobs)


def parse_tokenize(body: TokenizeBody) -> tuple[str | ChatInput, bool | None]:
    """What /tokenize encodes, and whether with special tokens (None: the prompt kind's default)."""
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of 'prompt' and 'messages'", "prompt")
    if body.prompt is not None:
        return body.prompt, body.add_special_tokens
    tools = tuple(msgspec.to_builtins(t) for t in body.tools or ()) or None
    chat = ChatInput(_messages(body.messages), tools, _checked_kwargs(body.chat_template_kwargs),
                     body.add_generation_prompt)
    return chat, body.add_special_tokens


def _chat_max_tokens(body: ChatBody, defaults: GenerateDefaults) -> int | None:
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return _max_tokens(body, defaults)


def _max_tokens(body: GenerateFields, defaults: GenerateDefaults) -> int | None:
    """The request's max_tokens; omitted or null, the server default."""
    return _or(_pick(body.max_tokens, None), defaults.max_new_tokens)


def _tools(body: ChatBody, parsers: ModelParsers) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The declared tools the model sees, and those it may call: with tool_choice "none" it
    sees them all (as vLLM: the prompt keeps the prefix of the turns that may call them; none
    with --exclude-tools-when-tool-choice-none) and calls none (its reply is text)."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidRequest(f"'tools' declares {duplicates[0]!r} more than once: tool names "
                             "must be unique", "tools")
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequest(f"'tool_choice' names {choice.function.name!r}, which is not in "
                             "'tools'", "tool_choice")
    if choice == "required" and not tools:
        raise InvalidRequest("'tool_choice' is 'required' but 'tools' declares no tool", "tool_choice")
    declared = [msgspec.to_builtins(t) for t in tools]
    if choice == "none":
        return ([] if parsers.exclude_tools_when_none else declared), []
    if tools and parsers.tool_parser is None:
        raise InvalidRequest("'tools' is not supported for this model: it has no tool-call "
                             "parser (see --tool-call-parser)", "tools")
    return declared, declared


def _forced_call(body: ChatBody, tools: list[dict[str, Any]]) -> tuple[str, str] | None:
    """tool_choice "required" or a named function: the reply must be a call (a grammar)."""
    choice = body.tool_choice
    if not tools or choice in (None, "auto"):
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest("'response_format' cannot constrain a reply that 'tool_choice' "
                             "forces to be a tool call: drop one of them", "response_format")
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return tool_choice_grammar(tools, name), "tool_choice"


def _checked_kwargs(given: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(given or {})
    reserved = RESERVED_TEMPLATE_KWARGS & set(kwargs)
    if reserved:
        raise InvalidRequest(f"'chat_template_kwargs' must not set {', '.join(sorted(reserved))}: "
                             "use the request fields of the same name", "chat_template_kwargs")
    return kwargs


def _template_kwargs(body: ChatBody) -> dict[str, Any]:
    kwargs = _checked_kwargs(body.chat_template_kwargs)
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if body.reasoning_effort == "none":  # Qwen3-style templates read enable_thinking
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def _messages(messages: list[Message]) -> tuple[dict, ...]:
    """The history as the chat template reads it; tool results must answer earlier calls."""
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        if m.role == "tool" and m.tool_call_id not in call_ids:
            raise InvalidRequest(f"messages[{i}] is a tool result whose tool_call_id "
                                 f"{m.tool_call_id!r} matches no earlier assistant tool call",
                                 "messages")
        message = msgspec.to_builtins(m)
        if isinstance(m.content, list):
            message["content"] = _text_of_parts(i, m.content)
        message.setdefault("content", None if m.tool_calls else "")
        if m.tool_calls:
            message["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(m.tool_calls)]
            call_ids.update(c.id for c in m.tool_calls if c.id is not None)
        out.append(message)
    return tuple(out)


def _text_of_parts(i: int, parts: list[dict[str, Any]]) -> str:
    """A list of content parts as one text, joined with newlines as vLLM does for a text-only
    model; any other kind of part is refused by name."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind != "text":
            raise InvalidRequest(f"messages[{i}].content[{j}] is a {kind!r} part: multimodal parts "
                                 "are not supported by this text-only model; send text parts",
                                 "messages")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"messages[{i}].content[{j}] is a text part without a 'text' "
                                 "string", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _history_call(i: int, j: int, call: MessageToolCall) -> dict[str, Any]:
    """A call as templates expect it: arguments as an object (Qwen's writes them with tojson)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON "
                             "object (or a string holding one)", "messages")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out
