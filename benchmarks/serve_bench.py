"""Serving benchmark client for OpenAI-compatible servers, in the spirit of `vllm bench serve`.

Drives pypto-serving, llama.cpp's llama-server or vLLM through a streamed `/v1/completions`
endpoint. Prompts are lists of token ids (`"prompt": [ids...]`), so their length in tokens is
exact without a tokenizer. Example:

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 \\
        --dataset shared-prefix --prefix-len 400 --input-len 64 --output-len 128 \\
        --num-prompts 64 --concurrency 16 --server-pid 1234 --json out.json

Library use (e.g. by a compare mode): `result = await run_benchmark(BenchConfig(...))`,
then `print(format_table(result))` or `write_json(result, path)`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

DATASETS = ("random", "shared-prefix", "rewrite")
ROOT = Path(__file__).resolve().parent.parent
REWRITE_MARK = "\n\n# ---- the same code, copied unchanged ----\n"


@dataclass
class BenchConfig:
    """What to send and how. `concurrency` 0 means unbounded; `request_rate` inf sends all at once."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 400
    num_prompts: int = 64
    concurrency: int = 16
    request_rate: float = math.inf
    seed: int = 0
    vocab_low: int = 1000
    vocab_high: int = 20000
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float | None = None  # None: left out of the request (the server's default)
    top_k: int | None = None
    min_p: float | None = None
    warmup: int = 2
    server_pid: int | None = None
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")


@dataclass
class RequestResult:
    """One request's outcome; times in seconds, relative to its own start."""

    prompt_len: int
    ok: bool = False
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    content_chunks: int = 0
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    text: str = ""
    last_chunk_at: float = field(default=0.0, repr=False)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LatencyStats:
    """Milliseconds; all zero when `count` is 0."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


@dataclass
class BenchResult:
    config: BenchConfig
    completed: int
    failed: int
    first_error: str | None
    warmup_failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int | None
    usage_missing: int
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    peak_rss_mib: float | None = None
    texts: list[str] = field(default_factory=list, repr=False)  # each prompt's text, in order

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"]["request_rate"] = _json_float(self.config.request_rate)
        del data["texts"]
        return data


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


# ---------------------------------------------------------------- datasets


def make_prompts(cfg: BenchConfig, count: int, rng: np.random.Generator) -> list[list[int] | str]:
    """`count` prompts of token ids drawn uniformly from [vocab_low, vocab_high) (random,
    shared-prefix), or of text (rewrite)."""
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose from {DATASETS}")
    if cfg.dataset == "rewrite":
        return rewrite_prompts(count, cfg.input_len, rng)
    rows = rng.integers(cfg.vocab_low, cfg.vocab_high, size=(count, cfg.input_len)).tolist()
    if cfg.dataset == "random":
        return rows
    prefix = rng.integers(cfg.vocab_low, cfg.vocab_high, size=cfg.prefix_len).tolist()
    return [prefix + row for row in rows]


def rewrite_prompts(count: int, input_len: int, rng: np.random.Generator) -> list[str]:
    """An input-grounded workload: a piece of this repository's code (about `input_len`
    tokens, at ~3.5 characters a token) and the start of a copy of it, to be continued."""
    source = "\n".join(p.read_text() for p in sorted((ROOT / "pypto_serving").rglob("*.py")))
    size = int(input_len * 3.5)
    prompts = []
    for _ in range(count):
        start = source.index("\n", int(rng.integers(0, len(source) - 2 * size))) + 1
        piece = source[start:start + size]
        first = piece[:piece.find("\n", 40) + 1 or 80]
        prompts.append(piece + REWRITE_MARK + first)
    return prompts


def build_payload(cfg: BenchConfig, prompt: list[int] | str) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name in ("top_p", "top_k", "min_p"):
        if getattr(cfg, name) is not None:
            payload[name] = getattr(cfg, name)
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.model:
        payload["model"] = cfg.model
    return payload


# ---------------------------------------------------------------- one request


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


def _record_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.usage_reported = True
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    result.usage_prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


def _handle_event(result: RequestResult, data: str, now: float, start: float) -> None:
    """Applies one SSE `data:` payload that arrived at `now`."""
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise ValueError(f"stream chunk is not an object: {data[:200]}")
    if chunk.get("error"):
        raise ValueError(f"error in stream: {json.dumps(chunk['error'])[:300]}")
    if text := _chunk_text(chunk):
        result.text += text
        if result.content_chunks == 0:
            result.ttft = now - start
        else:
            result.itls.append(now - result.last_chunk_at)
        result.last_chunk_at = now
        result.content_chunks += 1
    if chunk.get("usage"):
        _record_usage(result, chunk["usage"])


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        _handle_event(result, data, now, start)


def _finish(result: RequestResult, start: float) -> None:
    result.e2e = time.perf_counter() - start
    if result.content_chunks == 0:
        result.error = "stream ended without any content chunk"
        return
    if not result.usage_reported:
        result.output_tokens = result.content_chunks
    result.ok = True


async def send_request(session: aiohttp.ClientSession, cfg: BenchConfig,
                       prompt: list[int] | str) -> RequestResult:
    """Streams one completion; never raises, a failure is reported in the result."""
    result = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = time.perf_counter()
    try:
        async with session.post(cfg.url, json=build_payload(cfg, prompt)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {body}"
                return result
            await _read_stream(resp, result, start)
        _finish(result, start)
    except Exception as exc:  # connection errors, timeouts, bad JSON: all count as failures
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---------------------------------------------------------------- memory sampling


class RssSampler:
    """Samples the resident memory of a process and its children in a thread; keeps the peak."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def sample(self) -> int:
        total = 0
        procs = [self.process, *self.process.children(recursive=True)]
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except psutil.Error:
                return
            self._stop.wait(self.interval_s)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> float:
        """Stops sampling and returns the peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / (1024 * 1024)


# ---------------------------------------------------------------- the run


async def _issue_all(session: aiohttp.ClientSession, cfg: BenchConfig,
                     prompts: list[list[int] | str], rng: np.random.Generator) -> list[RequestResult]:
    """Poisson arrivals at `request_rate`, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency > 0 else None

    async def one(prompt: list[int]) -> RequestResult:
        if gate is None:
            return await send_request(session, cfg, prompt)
        async with gate:
            return await send_request(session, cfg, prompt)

    tasks = []
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
            await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
        tasks.append(asyncio.create_task(one(prompt)))
    return list(await asyncio.gather(*tasks))


