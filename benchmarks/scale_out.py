"""Scale-out on this host: tokens/s and TTFT of one replica on one device against tensor
parallelism (--tp 2) and data parallelism (--dp 2), and what the collectives cost a step.

    python -m benchmarks.scale_out [--model qwen2.5-coder-0.5b] [--repetitions 2]

Each configuration is its own server, with our default flags otherwise; the servers take turns
(tp1, tp2, dp2, tp1, ...) so the machine's load falls on each alike, and every figure is the
median [min, max] over the repetitions. A streamed c16 load of random-token prompts, greedy,
ignoring EOS. On a CPU this measures correctness and overhead, not a speed-up: the ranks and
replicas share the same cores (each worker gets an even share of them).

Then one profiled run per configuration with tensor parallelism (`--profile-level
e2e,kernel`): rank 0's collectives (torch.distributed's all-reduce, all-gather and the plan
broadcast, `c10d::*` in torch's profiler) as a share of its `forward` spans.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.serve_bench import BenchConfig, run_benchmark
from benchmarks.servers import Server, ours_command
from benchmarks.step_gaps import forwards, profiled
from pypto_serving.app.packaged_models import resolve_short_name

CONFIGS = {"tp1": [], "tp2": ["--tp", "2"], "dp2": ["--dp", "2"]}
# torch.distributed's ops as the calling thread sees them (the time a step waits); gloo's own
# spans (gloo:all_reduce, ...) run on its threads, inside these.
COLLECTIVES = ("c10d::allreduce_", "c10d::allgather_", "c10d::broadcast_")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def collective_share(trace: dict) -> dict:
    """Time in collective ops over time in forward steps, both on rank 0 (the device worker
    process that wrote the forward spans)."""
    steps = forwards(trace)
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == "forward"}
    outer = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in pids
             and e.get("name") in COLLECTIVES]
    step_us = sum(end - start for start, end, _ in steps)
    op_us = sum(e["dur"] for e in outer)
    return {"steps": len(steps), "collectives_per_step": round(len(outer) / max(1, len(steps)), 1),
            "collective_ms_per_step": round(op_us / 1000 / max(1, len(steps)), 2),
            "share_of_step": round(op_us / step_us, 3) if step_us else None,
            "names": sorted({e["name"] for e in outer})}


async def load(server: Server, cfg: BenchConfig) -> dict:
    result = await run_benchmark(replace(cfg, base_url=server.url, server_pid=server.pid))
    assert result.failed == 0, result.first_error
    return {"tok_s": result.output_throughput, "ttft_ms": result.ttft_ms.p50, "tpot_ms": result.tpot_ms.p50}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    model = str(resolve_short_name(args.model) or args.model)
    cfg = BenchConfig(input_len=args.input_len, output_len=args.output_len, num_prompts=args.requests,
                      concurrency=args.concurrency, temperature=0.0, ignore_eos=True, warmup=2)
    names = args.configs.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.repetitions):
        for name in names:
            server = Server(name, ours_command(model, CONFIGS[name])).start()
            try:
                runs[name].append(asyncio.run(load(server, cfg)))
            finally:
                server.stop()
    report = {name: {k: spread([r[k] for r in rs]) for k in ("tok_s", "ttft_ms", "tpot_ms")}
              for name, rs in runs.items()}
    for name in names:
        if name.startswith("tp") and name != "tp1":
            with tempfile.TemporaryDirectory() as tmp:
                extra = [*CONFIGS[name], "--profile", "--profile-output", tmp,
                         "--profile-level", "e2e,kernel"]
                server = Server(f"{name}-profiled", ours_command(model, extra)).start()
                try:
                    small = replace(cfg, num_prompts=min(16, args.requests))
                    trace, _ = asyncio.run(profiled(server, small, Path(tmp)))
                finally:
                    server.stop()
            report[name]["collectives"] = collective_share(trace)
    print(json.dumps({"model": args.model, "workload": f"c{args.concurrency} {args.input_len}/"
                      f"{args.output_len}, {args.requests} requests", "servers": report}, indent=2))


if __name__ == "__main__":
    main()
