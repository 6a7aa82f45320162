"""One reply's output parsing: reasoning first, then tool calls in what is left.

A `ReplyParser` chains the two parsers a request asked for (either may be absent): the
reasoning parser splits the reply into reasoning and content, and the tool-call parser reads
calls out of that content only (a call written while thinking is not a call). `push` takes
each new piece of text, `finish` the end of the reply, and both return a `ReplyDelta`.
`finish` also settles the finish reason: "tool_calls" when complete calls ended normally.
Invariants: the concatenated deltas equal the non-streamed result; after malformed tool
output (`error`) nothing more is produced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pypto_serving.parsers.reasoning import ReasoningDelta, ReasoningFormat, ReasoningParser
from pypto_serving.parsers.tool_calls import (
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallError,
    ToolEvent,
    ToolParser,
)


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    """How to parse one request's reply. `tool_parser` None: tool calls are not parsed (no
    tools, or tool_choice none); `tool_names` are the declared tools."""

    reasoning: ReasoningFormat | None = None
    include_reasoning: bool = True
    tool_parser: Callable[..., ToolParser] | None = None
    tool_names: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True


class ReplyDelta(msgspec.Struct, frozen=True):
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    error: str | None = None  # the model's tool-call output is malformed


@dataclass(frozen=True, slots=True)
class ReplyEnd:
    """How the reply ended once parsed: its finish reason and the complete calls."""

    finish_reason: str
    tool_calls: tuple[ToolCall, ...] = ()
    cut_call: str = ""  # the text of a call max_tokens cut off (tool_calls.ToolOutcome)


class ReplyParser:
    def __init__(self, fmt: ReplyFormat, prompt: str = ""):
        self._fmt = fmt
        self._reasoning: ReasoningParser | None = fmt.reasoning(prompt) if fmt.reasoning else None
        self._tools: ToolParser | None = None
        if fmt.tool_parser is not None:
            self._tools = fmt.tool_parser(set(fmt.tool_names), fmt.parallel_tool_calls)
        self.error: str | None = None

    def push(self, text: str) -> ReplyDelta:
        if not text or self.error is not None:
            return ReplyDelta()
        split = self._reasoning.push(text) if self._reasoning else ReasoningDelta(content=text)
        events = self._tools.push(split.content) if self._tools and split.content else None
        return self._delta(split, events)

    def finish(self, finish_reason: str) -> tuple[ReplyDelta, ReplyEnd]:
        if self.error is not None:
            return ReplyDelta(), ReplyEnd("error")
        split = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        if self._tools is None:
            return self._delta(split, None), ReplyEnd(finish_reason)
        events = self._tools.push(split.content) if split.content else []
        tail, outcome = self._tools.finish(finish_reason)
        delta = self._delta(split, events + tail)
        if outcome.error is not None:
            return delta, ReplyEnd("error")
        return delta, ReplyEnd(outcome.finish_reason, outcome.calls, outcome.cut_call)

    def _delta(self, split: ReasoningDelta, events: list[ToolEvent] | None) -> ReplyDelta:
        reasoning = split.reasoning if self._fmt.include_reasoning else ""
        if events is None:
            return ReplyDelta(reasoning, split.content)
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = tuple(e for e in events if isinstance(e, ToolCallDelta))
        errors = [e.message for e in events if isinstance(e, ToolCallError)]
        if errors:
            self.error = errors[0]
        return ReplyDelta(reasoning, content, calls, self.error)
