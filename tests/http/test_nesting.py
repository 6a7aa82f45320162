"""A body nested deeper than MAX_JSON_DEPTH is a 400 naming the field, whichever field holds
it, before anything recursive (msgspec, the chat template, llguidance) reads it."""

from __future__ import annotations

import json
import sys

import pytest

from pypto_serving.app.packaged_models import qwen_coder_path
from pypto_serving.core.request import InvalidRequest
from pypto_serving.http import bodies, protocol
from pypto_serving.http.protocol import MAX_JSON_DEPTH
from tests.replies.scripted import ScriptedServer

USER = [{"role": "user", "content": "Hi"}]


def nested(levels: int) -> object:
    """A value of `levels` nesting levels, objects and arrays in turn."""
    value: object = 1
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def deep_bytes(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def chat_bytes(field: str, value: bytes) -> bytes:
    return b'{"messages": ' + json.dumps(USER).encode() + b', "' + field.encode() + b'": ' + value + b"}"


def refused(raw: bytes, body_type: type = bodies.ChatBody) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        protocol.decode_body(raw, body_type)
    return info.value


@pytest.mark.parametrize("field", ["logit_bias", "response_format", "chat_template_kwargs",
                                   "tools", "messages", "no_such_field"])
@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 1000, 100_000])
def test_deep_fields_are_400s_naming_the_field(field: str, levels: int):
    error = refused(chat_bytes(field, deep_bytes(levels)))
    assert error.param == field
    assert f"'{field}'" in error.message and str(MAX_JSON_DEPTH) in error.message


def test_deep_completion_fields_too():
    raw = b'{"prompt": "x", "suffix": ' + deep_bytes(1000) + b"}"
    assert refused(raw, bodies.CompletionBody).param == "suffix"
    assert refused(deep_bytes(1000), bodies.CompletionBody).param is None  # no field to name


def test_the_bound_counts_the_body_itself():
    body = {"messages": USER, "chat_template_kwargs": nested(MAX_JSON_DEPTH - 1)}
    assert protocol.decode_body(json.dumps(body).encode(), bodies.ChatBody).chat_template_kwargs
    body["chat_template_kwargs"] = {"k": nested(MAX_JSON_DEPTH - 1)}
    assert refused(json.dumps(body).encode()).param == "chat_template_kwargs"


def test_brackets_in_strings_do_not_count():
    text = '[{ \\" \\\\" [' * 1000 + '\\"' + "[" * 1000
    body = {"messages": [{"role": "user", "content": text}], "user": "]" * 1000}
    assert protocol.decode_body(json.dumps(body).encode(), bodies.ChatBody).messages[0].content == text


def test_an_escaped_backslash_ends_the_string_before_deep_brackets():
    # the key ends with an escaped backslash: its closing quote is real, the brackets are outside
    raw = b'{"messages": [{"role": "user", "content": "x"}], "odd\\\\": ' + deep_bytes(200) + b"}"
    assert refused(raw).param == "odd\\"


def test_a_recursion_error_while_decoding_is_a_400(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(protocol, "MAX_JSON_DEPTH", 10**9)  # as if the bound let it through
    error = refused(chat_bytes("logit_bias", deep_bytes(100_000)))
    assert "nested too deeply" in error.message


def test_the_check_is_cheap_on_a_large_prompt():
    """Counted in Python trace events, not seconds: the 4 MiB prompt's brackets and quotes are
    scanned in C (~28,000 events here); a Python loop over its characters would take millions."""
    prompt = ('def f(x):\n    return {"a": [x, "\\\\"], "b": "[{"}\n' * 100_000)[:4 << 20]
    raw = json.dumps({"prompt": prompt}).encode()
    events = 0

    def count(frame, event, arg):
        nonlocal events
        events += 1
        return count

    sys.settrace(count)
    try:
        protocol.decode_body(raw, bodies.CompletionBody)
    finally:
        sys.settrace(None)
    assert events < 300_000


async def test_served_deep_template_kwargs_are_answered_with_a_400():
    async with ScriptedServer(str(qwen_coder_path())) as client:
        for path in ("/v1/chat/completions", "/tokenize"):
            body = chat_bytes("chat_template_kwargs", json.dumps(nested(500)).encode())
            r = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            assert r.status == 400, await r.text()
            assert (await r.json())["param"] == "chat_template_kwargs"
