from __future__ import annotations

import pytest
from hypothesis import given, settings

from pypto_serving.parsers.reasoning import ReasoningDelta, ThinkParser, reasoning_parser_for
from tests.parsers.splits import every_split, random_cuts, split_at

TAG_PARTS = ("<think", "</think")

# (reply, starts inside the thinking block, reasoning, content)
REPLIES = [
    ("<think>\nThe user greets me; 2 < 3 and </b> are not tags.\n</think>\n\nHello! 1 < 2.", False,
     "The user greets me; 2 < 3 and </b> are not tags.", "Hello! 1 < 2."),
    ("Let me think.\n</think>\n\nThe answer is 4.", True, "Let me think.", "The answer is 4."),
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", True, "Let me think.", "The answer is 4."),
    ("  Just an answer,\nno thinking.\n", False, "", "  Just an answer,\nno thinking.\n"),
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("</think>Hi", True, "", "Hi"),
    ("<think>Line one.\n\nLine two.</think>Answer\n\nwith two lines.", False,
     "Line one.\n\nLine two.", "Answer\n\nwith two lines."),
]
CUT_OFF = [  # the reply ended inside the thinking block (finish reason length)
    ("<think>\nStill thinking about it", False, "Still thinking about it", ""),
    ("Still thinking about it\n</thi", True, "Still thinking about it", ""),
]


def parse(pieces: list[str], opened: bool) -> tuple[str, str]:
    parser = ThinkParser(starts_in_reasoning=opened)
    deltas = [parser.push(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        assert not any(part in delta.reasoning or part in delta.content for part in TAG_PARTS)
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("reply, opened, reasoning, content", REPLIES + CUT_OFF)
def test_every_split_point_gives_the_same_reasoning_and_content(reply, opened, reasoning, content):
    for pieces in every_split(reply):
        assert parse(pieces, opened) == (reasoning, content), pieces


@pytest.mark.parametrize("reply, opened, reasoning, content", REPLIES)
@settings(max_examples=30, deadline=None)
@given(cuts=random_cuts())
def test_random_splits_give_the_same_reasoning_and_content(reply, opened, reasoning, content, cuts):
    assert parse(split_at(reply, cuts), opened) == (reasoning, content)


def test_a_reply_cut_off_at_any_point_of_the_thinking_is_all_reasoning():
    reply = "<think>\nFirst a thought, then </b>.\n</think>"
    for end in range(len(reply)):
        reasoning, content = parse([reply[:end]], opened=False)
        assert content == "" and "First a thought, then </b>.".startswith(reasoning)


def test_reasoning_streams_as_it_arrives():
    parser = ThinkParser()
    assert parser.push("<think>\nI") == ReasoningDelta("I")
    assert parser.push(" think </") == ReasoningDelta(" think")
    assert parser.push("think>\n\nDone") == ReasoningDelta("", "Done")
    assert parser.finish() == ReasoningDelta()


def test_qwen3_opens_the_block_only_when_the_prompt_does():
    qwen3 = reasoning_parser_for("qwen3")
    thinking = "<|im_start|>assistant\n<think>\n"
    not_thinking = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert parse_with(qwen3(thinking), "Hmm.\n</think>\n\nYes.") == ("Hmm.", "Yes.")
    assert parse_with(qwen3(not_thinking), "Yes.") == ("", "Yes.")
    assert parse_with(qwen3(""), "<think>Hmm.</think>Yes.") == ("Hmm.", "Yes.")


def test_deepseek_r1_starts_inside_the_block_whatever_the_prompt():
    assert parse_with(reasoning_parser_for("llama", "deepseek_r1")(), "Hmm.</think>Yes.") == ("Hmm.", "Yes.")


def parse_with(parser: ThinkParser, reply: str) -> tuple[str, str]:
    deltas = [parser.push(reply), parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def test_parser_selection_by_family_and_name():
    assert reasoning_parser_for("qwen3").name == "qwen3"
    assert reasoning_parser_for("qwen2") is None and reasoning_parser_for("llama") is None
    assert reasoning_parser_for("gemma3") is None
    assert reasoning_parser_for("qwen3", "none") is None
    assert reasoning_parser_for("qwen2", "qwen3").name == "qwen3"
    with pytest.raises(ValueError, match="--reasoning-parser.*'r2'.*deepseek_r1"):
        reasoning_parser_for("qwen3", "r2")
