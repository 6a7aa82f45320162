"""Reasoning and tool calls parsed together from one reply, streamed at every split point."""

from __future__ import annotations

import pytest

from pypto_serving.parsers import reasoning_parser_for, tool_parser_for
from pypto_serving.parsers.reply import ReplyDelta, ReplyEnd, ReplyFormat, ReplyParser
from tests.parsers.splits import every_split

QWEN3 = reasoning_parser_for("qwen3")
HERMES = tool_parser_for("qwen2")
TOOLS = frozenset({"get_weather"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(fmt: ReplyFormat, pieces: list[str], reason: str = "stop",
        prompt: str = "") -> tuple[ReplyDelta, ReplyEnd]:
    parser = ReplyParser(fmt, prompt)
    deltas = [parser.push(p) for p in pieces]
    tail, end = parser.finish(reason)
    deltas.append(tail)
    joined = ReplyDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
                        tuple(c for d in deltas for c in d.tool_calls),
                        next((d.error for d in deltas if d.error), None))
    return joined, end


def arguments(delta: ReplyDelta) -> str:
    return "".join(c.arguments for c in delta.tool_calls)


@pytest.mark.parametrize("pieces", list(every_split("<think>\nPlan: look it up.\n</think>\n\n" + CALL)))
def test_reasoning_then_a_call(pieces: list[str]):
    fmt = ReplyFormat(QWEN3, True, HERMES, TOOLS)
    delta, end = run(fmt, pieces)
    assert delta.reasoning == "Plan: look it up."
    assert delta.content == "" and arguments(delta) == '{"city": "Paris"}'
    assert end.finish_reason == "tool_calls" and end.tool_calls[0].name == "get_weather"


def test_a_call_written_while_thinking_is_not_a_call():
    fmt = ReplyFormat(QWEN3, True, HERMES, TOOLS)
    delta, end = run(fmt, [f"<think>maybe {CALL}</think>It is sunny."])
    assert CALL in delta.reasoning and delta.content == "It is sunny."
    assert end == ReplyEnd("stop")


def test_include_reasoning_false_drops_it():
    delta, end = run(ReplyFormat(QWEN3, include_reasoning=False), ["<think>hmm</think>Paris."])
    assert (delta.reasoning, delta.content, end.finish_reason) == ("", "Paris.", "stop")


def test_cut_off_while_thinking_is_reasoning_with_length():
    delta, end = run(ReplyFormat(QWEN3), ["<think>Still going </thi"], reason="length")
    assert (delta.reasoning, delta.content, end.finish_reason) == ("Still going", "", "length")


def test_malformed_call_is_an_error_and_ends_the_parse():
    fmt = ReplyFormat(None, True, HERMES, TOOLS)
    parser = ReplyParser(fmt)
    first = parser.push("<tool_call>\n{'name': oops}")
    assert first.error is not None
    assert parser.push(" more text") == ReplyDelta()
    assert parser.finish("stop") == (ReplyDelta(), ReplyEnd("error"))


def test_plain_format_passes_text_through():
    delta, end = run(ReplyFormat(), ["<think>", "a", CALL])
    assert delta.content == "<think>a" + CALL and end == ReplyEnd("stop")


def test_prompt_that_opens_the_block_starts_in_reasoning():
    prompt = "<|im_start|>assistant\n<think>\n"
    delta, _ = run(ReplyFormat(QWEN3), ["Thinking here</think>Answer"], prompt=prompt)
    assert (delta.reasoning, delta.content) == ("Thinking here", "Answer")
