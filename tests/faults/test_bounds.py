"""The server's bounds, against the real engine with a scripted, slow device worker: a full
queue answers 503 with Retry-After at once while the running batch streams on; a request
past --request-timeout ends with a timeout error and frees its blocks; a failure preparing
one prompt is that request's 500, not engine death; bodies over --max-request-bytes get 413
unread; a 405 names the allowed methods."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp.test_utils import TestClient, TestServer

from pypto_serving.actors.engine import Engine
from pypto_serving.actors.replicas import ReplicaSet
from pypto_serving.http.ops import Ops
from pypto_serving.http.server import Handlers, build_app
from pypto_serving.messages.worker import StepPlan
from tests.replies.scripted import ScriptedServer, ScriptedWorker

LONG = {"prompt": "Tell me a story.", "max_tokens": 60, "stream": True}


class SlowWorker(ScriptedWorker):
    """Answers each step after 20 ms, so requests are still running when the test acts."""

    def send(self, plan: StepPlan) -> None:
        asyncio.get_running_loop().call_later(0.02, super().send, plan)


class BoundedServer(ScriptedServer):
    def __init__(self, *flags: str) -> None:
        super().__init__("smollm2", *flags)
        self.worker = type("Worker", (SlowWorker,), {"script": []})
        self.say(" once upon a time" * 40)

    async def __aenter__(self) -> TestClient:
        self.engine = Engine(self.settings.engine, self.tokenizer, worker_factory=self.worker)
        await self.engine.start()
        replicas = ReplicaSet([self.engine])
        app = build_app(Handlers(replicas, "scripted", self.settings.defaults, self.settings.parsers),
                        self.settings.http)
        Ops(replicas, None).install(app)
        self.client = TestClient(TestServer(app))
        await self.client.start_server()
        return self.client


async def stream_events(client: TestClient, body: dict) -> list[dict | str]:
    r = await client.post("/v1/completions", json=body)
    assert r.status == 200, await r.text()
    lines = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in lines]


def finish_reason(events: list) -> str | None:
    reasons = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
    return next((r for r in reversed(reasons) if r), None)


def blocks_taken(engine: Engine) -> int:
    return engine.allocator.num_blocks - engine.allocator.num_available


async def wait_until(check, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


async def test_a_full_queue_answers_503_at_once_while_the_batch_streams_on() -> None:
    server = BoundedServer("--max-num-seqs", "2", "--max-queue-len", "1")
    async with server as client:
        engine = server.engine
        streams = [asyncio.ensure_future(stream_events(client, LONG)) for _ in range(3)]
        await wait_until(lambda: engine.scheduler.scheduler.num_running == 2
                         and engine.num_in_flight == 3, "two running, one waiting")
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        body = await r.json()
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert not any(s.done() for s in streams)  # answered at once: not queued behind the batch
        assert body["type"] == "overloaded" and "--max-queue-len 1" in body["message"]
        events = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert [finish_reason(e) for e in events] == ["length"] * 3
        assert all(e[-1] == "[DONE]" for e in events)
        assert engine.metrics.rejections["queue_full"] == 1
        late = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert late.status == 200  # room again


async def test_a_request_past_its_timeout_ends_with_a_timeout_error_and_frees_its_blocks() -> None:
    server = BoundedServer("--request-timeout", "0.3", "--max-num-seqs", "1")
    async with server as client:
        engine = server.engine
        running = asyncio.ensure_future(stream_events(client, {**LONG, "max_tokens": 400}))
        await wait_until(lambda: engine.scheduler.scheduler.num_running == 1, "one running")
        queued = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 400})
        events = await running
        queued_body = await queued.json()
        assert finish_reason(events) == "error" and events[-1] == "[DONE]"
        error = next(e["error"] for e in events if isinstance(e, dict) and "error" in e)
        assert error["type"] == "timeout" and error["code"] == 504
        assert "--request-timeout (0.3 s)" in error["message"]
        # the one behind it never got a slot: nothing sent yet, so a 504 before the first byte
        assert queued.status == 504 and "waited to be scheduled" in queued_body["message"]
        await wait_until(lambda: blocks_taken(engine) == 0 and not engine.scheduler.scheduler.has_work,
                         "blocks freed")
        engine.allocator.check_integrity()
        assert engine.metrics.rejections["timeout"] == 2
        assert engine.dead_reason is None


async def test_a_failure_preparing_one_prompt_is_that_requests_500_only() -> None:
    server = BoundedServer()
    async with server as client:
        engine = server.engine
        streams = [asyncio.ensure_future(stream_events(client, LONG)) for _ in range(2)]
        await wait_until(lambda: engine.scheduler.scheduler.num_running == 2, "two running")
        original = server.tokenizer.apply_chat_template

        def broken(*args, **kwargs):
            raise RuntimeError("template engine exploded")

        server.tokenizer.apply_chat_template = broken
        try:
            r = await client.post("/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        finally:
            server.tokenizer.apply_chat_template = original
        body = await r.json()
        assert r.status == 500 and "template engine exploded" in body["message"]
        events = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert [finish_reason(e) for e in events] == ["length"] * 2
        assert engine.dead_reason is None
        ok = await client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert ok.status == 200


async def test_a_body_over_the_limit_gets_413_unread_and_405_names_the_methods() -> None:
    server = BoundedServer("--max-request-bytes", "1MiB")
    async with server as client:
        big = b'{"prompt": "' + b"x" * (2 << 20) + b'", "max_tokens": 1}'
        r = await client.post("/v1/completions", data=big, headers={"Content-Type": "application/json"})
        body = await r.json()
        assert r.status == 413 and "--max-request-bytes" in body["message"]
        assert body["message"].startswith(f"the request body has {len(big)} bytes")
        assert server.engine.metrics.rejections["body_too_large"] == 1
        small = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert small.status == 200
        wrong = await client.delete("/v1/completions")
        assert wrong.status == 405 and wrong.headers["Allow"] == "POST"
        assert (await wrong.json())["code"] == 405


def test_a_gone_workers_client_reports_no_second_death() -> None:
    """After a restart the old client may still be asked to send (a profile started on it):
    a client whose worker is gone must not report a death again, which would kill the new
    engine."""
    from pypto_serving.actors.device_client import DeviceWorkerClient
    from pypto_serving.messages.worker import StartProfile

    deaths: list[str] = []
    client = DeviceWorkerClient(None, lambda result: None, deaths.append)
    client._gone = True
    assert client._send(StartProfile(["e2e"], "x")) is False
    assert deaths == []
