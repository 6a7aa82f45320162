"""From the engine's typed events to the response Structs of responses.py.

A `Choice` collects one choice's events for a non-streaming response; a `Renderer` builds
the bodies and chunks of one request (chat or text completion shapes, n choices).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pypto_serving.core.request import TIMEOUT, Candidate, Finished, TextDelta, TokenLogprob
from pypto_serving.http import responses as r
from pypto_serving.parsers.tool_calls import ToolCall, ToolCallDelta


def json_response(body: object, status: int = 200) -> web.Response:
    """`body`: plain JSON values or response Structs."""
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def http_finish_reason(reason: str) -> str:
    return "stop" if reason == "eos" else reason


def usage(dones: Sequence[Finished]) -> r.Usage:
    """n choices share one prompt: it counts once; their completions add up."""
    prompt, completion = dones[0].prompt_tokens, sum(d.completion_tokens for d in dones)
    return r.Usage(prompt, completion, prompt + completion,
                   r.PromptTokensDetails(dones[0].cached_tokens))


@dataclass(slots=True)
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: Finished | None = None

    def add(self, delta: TextDelta) -> None:
        self.text.append(delta.text)
        self.reasoning.append(delta.reasoning)
        self.logprobs.extend(delta.logprobs)


def _top(c: Candidate) -> r.TopLogprob:
    return r.TopLogprob(c.text, c.logprob, list(c.utf8))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> r.ChatLogprobs:
    return r.ChatLogprobs([
        r.ChatTokenLogprob(e.chosen.text, e.chosen.logprob, list(e.chosen.utf8),
                           [_top(c) for c in e.top])
        for e in entries
    ])


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> r.CompletionLogprobs:
    """`offset`: characters of this choice's text before these tokens (earlier chunks)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.chosen.text)
    tops = [{c.text: c.logprob for c in (*e.top, e.chosen)} for e in entries]
    return r.CompletionLogprobs([e.chosen.text for e in entries],
                                [e.chosen.logprob for e in entries], tops, offsets)


