from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings

from pypto_serving.parsers.tool_calls import (
    ContentDelta,
    HermesToolParser,
    ToolCallDelta,
    ToolCallError,
    ToolEvent,
    ToolOutcome,
    tool_parser_for,
    tool_parser_name,
)
from tests.parsers.splits import every_split, random_cuts, split_at

TOOLS = {"get_weather", "get_time", "run_code"}
TAG_PARTS = ("<tool_call", "</tool_call")
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
NOT_A_CALL = '{"city": "Paris", "temp": 21}'
UNDECLARED = '{"name": "send_email", "arguments": {"to": "bob"}}'
SCHEMA_ECHO = '{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}'


@dataclass(frozen=True)
class Reply:
    """What a client sees: (name, arguments) per call, content, finish reason, error."""

    calls: tuple[tuple[str, str], ...] = ()
    content: str | None = None
    finish_reason: str = "tool_calls"
    error: str | None = None


def parse(pieces: list[str], tools: set[str] | None = TOOLS, parallel: bool = True,
          finish_reason: str = "stop") -> Reply:
    parser = HermesToolParser(tools, parallel)
    events = [event for piece in pieces for event in parser.push(piece)]
    tail, outcome = parser.finish(finish_reason)
    check_stream(events + tail, outcome)
    calls = tuple((call.name, call.arguments) for call in outcome.calls)
    return Reply(calls, outcome.content, outcome.finish_reason, outcome.error)


def check_stream(events: list[ToolEvent], outcome: ToolOutcome) -> None:
    """The streamed events assemble into the outcome, and no tag leaks into content."""
    content = [e.text for e in events if isinstance(e, ContentDelta)]
    assert not any(part in text for text in content for part in TAG_PARTS)
    assert ("".join(content) or None) == outcome.content
    errors = [e.message for e in events if isinstance(e, ToolCallError)]
    assert errors == ([outcome.error] if outcome.error else [])
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    starts = [d for d in deltas if d.id is not None]
    assert [d.index for d in starts] == list(range(len(starts)))
    assert len(starts) >= len(outcome.calls)
    for call, start in zip(outcome.calls, starts, strict=False):
        assert (start.id, start.name, start.arguments) == (call.id, call.name, "")
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        fragments = [d for d in deltas if d.index == start.index and d.id is None]
        assert all(d.name is None for d in fragments) and deltas.index(start) < deltas.index(fragments[0])
        assert "".join(d.arguments for d in fragments) == call.arguments
        assert isinstance(json.loads(call.arguments), dict)


def weather(city: str) -> tuple[str, str]:
    return ("get_weather", json.dumps({"city": city}))


REPLIES = {
    "one call": (f"<tool_call>\n{PARIS}\n</tool_call>", Reply((weather("Paris"),))),
    "text before the call": (f"Let me check the weather.\n\n<tool_call>\n{PARIS}\n</tool_call>",
                             Reply((weather("Paris"),), "Let me check the weather.")),
    "parallel calls": (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call>",
                       Reply((weather("Paris"), weather("Rome")))),
    "bare JSON call": (PARIS, Reply((weather("Paris"),))),
    "bare JSON calls with padding": (f"\n{PARIS}\n{ROME}\n", Reply((weather("Paris"), weather("Rome")))),
    "bare call with parameters": ('{"name": "get_time", "parameters": {"zone": "UTC"}}',
                                  Reply((("get_time", '{"zone": "UTC"}'),))),
    "braces and tags inside strings": (
        '<tool_call>{"name": "run_code", "arguments": {"code": "if x: {\\"a\\": \\"}\\"} # </tool_call>"}}'
        '</tool_call>',
        Reply((("run_code", '{"code": "if x: {\\"a\\": \\"}\\"} # </tool_call>"}'),))),
    "arguments before the name": ('<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}'
                                  '</tool_call>', Reply((weather("Paris"),))),
    "no arguments": ('<tool_call>{"name": "get_time"}</tool_call>', Reply((("get_time", "{}"),))),
    "arguments as a JSON string": ('<tool_call>{"name": "get_weather", '
                                   '"arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
                                   Reply((weather("Paris"),))),
    "missing closing tag": (f"<tool_call>\n{PARIS}", Reply((weather("Paris"),))),
    "non-ASCII arguments": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
                            Reply((("get_weather", '{"city": "Zürich"}'),))),
    "plain text": ("It is sunny in Paris <b>today</b>, {sort of}.",
                   Reply((), "It is sunny in Paris <b>today</b>, {sort of}.", "stop")),
    "bare JSON that is not a call": (NOT_A_CALL, Reply((), NOT_A_CALL, "stop")),
    "bare call to an undeclared tool": (UNDECLARED, Reply((), UNDECLARED, "stop")),
    "bare tool schema echoed back": (SCHEMA_ECHO, Reply((), SCHEMA_ECHO, "stop")),
    "fenced JSON call": (f"```json\n{PARIS}\n```", Reply((weather("Paris"),))),
    "fenced calls, one per fence": (f"```\n{PARIS}\n```\n```json\n{ROME}\n```",
                                    Reply((weather("Paris"), weather("Rome")))),
    "fenced JSON that is not a call": (f"```json\n{NOT_A_CALL}\n```",
                                       Reply((), f"```json\n{NOT_A_CALL}\n```", "stop")),
    "fenced code": ("```python\nprint(1)\n```", Reply((), "```python\nprint(1)\n```", "stop")),
    "a lone fence": ("```", Reply((), "```", "stop")),
    "two calls in one fence": (f"```json\n{PARIS}\n{ROME}\n```", Reply((weather("Paris"), weather("Rome")))),
}
MALFORMED = {
    "bad JSON": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
    "unclosed object": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',
    "not JSON at all": 'Sure.<tool_call>get_weather(city="Paris")</tool_call>',
    "undeclared tool": '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',
    "arguments not an object": '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
    "ends inside the call": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"',
}