async def _warmup(session: aiohttp.ClientSession, cfg: BenchConfig, prompts: list[list[int] | str]) -> int:
    """Sends the warm-up prompts one by one; returns how many failed."""
    failed = 0
    for prompt in prompts:
        failed += not (await send_request(session, cfg, prompt)).ok
    return failed


def _session(cfg: BenchConfig) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max(cfg.concurrency, 0))
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Runs warm-up then the measured requests; failures are counted, never raised."""
    rng = np.random.default_rng(cfg.seed)
    prompts = make_prompts(cfg, cfg.num_prompts + cfg.warmup, rng)
    sampler = RssSampler(cfg.server_pid).start() if cfg.server_pid else None
    try:
        async with _session(cfg) as session:
            warmup_failed = await _warmup(session, cfg, prompts[cfg.num_prompts:])
            start = time.perf_counter()
            results = await _issue_all(session, cfg, prompts[:cfg.num_prompts], rng)
            duration = time.perf_counter() - start
    finally:
        peak = sampler.stop() if sampler else None
    return summarize(cfg, results, duration, warmup_failed, peak)


# ---------------------------------------------------------------- metrics


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    if not values_s:
        return LatencyStats()
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    return LatencyStats(count=len(ms), mean=float(ms.mean()), p50=p50, p90=p90, p99=p99)


def _cached_total(ok: list[RequestResult]) -> int | None:
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return sum(cached) if cached else None


def summarize(cfg: BenchConfig, results: list[RequestResult], duration_s: float,
              warmup_failed: int = 0, peak_rss_mib: float | None = None) -> BenchResult:
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    input_tokens = sum(r.prompt_len or r.usage_prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return BenchResult(
        config=cfg, completed=len(ok), failed=len(bad),
        first_error=bad[0].error if bad else None, warmup_failed=warmup_failed,
        duration_s=duration_s, request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        total_cached_tokens=_cached_total(ok),
        usage_missing=sum(not r.usage_reported for r in ok),
        ttft_ms=latency_stats([r.ttft for r in ok]),
        tpot_ms=latency_stats([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=latency_stats([gap for r in ok for gap in r.itls]),
        e2e_ms=latency_stats([r.e2e for r in ok]), peak_rss_mib=peak_rss_mib,
        texts=[r.text for r in results])


# ---------------------------------------------------------------- report


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{value:>12}"


def _header(title: str, width: int = 52, fill: str = "=") -> str:
    return f" {title} ".center(width, fill)


def _summary_rows(r: BenchResult) -> list[str]:
    cfg = r.config
    rate = "inf" if not math.isfinite(cfg.request_rate) else f"{cfg.request_rate:g}"
    rows = [_row("Endpoint:", cfg.url), _row("Dataset:", cfg.dataset),
            _row("Max concurrency:", cfg.concurrency or "unbounded"), _row("Request rate (req/s):", rate),
            _row("Successful requests:", r.completed), _row("Failed requests:", r.failed),
            _row("Benchmark duration (s):", r.duration_s),
            _row("Total input tokens:", r.total_input_tokens),
            _row("Total generated tokens:", r.total_output_tokens)]
    if r.total_cached_tokens is not None:
        rows.append(_row("Cached prompt tokens (server):", r.total_cached_tokens))
    rows += [_row("Request throughput (req/s):", r.request_throughput),
             _row("Output token throughput (tok/s):", r.output_throughput),
             _row("Total token throughput (tok/s):", r.total_token_throughput)]
    if r.peak_rss_mib is not None:
        rows.append(_row("Peak server RSS (MiB):", r.peak_rss_mib))
    return rows


def _latency_rows(title: str, name: str, stats: LatencyStats) -> list[str]:
    rows = [_header(title, fill="-")]
    rows.append(_row(f"Mean {name} (ms):", stats.mean))
    for pct in ("p50", "p90", "p99"):
        rows.append(_row(f"{pct.upper()} {name} (ms):", getattr(stats, pct)))
    return rows


def _notes(r: BenchResult) -> list[str]:
    notes = []
    if r.first_error:
        notes.append(f"First error: {r.first_error}")
    if r.warmup_failed:
        notes.append(f"Warm-up: {r.warmup_failed} of {r.config.warmup} requests failed")
    if r.usage_missing:
        notes.append(f"Note: {r.usage_missing} requests sent no usage; their output tokens "
                     "were counted as content chunks (may undercount)")
    return notes


def format_table(result: BenchResult) -> str:
    lines = [_header("Serving Benchmark Result"), *_summary_rows(result)]
    lines += _latency_rows("Time to First Token", "TTFT", result.ttft_ms)
    lines += _latency_rows("Time per Output Token (excl. 1st token)", "TPOT", result.tpot_ms)
    lines += _latency_rows("Inter-token Latency", "ITL", result.itl_ms)
    lines += _latency_rows("End-to-end Latency", "E2E", result.e2e_ms)
    lines.append("=" * 52)
    return "\n".join(lines + _notes(result))


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_dict(), indent=2) + "\n")


# ---------------------------------------------------------------- CLI


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name, sent as `model` when given")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="sample this process's (and its children's) RSS every 0.2 s")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--json", dest="json_path", default=None, help="write results to this file")


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=DATASETS, default="random")
    parser.add_argument("--input-len", type=int, default=128, help="distinct prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=400, help="shared-prefix: common prefix tokens")
    parser.add_argument("--vocab-low", type=int, default=1000)
    parser.add_argument("--vocab-high", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)


def _add_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16, help="max requests in flight (0: no cap)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests sent first")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Benchmark an OpenAI-compatible completions server.")
    _add_target_args(parser)
    _add_dataset_args(parser)
    _add_load_args(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = {f.name for f in dataclasses.fields(BenchConfig)} - {"timeout_s"}
    values = {name: getattr(args, name) for name in names}
    return BenchConfig(timeout_s=args.timeout, **values)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(run_benchmark(config_from_args(args)))
    print(format_table(result))
    if args.json_path:
        write_json(result, args.json_path)
    return 0 if result.completed else 1


if __name__ == "__main__":
    sys.exit(main())
