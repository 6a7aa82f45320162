"""TokenizerActor: chat template rendering and encoding, off the event loop.

Receives `Encode` (messages/tokenizer.py: text or chat input). Sends `Encoded` or `Rejected`
to `reply_to` (messages/request.py).
State owned: the tokenizer, a small thread pool for ordinary prompts and, started on first
use, the encoder process for big ones (tokenizer/encoder_process.py): the tokenizers library
and jinja2 hold the GIL while they work, so a megabyte prompt encoded in a thread would stall
every stream on the loop for seconds. A prompt whose characters alone prove it longer than
`--max-model-len` is refused before it is encoded at all (tokenizer/encode.py).
Invariants: every `Encode` is answered exactly once, whatever its input does to the
template or the tokenizer (a bug there is that request's 500, never a hang or engine death).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog

from pypto_serving.actors.base import Actor, FaultHandler, log_fault, unknown
from pypto_serving.core.request import ChatInput
from pypto_serving.messages.mailbox import Mailbox
from pypto_serving.messages.request import Encoded, Rejected
from pypto_serving.messages.tokenizer import Encode, TokenizerInbox
from pypto_serving.tokenizer.chat_template import ChatTemplateError
from pypto_serving.tokenizer.encode import PromptTooLong, encode_prompt, prompt_chars
from pypto_serving.tokenizer.encoder_process import EncoderBusy, EncoderProcess
from pypto_serving.tokenizer.tokenizer import Tokenizer

log = structlog.get_logger()
BIG_PROMPT_CHARS = 16 << 10  # above this a prompt is encoded in the encoder process


class TokenizerActor(Actor[TokenizerInbox]):
    def __init__(self, tokenizer: Tokenizer, threads: int = 2, on_fault: FaultHandler = log_fault,
                 max_model_len: int | None = None):
        super().__init__(on_fault)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")
        self.encoder = EncoderProcess(tokenizer)

    async def receive(self, msg: TokenizerInbox) -> None:
        match msg:
            case Encode(prompt, reply_to):
                # concurrent encodes: each waits for its pool on its own task
                asyncio.get_running_loop().create_task(self._encode(prompt, reply_to))
            case _:
                unknown(self, msg)

    async def _encode(self, prompt: str | ChatInput, reply_to: Mailbox) -> None:
        """Bad input is the request's `Rejected` (400); anything else is logged with its
        traceback and is the request's 500: the next request may well be fine."""
        try:
            text, ids = await self.encode(prompt)
        except PromptTooLong as exc:
            reply_to.tell(Rejected(str(exc), param="prompt"))
        except EncoderBusy as exc:
            reply_to.tell(Rejected(str(exc), 503))
        except (ChatTemplateError, ValueError, TypeError) as exc:
            reply_to.tell(Rejected(str(exc)))
        except RecursionError:
            reply_to.tell(Rejected("the chat input is nested too deeply to render"))
        except Exception as exc:
            log.error("cannot prepare the prompt", exc_info=exc)
            reply_to.tell(Rejected(f"the prompt could not be prepared: {type(exc).__name__}: {exc}", 500))
        else:
            reply_to.tell(Encoded(tuple(ids), text))

    async def encode(self, prompt: str | ChatInput, add_special_tokens: bool | None = None,
                     bounded: bool = True) -> tuple[str, list[int]]:
        """`encode_prompt` in the pool or the encoder process; also the edge's way in
        (/tokenize counts the tokens of any text: `bounded=False` skips the length proof)."""
        limit = self.max_model_len if bounded else None
        if prompt_chars(prompt) > BIG_PROMPT_CHARS:
            return await self.encoder.encode(prompt, add_special_tokens, limit)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, encode_prompt, self.tokenizer, prompt,
                                          add_special_tokens, limit)

    async def decode(self, ids: list[int]) -> str:
        """Token ids -> text (special tokens kept), in the pool (/detokenize)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.decode, ids, False)

    async def stop(self) -> None:
        await super().stop()
        await self.encoder.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
