"""Tests of benchmarks/serve_bench.py against a tiny fake OpenAI-compatible streaming server."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from benchmarks.serve_bench import (
    BenchConfig,
    RssSampler,
    build_parser,
    config_from_args,
    format_table,
    make_prompts,
    run_benchmark,
    write_json,
)


@dataclass
class FakeSpec:
    """How the fake server answers: `n_chunks` content chunks, then (optionally) a usage event."""

    first_delay: float = 0.05
    chunk_delay: float = 0.005
    n_chunks: int = 4
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0  # request i (0-based) gets HTTP 500 when i % fail_every == 0
    bad_json: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _stream(request: web.Request, spec: FakeSpec) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(spec.first_delay)
    if spec.bad_json:
        await resp.write(b"data: {not json\n\n")
        return resp
    for i in range(spec.n_chunks):
        if i:
            await asyncio.sleep(spec.chunk_delay)
        await resp.write(_sse({"object": "text_completion", "choices": [{"index": 0, "text": "ab"}]}))
    if spec.send_usage:
        usage = {"prompt_tokens": 7, "completion_tokens": spec.n_chunks * spec.tokens_per_chunk}
        await resp.write(_sse({"object": "text_completion", "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _app(spec: FakeSpec) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        index = len(spec.bodies)
        spec.bodies.append(await request.json())
        if spec.fail_every and index % spec.fail_every == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return await _stream(request, spec)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
def spec() -> FakeSpec:
    return FakeSpec()


@pytest.fixture
async def base_url(spec: FakeSpec) -> AsyncIterator[str]:
    runner = web.AppRunner(_app(spec))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _cfg(base_url: str, **overrides: Any) -> BenchConfig:
    values: dict[str, Any] = dict(base_url=base_url, input_len=8, output_len=4, num_prompts=6,
                                  concurrency=3, warmup=1)
    values.update(overrides)
    return BenchConfig(**values)


async def test_counts_and_latencies(base_url: str, spec: FakeSpec) -> None:
    spec.tokens_per_chunk = 2
    result = await run_benchmark(_cfg(base_url))
    assert (result.completed, result.failed, result.first_error) == (6, 0, None)
    assert len(spec.bodies) == 7  # one warm-up request, not counted
    assert result.total_output_tokens == 6 * 4 * 2  # from usage, not from the chunk count
    assert result.total_input_tokens == 6 * 8
    assert result.usage_missing == 0
    assert 0.04 <= result.ttft_ms.mean / 1000 < 2.0
    assert result.ttft_ms.count == 6 and result.itl_ms.count == 6 * 3
    assert result.e2e_ms.p50 >= result.ttft_ms.p50
    assert result.tpot_ms.count == 6 and result.output_throughput > 0
    assert "Successful requests:" in format_table(result)


async def test_payload(base_url: str, spec: FakeSpec) -> None:
    await run_benchmark(_cfg(base_url, num_prompts=1, warmup=0, model="m", output_len=5))
    body = spec.bodies[0]
    assert len(body["prompt"]) == 8 and all(isinstance(t, int) for t in body["prompt"])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["model"], body["temperature"]) == (5, True, "m", 0.0)


async def test_sampling_settings_are_sent_when_set_only(base_url: str, spec: FakeSpec) -> None:
    settings = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    await run_benchmark(_cfg(base_url, num_prompts=1, warmup=0, **settings))
    await run_benchmark(_cfg(base_url, num_prompts=1, warmup=0))
    sampled, plain = spec.bodies
    assert {name: sampled[name] for name in settings} == settings
    assert not {"top_k", "top_p", "min_p"} & plain.keys()


async def test_missing_usage_falls_back_to_chunks(base_url: str, spec: FakeSpec) -> None:
    spec.send_usage = False
    result = await run_benchmark(_cfg(base_url, num_prompts=2, warmup=0, request_rate=50.0))
    assert result.completed == 2 and result.usage_missing == 2
    assert result.total_output_tokens == 2 * spec.n_chunks
    assert "sent no usage" in format_table(result)


async def test_http_errors_counted(base_url: str, spec: FakeSpec) -> None:
    spec.fail_every = 2
    result = await run_benchmark(_cfg(base_url, concurrency=1, warmup=0))
    assert (result.completed, result.failed) == (3, 3)
    assert result.first_error is not None and "HTTP 500" in result.first_error
    assert result.total_output_tokens == 3 * spec.n_chunks


async def test_bad_stream_counted(base_url: str, spec: FakeSpec) -> None:
    spec.bad_json = True
    result = await run_benchmark(_cfg(base_url, num_prompts=2, warmup=0))
    assert (result.completed, result.failed) == (0, 2)
    assert result.first_error


async def test_connection_error_counted(tmp_path: Any) -> None:
    result = await run_benchmark(_cfg("http://127.0.0.1:1", num_prompts=2, warmup=1))
    assert (result.completed, result.failed, result.warmup_failed) == (0, 2, 1)
    assert result.first_error
    write_json(result, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["failed"] == 2 and data["config"]["request_rate"] == "inf"


def test_random_prompts_have_input_len_ids() -> None:
    cfg = BenchConfig(input_len=17, vocab_low=5, vocab_high=9)
    prompts = make_prompts(cfg, 4, np.random.default_rng(0))
    assert len(prompts) == 4 and all(len(p) == 17 for p in prompts)
    assert all(5 <= t < 9 and isinstance(t, int) for p in prompts for t in p)


def test_shared_prefix_prompts_share_prefix() -> None:
    cfg = BenchConfig(dataset="shared-prefix", prefix_len=30, input_len=10)
    prompts = make_prompts(cfg, 3, np.random.default_rng(1))
    assert all(len(p) == 40 for p in prompts)
    assert prompts[0][:30] == prompts[1][:30] == prompts[2][:30]
    assert prompts[0][30:] != prompts[1][30:]


def test_cli_maps_to_config() -> None:
    args = build_parser().parse_args(["--base-url", "http://h:1", "--dataset", "shared-prefix",
                                      "--no-ignore-eos", "--request-rate", "4", "--timeout", "9",
                                      "--top-p", "0.9", "--top-k", "20"])
    cfg = config_from_args(args)
    assert (cfg.top_p, cfg.top_k, cfg.min_p) == (0.9, 20, None)
    assert (cfg.base_url, cfg.dataset, cfg.ignore_eos, cfg.request_rate, cfg.timeout_s) == (
        "http://h:1", "shared-prefix", False, 4.0, 9.0)
    assert (cfg.input_len, cfg.output_len, cfg.prefix_len, cfg.concurrency, cfg.warmup) == (
        128, 128, 400, 16, 2)
    assert cfg.url == "http://h:1/v1/completions"


def test_rss_sampler_reports_peak() -> None:
    sampler = RssSampler(os.getpid(), interval_s=0.01).start()
    assert sampler.stop() > 1.0
