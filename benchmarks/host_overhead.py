"""The API process's CPU time per generated token under many streams, on a model too small to
matter: what bounds serving at high concurrency on a fast device (on the H200, 256 streams took
15-23 ms a token over a 2.9 ms step; docs/performance.md "On a GPU").

    python -m benchmarks.host_overhead [--streams 256] [--output-len 128] [--reps 2]

Writes a random two-layer Qwen2 checkpoint with a word-level tokenizer (benchmarks/gpu_check's
small shape), serves it on the CPU, runs `--streams` concurrent streams of `--input-len`-token
prompts with `--output-len` new tokens each (greedy, ignore_eos), and reports, per repetition:
output tok/s, TPOT p50, and the API process's CPU microseconds per output token (user +
system, from /proc, the whole run including prefills), besides the device worker's. The last
is the figure to compare between versions: unlike tok/s it does not depend on what else the
two cores were doing. `--server-args` passes more flags to our server.

`--scheduler`: the scheduling policy alone instead (no server): microseconds a sequence of
`Scheduler.step` over 400 decode steps of `--streams` sequences (async scheduling, every
result answered with one token a sequence).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import transformers

from benchmarks.gpu_check import SMALL, word_tokenizer
from benchmarks.serve_bench import BenchConfig, run_benchmark
from benchmarks.servers import Server, ours_command


def cpu_seconds(proc: psutil.Process) -> tuple[float, float]:
    """(the process's own CPU seconds, its children's: the device workers)"""
    own = proc.cpu_times()
    kids = 0.0
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
            kids += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return own.user + own.system, kids


def write_model(path: Path) -> None:
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).save_pretrained(path)
    word_tokenizer(path, SMALL["vocab_size"])


def measure(server: Server, streams: int, input_len: int, output_len: int) -> dict[str, float]:
    cfg = BenchConfig(base_url=server.url, input_len=input_len, output_len=output_len,
                      num_prompts=streams, concurrency=streams, temperature=0.0, ignore_eos=True,
                      warmup=0, vocab_low=10, vocab_high=SMALL["vocab_size"])
    asyncio.run(run_benchmark(dataclasses.replace(cfg, num_prompts=2, output_len=8)))  # warm-up
    proc = psutil.Process(server.pid)
    api0, worker0 = cpu_seconds(proc)
    result = asyncio.run(run_benchmark(cfg))
    api1, worker1 = cpu_seconds(proc)
    tokens = max(1, result.total_output_tokens)
    return dict(failed=result.failed, output_tok_s=round(result.output_throughput),
                tpot_p50_ms=round(result.tpot_ms.p50, 2),
                api_us_per_token=round((api1 - api0) / tokens * 1e6, 1),
                worker_us_per_token=round((worker1 - worker0) / tokens * 1e6, 1))


def scheduler_step_us(streams: int, steps: int = 400) -> float:
    """Microseconds a sequence a step of the pure Scheduler, decode steps only."""
    from pypto_serving.core.block_allocator import BlockAllocator
    from pypto_serving.core.sampling_params import SamplingParams
    from pypto_serving.core.scheduler import Scheduler, SchedulerConfig
    from pypto_serving.core.sequence import Sequence
    from pypto_serving.messages.worker import StepResult

    cfg = SchedulerConfig(max_num_seqs=streams, max_num_batched_tokens=max(8192, 32 * streams),
                          max_model_len=2048, async_scheduling=True)
    policy = Scheduler(cfg, BlockAllocator(streams * 2048 // 16 + 16, 16))
    for i in range(streams):
        policy.add(Sequence(i, tuple(range(10, 42)), steps + 8, SamplingParams(), frozenset()))
    plans = [policy.schedule(), policy.schedule()]  # the prefill, and the decode planned ahead
    policy_step = policy.step
    gc.collect()
    gc.freeze()  # what importing torch made is not walked by the collections the steps cause
    t0 = time.perf_counter()
    for _ in range(steps):
        plan = plans.pop(0)
        sampled = [s.seq_id for s in plan.seqs if s.sample]
        nxt, _ = policy_step(StepResult(plan.step_id, sampled, [7] * len(sampled)))
        if nxt is not None:
            plans.append(nxt)
    return (time.perf_counter() - t0) / steps / streams * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--server-args", default="", help="more flags for our server, one string")
    p.add_argument("--scheduler", action="store_true", help="time the scheduling policy alone")
    args = p.parse_args(argv)
    if args.scheduler:
        us = sorted(scheduler_step_us(args.streams) for _ in range(max(args.reps, 3)))
        print(json.dumps(dict(streams=args.streams, scheduler_us_per_seq_step=[round(u, 2) for u in us])))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        write_model(model)
        extra = ["--max-num-seqs", str(args.streams), "--max-model-len",
                 str(args.input_len + args.output_len + 16), "--kv-cache-memory", "256MiB",
                 *shlex.split(args.server_args)]
        server = Server("host-overhead", ours_command(str(model), extra), startup_timeout=300)
        server.start()
        try:
            rows = [measure(server, args.streams, args.input_len, args.output_len) for _ in range(args.reps)]
        finally:
            server.stop()
    for row in rows:
        print(json.dumps(row), flush=True)
    api = [r["api_us_per_token"] for r in rows]
    print(json.dumps(dict(streams=args.streams, api_us_per_token_median=statistics.median(api),
                          api_us_per_token_range=[min(api), max(api)])))
    return 0 if not any(r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
