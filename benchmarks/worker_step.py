"""Times the device worker's decode step alone (no HTTP, no pipe) on GGUF models (or HF
checkpoint directories, e.g. a random one of a family's shape from `benchmarks.random_models`).

    python -m benchmarks.worker_step [--model PATH|NAME ...] [--batch 1 16] [--steps 64]
        [--prompt 128] [--quantization auto] [--activation-quantization mixed] [--profile]
        [--linears]

Per family, e.g. `--model smollm2 qwen2.5-coder-0.5b gemma3-270m --batch 16 --prompt 512`
(packaged short names or GGUF paths). Prints, for each model and batch size, the prefill of
`batch` `--prompt`-token prompts (one step) and ms per decode step (median over `--steps`),
and with `--profile`
the functions where a batch-1 step spends its time (cProfile, sorted by own time). Compare
with the serve benchmark's inter-token latency to see what the rest of the server adds.
`--linears` also times a step's packed linears alone at batch 1 (the lm_head aside), all of
them in model order as a decode step calls them, and prints per kind and width the time per
step and the bytes of weights read per second: how near each kernel comes to the memory's
bandwidth (`benchmarks/machine_limits.py`).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch

from pypto_serving.app.packaged_models import resolve_short_name
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.loader.gguf_file import arch_from_gguf
from pypto_serving.loader.hf import arch_from_hf_config, load_hf_config
from pypto_serving.messages.worker import (
    ActivationQuantization,
    BackendName,
    DeviceConfig,
    DType,
    KVCacheConfig,
    ModelConfig,
    ModelFormat,
    QuantConfig,
    Quantization,
    ScheduledSeq,
    StepLimits,
    StepPlan,
    WorkerConfig,
)
from pypto_serving.worker.kv_cache import bytes_per_block
from pypto_serving.worker.main import freeze_loaded
from pypto_serving.worker.model_runner import ModelRunner

BLOCK = 16
MAX_LEN = 1024  # the runner's max_model_len: the prompt and every step must fit


def runner_for(path: str, max_seqs: int, quantization: str, activations: str) -> ModelRunner:
    packed = quantization != "none"
    hf = Path(path).is_dir()
    arch = arch_from_hf_config(load_hf_config(path)) if hf else arch_from_gguf(path)
    blocks, kv_dtype = max_seqs * MAX_LEN // BLOCK, torch.float16 if packed else torch.float32
    return ModelRunner(WorkerConfig(
        model=ModelConfig(path, ModelFormat.HF if hf else ModelFormat.GGUF, arch),
        device=DeviceConfig(BackendName.CPU, "cpu", DType.FLOAT32,
                            DType.FLOAT16 if packed else DType.FLOAT32),
        kv_cache=KVCacheConfig(BLOCK, blocks, blocks * bytes_per_block(arch, BLOCK, kv_dtype, torch.float32)),
        limits=StepLimits(max_num_seqs=max_seqs, max_model_len=MAX_LEN, max_num_batched_tokens=4096),
        quant=QuantConfig(Quantization(quantization),
                          ActivationQuantization(activations if packed else "none"))))


class Decoder:
    """`batch` sequences of a PROMPT-token prompt, then one decode step per call."""

    def __init__(self, runner: ModelRunner, batch: int, first_id: int, steps: int, prompt_len: int):
        self.runner, self.step_id = runner, 0
        self.seqs = list(range(first_id, first_id + batch))
        blocks = -(-(prompt_len + steps + 1) // BLOCK)
        self.tables = {s: list(range(i * blocks, (i + 1) * blocks)) for i, s in enumerate(self.seqs)}
        prompt = [(7 * i + 3) % 1000 + 10 for i in range(prompt_len)]
        plan = [ScheduledSeq(s, prompt, 0, self.tables[s], True, True, [], prompt_len, SamplingParams())
                for s in self.seqs]
        self.last = dict(zip(self.seqs, self._run(plan), strict=True))
        self.pos = prompt_len

    def _run(self, seqs: list[ScheduledSeq]) -> list[int]:
        result = self.runner.execute(StepPlan(self.step_id, seqs))
        self.step_id += 1
        return result.token_ids

    def step(self) -> None:
        plan = [ScheduledSeq(s, [self.last[s]], self.pos, [], True) for s in self.seqs]
        self.last = dict(zip(self.seqs, self._run(plan), strict=True))
        self.pos += 1

    def finish(self) -> None:
        self.runner.execute(StepPlan(self.step_id, [], self.seqs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["smollm2"],
                   help="GGUF paths, HF checkpoint directories or packaged short names (default: smollm2)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of each sequence")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"))
    p.add_argument("--activation-quantization", default="mixed", choices=("none", "int8", "int16", "mixed"),
                   help="the packed linears' inputs (default: mixed, the server's default on the cpu)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--linears", action="store_true", help="time the packed linears alone at batch 1")
    args = p.parse_args()
    if args.prompt + args.steps >= MAX_LEN:
        p.error(f"--prompt plus --steps must be below {MAX_LEN}")
    for model in args.model:
        path = str(resolve_short_name(model) or model)
        runner = runner_for(path, max(args.batch), args.quantization, args.activation_quantization)
        freeze_loaded()  # as the server's worker does after loading
        first = time_batches(runner, args)
        if args.linears:
            for kind, (ms, gbs) in time_linears(runner, args.steps).items():
                print(f"  {kind:22s} {ms:6.2f} ms/step  {gbs:5.1f} GB/s")
    if args.profile:  # the last model's
        dec = Decoder(runner, 1, first, args.steps, args.prompt)
        with cProfile.Profile() as prof:
            for _ in range(args.steps):
                dec.step()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def time_batches(runner: ModelRunner, args: argparse.Namespace) -> int:
    """Prints one line per batch size; the next free sequence id."""
    first, family = 0, runner.arch.family
    for batch in args.batch:
        t0 = time.perf_counter()
        dec = Decoder(runner, batch, first, args.steps, args.prompt)
        prefill_s = time.perf_counter() - t0
        first += batch
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            dec.step()
            times.append((time.perf_counter() - t0) * 1e3)
        dec.finish()
        ms = statistics.median(times)
        print(f"{family:7s} batch {batch:3d}: prefill {batch * args.prompt} tokens {prefill_s * 1e3:7.1f} ms "
              f"({batch * args.prompt / prefill_s:6.0f} tokens/s); decode {ms:7.2f} ms/step "
              f"(min {min(times):.2f}), {batch * 1e3 / ms:7.1f} tokens/s")
    return first


def time_linears(runner: ModelRunner, steps: int) -> dict[str, tuple[float, float]]:
    """"<name> int<bits>" -> (median ms per step over `steps` passes, GB/s of weights read)
    for the packed linears of a batch-1 step, run in model order; "all" for the whole pass."""
    from pypto_serving.models.quant import QuantLinear
    from pypto_serving.worker.memory import module_bytes

    linears = [(f"{name.rsplit('.', 1)[-1]} int{m.weight.packed.bits}", m)
               for name, m in runner.model.named_modules()
               if isinstance(m, QuantLinear) and not name.endswith("lm_head")]

    x = {m.weight.k: torch.randn(1, m.weight.k) for _, m in linears}
    times: dict[str, list[float]] = {}
    for _ in range(steps):
        step: dict[str, float] = {}
        for kind, m in linears:
            t0 = time.perf_counter()
            m(x[m.weight.k])
            step[kind] = step.get(kind, 0.0) + time.perf_counter() - t0
        step["all"] = sum(step.values())
        for kind, seconds in step.items():
            times.setdefault(kind, []).append(seconds)
    sizes: dict[str, int] = {}
    for kind, m in linears:
        sizes[kind] = sizes.get(kind, 0) + module_bytes(m)
    sizes["all"] = sum(sizes.values())
    return {kind: (statistics.median(t) * 1e3, sizes[kind] / statistics.median(t) / 1e9)
            for kind, t in sorted(times.items())}


if __name__ == "__main__":
    main()
