"""The encoder process: a child that encodes big prompts, so the API process's GIL (and with
it every stream on its event loop) is never held for the seconds a megabyte takes.

`python -P -m pypto_serving.tokenizer.encoder_process` reads the pickled tokenizer, then
frames of (prompt, add_special_tokens, max_model_len) from stdin and answers each with one
frame on stdout: ("ok", (text, ids)), ("invalid", message) for bad input, or ("failed",
message). A frame is an 8-byte length and a pickle. One prompt at a time: big prompts are
rare, and a second one waits for the first rather than doubling the memory.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

from pypto_serving.tokenizer.chat_template import ChatTemplateError
from pypto_serving.tokenizer.encode import encode_prompt
from pypto_serving.tokenizer.tokenizer import Tokenizer

_LENGTH = struct.Struct("<Q")


class EncoderDied(RuntimeError):
    pass


class EncoderProcess:
    """The API side: started on first use, started again after a death."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def encode(self, prompt: Any, add_special_tokens: bool | None,
                     max_model_len: int | None) -> tuple[str, list[int]]:
        # shielded: a request that goes away mid-exchange must not leave its answer unread
        exchange = asyncio.ensure_future(self._exchange((prompt, add_special_tokens, max_model_len)))
        kind, value = await asyncio.shield(exchange)
        if kind == "invalid":
            raise ValueError(value)
        if kind == "failed":
            raise RuntimeError(value)
        return value

    async def _exchange(self, request: tuple) -> tuple[str, Any]:
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                await self._start()
            try:
                self._proc.stdin.write(_frame(request))
                await self._proc.stdin.drain()
                size = _LENGTH.unpack(await self._proc.stdout.readexactly(_LENGTH.size))[0]
                return pickle.loads(await self._proc.stdout.readexactly(size))
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                await self.stop()
                raise EncoderDied("the tokenizer process died while it encoded this prompt") from exc

    async def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "pypto_serving.tokenizer.encoder_process",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            limit=1 << 20)
        self._proc.stdin.write(_frame(self._tokenizer))
        await self._proc.stdin.drain()

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()


def _frame(value: object) -> bytes:
    data = pickle.dumps(value)
    return _LENGTH.pack(len(data)) + data


def _read(stream: BinaryIO) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return stream.read(_LENGTH.unpack(head)[0])


def _answer(tokenizer: Tokenizer, request: tuple) -> tuple[str, Any]:
    try:
        return "ok", encode_prompt(tokenizer, *request)
    except (ChatTemplateError, ValueError, TypeError) as exc:
        return "invalid", str(exc)
    except RecursionError:
        return "invalid", "the chat input is nested too deeply to render"
    except Exception as exc:  # the API process logs it as this request's failure
        return "failed", f"{type(exc).__name__}: {exc}"


def main() -> None:
    stdin = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the frames
    tokenizer = pickle.loads(_read(stdin))
    while (data := _read(stdin)) is not None:
        out.write(_frame(_answer(tokenizer, pickle.loads(data))))
        out.flush()


if __name__ == "__main__":
    main()
