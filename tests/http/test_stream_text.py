"""The text a request streams, as http/ receives it from the RequestStream: incremental
detokenization and stop-string hold-back together, on random texts, random stop strings
and random splits of the tokens into scheduler messages (the real SmolLM2 tokenizer).

tests/tokenizer checks each piece alone; this checks what a client sees: the streamed text
equals the one-shot decode cut before the earliest stop, and no prefix of it ever shows a
stop string or a broken character.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pypto_serving.actors.request import RequestLimits, RequestStream
from pypto_serving.core.request import Finished, GenerateRequest, TextDelta
from pypto_serving.messages.request import Tokens
from pypto_serving.messages.scheduler import Abort
from pypto_serving.tokenizer.tokenizer import Tokenizer
from tests.http.fakes import Letters, Recorder

PIECES = ["a", " b", "ab", " ", "\n", "Paris", " café", "🦩", "你好", "e\u0301", "!", "5,"]


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@st.composite
def cases(draw: st.DrawFn, tok: Tokenizer) -> tuple[list[list[int]], list[str]]:
    """(generated ids split into scheduler messages, stop strings)."""
    text = "".join(draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=12)))
    ids = tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids)
    stops = draw(st.lists(st.text(alphabet=sorted(set(decoded)), min_size=1, max_size=3), max_size=2))
    if draw(st.booleans()):  # a stop that surely occurs, often inside one token
        start = draw(st.integers(0, len(decoded) - 1))
        stops.append(decoded[start:start + draw(st.integers(1, 4))])
    cuts = sorted(set(draw(st.lists(st.integers(1, len(ids)), max_size=len(ids)))) | {len(ids)})
    return [ids[a:b] for a, b in zip([0, *cuts], cuts, strict=False) if b > a], stops


async def stream(tok: Tokenizer, chunks: list[list[int]], stops: list[str]) -> tuple[list[str], str, list]:
    scheduler = Recorder()
    total = sum(len(c) for c in chunks)
    request = GenerateRequest("x", (1, 2), total, stop=tuple(stops))
    events = RequestStream(request, 0, tok, None, scheduler, RequestLimits(4096, 16)).events()
    await anext(events)  # Started: the sequence was submitted
    actor = scheduler.messages[0].reply_to
    for i, chunk in enumerate(chunks):
        actor.tell(Tokens(0, tuple(chunk), "length" if i == len(chunks) - 1 else None))
    texts, reason = [], ""
    async for event in events:
        match event:
            case TextDelta(text):
                texts.append(text)
            case Finished(finish_reason):
                reason = finish_reason
    return texts, reason, scheduler.of(Abort)


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[:min(hits)], True) if hits else (text, False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_is_the_decode_cut_at_the_first_stop(smollm2: Tokenizer, data: st.DataObject):
    chunks, stops = data.draw(cases(smollm2))
    texts, reason, aborts = asyncio.run(stream(smollm2, chunks, stops))
    want, stopped = cut(smollm2.decode([i for c in chunks for i in c]), stops)
    assert "".join(texts) == want
    assert reason == ("stop" if stopped else "length")
    shown = ""
    for text in texts:  # at no moment does a client see a stop string or a broken character
        shown += text
        assert not any(s in shown for s in stops) and "\ufffd" not in shown
    assert len(aborts) <= 1


def test_a_match_held_until_the_end_still_finishes_with_stop():
    # "b" matches, but "abb" could still start earlier; at the end the held "b" is the stop.
    scheduler = Recorder()
    request = GenerateRequest("x", (5,), 2, stop=("abb", "b"))
    events = RequestStream(request, 0, Letters(), None, scheduler, RequestLimits(64, 8)).events()

    async def run() -> list:
        await anext(events)
        scheduler.messages[0].reply_to.tell(Tokens(0, (0, 1), "length"))
        return [e async for e in events]

    delta, done = asyncio.run(run())
    assert (delta.text, done.finish_reason) == ("a", "stop")