@pytest.mark.parametrize("case", REPLIES)
def test_every_split_point_gives_the_same_reply(case):
    text, expected = REPLIES[case]
    for pieces in every_split(text):
        assert parse(pieces) == expected, pieces


@pytest.mark.parametrize("case", REPLIES)
@settings(max_examples=25, deadline=None)
@given(cuts=random_cuts())
def test_random_splits_give_the_same_reply(case, cuts):
    text, expected = REPLIES[case]
    assert parse(split_at(text, cuts)) == expected


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_calls_are_an_error_at_every_split(case):
    results = {parse(pieces) for pieces in every_split(MALFORMED[case])}
    assert len(results) == 1
    reply = results.pop()
    assert reply.error and reply.calls == () and reply.finish_reason == "stop"
    assert reply.content == ("Sure." if case == "not JSON at all" else None)


def test_without_parallel_calls_only_the_first_is_returned():
    text = REPLIES["parallel calls"][0]
    for pieces in every_split(text):
        assert parse(pieces, parallel=False) == Reply((weather("Paris"),))


def test_calls_cut_off_by_length_are_not_reported():
    text = f"Checking.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call>"
    first_end, second_end = text.index(PARIS) + len(PARIS), text.index(ROME) + len(ROME)
    for end in range(len(text)):
        reply = parse([text[:end]], finish_reason="length")
        complete = (end >= first_end) + (end >= second_end)
        assert reply.calls == (weather("Paris"), weather("Rome"))[:complete], end
        assert reply.finish_reason == "length" and reply.error is None
        assert "Checking.\n".startswith(reply.content or "")


def test_bare_json_is_a_call_only_when_tools_are_declared():
    assert parse([PARIS], tools=None) == Reply((), PARIS, "stop")
    assert parse([PARIS], tools={"get_time"}) == Reply((), PARIS, "stop")


def test_tagged_calls_need_no_declared_tools():
    assert parse([f"<tool_call>{PARIS}</tool_call>"], tools=None) == Reply((weather("Paris"),))


def test_arguments_stream_as_they_arrive():
    parser = HermesToolParser(TOOLS)
    events = [event for char in f"<tool_call>\n{PARIS}\n</tool_call>" for event in parser.push(char)]
    assert len([e for e in events if isinstance(e, ToolCallDelta) and e.arguments]) > 10


def test_parser_selection_by_family_and_name():
    assert tool_parser_for("qwen2") is HermesToolParser and tool_parser_for("qwen3") is HermesToolParser
    assert tool_parser_for("llama") is None and tool_parser_for("qwen2", "none") is None
    assert tool_parser_for("gemma3") is None and tool_parser_name("gemma3") == "none"
    assert tool_parser_for("llama", "qwen") is HermesToolParser
    assert tool_parser_name("qwen2") == "hermes" and tool_parser_name("llama", "qwen") == "qwen"
    with pytest.raises(ValueError, match="--tool-call-parser.*'mistral'.*hermes"):
        tool_parser_for("llama", "mistral")
