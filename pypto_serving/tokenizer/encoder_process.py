"""The encoder process: a child that encodes big prompts, so the API process's GIL (and with
it every stream on its event loop) is never held for the seconds a megabyte takes.

`python -P -m pypto_serving.tokenizer.encoder_process` reads the tokenizer once (a pickle:
it is an object graph of the tokenizers library, not a message), then `EncodeJob` frames
from stdin, answering each with one `EncodeAnswer` frame on stdout (msgpack; a frame is an
8-byte length and its bytes). One prompt at a time: big prompts are rare, and a second one
waits for the first rather than doubling the memory. A job that runs past `DEADLINE_S`
kills the child (the next job starts a new one); more than `MAX_WAITING` jobs waiting are
refused; a job whose requester went away while it waited is skipped.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import sys
from typing import BinaryIO

import msgspec

from pypto_serving.core.request import ChatInput
from pypto_serving.tokenizer.chat_template import ChatTemplateError
from pypto_serving.tokenizer.encode import PromptTooLong, encode_prompt
from pypto_serving.tokenizer.tokenizer import Tokenizer

_LENGTH = struct.Struct("<Q")
DEADLINE_S = 120.0  # no honest prompt under --max-request-bytes takes this long to encode
MAX_WAITING = 8


class EncodeJob(msgspec.Struct, frozen=True):
    prompt: str | ChatInput
    add_special_tokens: bool | None
    max_model_len: int | None


class EncodeAnswer(msgspec.Struct, frozen=True):
    kind: str  # ok | too_long | invalid (bad input) | failed
    text: str = ""
    ids: list[int] = []
    message: str = ""


class EncoderDied(RuntimeError):
    pass


class EncoderBusy(RuntimeError):
    """Too many big prompts wait for the encoder: the request gets 503."""


class EncoderProcess:
    """The API side: started on first use, started again after a death."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EncodeAnswer)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def encode(self, prompt: str | ChatInput, add_special_tokens: bool | None,
                     max_model_len: int | None) -> tuple[str, list[int]]:
        if self._waiting >= MAX_WAITING:
            raise EncoderBusy(f"{self._waiting} big prompts are already waiting to be encoded: "
                              "retry later")
        gone = asyncio.Event()  # the requester went away: skip the job if it has not started
        job = EncodeJob(prompt, add_special_tokens, max_model_len)
        # shielded: a request that goes away mid-exchange must not leave its answer unread
        exchange = asyncio.ensure_future(self._exchange(job, gone))
        try:
            answer = await asyncio.shield(exchange)
        except asyncio.CancelledError:
            gone.set()
            raise
        if answer.kind == "too_long":
            raise PromptTooLong(answer.message)
        if answer.kind == "invalid":
            raise ValueError(answer.message)
        if answer.kind == "failed":
            raise RuntimeError(answer.message)
        return answer.text, answer.ids

    async def _exchange(self, job: EncodeJob, gone: asyncio.Event) -> EncodeAnswer:
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            if self._closed:
                raise EncoderDied("the tokenizer is stopping")
            if gone.is_set():
                return EncodeAnswer("failed", message="the request went away")
            if self._proc is None or self._proc.returncode is not None:
                await self._start()
            try:
                return await asyncio.wait_for(self._ask(job), DEADLINE_S)
            except TimeoutError:
                await self._kill()
                raise EncoderDied(f"encoding this prompt took over {DEADLINE_S:g} s") from None
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                await self._kill()
                raise EncoderDied("the tokenizer process died while it encoded this prompt") from exc
        finally:
            self._lock.release()

    async def _ask(self, job: EncodeJob) -> EncodeAnswer:
        self._proc.stdin.write(_frame(self._encoder.encode(job)))
        await self._proc.stdin.drain()
        size = _LENGTH.unpack(await self._proc.stdout.readexactly(_LENGTH.size))[0]
        return self._decoder.decode(await self._proc.stdout.readexactly(size))

    async def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "pypto_serving.tokenizer.encoder_process",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        self._proc.stdin.write(_frame(pickle.dumps(self._tokenizer)))
        await self._proc.stdin.drain()

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def stop(self) -> None:
        """For good: the running job (if any) is cut off, waiting ones end with EncoderDied."""
        self._closed = True
        await self._kill()


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _read(stream: BinaryIO) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return stream.read(_LENGTH.unpack(head)[0])


def _answer(tokenizer: Tokenizer, job: EncodeJob) -> EncodeAnswer:
    try:
        text, ids = encode_prompt(tokenizer, job.prompt, job.add_special_tokens, job.max_model_len)
    except PromptTooLong as exc:
        return EncodeAnswer("too_long", message=str(exc))
    except (ChatTemplateError, ValueError, TypeError) as exc:
        return EncodeAnswer("invalid", message=str(exc))
    except RecursionError:
        return EncodeAnswer("invalid", message="the chat input is nested too deeply to render")
    except Exception as exc:  # the API process logs it as this request's failure
        return EncodeAnswer("failed", message=f"{type(exc).__name__}: {exc}")
    return EncodeAnswer("ok", text, ids)


def main() -> None:
    stdin = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the frames
    tokenizer = pickle.loads(_read(stdin))
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EncodeJob)
    while (data := _read(stdin)) is not None:
        out.write(_frame(encoder.encode(_answer(tokenizer, decoder.decode(data)))))
        out.flush()


if __name__ == "__main__":
    main()
