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

from pypto_serving.core.request import (
    TIMEOUT,
    Candidate,
    Echo,
    Finished,
    PromptLogprob,
    TextDelta,
    TokenLogprob,
)
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
    echo: Echo | None = None
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


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0,
                        prompt: Sequence[PromptLogprob] = (), k: int = 0) -> r.CompletionLogprobs:
    """`offset`: characters of this choice's text before these tokens (earlier chunks);
    `prompt`: the echoed prompt's tokens, first (with their top `k`)."""
    rows = [(p.text, p.logprob, None if p.logprob is None else
             {c.text: c.logprob for c in p.top[:k]} | {p.text: p.logprob}) for p in prompt]
    rows += [(e.chosen.text, e.chosen.logprob, {c.text: c.logprob for c in (*e.top, e.chosen)})
             for e in entries]
    offsets = []
    for text, _, _ in rows:
        offsets.append(offset)
        offset += len(text)
    return r.CompletionLogprobs([t for t, _, _ in rows], [lp for _, lp, _ in rows],
                                [top for _, _, top in rows], offsets)


def vllm_prompt_logprobs(entries: Sequence[PromptLogprob], k: int) -> r.PromptLogprobsOut:
    """vLLM's `prompt_logprobs`: per token, its own entry and the top `k`'s, by token id."""
    out: r.PromptLogprobsOut = []
    for p in entries:
        if p.logprob is None:
            out.append(None)
            continue
        top = {c.token_id: r.PromptTokenLogprob(c.logprob, rank, c.text)
               for rank, c in enumerate(p.top[:k], 1)}
        out.append(top | {p.token_id: r.PromptTokenLogprob(p.logprob, p.rank, p.text)})
    return out


class Renderer:
    """Builds the bodies of one response. `logprobs`: None when the request asked for none;
    `running_usage`: every streamed chunk carries its choice's usage so far
    (`stream_options.continuous_usage_stats`, as vLLM); `echo`: a completion's text (and
    logprobs) start with the prompt's; `prompt_logprobs`: vLLM's field of that name, with
    the top k."""

    def __init__(self, request_id: str, model: str, chat: bool, logprobs: int | None = None,
                 running_usage: bool = False, echo: bool = False, prompt_logprobs: int | None = None):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.running_usage = running_usage
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
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
                                  choices=[self._chat_choice(i, c) for i, c in enumerate(choices)],
                                  prompt_logprobs=self._vllm_prompt_logprobs(choices[0]))
        return r.CompletionResponse(object="text_completion", usage=total, **self._head(),
                                    choices=[self._text_choice(i, c) for i, c in enumerate(choices)])

    def _chat_choice(self, index: int, c: Choice) -> r.ChatChoice:
        # a call cut off by max_tokens is no call: its text is content (streamed, it went out
        # as tool-call deltas before the cut was known)
        text, calls = "".join(c.text) + c.done.cut_call, c.done.tool_calls
        # With tool calls, no text before them is null content (OpenAI's shape).
        content = (text or None) if calls else text
        message = r.AssistantMessage("assistant", content, "".join(c.reasoning) or None,
                                     [_tool_call(call) for call in calls] or None)
        return r.ChatChoice(index, message, self._chat_logprobs(c.logprobs),
                            http_finish_reason(c.done.finish_reason))

    def _text_choice(self, index: int, c: Choice) -> r.CompletionChoice:
        echoed = c.echo if self.echo and c.echo is not None else Echo("")
        return r.CompletionChoice(index, echoed.text + "".join(c.text),
                                  self._completion_logprobs(c.logprobs, 0, echoed.logprobs),
                                  http_finish_reason(c.done.finish_reason), self._vllm_prompt_logprobs(c))

    def _vllm_prompt_logprobs(self, c: Choice) -> r.PromptLogprobsOut | None:
        if self.prompt_logprobs is None or c.echo is None:
            return None
        return vllm_prompt_logprobs(c.echo.logprobs, self.prompt_logprobs)

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> r.ChatLogprobs | None:
        return None if self.logprobs is None else chat_logprobs(entries)

    def _completion_logprobs(self, entries: Sequence[TokenLogprob], offset: int,
                             prompt: Sequence[PromptLogprob] = ()) -> r.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(entries, offset, prompt, self.logprobs)

    def echo_chunk(self, index: int, echo: Echo) -> r.CompletionResponse | None:
        """A streamed completion's first chunk with `echo`: the prompt (and its logprobs)."""
        if self.chat or not self.echo:
            return None
        self._offsets[index] = sum(len(p.text) for p in echo.logprobs)
        choice = r.CompletionChoice(index, echo.text, self._completion_logprobs((), 0, echo.logprobs), None)
        return r.CompletionResponse(object="text_completion", choices=[choice], usage=self._running(index),
                                    **self._head())

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
