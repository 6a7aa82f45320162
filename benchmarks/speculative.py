"""N-gram speculative decoding against plain decoding, side by side, on an input-grounded
workload (each prompt is a piece of this repository's code and the start of a copy of it).

    python -m benchmarks.speculative [--model qwen2.5-coder-0.5b] [--reps 2] [--k 5]

Starts pypto-serving twice on the same model (default flags, plus `--speculative-config
'{"method": "ngram", "num_speculative_tokens": K}'` for the second), runs each workload (c1
and c16, greedy, 256-token pieces and 256 new tokens) on both alternately, prints output
tok/s and TPOT per run, the ratio speculative / plain as median [min, max] over repetitions,
and whether every prompt's text was the same on both (greedy speculation must not change
it; where not, where the first one parts).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import replace

import httpx

from benchmarks.serve_bench import BenchConfig, BenchResult, run_benchmark
from benchmarks.servers import Server, ours_command
from pypto_serving.app.packaged_models import resolve_short_name

REWRITE = BenchConfig(dataset="rewrite", input_len=256, output_len=256, warmup=1, temperature=0.0)
LOADS = {"c1": replace(REWRITE, num_prompts=4, concurrency=1),
         "c16": replace(REWRITE, num_prompts=16, concurrency=16)}


def accepted(url: str) -> dict:
    return httpx.get(url + "/metrics/json").json()["replicas"][0].get("spec_decode", {})


async def run(servers: dict[str, Server], reps: int) -> dict[tuple[str, str], list[BenchResult]]:
    runs: dict[tuple[str, str], list[BenchResult]] = {}
    for rep in range(reps):
        for load, cfg in LOADS.items():
            names = list(servers) if rep % 2 == 0 else list(servers)[::-1]
            for name in names:
                server = servers[name]
                result = await run_benchmark(replace(cfg, base_url=server.url, server_pid=server.pid,
                                                     seed=100 * rep + 1))
                runs.setdefault((load, name), []).append(result)
                print(f"rep {rep} {load:<4} {name:<6} out {result.output_throughput:6.1f} tok/s  "
                      f"TPOT p50 {result.tpot_ms.p50:6.1f} ms  failed {result.failed}", flush=True)
    return runs


def first_difference(plain: list[BenchResult], fast: list[BenchResult]) -> str | None:
    """Where the first prompt whose texts differ parts, with some context; None: all equal."""
    for rep, (p, f) in enumerate(zip(plain, fast, strict=True)):
        for i, (a, b) in enumerate(zip(p.texts, f.texts, strict=True)):
            if a != b:
                j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                at = slice(max(0, j - 30), j + 30)
                return f"rep {rep} prompt {i} at char {j}: {a[at]!r} / {b[at]!r}"
    return None


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    args = p.parse_args()
    model = str(resolve_short_name(args.model) or args.model)
    spec = f'{{"method": "ngram", "num_speculative_tokens": {args.k}}}'
    commands = {"plain": ours_command(model, []),
                "ngram": ours_command(model, ["--speculative-config", spec])}
    servers = {name: Server(name, command, startup_timeout=900).start() for name, command in commands.items()}
    try:
        runs = asyncio.run(run(servers, args.reps))
        stats = accepted(servers["ngram"].url)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{'workload':<10}{'plain tok/s':>26}{'ngram tok/s':>26}{'ratio':>22}  same text")
    for load in LOADS:
        plain, fast = runs[(load, "plain")], runs[(load, "ngram")]
        ratios = [f.output_throughput / p.output_throughput for p, f in zip(plain, fast, strict=True)]
        difference = first_difference(plain, fast)
        print(f"{load:<10}{spread([r.output_throughput for r in plain]):>26}"
              f"{spread([r.output_throughput for r in fast]):>26}{spread(ratios):>22}  {difference is None}")
        if difference:
            print(f"  texts part: {difference}")
    if stats.get("num_draft_tokens"):
        kept, proposed = stats["num_accepted_tokens"], stats["num_draft_tokens"]
        print(f"proposals kept: {kept} of {proposed} ({kept / proposed:.0%}) in {stats['num_drafts']} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
