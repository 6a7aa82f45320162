"""The text a request streams, as http/ receives it from the RequestStream: incremental
detokenization and stop-string hold-back together, on random texts, random stop strings
and random splits of the tokens into scheduler messages (the real SmolLM2 tokenizer).

tests/tokenizer checks each piece alone; this checks what a client sees: the streamed text
equals the one-shot decode cut before the earliest stop, and no prefix of it ever shows a
stop string or a broken character.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pypto_serving.actors.request import RequestLimits, RequestStream
from pypto_serving.core.request import Finished, GenerateRequest, TextDelta
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.request import Tokens
from pypto_serving.messages.scheduler import Abort
from pypto_serving.parsers.reply import ReplyFormat
from pypto_serving.parsers.tool_calls import HermesToolParser
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


def test_a_message_of_several_tokens_ends_at_the_token_that_completes_a_stop():
    """Tokens merged into one message (delivery under load, speculation) end where they would
    one to a message: the stop's token is the last one reported, with its logprob, and usage
    counts no token after it."""

    async def run(chunks: list[tuple[int, ...]]) -> tuple[list[TextDelta], Finished, int]:
        scheduler = Recorder()
        request = GenerateRequest("x", (5,), 8, stop=("b",), sampling=SamplingParams(logprobs=0))
        events = RequestStream(request, 0, Letters(), None, scheduler, RequestLimits(64, 8)).events()
        await anext(events)
        for chunk in chunks:
            scheduler.messages[0].reply_to.tell(Tokens(0, chunk, None, logprobs=(-0.5,) * len(chunk),
                                                       top_logprobs=((),) * len(chunk)))
        got = [e async for e in events]
        return got[:-1], got[-1], len(scheduler.of(Abort))

    one_by_one = asyncio.run(run([(0,), (1,), (2,), (3,)]))
    merged = asyncio.run(run([(0, 1, 2, 3)]))
    for deltas, done, aborts in (one_by_one, merged):
        assert "".join(d.text for d in deltas) == "a"
        assert [t for d in deltas for t in d.token_ids] == [0, 1]  # "b" is token 1: 2 and 3 never were
        assert sum(len(d.logprobs) for d in deltas) == 2
        assert (done.finish_reason, done.completion_tokens, aborts) == ("stop", 2, 1)
    assert len(merged[0]) == 1  # one delta for the tokens taken


class Chars:
    """A tokenizer stand-in over a fixed alphabet: token i is ALPHABET[i]."""

    ALPHABET = sorted(set('<tool_call>{"name": "f", "arguments": {"x": 12}}</tool_call>\\n ok'))
    vocab_size = len(ALPHABET) + 1
    bos_token_id = None
    eos_token_ids = frozenset({len(ALPHABET)})

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i] for i in ids if i < len(self.ALPHABET))

    def ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.ALPHABET.index(c) for c in text)


def test_a_call_in_one_message_streams_as_it_does_a_token_at_a_time():
    """A tool call's text in one message (merged tokens) gives the same call, and one delta
    whose argument fragments of the call are joined into one."""
    tok = Chars()
    reply = ReplyFormat(tool_parser=HermesToolParser, tool_names=frozenset({"f"}))
    ids = tok.ids('ok <tool_call>{"name": "f", "arguments": {"x": 12}}</tool_call>')

    async def run(chunks: list[tuple[int, ...]]) -> tuple[list[TextDelta], Finished]:
        scheduler = Recorder()
        request = GenerateRequest("x", (0,), len(ids), reply=reply)
        events = RequestStream(request, 0, tok, None, scheduler, RequestLimits(256, 64)).events()
        await anext(events)
        for i, chunk in enumerate(chunks):
            scheduler.messages[0].reply_to.tell(Tokens(0, chunk, "length" if i == len(chunks) - 1 else None))
        got = [e async for e in events]
        return got[:-1], got[-1]

    seen = []
    for chunks in ([ids[i:i + 1] for i in range(len(ids))], [ids]):
        deltas, done = asyncio.run(run(chunks))
        calls = [c for d in deltas for c in d.tool_calls]
        assert [c.name for c in calls if c.name] == ["f"]
        assert json.loads("".join(c.arguments for c in calls)) == {"x": 12}
        seen.append(("".join(d.text for d in deltas), done.finish_reason,
                     [(c.name, c.arguments) for c in done.tool_calls]))
    assert seen[0] == seen[1] and seen[0][0].strip() == "ok" and seen[0][2] == [("f", '{"x": 12}')]
    assert len(deltas) == 1 and len(deltas[0].tool_calls) <= 2  # the name, then the arguments at once


def test_text_after_a_call_in_one_message_comes_after_the_call():
    """Merged tokens whose call is followed by text give the call's delta first, then the text's:
    the order a token at a time gives (a delta does not tell which of its text and calls came
    first; the Responses API orders its items by it)."""
    tok = Chars()
    reply = ReplyFormat(tool_parser=HermesToolParser, tool_names=frozenset({"f"}))
    ids = tok.ids('<tool_call>{"name": "f", "arguments": {"x": 12}}</tool_call> ok')

    async def run(chunks: list[tuple[int, ...]]) -> list[TextDelta]:
        scheduler = Recorder()
        request = GenerateRequest("x", (0,), len(ids), reply=reply, sampling=SamplingParams(logprobs=0))
        events = RequestStream(request, 0, tok, None, scheduler, RequestLimits(256, 64)).events()
        await anext(events)
        for i, chunk in enumerate(chunks):
            scheduler.messages[0].reply_to.tell(Tokens(
                0, chunk, "length" if i == len(chunks) - 1 else None, logprobs=(-0.5,) * len(chunk),
                top_logprobs=((),) * len(chunk)))
        return [e async for e in events][:-1]

    def kinds(deltas: list[TextDelta]) -> list[str]:
        seen = [k for d in deltas for k in ["call"] * bool(d.tool_calls) + ["text"] * bool(d.text.strip())]
        return [k for i, k in enumerate(seen) if not i or seen[i - 1] != k]

    one_by_one, merged = asyncio.run(run([ids[i:i + 1] for i in range(len(ids))])), asyncio.run(run([ids]))
    assert kinds(one_by_one) == kinds(merged) == ["call", "text"]
    assert [t for d in merged for t in d.token_ids] == list(ids) and len(merged) == 2
    assert sum(len(d.logprobs) for d in merged) == len(ids)
