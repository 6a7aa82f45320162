"""Hermes-style tool calls in a reply, parsed as the text streams in.

A `HermesToolParser` receives one reply's text piece by piece (`push`) and once at the end
(`finish`), and returns `ToolEvent`s: content text; call deltas, the first of each call
carrying its index, id and name and the later ones argument fragments whose concatenation is
exactly that call's final arguments string; at most one `ToolCallError` (malformed model
output). `finish` also returns the `ToolOutcome`. Non-streaming is `push(all)` then `finish`.
Two forms are calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2/2.5/3,
Hermes) and, when the declared tools are known, a bare JSON object naming one of them where
the reply, or the gap after a call, starts with `{` or with a Markdown code fence around it
(small Qwen2.5-Coder models write both).
State: where the reply is (text, inside a call, after one), the held-back text, the call
being read. Invariants: no part of a tag reaches content; a call counts only once its object
closed and parsed; after an error, or after the first call without parallel calls, the rest
of the reply is ignored; a call cut off by the length limit is dropped, not an error.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pypto_serving.parsers._text import partial_tag_len, safe_end
from pypto_serving.parsers.json_scan import JsonScan, read_call


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """The first delta of a call has `id` and `name` and empty `arguments`; later ones only a
    fragment of `arguments`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallError:
    message: str


ToolEvent = ContentDelta | ToolCallDelta | ToolCallError


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """`finish_reason` is "tool_calls" when complete calls ended normally; `error` is set when
    the model's output was malformed."""

    calls: tuple[ToolCall, ...]
    content: str | None
    finish_reason: str
    error: str | None = None
    cut_call: str = ""  # the text of a call that max_tokens cut off (streamed as deltas, no call)


