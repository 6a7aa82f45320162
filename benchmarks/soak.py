"""Soak benchmark: many mixed requests against one server, then a check that it is still whole.

Starts a pypto-serving itself (flags after `--server-args`) or targets a running one (`--url`):

    python benchmarks/soak.py --requests 10000 --json soak.json
    python benchmarks/soak.py --requests 2000 --server-args "--max-model-len 512"
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid 1234

The mix is seeded: /v1/completions and /v1/chat/completions, streamed and not, 1-16 tokens;
stop strings, n=2, logprobs (the prompt's too: echo, prompt_logprobs), top-k/top-p/min-p cuts
and penalties; streams the client drops after the first chunk or after a random delay; requests
cancelled before the reply; invalid bodies that must get a 400 (counted apart, not as errors).
The first --warmup requests are part of --requests; the RSS of the server and of its children
(the device worker) is taken once the server is idle after them, and again at the end. Exits 1
on any error (a 5xx, a connection error, a stream without [DONE] or with an error event,
finish_reason "error"), on a KV cache not empty once idle (running, waiting and blocks in use
all 0; cached prefix blocks are free) or on RSS growth above --max-rss-growth percent.

KV cache pages count in RSS only once first written, and with prefix caching the allocator
hands out never-used blocks before it evicts cached ones, so RSS grows until every block was
used once (the default 1 GiB cache: ~2,400 requests here): not a leak. The started server
therefore gets --kv-cache-memory 64MiB, used up in warm-up, unless --server-args sets it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.servers import PORT, Server  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CUTS = [{"top_p": 0.9}, {"top_k": 40}, {"top_k": 40, "top_p": 0.95, "min_p": 0.05}, {"min_p": 0.1},
        {"frequency_penalty": 0.5, "presence_penalty": 0.3}, {"repetition_penalty": 1.1, "top_k": 5}]
KINDS = {"plain": 18, "stream": 18, "stop": 12, "n2": 10, "logprobs": 10, "abort_first_chunk": 10,
         "abort_delay": 8, "cancel_before_reply": 8, "invalid": 6}  # kind -> weight
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold "
         "jackdaws near old river banks under bright morning light and distant hills").split()
PREAMBLES = tuple(" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(3))  # prefix-cache hits
STOPS = (".", ",", " the", "\n", "!", " a")
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the mix: what to send and how the client ends it."""

    kind: str
    path: str
    body: bytes
    stream: bool = False
    n: int = 1
    abort: str = ""  # "", "first_chunk", "delay" (after `delay` s) or "before" (cancel before the reply)
    delay: float = 0.0


@dataclass(slots=True)
class Outcome:
    kind: str
    status: int | None = None
    error: str | None = None
    aborted: bool = False  # the client ended it before the server did
    tokens: int = 0  # completion tokens, where usage was reported

    @property
    def state(self) -> str:
        return "error" if self.error else "aborted" if self.aborted else "completed"


# ---------------------------------------------------------------- the mix
def make_workload(count: int, seed: int, max_len: int = 1024) -> list[Spec]:
    """`count` requests, each kind at least once when count allows, the rest by weight."""
    rng = random.Random(seed)
    kinds = list(KINDS)[:count] + rng.choices(list(KINDS), list(KINDS.values()), k=max(0, count - len(KINDS)))
    rng.shuffle(kinds)
    return [make_spec(rng, kind, max_len) for kind in kinds]


def make_spec(rng: random.Random, kind: str, max_len: int) -> Spec:
    chat = rng.random() < 0.5
    body = _base_body(rng, chat, max_len)
    stream = kind in ("stream", "abort_first_chunk", "abort_delay") or (
        kind in ("stop", "n2", "logprobs") and rng.random() < 0.5)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    n, abort, delay = 1, "", 0.0
    match kind:
        case "stop":
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        case "n2":
            n = body["n"] = 2
            body["temperature"] = 0.8
        case "logprobs":
            body.update({"logprobs": True, "top_logprobs": rng.randint(0, 3)} if chat
                        else {"logprobs": rng.randint(0, 3)})
            if not chat and rng.random() < 0.5:  # the prompt's too (a cached prefix's rows included)
                body.update({"echo": True} if stream or rng.random() < 0.5  # (a stream has no other way)
                            else {"prompt_logprobs": rng.randint(0, 3)})
        case "abort_first_chunk":
            abort = "first_chunk"
        case "abort_delay":
            abort, delay = "delay", rng.uniform(0.02, 0.6)
        case "cancel_before_reply":
            abort, delay = "before", rng.uniform(0.0, 0.03)
        case "invalid":
            return Spec(kind, CHAT if chat else COMPLETIONS, _invalid_body(rng, body, chat, max_len))
    return Spec(kind, CHAT if chat else COMPLETIONS, json.dumps(body).encode(), stream, n, abort, delay)


