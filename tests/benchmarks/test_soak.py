"""Tests of benchmarks/soak.py: the workload mix, the error checks on a fake server, and a short
soak against the real server with the default packaged model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from benchmarks.soak import (
    CHAT,
    COMPLETIONS,
    KINDS,
    SoakConfig,
    Spec,
    failures,
    make_workload,
    rss_growth,
    run_request,
    run_soak,
)
from tests.e2e.server import ServerProcess


def _kinds(specs: list[Spec]) -> set[str]:
    return {s.kind for s in specs}


def test_workload_is_deterministic_for_a_seed() -> None:
    assert make_workload(300, seed=3, max_len=256) == make_workload(300, seed=3, max_len=256)
    assert make_workload(300, seed=3, max_len=256) != make_workload(300, seed=4, max_len=256)


def test_workload_covers_every_kind() -> None:
    assert _kinds(make_workload(len(KINDS), seed=0)) == set(KINDS)
    specs = make_workload(400, seed=1, max_len=256)
    assert _kinds(specs) == set(KINDS)
    assert {s.path for s in specs} == {COMPLETIONS, CHAT}
    assert {s.stream for s in specs if s.kind in ("stop", "n2", "logprobs")} == {True, False}
    assert {s.abort for s in specs} == {"", "first_chunk", "delay", "before"}
    bodies = {s: json.loads(s.body) for s in specs if s.kind != "invalid"}
    assert all(1 <= b["max_tokens"] <= 16 for b in bodies.values())
    assert all(b.get("n", 1) == s.n == (2 if s.kind == "n2" else 1) for s, b in bodies.items())
    sent = {key for b in bodies.values() for key in b}  # every cut and penalty the sampler takes
    assert {"top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"} <= sent
    assert {"echo", "prompt_logprobs"} <= sent  # the prompt's logprobs too


def test_rss_growth_and_failures() -> None:
    growth = rss_growth({"main": 100.0, "child 7 python": 300.0}, {"main": 110.0, "child 7 python": 300.0})
    assert growth["growth_pct"] == {"main": 10.0, "child 7 python": 0.0}
    assert growth["total_growth_pct"] == 2.5
    summary = {"errors": {"count": 0}, "server_finish_reasons": {"error": 0}, "kv": {"clean": True},
               "rss": growth, "config": {"max_rss_growth_pct": 2.0}}
    assert failures(summary) == ["RSS grew 2.5% after warm-up"]
    assert failures({**summary, "config": {"max_rss_growth_pct": 5.0}}) == []


# ---------------------------------------------------------------- error checks, fake server
async def _broken_completions(request: web.Request) -> web.StreamResponse:
    if not (await request.json()).get("stream"):
        return web.json_response({"error": "boom"}, status=500)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n')
    return resp  # no [DONE]


async def _broken_chat(request: web.Request) -> web.StreamResponse:
    if not (await request.json()).get("stream"):
        return web.json_response({"choices": [{"index": 0, "finish_reason": "error"}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]}\n\n')
    await resp.write(b'data: {"error": {"message": "engine error", "code": 500}}\n\ndata: [DONE]\n\n')
    return resp


@pytest.fixture
async def fake_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post(COMPLETIONS, _broken_completions)
    app.router.add_post(CHAT, _broken_chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def _spec(kind: str, path: str, stream: bool, abort: str = "") -> Spec:
    return Spec(kind, path, json.dumps({"stream": stream}).encode(), stream, 1, abort)


async def _outcome(url: str, spec: Spec) -> tuple[str | None, bool]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        out = await run_request(session, url, spec)
    return out.error, out.aborted


async def test_each_failure_is_an_error(fake_url: str) -> None:
    cases = [(_spec("stream", COMPLETIONS, True), "without [DONE]"),
             (_spec("plain", COMPLETIONS, False), "HTTP 500"),
             (_spec("invalid", COMPLETIONS, False), "HTTP 500"),
             (_spec("stream", CHAT, True), "error event"),
             (_spec("plain", CHAT, False), "finish_reason 'error'")]
    for spec, expected in cases:
        error, aborted = await _outcome(fake_url, spec)
        assert error is not None and expected in error and not aborted, (spec, error)
    error, _ = await _outcome("http://127.0.0.1:1", _spec("plain", COMPLETIONS, False))
    assert error and "Connect" in error


async def test_an_abort_is_no_error(fake_url: str) -> None:
    spec = _spec("abort_first_chunk", COMPLETIONS, True, "first_chunk")
    assert await _outcome(fake_url, spec) == (None, True)


# ---------------------------------------------------------------- the real server
def test_short_soak_against_the_server() -> None:
    with ServerProcess(["--max-model-len", "256", "--kv-cache-memory", "64MiB"]) as server:
        cfg = SoakConfig(server.url, server.proc.pid, requests=60, concurrency=8, warmup=20, seed=5)
        summary = asyncio.run(run_soak(cfg))
    assert summary["errors"] == {"count": 0, "first": []}, server.output()[-3000:]
    assert summary["kv"] == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "health": 200, "clean": True}
    assert set(summary["by_kind"]) == set(KINDS) and summary["requests"] == 60
    assert summary["invalid_400"] == sum(summary["by_kind"]["invalid"].values())
    assert summary["server_finish_reasons"]["error"] == 0
    rss = summary["rss"]
    assert rss["total_before_mib"] > 10 and any(k.startswith("child") for k in rss["growth_pct"])
