"""Splitting a reply into reasoning and content where the model thinks in `<think>…</think>`.

A `ThinkParser` receives one reply's text piece by piece (`push`) and once at the end
(`finish`); each returns a `ReasoningDelta` with the new reasoning and content text.
Non-streaming is `push(all)` then `finish()`, so both modes give the same result.
State: where the reply is (before, inside or after the thinking block) and the held-back
end of the text. Invariants: only one thinking block, and only at the start of the reply
(Qwen3 writes `<think>` first; DeepSeek-R1 and thinking Qwen3 templates open it in the
prompt, so the reply starts inside it); no part of a tag ever reaches either field; the
whitespace that pads the tags is dropped; a reply cut off inside the block is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pypto_serving.parsers._text import partial_tag_len, safe_end


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningParser(Protocol):
    def push(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


class ThinkParser:
    """One reply's reasoning parser; see the module docstring."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False):
        self._start, self._end = start, end
        self._state = "opened" if starts_in_reasoning else "lead"
        self._buf = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def push(self, text: str) -> ReasoningDelta:
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> ReasoningDelta:
        """Flushes what was held back; a tag cut off at the end of the reply is dropped."""
        if self._state == "think":
            thought = self._buf[: len(self._buf) - partial_tag_len(self._buf, self._end)]
            self._reasoning.append(thought.rstrip())
        elif self._state == "lead":
            self._content.append(self._buf[: len(self._buf) - partial_tag_len(self._buf, self._start)])
        # The other states hold only padding or a partial opening tag; "content" holds nothing.
        self._buf = ""
        return self._take()

    def _step(self) -> bool:
        """Moves the held text on as far as it can; True when there is more to do."""
        match self._state:
            case "lead" | "opened":
                return self._lead()
            case "think_lead":
                return self._skip_space("think")
            case "think":
                return self._think()
            case "content_lead":
                return self._skip_space("content")
            case "content":
                self._content.append(self._buf)
                self._buf = ""
                return False
        raise AssertionError(f"unknown state {self._state!r}")

    def _lead(self) -> bool:
        text = self._buf.lstrip()
        if text.startswith(self._start):
            self._buf, self._state = text[len(self._start):], "think_lead"
            return True
        if self._start.startswith(text):  # nothing yet, or the opening tag arriving
            return False
        # Outside the block the leading text is content as written; inside, padding goes.
        self._state = "think_lead" if self._state == "opened" else "content"
        return True

    def _skip_space(self, then: str) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        self._state = then
        return True

    def _think(self) -> bool:
        i = self._buf.find(self._end)
        if i >= 0:
            self._reasoning.append(self._buf[:i].rstrip())
            self._buf, self._state = self._buf[i + len(self._end):], "content_lead"
            return True
        k = safe_end(self._buf, self._end)
        self._reasoning.append(self._buf[:k])
        self._buf = self._buf[k:]
        return False

    def _take(self) -> ReasoningDelta:
        delta = ReasoningDelta("".join(self._reasoning), "".join(self._content))
        self._reasoning.clear()
        self._content.clear()
        return delta


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one model family marks its thinking; calling it makes the parser for one reply."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # DeepSeek-R1's template opens the block itself, and the model may never write `<think>`.
    always_open: bool = False

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves the reply inside the thinking block."""
        return prompt.rstrip().endswith(self.start)

    def __call__(self, prompt: str = "") -> ThinkParser:
        return ThinkParser(self.start, self.end, self.always_open or self.opened_by(prompt))


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_open=True),
}
REASONING_PARSER_NAMES = ("none", *REASONING_FORMATS)
_FAMILY_DEFAULTS = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gemma3": "none"}  # Gemma 3: no thinking markup


def reasoning_parser_for(family: str, name: str | None = None) -> ReasoningFormat | None:
    """The format for `--reasoning-parser NAME`, or the family's default when NAME is None;
    None means the reply has no reasoning to separate."""
    chosen = _FAMILY_DEFAULTS.get(family, "none") if name is None else name
    if chosen not in REASONING_PARSER_NAMES:
        raise ValueError(f"--reasoning-parser: unknown parser {chosen!r}; "
                         f"choose one of {', '.join(REASONING_PARSER_NAMES)}")
    return REASONING_FORMATS.get(chosen)