class ToolParser(Protocol):
    def push(self, text: str) -> list[ToolEvent]: ...

    def finish(self, finish_reason: str) -> tuple[list[ToolEvent], ToolOutcome]: ...


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,')
_ARGUMENTS = re.compile(r'\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_NORMAL_ENDS = ("stop", "eos")
_FENCE = re.compile(r"```(?:json)?\n")
_FENCE_STARTS = ("```json\n", "```\n")


def _fenced(text: str) -> bool | None:
    """Whether `text` opens a Markdown code fence around a JSON object; None: too early to say."""
    m = _FENCE.match(text)
    if m is None:
        return None if any(start.startswith(text) for start in _FENCE_STARTS) else False
    rest = text[m.end():].lstrip()
    return rest[0] == "{" if rest else None


class _Call:
    """The call being read: its object's scan and, once named, its index, id and arguments."""

    def __init__(self, bare: bool) -> None:
        self.bare = bare
        self.object = JsonScan()
        self.arguments: JsonScan | None = None  # set when the arguments stream as written
        self.header_end = 0
        self.index: int | None = None
        self.id = self.name = ""
        self.sent = 0  # characters of arguments already sent


class HermesToolParser:
    """One reply's tool-call parser; see the module docstring. `tool_names` None accepts any
    name in tags and never takes bare JSON for a call."""

    def __init__(self, tool_names: set[str] | None = None, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id):
        self._names, self._parallel, self._new_id = tool_names, parallel, new_id
        self._state = "lead"
        self._buf = ""
        self._call: _Call | None = None
        self._fence = ""  # the code fence around the bare call being read
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._error: str | None = None
        self._out: list[ToolEvent] = []
        self._cut_call = ""

    def push(self, text: str) -> list[ToolEvent]:
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self, finish_reason: str) -> tuple[list[ToolEvent], ToolOutcome]:
        if self._state in ("lead", "between", "text"):
            cut = partial_tag_len(self._buf, _OPEN) if finish_reason == "length" else 0
            self._emit_content(self._buf[: len(self._buf) - cut])
        elif self._state == "call":
            self._unfinished_call(finish_reason == "length")
        self._buf, self._state = "", "done"
        calls = tuple(self._calls)
        if calls and finish_reason in _NORMAL_ENDS and self._error is None:
            finish_reason = "tool_calls"
        content = "".join(self._content) or None
        return self._take(), ToolOutcome(calls, content, finish_reason, self._error, self._cut_call)

    def _step(self) -> bool:
        """Moves the held text on as far as it can; True when there is more to do."""
        match self._state:
            case "lead" | "between":
                return self._lead()
            case "text":
                return self._text()
            case "call":
                return self._in_call(self._call)
            case "after":
                return self._after_call()
            case "done":
                self._buf = ""
                return False
        raise AssertionError(f"unknown state {self._state!r}")

    def _lead(self) -> bool:
        """At the start of the reply (whitespace kept) or after a call (whitespace dropped)."""
        text = self._buf.lstrip()
        if self._state == "between":
            self._buf = text
        if not text:
            return False
        fenced = _fenced(text) if self._names and text[0] == "`" else False
        if fenced is None:  # a code fence arriving: it may hold a call
            return False
        if fenced:
            cut = len(self._buf) - len(text) + _FENCE.match(text).end()  # leading space kept
            self._fence, self._buf = self._buf[:cut], self._buf[cut:]
            self._begin_call(bare=True)
        elif text[0] == "{" and self._names:
            self._begin_call(bare=True)
        else:
            self._state = "text"
        return True

    def _text(self) -> bool:
        i = self._buf.find(_OPEN)
        if i >= 0:
            self._emit_content(self._buf[:i].rstrip())
            self._buf = self._buf[i + len(_OPEN):]
            self._begin_call(bare=False)
            return True
        k = safe_end(self._buf, _OPEN)
        self._emit_content(self._buf[:k])
        self._buf = self._buf[k:]
        return False

    def _begin_call(self, bare: bool) -> None:
        self._call, self._state = _Call(bare), "call"

    def _in_call(self, call: _Call) -> bool:
        call.object.advance(self._buf)
        if call.object.bad:
            self._reject(call, "the tool call is not a JSON object")
            return True
        if call.index is None and not self._try_header(call):
            return True
        if call.index is not None:
            self._stream_arguments(call)
        if call.object.end < 0:
            return False
        self._close(call)
        return True

    def _try_header(self, call: _Call) -> bool:
        """Names the call as soon as its object starts with a name; False once it is rejected.
        A bare object commits only to the usual shape: a name, then its arguments."""
        m = _HEADER.match(self._buf)
        if m is None or (call.bare and not _ARGUMENTS.match(self._buf, m.end())):
            return True
        try:
            name = json.loads(m.group(1))
        except json.JSONDecodeError:
            if not call.bare:
                self._reject(call, "the tool call's name is not a valid JSON string")
            return call.bare
        call.header_end = m.end()
        return self._commit(call, name)

    def _commit(self, call: _Call, name: str) -> bool:
        if self._names is not None and name not in self._names:
            self._reject(call, f"the model called {name!r}, which is not a declared tool")
            return False
        call.index, call.id, call.name = len(self._calls), self._new_id(), name
        self._out.append(ToolCallDelta(call.index, "", call.id, name))
        return True

    def _stream_arguments(self, call: _Call) -> None:
        """Sends the arguments object as the model writes it, up to what has arrived."""
        if call.arguments is None:
            m = _ARGUMENTS.match(self._buf, call.header_end) if call.header_end else None
            if m is None:
                return
            call.arguments = JsonScan(m.end())
        call.arguments.advance(self._buf)
        stop = call.arguments.end if call.arguments.end >= 0 else call.arguments.pos
        self._emit_arguments(call, self._buf[call.arguments.start + call.sent: stop])

    def _close(self, call: _Call) -> None:
        text = self._buf[: call.object.end]
        try:
            name, arguments = read_call(text, bare=call.bare)
        except ValueError as exc:
            self._reject(call, str(exc))
            return
        if call.index is None and not self._commit(call, name):
            return
        scanned = call.arguments
        if scanned is not None and scanned.end >= 0:  # sent as written: keep it so
            final = self._buf[scanned.start: scanned.end]
        else:
            final = json.dumps(arguments, ensure_ascii=False)
        self._emit_arguments(call, final[call.sent:])
        self._calls.append(ToolCall(call.id, call.name, final))
        self._buf, self._call = self._buf[call.object.end:], None
        self._state = "after" if self._parallel else "done"

    def _after_call(self) -> bool:
        text = self._buf.lstrip()
        close = "```" if self._fence else _CLOSE
        if text.startswith(close):
            self._buf, self._state, self._fence = text[len(close):], "between", ""
            return True
        self._buf = text
        if close.startswith(text):  # nothing yet, or the closing tag arriving
            return False
        if not (self._fence and text.startswith("{")):  # another call in the same fence
            self._fence = ""
        self._state = "between"  # a missing closing tag is forgiven
        return True

    def _unfinished_call(self, cut_by_length: bool) -> None:
        call = self._call
        if call.bare and call.index is None:  # never turned out to be a call
            self._emit_content(self._fence + self._buf)
        elif not cut_by_length:
            self._reject(call, "the tool call ended before its JSON object closed")
        else:  # not a call; its text (all of it still held) is kept for a reply not streamed
            self._cut_call = (self._fence if call.bare else _OPEN) + self._buf

    def _reject(self, call: _Call, message: str) -> None:
        """A bare object that is not a call is content; a tagged one is an error."""
        if call.bare and call.index is None:
            self._call, self._state = None, "text"
            self._buf, self._fence = self._fence + self._buf, ""
        else:
            self._error, self._state = message, "done"
            self._out.append(ToolCallError(message))

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        self._content.append(text)
        last = self._out[-1] if self._out else None
        if isinstance(last, ContentDelta):
            self._out[-1] = ContentDelta(last.text + text)
        else:
            self._out.append(ContentDelta(text))

    def _emit_arguments(self, call: _Call, fragment: str) -> None:
        if fragment:
            call.sent += len(fragment)
            self._out.append(ToolCallDelta(call.index, fragment))

    def _take(self) -> list[ToolEvent]:
        out, self._out = self._out, []
        return out


TOOL_PARSERS: dict[str, Callable[..., ToolParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser}
TOOL_PARSER_NAMES = ("none", *TOOL_PARSERS)
# Gemma 3 has no tool-call format of its own
_FAMILY_DEFAULTS = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes", "gemma3": "none"}


def tool_parser_name(family: str, name: str | None = None) -> str:
    """`--tool-call-parser NAME`, or the family's default when NAME is None ("none": no parser)."""
    chosen = _FAMILY_DEFAULTS.get(family, "none") if name is None else name
    if chosen not in TOOL_PARSER_NAMES:
        raise ValueError(f"--tool-call-parser: unknown parser {chosen!r}; "
                         f"choose one of {', '.join(TOOL_PARSER_NAMES)}")
    return chosen


def tool_parser_for(family: str, name: str | None = None) -> Callable[..., ToolParser] | None:
    """The parser class `tool_parser_name` picks; None means the model has no tool-call
    parser, so tool requests are rejected."""
    return TOOL_PARSERS.get(tool_parser_name(family, name))
