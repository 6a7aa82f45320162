"""What this machine allows on each workload of `benchmarks/compare.py`, and how near each
server came to it: the largest ratio to llama-server a target can ask for here.

    python benchmarks/machine_limits.py --json limits.json
    python benchmarks/compare.py --json compare.json [--model M]
    python -m benchmarks.roofline --limits limits.json --results compare.json [--model M]

A dense decoder's least time for a workload (its GGUF's shapes and tensor bytes), with every
step at the machine's measured limits and nothing between steps:
- prefill: every prompt token's linear multiply-adds at the int8 inner loop's roof
  (`vpmaddubsw` + `vpaddw`, `int8_roof.c`), a prefix the prompts share counted once; the
  prompt's causal attention (QK and PV, L^2 / 2 per head each) at the fp32 GEMM rate;
- decode, in waves of `concurrency` sequences in lockstep: per step the larger of reading the
  layers' and the head's bytes (as the file stores them) at the memory's read rate and the
  step's multiply-adds at the roof (the head's at half of `vpmaddubsw` alone: int16
  activations), plus reading every sequence's keys and values (float16) at the read rate.
Activations are taken at int8 everywhere: the default's second planes and int16 edge layers
(~1.2x the prefill's multiply-adds) only lower what is possible.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pypto_serving.app.packaged_models import resolve_short_name  # noqa: E402
from pypto_serving.loader.arch import ModelArch  # noqa: E402
from pypto_serving.loader.gguf_file import arch_from_gguf  # noqa: E402
from pypto_serving.loader.gguf_reader import read_gguf  # noqa: E402

KV_BYTES = 2  # float16 keys and values, as both servers keep them


@dataclass(frozen=True, slots=True)
class Limits:
    int8_gmacs: float  # the int8 x int4 inner loop's roof
    head_gmacs: float  # int16 activations: vpmaddwd, half the multiply-adds of vpmaddubsw
    fma_gmacs: float  # fp32, for attention
    read_gbs: float

    @classmethod
    def from_measurements(cls, rows: list[dict], read_gbs: float | None = None) -> Limits:
        value = {r["name"]: r["value"] for r in rows}
        return cls(value["int8 dot roof, vpmaddubsw + vpaddw"],
                   value["int8 dot roof, vpmaddubsw alone"] / 2,
                   value["GEMM float32 square 1024"] / 2,
                   read_gbs or value["memory read"])


@dataclass(frozen=True, slots=True)
class Model:
    layer_macs: int  # the linears of all layers, per token
    head_macs: int  # per sampled token
    weight_bytes: int  # read by a decode step: the layers and the head
    layers: int
    heads: int
    kv_width: int  # kv heads x head_dim
    head_dim: int

    @classmethod
    def from_gguf(cls, path: str) -> Model:
        arch = arch_from_gguf(path)
        if arch.num_experts or arch.deepseek_v4 or arch.sliding_layers:
            raise SystemExit(f"{path}: the roofline covers dense decoders with full attention only")
        return cls(_layer_macs(arch) * arch.num_layers, arch.vocab_size * arch.hidden_size,
                   _step_bytes(path), arch.num_layers, arch.num_heads,
                   arch.num_kv_heads * arch.head_dim, arch.head_dim)


def _layer_macs(arch: ModelArch) -> int:
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return arch.hidden_size * (q + 2 * kv + 3 * arch.intermediate_size) + q * arch.hidden_size


def _step_bytes(path: str) -> int:
    """The bytes of the layers' tensors and of the head (the embedding where it is tied)."""
    gguf = read_gguf(path)
    starts = sorted((t.start, name) for name, t in gguf.tensors.items())
    ends = [s for s, _ in starts[1:]] + [len(gguf.buffer)]
    size = {name: end - start for (start, name), end in zip(starts, ends, strict=True)}
    head = "output.weight" if "output.weight" in size else "token_embd.weight"
    return sum(n for name, n in size.items() if name.startswith("blk.")) + size[head]


def least_seconds(model: Model, limits: Limits, config: dict) -> float:
    """The least time of a workload (`serve_bench`'s config) on this machine (see the
    module's docstring)."""
    n, c = config["num_prompts"], config["concurrency"]
    shared = config["prefix_len"] if config["dataset"] == "shared-prefix" else 0
    prompt = config["input_len"] + shared
    prefill_tokens = n * prompt - (n - 1) * shared
    seconds = prefill_tokens * model.layer_macs / (limits.int8_gmacs * 1e9)
    causal = model.layers * model.heads * model.head_dim * prompt * prompt  # QK and PV, L^2 / 2 each
    seconds += n * causal / (limits.fma_gmacs * 1e9)
    for wave in range(math.ceil(n / c)):
        seqs = min(c, n - wave * c)
        compute = seqs * (model.layer_macs / limits.int8_gmacs + model.head_macs / limits.head_gmacs) / 1e9
        weights = model.weight_bytes / (limits.read_gbs * 1e9)
        for step in range(config["output_len"]):
            kv = seqs * model.layers * 2 * model.kv_width * KV_BYTES * (prompt + step)
            seconds += max(weights, compute) + kv / (limits.read_gbs * 1e9)
    return seconds


def report(model: Model, limits: Limits, results: list[dict]) -> list[dict]:
    """Per workload: the roof's output tok/s, each server's median and share of it, and the
    largest ratio to llama-server the roof allows (roof / llama's median)."""
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in results):
        servers = {r["server"]: r["runs"] for r in results if r["workload"] == workload}
        first = next(iter(servers.values()))[0]
        roof = first["total_output_tokens"] / least_seconds(model, limits, first["config"])
        row = {"workload": workload, "roof_tok_s": round(roof, 1)}
        for name, runs in servers.items():
            median = statistics.median(run["output_throughput"] for run in runs)
            row[name] = {"tok_s": round(median, 1), "of_roof": round(median / roof, 3)}
        if "llama" in servers:
            row["roof_over_llama"] = round(roof / row["llama"]["tok_s"], 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limits", required=True, help="benchmarks/machine_limits.py --json output")
    p.add_argument("--results", required=True, help="benchmarks/compare.py --json output")
    p.add_argument("--model", default="smollm2", help="the GGUF compare.py ran (a packaged name or path)")
    p.add_argument("--read-gbs", type=float, default=None,
                   help="memory read rate in GB/s (default: machine_limits' `memory read`)")
    args = p.parse_args(argv)
    limits = Limits.from_measurements(json.loads(Path(args.limits).read_text()), args.read_gbs)
    model = Model.from_gguf(str(resolve_short_name(args.model)))
    rows = report(model, limits, json.loads(Path(args.results).read_text()))
    print(json.dumps({"limits": dataclasses.asdict(limits), "weight_bytes_per_step": model.weight_bytes,
                      "workloads": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
