"""TokenizerActor: chat template rendering and encoding, off the event loop thread.

Receives `Encode` (text or chat input). Sends `Encoded` or `Rejected` to `reply_to`.
State owned: the tokenizer and a small thread pool (the tokenizers library and jinja2
rendering run there, so a long prompt never stalls the loop).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pypto_serving.actors.base import Actor, unknown
from pypto_serving.requests import ChatInput
from pypto_serving.tokenizer.chat_template import ChatTemplateError
from pypto_serving.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Encode:
    prompt: str | ChatInput
    reply_to: Actor


@dataclass(frozen=True, slots=True)
class Encoded:
    token_ids: tuple[int, ...]
    text: str  # the prompt as the model reads it (a chat prompt after its template)


@dataclass(frozen=True, slots=True)
class Rejected:
    message: str


class TokenizerActor(Actor):
    def __init__(self, tokenizer: Tokenizer, threads: int = 2):
        super().__init__()
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")

    async def receive(self, msg: object) -> None:
        match msg:
            case Encode(prompt, reply_to):
                # concurrent encodes: each waits for the pool on its own task
                asyncio.get_running_loop().create_task(self._encode(prompt, reply_to))
            case _:
                unknown(self, msg)

    async def _encode(self, prompt: str | ChatInput, reply_to: Actor) -> None:
        loop = asyncio.get_running_loop()
        try:
            text, ids = await loop.run_in_executor(self._pool, self.encode_now, prompt)
        except (ChatTemplateError, ValueError, TypeError) as exc:
            reply_to.tell(Rejected(str(exc)))
        else:
            reply_to.tell(Encoded(tuple(ids), text))

    def encode_now(self, prompt: str | ChatInput) -> tuple[str, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        text = self.tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=prompt.add_generation_prompt,
            tools=list(prompt.tools) if prompt.tools else None, **prompt.template_kwargs)
        # the template already wrote any BOS it wants
        return text, self.tokenizer.encode(text, add_special_tokens=False)
