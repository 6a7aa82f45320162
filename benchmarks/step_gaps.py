"""Where a token's time goes outside the device: the gap between steps and the per-token
overhead of the HTTP + Python path around a batch-1 forward.

    python -m benchmarks.step_gaps [--model smollm2] [--requests 32]

Starts pypto-serving with `--profile --profile-level e2e`, records a trace while a streamed
c16 load runs and again while a c1 load runs (128/128 random token prompts, greedy), and
reads the device worker's `forward` spans from the merged trace:
- c16: the gap from the end of one forward to the start of the next, while requests run
  (the step result's trip to the API process, planning, and the next plan's trip back), and
  the planning alone (the scheduler's `schedule` span), and the batch-16 decode forwards
  themselves (to set beside `benchmarks.worker_step`'s, timed with the two cores to itself);
- c1: the median inter-token latency the client saw, less the median decode forward: what
  HTTP, detokenizing, the scheduler and the pipes add to each token.
Prints median [p10, p90] in milliseconds as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.serve_bench import BenchConfig, run_benchmark
from benchmarks.servers import Server, ours_command
from pypto_serving.app.packaged_models import resolve_short_name

BASE = BenchConfig(input_len=128, output_len=128, temperature=0.0, ignore_eos=True, warmup=2)


def forwards(trace: dict, name: str = "forward") -> list[tuple[float, float, int]]:
    """(start us, end us, tokens) of the spans called `name` (the device worker's forward
    steps by default; "schedule": the API process planning a step), in time order."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == name]
    return sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("tokens", 0)) for e in spans)


def gaps_ms(spans: list[tuple[float, float, int]]) -> list[float]:
    """Idle time between consecutive forwards (a gap over 50 ms is the load's start or end)."""
    gaps = [(b[0] - a[1]) / 1000 for a, b in zip(spans, spans[1:], strict=False)]
    return [g for g in gaps if g < 50]


def quantiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return {"median": round(statistics.median(values), 3), "p10": round(cuts[0], 3),
            "p90": round(cuts[-1], 3), "count": len(values)}


async def profiled(server: Server, cfg: BenchConfig, out: Path) -> tuple[dict, object]:
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        (await client.post("/start_profile")).raise_for_status()
        result = await run_benchmark(replace(cfg, base_url=server.url))
        (await client.post("/stop_profile")).raise_for_status()
    return json.loads((out / "trace.json").read_text()), result


async def measure(server: Server, out: Path, requests: int) -> dict:
    c16, _ = await profiled(server, replace(BASE, concurrency=16, num_prompts=requests), out)
    c1, result = await profiled(server, replace(BASE, concurrency=1, num_prompts=max(2, requests // 8)), out)
    decode = [(e - s) / 1000 for s, e, tokens in forwards(c1) if tokens == 1]
    itl = result.itl_ms.p50
    planning = [(e - s) / 1000 for s, e, _ in forwards(c16, "schedule")]
    full = [(e - s) / 1000 for s, e, tokens in forwards(c16) if tokens == 16]
    return {"c16_gap_between_forwards_ms": quantiles(gaps_ms(forwards(c16))),
            "c16_planning_ms": quantiles(planning),
            "c16_decode_forward_ms": quantiles(full) if full else None,
            "c1_itl_ms": round(itl, 3), "c1_decode_forward_ms": quantiles(decode),
            "c1_overhead_per_token_ms": round(itl - statistics.median(decode), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=32, help="c16 requests (c1 runs an eighth)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        command = ours_command(str(resolve_short_name(args.model) or args.model),
                               ["--profile", "--profile-output", str(out), "--profile-level", "e2e"])
        server = Server("ours", command).start()
        try:
            print(json.dumps(asyncio.run(measure(server, out, args.requests)), indent=2))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