class Renderer:
    """Builds the bodies of one response. `logprobs`: None when the request asked for none;
    `running_usage`: every streamed chunk carries its choice's usage so far
    (`stream_options.continuous_usage_stats`, as vLLM)."""

    def __init__(self, request_id: str, model: str, chat: bool, logprobs: int | None = None,
                 running_usage: bool = False):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.running_usage = running_usage
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # streamed completions: text_offset per choice
        self._prompt_tokens = 0
        self._generated: dict[int, int] = {}  # streamed: tokens generated so far per choice

    def started(self, prompt_tokens: int) -> None:
        self._prompt_tokens = prompt_tokens

    def generated(self, index: int, tokens: int) -> None:
        """`tokens` more tokens of choice `index` came (whether or not their text is out)."""
        self._generated[index] = self._generated.get(index, 0) + tokens

    def _running(self, index: int) -> r.Usage | None:
        if not self.running_usage:
            return None
        done = self._generated.get(index, 0)
        return r.Usage(self._prompt_tokens, done, self._prompt_tokens + done)

    def _head(self) -> dict[str, Any]:
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def full(self, choices: Sequence[Choice]) -> r.ChatResponse | r.CompletionResponse:
        total = usage([c.done for c in choices])
        if self.chat:
            return r.ChatResponse(object="chat.completion", usage=total, **self._head(),
                                  choices=[self._chat_choice(i, c) for i, c in enumerate(choices)])
        return r.CompletionResponse(object="text_completion", usage=total, **self._head(),
                                    choices=[self._text_choice(i, c) for i, c in enumerate(choices)])

    def _chat_choice(self, index: int, c: Choice) -> r.ChatChoice:
        text, calls = "".join(c.text), c.done.tool_calls
        # With tool calls, no text before them is null content (OpenAI's shape).
        content = (text or None) if calls else text
        message = r.AssistantMessage("assistant", content, "".join(c.reasoning) or None,
                                     [_tool_call(call) for call in calls] or None)
        return r.ChatChoice(index, message, self._chat_logprobs(c.logprobs),
                            http_finish_reason(c.done.finish_reason))

    def _text_choice(self, index: int, c: Choice) -> r.CompletionChoice:
        return r.CompletionChoice(index, "".join(c.text), self._completion_logprobs(c.logprobs, 0),
                                  http_finish_reason(c.done.finish_reason))

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> r.ChatLogprobs | None:
        return None if self.logprobs is None else chat_logprobs(entries)

    def _completion_logprobs(self, entries: Sequence[TokenLogprob],
                             offset: int) -> r.CompletionLogprobs | None:
        return None if self.logprobs is None else completion_logprobs(entries, offset)

    def role_chunk(self, index: int) -> r.ChatChunk:
        """The first chunk of each chat choice: it carries the role, once."""
        choice = r.ChatChunkChoice(index, r.Delta("assistant", ""), None, None)
        return r.ChatChunk(object="chat.completion.chunk", choices=[choice], usage=self._running(index),
                           **self._head())

    def chunk(self, index: int, text: str = "", reasoning: str = "",
              logprobs: Sequence[TokenLogprob] = (), finish_reason: str | None = None,
              tool_calls: Sequence[ToolCallDelta] = ()) -> r.ChatChunk | r.CompletionResponse:
        reason = None if finish_reason is None else http_finish_reason(finish_reason)
        if self.chat:
            delta = r.Delta(content=text or None, reasoning=reasoning or None,
                            tool_calls=_tool_call_chunks(tool_calls) or None)
            lp = self._chat_logprobs(logprobs) if logprobs else None
            choice = r.ChatChunkChoice(index, delta, lp, reason)
            return r.ChatChunk(object="chat.completion.chunk", choices=[choice], usage=self._running(index),
                               **self._head())
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(e.chosen.text) for e in logprobs)
        lp = self._completion_logprobs(logprobs, offset) if logprobs else None
        choice = r.CompletionChoice(index, text, lp, reason)
        return r.CompletionResponse(object="text_completion", choices=[choice], usage=self._running(index),
                                    **self._head())

    def usage_chunk(self, dones: Sequence[Finished]) -> r.ChatChunk | r.CompletionResponse:
        if self.chat:
            return r.ChatChunk(object="chat.completion.chunk", choices=[], usage=usage(dones),
                               **self._head())
        return r.CompletionResponse(object="text_completion", choices=[], usage=usage(dones),
                                    **self._head())


def _tool_call(call: ToolCall) -> r.ToolCallOut:
    return r.ToolCallOut(call.id, "function", r.FunctionCallOut(call.name, call.arguments))


def _tool_call_chunks(deltas: Sequence[ToolCallDelta]) -> list[r.ToolCallChunk]:
    """One entry per call in a chunk: a call's fragments that arrived together are joined."""
    out: list[r.ToolCallChunk] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1].function
            last.arguments = (last.arguments or "") + d.arguments
        elif d.id is not None:
            out.append(r.ToolCallChunk(d.index, d.id, "function", r.FunctionDelta(d.name, d.arguments)))
        else:
            out.append(r.ToolCallChunk(d.index, function=r.FunctionDelta(arguments=d.arguments)))
    return out


def stream_error(message: str, kind: str, code: int = 400) -> r.StreamErrorEvent:
    return r.StreamErrorEvent(r.StreamError(message, kind, code))


def engine_error(done: Finished) -> tuple[str, int]:
    """The error type and HTTP status of a finish with `error`: 504 when it timed out."""
    return ("timeout", 504) if done.error_type == TIMEOUT else ("engine_error", 500)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: int = 400) -> dict[str, Any]:
    return msgspec.to_builtins(r.ErrorResponse("error", message, kind, param, code))
