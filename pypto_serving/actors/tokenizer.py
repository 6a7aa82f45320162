"""TokenizerActor: chat template rendering and encoding, off the event loop thread.

Receives `Encode` (messages/tokenizer.py: text or chat input). Sends `Encoded` or `Rejected`
to `reply_to` (messages/request.py).
State owned: the tokenizer and a small thread pool (the tokenizers library and jinja2
rendering run there, so a long prompt never stalls the loop).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pypto_serving.actors.base import Actor, FaultHandler, log_fault, unknown
from pypto_serving.core.request import ChatInput
from pypto_serving.messages.mailbox import Mailbox
from pypto_serving.messages.request import Encoded, Rejected
from pypto_serving.messages.tokenizer import Encode, TokenizerInbox
from pypto_serving.tokenizer.chat_template import ChatTemplateError
from pypto_serving.tokenizer.tokenizer import Tokenizer


class TokenizerActor(Actor[TokenizerInbox]):
    def __init__(self, tokenizer: Tokenizer, threads: int = 2, on_fault: FaultHandler = log_fault):
        super().__init__(on_fault)
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")

    async def receive(self, msg: TokenizerInbox) -> None:
        match msg:
            case Encode(prompt, reply_to):
                # concurrent encodes: each waits for the pool on its own task
                asyncio.get_running_loop().create_task(self._encode(prompt, reply_to))
            case _:
                unknown(self, msg)

    async def _encode(self, prompt: str | ChatInput, reply_to: Mailbox) -> None:
        """Bad input is the request's `Rejected`; anything else is a fault, as it would be
        in `receive` (this task is outside the actor's loop, so it says so itself)."""
        try:
            text, ids = await self.encode(prompt)
        except (ChatTemplateError, ValueError, TypeError) as exc:
            reply_to.tell(Rejected(str(exc)))
        except RecursionError:
            reply_to.tell(Rejected("the chat input is nested too deeply to render"))
        except Exception as exc:
            self.on_fault(self, Encode(prompt, reply_to), exc)
        else:
            reply_to.tell(Encoded(tuple(ids), text))

    async def encode(self, prompt: str | ChatInput,
                     add_special_tokens: bool | None = None) -> tuple[str, list[int]]:
        """`encode_now` in the pool; also the edge's way in (/tokenize)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.encode_now, prompt, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        """Token ids -> text (special tokens kept), in the pool (/detokenize)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.decode, ids, False)

    def encode_now(self, prompt: str | ChatInput,
                   add_special_tokens: bool | None = None) -> tuple[str, list[int]]:
        """(the text the model reads, its token ids); special tokens by default for a prompt,
        not for a chat (the template already wrote any BOS it wants)."""
        if isinstance(prompt, str):
            special = True if add_special_tokens is None else add_special_tokens
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=special)
        text = self.tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=prompt.add_generation_prompt,
            tools=list(prompt.tools) if prompt.tools else None, **prompt.template_kwargs)
        return text, self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
