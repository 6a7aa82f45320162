"""JSON shapes of responses and stream chunks (OpenAI-compatible)."""

from __future__ import annotations

import time
from typing import Any

from pypto_serving.requests import Finished


def http_finish_reason(reason: str) -> str:
    return "stop" if reason == "eos" else reason


def usage(done: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class Renderer:
    """Builds the bodies of one response; `chat` picks chat or text completion shapes."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def full(self, text: str, done: Finished) -> dict[str, Any]:
        reason = http_finish_reason(done.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
            return self._envelope("chat.completion", [choice], usage=usage(done))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope("text_completion", [choice], usage=usage(done))

    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              role: bool = False) -> dict[str, Any]:
        reason = None if finish_reason is None else http_finish_reason(finish_reason)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, done: Finished) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage(done))


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: int = 400) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}
