"""From Responses input items to chat messages, and the bounded store of conversations."""

from __future__ import annotations

import msgspec
import pytest

from pypto_serving.core.request import InvalidRequest
from pypto_serving.http.responses_api import ResponsesBody, ResponseStore, chat_body, input_messages


def test_input_items_become_chat_messages() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    messages = input_messages(items)
    assert messages[:2] == [{"role": "developer", "content": "Be brief."},
                            {"role": "user", "content": "a\nb"}]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}


@pytest.mark.parametrize(("item", "words"), [
    ({"type": "input_image", "image_url": "data:"}, "'input_image' item"),
    ({"role": "user", "content": [{"type": "input_image"}]}, "'input_image' content part"),
    ({"role": "tool", "content": "x"}, "role 'tool'"),
    ({"type": "function_call", "name": "f"}, "call_id"),
])
def test_what_cannot_be_read_is_a_400_naming_it(item: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        input_messages([item])


def test_the_chat_request_keeps_instructions_tools_and_limits() -> None:
    body = msgspec.convert({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5,
                            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                            "tool_choice": {"type": "function", "name": "f"}}, ResponsesBody)
    chat = chat_body(body, [{"role": "user", "content": "earlier"}])
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.max_completion_tokens == 5 and chat.tools[0].function.name == "f"
    assert chat.tool_choice.function.name == "f"
    assert chat.temperature is msgspec.UNSET  # not given: the server's default applies


def test_the_store_keeps_the_newest_conversations() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    assert store.history("r2") == [{"role": "user", "content": "2"}] and store.history(None) == []
    with pytest.raises(InvalidRequest, match="newest 2"):
        store.history("r0")
