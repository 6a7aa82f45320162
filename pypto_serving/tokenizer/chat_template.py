"""Chat template rendering with the semantics of Hugging Face `apply_chat_template`.

Templates come from model files and requests, so they are untrusted code: they run in jinja2's
immutable sandbox. The environment matches transformers' (trim_blocks, lstrip_blocks,
loopcontrols, a `tojson` that keeps non-ASCII, `raise_exception`, `strftime_now`), so the same
template and inputs render the same string. Any failure while compiling or rendering is a
`ChatTemplateError`, a `ValueError` the HTTP layer turns into a 400.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names the renderer sets itself; extra kwargs may not replace them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Older names a message's reasoning may arrive under; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template cannot render these inputs (or there is no template)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes and ASCII-escapes; models were trained on plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` and `dict.fromkeys(...)` without handing the template the `dict` type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace could reach CPython internals through the sandbox.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for `source`; each distinct source is compiled once."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error (line {exc.lineno}): {exc}") from exc


def _plain(value: Any) -> Any:
    """A copy of `value` made of JSON types only, so the sandbox never sees rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums) would carry extra methods into the sandbox
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # Templates handle a missing key but often render a None as "None" or crash on it. Content
    # is the exception: templates without tool support concatenate it unconditionally, and an
    # assistant turn that only called tools has none (OpenAI clients send null), so it renders
    # as "" (as vLLM renders it); tool-aware templates test it for truth, which "" also fails.
    msg = {k: _plain(v) for k, v in message.items() if v is not None}
    if "content" in message and message["content"] is None:
        msg["content"] = ""
    reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"each message must be an object, got {type(message).__name__}")
    return [_normalize_message(m) for m in messages]


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    /,
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Renders `messages` like `tokenizer.apply_chat_template(..., tokenize=False)`.

    `special_tokens` (bos_token, eos_token, ...) are visible to the template; `kwargs`
    (chat_template_kwargs such as `enable_thinking`) are too, and override them.
    """
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template; pass one with --chat-template or use /v1/completions"
        )
    if clash := sorted(_RESERVED & kwargs.keys()):
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
    compiled = compile_template(template)
    variables = _plain({**(special_tokens or {}), **kwargs})
    conversation = _normalize_messages(messages)
    try:
        return compiled.render(
            messages=conversation, tools=_plain(tools), documents=None,
            add_generation_prompt=add_generation_prompt, **variables,
        )  # fmt: skip
    except (jinja2.TemplateError, TypeError) as exc:
        # Both come from what the request put in front of the template (missing keys, lists where
        # the template concatenates strings, sandbox violations): bad input, not a server bug.
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
