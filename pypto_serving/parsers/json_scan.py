"""Finding where a JSON object ends in text that is still arriving, and reading a call object."""

from __future__ import annotations

import json


class JsonScan:
    """Walks text from `start`, a piece at a time, until the JSON object there closes.

    `end` is the index just past the object once it closed (-1 before); `bad` turns true at
    text no JSON object can hold there: a non-space before its `{`, or `<` outside a string
    (a closing tag arriving before the object closed). Brackets are only counted, so a
    closed object still has to parse.
    """

    __slots__ = ("start", "pos", "end", "bad", "_depth", "_in_string", "_escaped")

    def __init__(self, start: int = 0) -> None:
        self.start = self.pos = start
        self.end = -1
        self.bad = False
        self._depth = 0
        self._in_string = self._escaped = False

    def advance(self, text: str) -> None:
        while self.end < 0 and not self.bad and self.pos < len(text):
            self._see(text[self.pos])
            self.pos += 1

    def _see(self, c: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            else:
                self._escaped, self._in_string = c == "\\", c != '"'
        elif self._depth == 0:
            self._depth, self.bad = (1, False) if c == "{" else (0, not c.isspace())
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.end = self.pos + 1
        elif c == "<":
            self.bad = True


_CALL_KEYS = {"name", "arguments", "parameters"}


def read_call(text: str, bare: bool = False) -> tuple[str, dict]:
    """The name and arguments of a call object; ValueError saying what is wrong otherwise.

    Arguments come from "arguments" or "parameters", as an object or a JSON string of one,
    and are empty without either key. A `bare` object (no tags) must have arguments and no
    other keys, so that ordinary JSON, or a tool's definition echoed back, is not a call.
    """
    try:
        call = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the tool call is not valid JSON ({exc})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('the tool call is not a JSON object with a "name" string')
    key = next((k for k in ("arguments", "parameters") if k in call), None)
    if bare and (key is None or not call.keys() <= _CALL_KEYS):
        raise ValueError('the object is not {"name": …, "arguments": {…}}')
    return call["name"], _arguments(call.get(key, {}) if key else {})


def _arguments(value: object) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):  # some models encode the arguments object once more
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise ValueError("the tool call's arguments are not a JSON object")
    return value
