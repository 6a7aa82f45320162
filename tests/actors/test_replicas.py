"""ReplicaSet, the data-parallel router: its pick, and two real engines (scripted device
workers) behind it: a burst split evenly, a dead replica passed over, /health."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp.test_utils import TestClient, TestServer

from pypto_serving.actors.engine import Engine
from pypto_serving.actors.replicas import ReplicaLoad, ReplicaSet, pick_replica, prefix_key
from pypto_serving.core.request import ChatInput, Finished, GenerateRequest, Started, estimated_tokens
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.http.server import Handlers, build_app
from pypto_serving.messages.worker import StepPlan
from pypto_serving.telemetry.metrics import EngineMetrics
from tests.replies.scripted import ScriptedServer, ScriptedWorker


def loads(*rows: tuple[bool, int, int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(*row) for row in rows]


# -- the pick ----------------------------------------------------------------------------


def test_the_fewest_pending_tokens_win():
    assert pick_replica(loads((True, 900, 1), (True, 100, 5), (True, 500, 0))) == 1


def test_ties_go_to_the_fewest_in_flight_then_the_preferred_then_the_first():
    assert pick_replica(loads((True, 100, 3), (True, 100, 2))) == 1
    assert pick_replica(loads((True, 100, 2), (True, 100, 2), (True, 100, 2)), preferred=2) == 2
    assert pick_replica(loads((True, 100, 2), (True, 100, 2))) == 0
    assert pick_replica(loads((True, 50, 2), (True, 100, 2)), preferred=1) == 0  # only a tie breaker


def test_a_replica_that_cannot_serve_is_passed_over_unless_none_can():
    assert pick_replica(loads((False, 0, 0), (True, 900, 9))) == 1
    assert pick_replica(loads((False, 900, 0), (False, 0, 0))) == 1


def test_prompts_that_begin_the_same_way_share_a_key():
    def request(prompt: object) -> GenerateRequest:
        return GenerateRequest("r", prompt, 8)

    head = "You are a terse assistant. " * 20
    assert prefix_key(request(head + "Question 1")) == prefix_key(request(head + "Question 2"))
    assert prefix_key(request("short a")) != prefix_key(request("short b"))
    ids = tuple(range(200))
    assert prefix_key(request(ids + (1,))) == prefix_key(request(ids + (2,)))
    system = {"role": "system", "content": head}
    chat = [ChatInput(({**system}, {"role": "user", "content": q})) for q in ("a", "b")]
    assert prefix_key(request(chat[0])) == prefix_key(request(chat[1]))


# -- two engines behind the router -------------------------------------------------------


class SlowWorker(ScriptedWorker):
    """Answers each step after 10 ms, so requests are mid-generation when a test acts; keeps
    its death callback, so a test can kill it."""

    def __init__(self, cfg, on_result, on_death) -> None:
        super().__init__(cfg, on_result, on_death)
        self.die = on_death

    def send(self, plan: StepPlan) -> None:
        asyncio.get_running_loop().call_later(0.01, super().send, plan)


def replica_set(n: int = 2) -> ReplicaSet:
    server = ScriptedServer("smollm2", "--dp", str(n))
    worker = type("Worker", (SlowWorker,), {"script": []})
    worker.script = server.tokenizer.encode(" once upon a time" * 20, add_special_tokens=False)
    return ReplicaSet([Engine(server.settings.replica(i), server.tokenizer,
                              EngineMetrics("scripted", 1024, engine=str(i)), worker_factory=worker)
                       for i in range(n)])


def request(i: int, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(f"req-{i}", f"Tell me story number {i}.", max_tokens, SamplingParams())


async def run(replicas: ReplicaSet, req: GenerateRequest) -> list[object]:
    return [event async for event in replicas.generate(req)]


def finished(metrics: EngineMetrics) -> int:
    return sum(metrics.finish_reasons.values())


async def test_a_burst_is_split_between_the_replicas_and_each_request_answered_once():
    replicas = replica_set()
    await replicas.start()
    try:
        results = await asyncio.gather(*(run(replicas, request(i)) for i in range(32)))
    finally:
        await replicas.shutdown()
    for events in results:
        assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
        assert sum(isinstance(e, Finished) for e in events) == 1
        assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 8
    assert [finished(e.metrics) for e in replicas.engines] == [16, 16]
    assert replicas.metrics.snapshot()["replicas"][1]["counters"]["requests_finished"] == 16


async def test_pending_tokens_count_requests_before_and_after_the_scheduler_holds_them():
    replicas = replica_set(1)
    await replicas.start()
    engine = replicas.engines[0]
    try:
        assert engine.pending_tokens == 0
        stream = replicas.generate(request(0, max_tokens=50))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # routed and registered, not tokenized yet: a guess
        assert engine.pending_tokens == len("Tell me story number 0.") // 4 + 50
        assert isinstance(await first, Started)
        await asyncio.sleep(0.05)  # held and generating: prompt and outputs left, exactly
        seq = engine.scheduler.scheduler.running[0]
        assert engine.pending_tokens == seq.work_left < seq.num_prompt_tokens + 50
        await stream.aclose()
        await asyncio.sleep(0.05)  # the abort reaches the scheduler
        assert engine.pending_tokens == 0
    finally:
        await replicas.shutdown()


async def test_a_dead_replica_ends_only_its_own_requests_and_the_other_serves():
    replicas = replica_set()
    await replicas.start()
    try:
        tasks = [asyncio.ensure_future(run(replicas, request(i, max_tokens=200))) for i in range(4)]
        await asyncio.sleep(0.1)
        on = Counter(e.metrics.engine for e in replicas.engines for _ in range(e.num_in_flight))
        assert on == {"0": 2, "1": 2}
        replicas.engines[1].worker.die("device worker cpu died (exit code -9)")
        ends = Counter(events[-1].finish_reason for events in await asyncio.gather(*tasks))
        assert ends == {"eos": 2, "error": 2}  # the script, then EOS; or the death
        assert replicas.engines[1].metrics.finish_reasons["error"] == 2
        assert replicas.engines[0].metrics.finish_reasons["error"] == 0
        assert replicas.dead_reason is None
        later = await asyncio.gather(*(run(replicas, request(i)) for i in range(4)))
        assert all(events[-1].finish_reason == "length" for events in later)
        assert finished(replicas.engines[0].metrics) == 6
        replicas.engines[0].worker.die("device worker cpu died (exit code -9)")
        assert replicas.dead_reason.startswith("no replica can serve: replica 0: device worker")
        assert "; replica 1: device worker cpu died" in replicas.dead_reason
    finally:
        await replicas.shutdown()


async def test_health_is_200_naming_the_down_replica_while_one_serves_and_503_when_none():
    replicas = replica_set()
    await replicas.start()
    server = ScriptedServer("smollm2")
    client = TestClient(TestServer(build_app(Handlers(replicas, "scripted", server.settings.defaults))))
    await client.start_server()
    try:
        r = await client.get("/health")
        assert r.status == 200 and (await r.json())["replicas"] == [
            {"engine": "0", "status": "ok"}, {"engine": "1", "status": "ok"}]
        replicas.engines[1].worker.die("device worker cpu died (exit code -9)")
        r = await client.get("/health")
        body = await r.json()
        assert r.status == 200 and body["status"] == "ok"
        assert body["replicas"][1] == {"engine": "1", "status": "error",
                                       "reason": "device worker cpu died (exit code -9)"}
        r = await client.post("/tokenize", json={"prompt": "hello"})  # the live replica's tokenizer
        assert r.status == 200 and (await r.json())["count"] > 0
        replicas.engines[0].worker.die("device worker cpu died (exit code -9)")
        r = await client.get("/health")
        body = await r.json()
        assert r.status == 503 and body["status"] == "error" and "replica 0" in body["reason"]
        assert [x["status"] for x in body["replicas"]] == ["error", "error"]
    finally:
        await client.close()
        await replicas.shutdown()


async def test_one_replica_is_that_engine():
    replicas = replica_set(1)
    await replicas.start()
    server = ScriptedServer("smollm2")
    client = TestClient(TestServer(build_app(Handlers(replicas, "scripted", server.settings.defaults))))
    await client.start_server()
    try:
        assert await (await client.get("/health")).json() == {"status": "ok"}
        replicas.engines[0].worker.die("device worker cpu died (exit code -9)")
        r = await client.get("/health")
        assert r.status == 503 and await r.json() == {
            "status": "error", "reason": "device worker cpu died (exit code -9)"}
    finally:
        await client.close()
        await replicas.shutdown()


def test_a_request_not_yet_tokenized_is_guessed_from_its_prompt_and_max_tokens():
    def guess(prompt: object, max_tokens: int | None = 10) -> int:
        return estimated_tokens(GenerateRequest("r", prompt, max_tokens), 100, 1024)

    assert guess("x" * 40) == 10 + 10
    assert guess(tuple(range(7))) == 7 + 10
    assert guess(ChatInput(({"role": "user", "content": "y" * 80},))) == 20 + 10
    assert guess("x" * 40, None) == 10 + 100  # the server's default max_tokens
    assert guess("x" * 8000) == 1024  # at most the context