def _base_body(rng: random.Random, chat: bool, max_len: int) -> dict[str, Any]:
    words = rng.choices(WORDS, k=rng.randint(1, max(1, min(40, (max_len - 120) // 3))))
    prompt = " ".join(words)
    if max_len >= 256 and rng.random() < 0.3:
        prompt = rng.choice(PREAMBLES) + " " + prompt
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 16), "temperature": rng.choice((0.0, 0.7, 1.0))}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.3:  # the cuts and penalties clients send (the sampler's every path)
        body.update(rng.choice(CUTS))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _invalid_body(rng: random.Random, body: dict[str, Any], chat: bool, max_len: int) -> bytes:
    """A body the server must refuse with 400."""
    broken = [{"n": 0}, {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 2.0}, {"logprobs": 50}]
    if chat:
        broken = [*broken[:4], {"messages": []}, {"top_logprobs": 50, "logprobs": True}]
    choice = rng.randrange(len(broken) + 2)
    if choice == len(broken):
        return b'{"prompt": '  # not JSON
    if choice == len(broken) + 1:  # longer than --max-model-len
        long = "word " * (max_len + 8)
        prompt = {"messages": [{"role": "user", "content": long}]} if chat else {"prompt": long}
        return json.dumps({**body, **prompt}).encode()
    return json.dumps({**body, **broken[choice]}).encode()


# ---------------------------------------------------------------- one request
async def run_request(session: aiohttp.ClientSession, base_url: str, spec: Spec) -> Outcome:
    out = Outcome(spec.kind)
    try:
        if spec.abort == "before":
            await asyncio.wait_for(_post(session, base_url, spec, out), spec.delay)
        else:
            await _post(session, base_url, spec, out)
    except TimeoutError:
        if spec.abort == "before":
            out.aborted = True
        else:
            out.error = "client timeout"
    except (aiohttp.ClientError, ValueError, KeyError) as exc:  # ValueError: bad JSON
        if not out.aborted:
            out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _post(session: aiohttp.ClientSession, base_url: str, spec: Spec, out: Outcome) -> None:
    headers = {"Content-Type": "application/json"}
    async with session.post(base_url + spec.path, data=spec.body, headers=headers) as resp:
        out.status = resp.status
        if spec.kind == "invalid" or resp.status != 200:
            text = await resp.text()
            if resp.status != (400 if spec.kind == "invalid" else 200):
                out.error = f"HTTP {resp.status}: {text[:200]}"
        elif spec.stream:
            await _read_stream(resp, spec, out)
        else:
            _check_full(await resp.json(), spec, out)


def _check_full(doc: dict[str, Any], spec: Spec, out: Outcome) -> None:
    out.tokens = (doc.get("usage") or {}).get("completion_tokens", 0)
    _check_finishes({c["index"]: c.get("finish_reason") for c in doc.get("choices", [])}, spec, out)


def _check_finishes(finishes: dict[int, str | None], spec: Spec, out: Outcome) -> None:
    for index in range(spec.n):
        reason = finishes.get(index)
        if reason not in ("stop", "length"):
            out.error = f"choice {index} finish_reason {reason!r}"
            return


async def _read_stream(resp: aiohttp.ClientResponse, spec: Spec, out: Outcome) -> None:
    finishes: dict[int, str | None] = {}
    scope = asyncio.timeout(spec.delay if spec.abort == "delay" else None)
    try:
        async with scope:
            done = await _consume(resp, spec, out, finishes)
    except TimeoutError:
        if not scope.expired():  # the client's own timeout: an error, not an abort
            raise
        done = None
    if done is None or out.aborted:  # the client walks away: the connection is closed under the server
        out.aborted = True
        resp.close()
    elif out.error is None and not done:
        out.error = "stream ended without [DONE]"
    elif out.error is None:
        _check_finishes(finishes, spec, out)


async def _consume(resp: aiohttp.ClientResponse, spec: Spec, out: Outcome,
                   finishes: dict[int, str | None]) -> bool:
    """Reads SSE events until [DONE] (True) or the end of the body (False)."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return True
        event = json.loads(line[len("data: "):])
        if "error" in event:
            out.error = f"error event: {json.dumps(event)[:200]}"
        for choice in event.get("choices", []):
            finishes[choice["index"]] = choice.get("finish_reason") or finishes.get(choice["index"])
        out.tokens = (event.get("usage") or {}).get("completion_tokens", out.tokens)
        if spec.abort == "first_chunk":
            out.aborted = True
            return False
    return False


async def run_mix(session: aiohttp.ClientSession, base_url: str, specs: list[Spec], concurrency: int,
                  on_done: Any = None) -> list[Outcome]:
    """Runs `specs` with `concurrency` in flight; `on_done(count)` after each one."""
    outcomes: list[Outcome] = []
    pending = iter(specs)

    async def worker() -> None:
        for spec in pending:
            outcomes.append(await run_request(session, base_url, spec))
            if on_done:
                on_done(len(outcomes))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


# ---------------------------------------------------------------- the server's state
def sample_rss(pid: int) -> dict[str, float]:
    """MiB resident per process: the server's main process and each of its children."""
    try:
        main = psutil.Process(pid)
        rss = {"main": main.memory_info().rss / MiB}
        children = main.children(recursive=True)
    except psutil.Error:  # the server is gone: its requests say so
        return {}
    for child in children:
        try:
            rss[f"child {child.pid} {child.name()}"] = child.memory_info().rss / MiB
        except psutil.Error:
            pass
    return rss


def pid_listening(url: str) -> int | None:
    """The process listening on the URL's port, when this user may see it."""
    port = urllib.parse.urlsplit(url).port
    try:
        conns = psutil.net_connections("tcp")
    except psutil.AccessDenied:
        return None
    return next((c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port), None)


def rss_growth(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    common = [k for k in before if k in after]
    growth = {k: round(100 * (after[k] / before[k] - 1), 2) for k in common}
    total_before, total_after = sum(before[k] for k in common), sum(after[k] for k in common)
    return {"before_mib": _rounded(before), "after_mib": _rounded(after), "growth_pct": growth,
            "total_before_mib": round(total_before, 1), "total_after_mib": round(total_after, 1),
            "total_growth_pct": round(100 * (total_after / total_before - 1), 2) if total_before else None,
            "processes_gone": [k for k in before if k not in after],
            "processes_new": [k for k in after if k not in before]}


def _rounded(rss: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in rss.items()}


async def metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    async with session.get(base_url + "/metrics/json") as resp:
        return await resp.json()


def totals(snapshot: dict[str, Any], section: str) -> Counter:
    """One section of /metrics/json summed over replicas."""
    total: Counter = Counter()
    for replica in snapshot["replicas"]:
        total.update(replica[section])
    return total


async def wait_idle(session: aiohttp.ClientSession, base_url: str, timeout: float = 120.0,
                    settle: float = 1.0) -> Counter:
    """The gauges once nothing ran or waited for `settle` s (or when `timeout` ran out).

    The settling time lets a cancelled request the server has not read yet arrive.
    """
    deadline, idle_since = time.monotonic() + timeout, None
    while True:
        gauges, now = totals(await metrics(session, base_url), "gauges"), time.monotonic()
        idle = gauges["running"] == 0 and gauges["waiting"] == 0
        idle_since = (idle_since or now) if idle else None
        if (idle_since is not None and now - idle_since >= settle) or now > deadline:
            return gauges
        await asyncio.sleep(0.2)


async def kv_state(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    gauges = await wait_idle(session, base_url)
    async with session.get(base_url + "/health") as resp:
        health = resp.status
    clean = gauges["running"] == 0 and gauges["waiting"] == 0 and gauges["kv_cache_usage"] == 0
    return {"running": gauges["running"], "waiting": gauges["waiting"],
            "kv_cache_usage": gauges["kv_cache_usage"], "health": health, "clean": clean and health == 200}


# ---------------------------------------------------------------- the run
@dataclass(frozen=True, slots=True)
class SoakConfig:
    base_url: str
    server_pid: int | None = None  # RSS is skipped without it
    requests: int = 10000
    concurrency: int = 16
    warmup: int = 500
    seed: int = 0
    max_rss_growth: float = 5.0
    timeout_s: float = 120.0


@dataclass(slots=True)
class Progress:
    total: int
    started: float = field(default_factory=time.monotonic)
    rss: list[dict[str, Any]] = field(default_factory=list)

    def tick(self, done: int, pid: int | None, offset: int) -> None:
        if done % max(1, self.total // 10):
            return
        elapsed = round(time.monotonic() - self.started, 1)
        total_mib = round(sum(sample_rss(pid).values()), 1) if pid else None
        self.rss.append({"done": offset + done, "s": elapsed, "rss_mib": total_mib})
        print(f"{offset + done} requests, {elapsed} s, RSS {total_mib} MiB", file=sys.stderr, flush=True)


async def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        max_len = await _max_model_len(session, cfg.base_url)
        specs = make_workload(cfg.requests, cfg.seed, max_len)
        first = await metrics(session, cfg.base_url)
        warm = min(cfg.warmup, len(specs))
        t0 = time.monotonic()
        outcomes = await run_mix(session, cfg.base_url, specs[:warm], cfg.concurrency)
        await wait_idle(session, cfg.base_url)
        before = sample_rss(cfg.server_pid) if cfg.server_pid else None
        progress = Progress(len(specs) - warm)
        outcomes += await run_mix(session, cfg.base_url, specs[warm:], cfg.concurrency,
                                  lambda done: progress.tick(done, cfg.server_pid, warm))
        duration = time.monotonic() - t0
        kv = await kv_state(session, cfg.base_url)
        after = sample_rss(cfg.server_pid) if cfg.server_pid else None
        last = await metrics(session, cfg.base_url)
    server = {section: _delta(first, last, section) for section in ("finish_reasons", "counters")}
    return summarize(cfg, outcomes, duration, kv, (before, after), progress.rss, server)


def _delta(first: dict[str, Any], last: dict[str, Any], section: str) -> dict[str, float]:
    before, after = totals(first, section), totals(last, section)
    return {key: after[key] - before[key] for key in after}


async def _max_model_len(session: aiohttp.ClientSession, base_url: str) -> int:
    async with session.get(base_url + "/v1/models") as resp:
        return (await resp.json())["data"][0].get("max_model_len") or 1024


def summarize(cfg: SoakConfig, outcomes: list[Outcome], duration: float, kv: dict[str, Any],
              rss: tuple[dict | None, dict | None], trend: list[dict], server: dict[str, dict]) -> dict:
    errors = [o for o in outcomes if o.error]
    kinds: dict[str, Counter] = {}
    for o in outcomes:
        kinds.setdefault(o.kind, Counter())[o.state] += 1
    tokens = sum(o.tokens for o in outcomes)
    growth = rss_growth(*rss) if rss[0] and rss[1] else None
    return {"requests": len(outcomes), "by_kind": {k: dict(v) for k, v in sorted(kinds.items())},
            "invalid_400": sum(o.kind == "invalid" and o.status == 400 for o in outcomes),
            "errors": {"count": len(errors), "first": [f"{o.kind}: {o.error}" for o in errors[:10]]},
            "server_finish_reasons": server["finish_reasons"],
            "server_counters": server["counters"], "kv": kv, "rss": growth, "rss_trend": trend,
            "duration_s": round(duration, 1), "requests_per_s": round(len(outcomes) / duration, 2),
            "completion_tokens_reported": tokens, "tokens_per_s": round(tokens / duration, 1),
            "config": {"requests": cfg.requests, "concurrency": cfg.concurrency, "warmup": cfg.warmup,
                       "seed": cfg.seed, "max_rss_growth_pct": cfg.max_rss_growth}}


def failures(summary: dict[str, Any]) -> list[str]:
    """Why the soak failed; empty when it passed."""
    out = []
    if summary["errors"]["count"]:
        out.append(f"{summary['errors']['count']} requests failed")
    if summary["server_finish_reasons"].get("error"):
        out.append(f"the server ended {summary['server_finish_reasons']['error']} requests with error")
    if not summary["kv"]["clean"]:
        out.append(f"KV not clean once idle: {summary['kv']}")
    growth = (summary["rss"] or {}).get("total_growth_pct")
    if growth is not None and growth > summary["config"]["max_rss_growth_pct"]:
        out.append(f"RSS grew {growth}% after warm-up")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Soak: mixed requests, then RSS growth, errors and KV state.")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS (with --url)")
    p.add_argument("--server-args", default="", help="flags for the started server, one string")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=500, help="requests (of --requests) before the RSS baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="percent")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--json", dest="json_path", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server = None
    if args.url is None:
        command = [sys.executable, "-m", "pypto_serving", "--host", "127.0.0.1", "--port", PORT,
                   "--log-level", "warning", "--kv-cache-memory", "64MiB", *shlex.split(args.server_args)]
        server = Server("soak", command)
        server.log_path = Path(f"/tmp/soak-{server.port}.log")
        server.start()
    url = args.url or server.url
    pid = args.server_pid or (server.pid if server else pid_listening(url))
    cfg = SoakConfig(url, pid, args.requests,
                     args.concurrency, args.warmup, args.seed, args.max_rss_growth, args.timeout)
    try:
        summary = asyncio.run(run_soak(cfg))
    finally:
        if server:
            server.stop()
    if server:
        summary["server"] = {"exit_code": server.proc.returncode, "log": str(server.log_path),
                             "log_problems": _log_problems(server.log_path)}
    summary["failures"] = failures(summary)
    print(json.dumps(summary, indent=1))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["failures"] else 0


def _log_problems(path: Path) -> list[str]:
    """The server's warning, error and traceback lines (the first 20)."""
    marks = ("[warning", "[error", "[critical", "Traceback", "Error")
    return [line.rstrip() for line in path.read_text().splitlines() if any(m in line for m in marks)][:20]


if __name__ == "__main__":
    sys.exit(main())
