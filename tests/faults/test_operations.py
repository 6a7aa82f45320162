"""Operations faults against one real server (the default model), loopback only, bounded:
malformed HTTP, half-sent requests, huge bodies and prompts beside a canary stream, a storm
of abandoned streams, a killed device worker that --restart-worker brings back, and last a
SIGTERM drain with 16 requests in flight."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import aiohttp
import httpx
import psutil
import pytest

from tests.e2e.ops_helpers import assert_all_gone, children, idle, replica, wait_for, worker_process
from tests.e2e.server import ServerProcess

ARGS = ["--max-model-len", "4096", "--kv-cache-memory", "128MiB", "--max-num-seqs", "8",
        "--max-queue-len", "256", "--restart-worker", "--request-body-timeout", "1",
        "--keep-alive-timeout", "1", "--shutdown-timeout", "120"]
CANARY = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 400, "stream": True,
          "ignore_eos": True}
MAX_GAP_S = 1.0


@pytest.fixture(scope="module")
def srv() -> ServerProcess:
    with ServerProcess(ARGS) as server:
        yield server


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


async def with_canary(url: str, action) -> tuple[float, object]:
    """Runs `action()` (a coroutine function) while a canary stream generates; returns the
    canary's largest gap between two chunks while the action ran, and the action's result."""
    times: list[float] = []
    first = asyncio.Event()

    async def canary(session: aiohttp.ClientSession) -> None:
        async with session.post(url + "/v1/completions", json=CANARY) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    times.append(time.monotonic())
                    first.set()

    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(canary(session))
        await asyncio.wait_for(first.wait(), 120)
        start = time.monotonic()
        result = await action(session)
        end = time.monotonic() + 0.2
        await asyncio.sleep(0.3)  # a stall right after the answer counts too
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    window = [t for t in times if t >= start - MAX_GAP_S]
    assert window and window[-1] >= end - MAX_GAP_S, "the canary stopped streaming"
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    return max(gaps, default=0.0), result


def test_malformed_http_gets_the_json_error_shape(srv: ServerProcess):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"GARBAGE / HTTP/1.1\r\n\r\n")
        reply = s.recv(4096).decode()
    head, _, body = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.") and " 400 " in head.splitlines()[0]
    assert "application/json" in head and '"type":"invalid_request_error"' in body


def test_half_sent_requests_are_closed(srv: ServerProcess):
    """Slowloris: headers that never end, bodies that never arrive: closed within seconds."""
    proc = psutil.Process(srv.proc.pid)
    before = proc.num_fds()
    socks = []
    for i in range(100):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        socks.append(s)
    wait_for(lambda: proc.num_fds() >= before + 50, timeout=10, what="connections accepted")
    answers = []
    for s in socks:
        data = s.recv(4096)  # the server closes (b"") or answers 408, within its timeouts
        answers.append(data)
        s.close()
    timeouts = [a for a in answers if b" 408 " in a.split(b"\r\n")[0]]
    assert len(timeouts) == 50 and all(b"request_timeout" in a for a in timeouts)
    assert all(a == b"" for a in answers[1::2])
    wait_for(lambda: proc.num_fds() <= before + 5, timeout=10, what="fds released")
    assert post(srv.url, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


async def test_a_body_over_the_limit_is_413_and_stalls_no_one(srv: ServerProcess):
    body = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'

    async def send(session: aiohttp.ClientSession) -> tuple[int, dict]:
        async with session.post(srv.url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()

    gap, (status, answer) = await with_canary(srv.url, send)
    assert status == 413 and "--max-request-bytes" in answer["message"]
    assert gap < MAX_GAP_S, f"the canary stalled {gap:.2f} s"


async def test_a_4mib_prompt_is_answered_without_stalls_and_its_memory_returns(srv: ServerProcess):
    proc = psutil.Process(srv.proc.pid)
    words = ("lorem ipsum dolor sit amet " * 160_000)[: 4 << 20]

    async def send(session: aiohttp.ClientSession) -> tuple[int, dict]:
        async with session.post(srv.url + "/v1/completions",
                                json={"prompt": words, "max_tokens": 4}) as r:
            return r.status, await r.json()

    # The first big body grows the allocator's arenas once (~8 MiB here); each one after it
    # must give back what it took.
    await asyncio.to_thread(post, srv.url, {"prompt": words, "max_tokens": 4})
    await asyncio.sleep(0.5)
    rss_before = proc.memory_info().rss
    gap, (status, answer) = await with_canary(srv.url, send)
    assert status == 400 and "--max-model-len is 4096" in answer["message"]
    assert gap < MAX_GAP_S, f"the canary stalled {gap:.2f} s"
    await asyncio.sleep(1.0)
    rss_after = proc.memory_info().rss
    assert rss_after <= rss_before * 1.10, f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB"


async def test_a_big_prompt_is_tokenized_in_its_own_process(srv: ServerProcess):
    """300,000 characters could fit 4096 tokens as far as their count shows: they are
    encoded, in the tokenizer process, and found too long; the canary streams on."""
    words = ("the quick brown fox jumps over the lazy dog " * 7000)[:300_000]

    async def send(session: aiohttp.ClientSession) -> tuple[int, dict]:
        async with session.post(srv.url + "/v1/completions",
                                json={"prompt": words, "max_tokens": 4}) as r:
            return r.status, await r.json()

    gap, (status, answer) = await with_canary(srv.url, send)
    assert status == 400 and "the prompt has" in answer["message"] and "tokens" in answer["message"]
    assert gap < MAX_GAP_S, f"the canary stalled {gap:.2f} s"
    worker = worker_process(srv.proc.pid)
    others = [p for p in psutil.Process(srv.proc.pid).children() if p.pid != worker.pid]
    assert len(others) == 1 and "pypto_serving.tokenizer.encoder_process" in others[0].cmdline()


async def test_a_storm_of_abandoned_streams_settles_and_leaks_nothing(srv: ServerProcess):
    finished = replica(srv.url)["counters"]["requests_finished"]
    start = len(srv.lines)

    async def abandon(session: aiohttp.ClientSession, i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": 200, "stream": True}
        async with session.post(srv.url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: ") or i % 3 == 0:
                    return  # go away at the first event (or before it)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(abandon(session, i) for i in range(200)))
    settled = time.monotonic()
    wait_for(lambda: idle(srv.url, finished + 200), timeout=5, what="all 200 aborted and freed")
    r = post(srv.url, {"prompt": "Hi", "max_tokens": 2}, timeout=5)
    assert r.status_code == 200 and time.monotonic() - settled < 5
    logged = "".join(srv.lines[start:])
    assert logged.count("request aborted") >= 100  # at INFO, one per stream that had started
    assert "Traceback" not in logged and "[error" not in logged and "closing transport" not in logged


def test_a_killed_worker_is_restarted_and_serves_again(srv: ServerProcess):
    before = replica(srv.url)
    stream = asyncio.run(_kill_during_stream(srv))
    assert stream.rstrip().endswith("[DONE]") and '"finish_reason":"error"' in stream and "died" in stream
    wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=180,
             what="health 200 again")
    r = post(srv.url, {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    after = replica(srv.url)
    assert after["worker_restarts"] == before["worker_restarts"] + 1
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'pypto:worker_restarts_total{engine="0",model_name="smollm2"} 1.0' in metrics
    assert "engine restarted" in srv.output()


async def _kill_during_stream(srv: ServerProcess) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.url + "/v1/completions", json=CANARY) as r:
            await r.content.readline()
            killed = time.monotonic()
            worker_process(srv.proc.pid).kill()
            text = (await r.read()).decode()
            assert time.monotonic() - killed < 5
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 or health.status_code == 200  # restarting, or back already
    return text


def test_sigterm_drains_16_in_flight_and_leaves_no_process(srv: ServerProcess):
    """Last: it ends the module's server."""
    procs = children(srv.proc.pid)

    async def run() -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def one(i: int) -> dict:
                async with session.post(srv.url + "/v1/completions",
                                        json={"prompt": f"Count to {i}:", "max_tokens": 12,
                                              "ignore_eos": True}) as r:
                    return await r.json()

            tasks = [asyncio.ensure_future(one(i)) for i in range(16)]
            for _ in range(600):  # every one of them in flight before the signal
                async with session.get(srv.url + "/metrics/json") as r:
                    gauges = (await r.json())["replicas"][0]["gauges"]
                if gauges["running"] + gauges["waiting"] == 16:
                    break
                await asyncio.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    answers = asyncio.run(run())
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["length"] * 16
    assert srv.proc.wait(120) == 0
    assert_all_gone(procs)
