"""The encoder process: big prompts encode there exactly as in-process; bad input, a prompt
too long, a child killed mid-prompt, a prompt past the deadline, too many waiting and a
stopped encoder each end that one call with a clear error, and the next call works."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pypto_serving.core.request import ChatInput
from pypto_serving.tokenizer import encoder_process
from pypto_serving.tokenizer.encode import PromptTooLong, encode_prompt
from pypto_serving.tokenizer.encoder_process import EncoderBusy, EncoderDied, EncoderProcess

BIG = "the quick brown fox jumps over the lazy dog. " * 2000


async def test_big_prompts_encode_as_in_process(smollm2_tokenizer) -> None:
    encoder = EncoderProcess(smollm2_tokenizer)
    try:
        chat = ChatInput(({"role": "user", "content": BIG},))
        for prompt, special in ((BIG, None), (BIG, False), (chat, None)):
            assert await encoder.encode(prompt, special, None) == \
                tuple(encode_prompt(smollm2_tokenizer, prompt, special, None))
        with pytest.raises(PromptTooLong, match="--max-model-len is 100"):
            await encoder.encode(BIG, None, 100)
        bad = ChatInput(({"role": "user", "content": BIG},), template_kwargs={"messages": 1})
        with pytest.raises((ValueError, TypeError)):
            await encoder.encode(bad, None, None)
    finally:
        await encoder.stop()


async def test_a_child_killed_mid_prompt_fails_that_call_only(smollm2_tokenizer) -> None:
    encoder = EncoderProcess(smollm2_tokenizer)
    try:
        await encoder.encode("warm up " * 3000, None, None)
        first = encoder.pid
        call = asyncio.ensure_future(encoder.encode(BIG * 20, None, None))
        await asyncio.sleep(0.05)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EncoderDied, match="died"):
            await call
        text, ids = await encoder.encode(BIG, None, None)
        assert ids and encoder.pid != first
    finally:
        await encoder.stop()


async def test_the_deadline_kills_a_slow_encode(smollm2_tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(encoder_process, "DEADLINE_S", 0.05)
    encoder = EncoderProcess(smollm2_tokenizer)
    try:
        await encoder._start()
        with pytest.raises(EncoderDied, match="took over 0.05 s"):
            await encoder.encode(BIG * 40, None, None)
        assert encoder.pid is None  # killed: the next call starts a new child
    finally:
        await encoder.stop()


async def test_too_many_waiting_are_refused_and_a_stopped_encoder_refuses(smollm2_tokenizer,
                                                                        monkeypatch) -> None:
    monkeypatch.setattr(encoder_process, "MAX_WAITING", 1)
    encoder = EncoderProcess(smollm2_tokenizer)
    running = asyncio.ensure_future(encoder.encode(BIG * 10, None, None))
    waiting = asyncio.ensure_future(encoder.encode(BIG, None, None))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    with pytest.raises(EncoderBusy, match="retry later"):
        await encoder.encode(BIG, None, None)
    assert (await running)[1] and (await waiting)[1]
    await encoder.stop()
    with pytest.raises(EncoderDied, match="stopping"):
        await encoder.encode(BIG, None, None)
