"""n choices over real RequestStreams and a stand-in scheduler: merging, seeds, aborts."""

from __future__ import annotations

import asyncio

import pytest

from pypto_serving.core.request import Finished, GenerateRequest, InvalidRequest, TextDelta
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.http.choices import ChoiceStreams, choice_requests
from pypto_serving.messages.request import Tokens
from pypto_serving.messages.scheduler import Abort, Submit
from pypto_serving.messages.worker import TopLogprob
from tests.http.fakes import EOS, FakeEngine


def request(n_tokens: int = 4, **sampling: object) -> GenerateRequest:
    return GenerateRequest("cmpl-x", (5, 6, 7), n_tokens, SamplingParams(**sampling))


async def started(engine: FakeEngine, req: GenerateRequest, n: int) -> ChoiceStreams:
    streams = ChoiceStreams(engine, choice_requests(req, n))  # type: ignore[arg-type]
    await streams.start()
    return streams


def test_choices_get_consecutive_seeds_and_their_own_ids():
    reqs = choice_requests(request(seed=2**64 - 2, temperature=1.0), 3)
    assert [r.sampling.seed for r in reqs] == [2**64 - 2, 2**64 - 1, 0]
    assert [r.request_id for r in reqs] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [r.sampling.seed for r in choice_requests(request(), 2)] == [None, None]
    assert choice_requests(request(), 1) == [request()]


async def test_events_of_all_choices_are_merged_with_their_index():
    engine = FakeEngine()
    streams = await started(engine, request(), 2)
    replies = {s.seq_id: s.reply_to for s in engine.scheduler.of(Submit)}
    replies[1].tell(Tokens(1, (10,), None))
    replies[0].tell(Tokens(0, (11,), "length"))
    replies[1].tell(Tokens(1, (12,), "eos"))
    got = [(i, type(e).__name__, getattr(e, "text", None)) async for i, e in streams.events()]
    await streams.close()
    assert sorted(got) == [(0, "Finished", None), (0, "TextDelta", "l"),
                           (1, "Finished", None), (1, "TextDelta", "k"), (1, "TextDelta", "m")]
    assert engine.scheduler.of(Abort) == []  # everyone finished: nothing to abort


async def test_closing_before_any_token_aborts_every_choice():
    engine = FakeEngine()
    streams = await started(engine, request(), 3)
    await streams.close()
    assert sorted(a.seq_id for a in engine.scheduler.of(Abort)) == [0, 1, 2]


async def test_closing_mid_generation_aborts_only_the_unfinished():
    engine = FakeEngine()
    streams = await started(engine, request(), 2)
    replies = {s.seq_id: s.reply_to for s in engine.scheduler.of(Submit)}
    replies[0].tell(Tokens(0, (10,), "length"))
    events = streams.events()
    while not isinstance((await anext(events))[1], Finished):
        pass
    await streams.close()
    assert [a.seq_id for a in engine.scheduler.of(Abort)] == [1]


async def test_an_invalid_request_fails_start_and_submits_nothing():
    engine = FakeEngine()
    streams = ChoiceStreams(engine, choice_requests(  # type: ignore[arg-type]
        GenerateRequest("x", (5, 500), 4), 2))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await streams.start()
    await streams.close()
    assert engine.scheduler.of(Submit) == []


async def test_min_tokens_masks_eos_and_stop_token_ids_even_with_ignore_eos():
    engine = FakeEngine()
    req = GenerateRequest("x", (5,), 3, SamplingParams(min_tokens=10), stop_token_ids=(9, 4),
                          ignore_eos=True)
    streams = await started(engine, req, 1)
    submit = engine.scheduler.of(Submit)[0]
    await streams.close()
    assert submit.sampling.eos_token_ids == (EOS, 4, 9)
    assert submit.sampling.min_tokens == 3  # never more than the sequence may produce
    assert submit.stop_token_ids == frozenset({4, 9})  # EOS ignored: it does not stop


async def test_without_min_tokens_sampling_is_passed_as_is():
    engine = FakeEngine()
    req = GenerateRequest("x", (5,), 3, SamplingParams(temperature=0.7))
    await (await started(engine, req, 1)).close()
    assert engine.scheduler.of(Submit)[0].sampling == req.sampling


async def test_logprobs_are_carried_per_token():
    engine = FakeEngine()
    streams = await started(engine, request(logprobs=1), 1)
    reply = engine.scheduler.of(Submit)[0].reply_to
    reply.tell(Tokens(0, (3,), "length", logprobs=(-0.25,), top_logprobs=((TopLogprob(4, -0.1),),)))
    deltas = [e async for _, e in streams.events() if isinstance(e, TextDelta)]
    await streams.close()
    (entry,) = deltas[0].logprobs
    chosen = entry.chosen
    assert (chosen.token_id, chosen.text, chosen.utf8, chosen.logprob) == (3, "d", b"d", -0.25)
    assert [(c.text, c.logprob) for c in entry.top] == [("e", -0.1)]


async def test_no_logprobs_unless_asked():
    engine = FakeEngine()
    streams = await started(engine, request(), 1)
    engine.scheduler.of(Submit)[0].reply_to.tell(Tokens(0, (3,), "length", logprobs=(0.0,)))
    deltas = [e async for _, e in streams.events() if isinstance(e, TextDelta)]
    await streams.close()
    assert deltas[0].logprobs == ()


async def test_a_cancelled_consumer_aborts_through_close():
    engine = FakeEngine()
    streams = await started(engine, request(), 2)

    async def consume() -> None:
        try:
            async for _ in streams.events():
                pass
        finally:
            await streams.close()

    task = asyncio.get_running_loop().create_task(consume())
    await asyncio.sleep(0.01)
    task.cancel()  # what aiohttp does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(a.seq_id for a in engine.scheduler.of(Abort)) == [0, 1]
