"""One fault policy: a fault in any engine actor, a failed device step or a dead worker is
engine death. Each test has three streams generating when the fault comes, and checks within
5 s: every stream ends with `error`, an error event and `[DONE]`; /health answers 503 with
the reason; the fault is logged with the request ids in flight; no KV block is left taken;
a later request ends with an error at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from pypto_serving.actors.engine import Engine
from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.http.ops import Ops
from pypto_serving.http.server import Handlers, build_app
from pypto_serving.messages.worker import StepPlan
from tests.replies.scripted import ScriptedServer, ScriptedWorker

DEADLINE_S = 5.0
PROMPT = {"prompt": "Tell me a story.", "max_tokens": 400, "stream": True}


class SlowWorker(ScriptedWorker):
    """Answers each step after 20 ms, so streams are mid-generation when the fault comes;
    keeps its death callback so a test can kill it."""

    def __init__(self, cfg, on_result, on_death) -> None:
        super().__init__(cfg, on_result, on_death)
        self.on_death = on_death
        SlowWorker.last = self

    def send(self, plan: StepPlan) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, super().send, plan)


class FaultServer(ScriptedServer):
    """The scripted server with /health (ops) and a slow worker."""

    def __init__(self) -> None:
        super().__init__("smollm2")
        self.worker = type("Worker", (SlowWorker,), {"script": [], "fail_at": None})
        self.say(" once upon a time" * 100)

    async def __aenter__(self) -> TestClient:
        self.engine = Engine(self.settings.engine, self.tokenizer, worker_factory=self.worker)
        await self.engine.start()
        replicas = ReplicaSet([self.engine])
        app = build_app(Handlers(replicas, "scripted", self.settings.defaults, self.settings.parsers))
        Ops(replicas, None).install(app)
        self.client = TestClient(TestServer(app))
        await self.client.start_server()
        return self.client


async def read_stream(client: TestClient) -> list[str]:
    r = await client.post("/v1/completions", json=PROMPT)
    assert r.status == 200
    return [line[len("data: "):] for line in (await r.text()).splitlines() if line.startswith("data: ")]


async def wait_for(check: Callable[[], bool], what: str) -> None:
    for _ in range(int(DEADLINE_S / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {DEADLINE_S} s: {what}")


def blocks_taken(engine: Engine) -> int:
    return engine.allocator.num_blocks - engine.allocator.num_available


async def run_fault(inject: Callable[[Engine], None], reason: str, actor: str | None = None) -> None:
    """`actor`: the actor whose fault it is, whose traceback must be logged."""
    server = FaultServer()
    with capture_logs() as logs:
        async with server as client:
            streams = [asyncio.ensure_future(read_stream(client)) for _ in range(3)]
            engine = server.engine
            await wait_for(lambda: engine.scheduler.scheduler.num_running == 3 and blocks_taken(engine) > 0,
                           "three streams generating")
            ids = sorted(engine._request_ids())
            inject(engine)
            events = await asyncio.wait_for(asyncio.gather(*streams), DEADLINE_S)
            health = await client.get("/health")
            health_body = await health.json()
            late = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            late_body = await late.json()
            engine.allocator.check_integrity()
            assert blocks_taken(engine) == 0, "KV blocks leaked"
    for lines in events:
        chunks = [json.loads(e) for e in lines[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finishes[-1] == "error" and lines[-1] == "[DONE]"
        errors = [c["error"] for c in chunks if "error" in c]
        assert errors and reason in errors[0]["message"] and errors[0]["type"] == "engine_error"
    assert health.status == 503 and reason in health_body["reason"]
    assert late.status == 500 and reason in late_body["message"]
    stopped = [e for e in logs if e["event"] == "engine stopped"]
    assert stopped and reason in stopped[0]["reason"] and set(ids) <= set(stopped[0]["request_ids"])
    if actor is not None:
        failed = [e for e in logs if e["event"] == "engine actor failed"]
        assert failed and failed[0]["actor"] == actor and isinstance(failed[0]["exc_info"], RuntimeError)
        assert set(ids) <= set(failed[0]["request_ids"])


def fail_on_call(obj: object, name: str) -> None:
    """Makes `obj.name` raise from its next call on."""
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"injected fault in {name}")

    setattr(obj, name, boom)


async def test_a_fault_in_the_scheduler_actor_is_engine_death() -> None:
    def inject(engine: Engine) -> None:
        fail_on_call(engine.scheduler.scheduler, "step")  # the pure core, inside the actor

    await run_fault(inject, "injected fault in step", actor="SchedulerActor")


async def test_a_fault_in_the_tokenizer_actor_is_engine_death() -> None:
    """A fault in the actor's dispatch, on a fourth request's Encode, ends it and the three
    generating ones. (A failure encoding one prompt is only that request's: see
    test_hostile_input.py.)"""
    def inject(engine: Engine) -> None:
        fail_on_call(engine.tokenizer_actor, "receive")
        asyncio.ensure_future(read_stream_after(engine))

    async def read_stream_after(engine: Engine) -> None:
        events = [e async for e in engine.generate(_request())]
        assert events[-1].finish_reason == "error"

    await run_fault(inject, "injected fault in receive", actor="TokenizerActor")


async def test_a_failed_device_step_is_engine_death() -> None:
    def inject(engine: Engine) -> None:
        SlowWorker.last.fail_at = 0  # the next step fails

    await run_fault(inject, "scripted device failure")


async def test_a_dead_worker_is_engine_death() -> None:
    def inject(engine: Engine) -> None:
        SlowWorker.last.on_death("device worker cpu died (exit code -9)")

    await run_fault(inject, "died (exit code -9)")


def _request():
    from pypto_serving.core.request import GenerateRequest
    from pypto_serving.core.sampling_params import SamplingParams

    return GenerateRequest("late-tokenized", "Once", 4, SamplingParams())


@pytest.fixture(autouse=True)
def _no_slow_worker_left() -> None:
    yield
    SlowWorker.last = None
