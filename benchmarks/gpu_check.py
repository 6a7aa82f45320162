"""The CUDA backend's device check (issue 20), one command for a machine with an NVIDIA GPU and
no internet (run by benchmarks/gpu_check.sh, which installs the carried wheels first):

    python -m benchmarks.gpu_check [--dry-run]

(a) correctness: tiny random Llama, Qwen2 and Qwen3 checkpoints on `--backend cuda` against
    the portable backend on the CPU: greedy tokens equal for 32 steps in float32, logprobs
    within bf16 tolerance in bfloat16;
(b) speed: a random model of Qwen2.5-Coder-0.5B's shape (the GGUF files are larger than what a
    device run can carry) in bfloat16: a 2,048-token prefill, with its share of the bf16
    tensor-core peak, and the decode step at batch 1, 16, 64, 256, once replaying the decode
    graphs and once with --enforce-eager, through the model runner (start-up time, captured
    sizes and the KV budget's arithmetic of each runner too);
(c) serving: the real HTTP server on that model (a word-level tokenizer over its whole
    vocabulary, so random token prompts decode), 256 concurrent streams of 128-token prompts
    and 256 new tokens: output tok/s, TTFT p50/p99, TPOT p50.
Prints one JSON line per result. `--dry-run`: the same flow on the CPU with small shapes and
the portable backend, to check the script itself where no GPU is.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import transformers

from benchmarks.serve_bench import BenchConfig, run_benchmark
from benchmarks.servers import Server, ours_command
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import BackendName, DType, ScheduledSeq, StepPlan, WorkerConfig
from pypto_serving.worker.model_runner import ModelRunner
from tests.parallel.test_tensor_parallel import _tiny, decode
from tests.worker.tiny_models import worker_config

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                tie_word_embeddings=True, rope_theta=1e6)
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True)
BF16_PEAK_TFLOPS = 790.0  # a bf16 8192^3 matmul through PyTorch on this H200 (device notes)


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def on_device(cfg: WorkerConfig, backend: str, device: str, dtype: str) -> WorkerConfig:
    dev = msgspec.structs.replace(cfg.device, backend=BackendName(backend), device=device,
                                  dtype=DType(dtype), kv_cache_dtype=DType.AUTO)
    return msgspec.structs.replace(cfg, device=dev)


def correctness(tmp: Path, backend: str, device: str) -> bool:
    ok = True
    kinds = (("Llama", {}), ("Qwen2", {"tie_word_embeddings": True}), ("Qwen3", {"head_dim": 32}))
    for kind, extra in kinds:
        cfg = worker_config(_tiny(tmp / kind, kind, **extra))
        ref = asyncio.run(decode(on_device(cfg, "portable", "cpu", "float32"), 32))
        for dtype, tol in (("float32", 1e-3), ("bfloat16", 0.1)):
            got = asyncio.run(decode(on_device(cfg, backend, device, dtype), 32))
            agreed = [common_prefix(a, b) for a, b in zip(got[0], ref[0], strict=True)]
            diff = max(((torch.tensor(a[: n + 1]) - torch.tensor(b[: n + 1])).abs().max().item()
                        for a, b, n in zip(got[1], ref[1], agreed, strict=True)), default=0.0)
            same = got[0] == ref[0]
            # bf16 may pick the other of two near-tied tokens; the logprobs compare up to there
            good = diff < tol and (same or dtype != "float32")
            ok &= good
            emit(check=f"{kind} {backend} {dtype} vs portable float32", tokens_equal=same,
                 steps_agreed=agreed, max_logprob_diff=round(diff, 5), ok=good)
    return ok


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _runner(path: Path, backend: str, device: str, batch: int, budget: int, eager: bool) -> ModelRunner:
    dtype = "bfloat16" if backend == "cuda" else "float32"
    cfg = worker_config(path, backend=backend, device=device, dtype=dtype, block_size=16,
                        max_num_blocks=batch * 12 + 160, kv_cache_bytes=1 << 30, max_num_seqs=batch,
                        max_model_len=budget + 64, max_num_batched_tokens=budget)
    return ModelRunner(msgspec.structs.replace(cfg, device=msgspec.structs.replace(cfg.device,
                                                                                   enforce_eager=eager)))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def speed(path: Path, backend: str, device: str, batches: list[int], prefill: int,
          flops_per_token: float) -> None:
    """The prefill once (eager either way), the decode steps with the decode graphs and with
    --enforce-eager, each on a runner of its own."""
    for eager in (False, True):
        t0 = time.perf_counter()
        runner = _runner(path, backend, device, max(batches), prefill, eager)
        emit(runner="eager" if eager else "graphs", graph_sizes=runner.graph_sizes,
             start_s=round(time.perf_counter() - t0, 2), kv_budget=runner.budget.how)
        if not eager:
            prefill_speed(runner, device, prefill, flops_per_token)
        for batch in batches:
            decode_speed(runner, device, batch, "off" if eager or not runner.graph_sizes else "on")
        del runner
        if device.startswith("cuda"):
            gc.collect()  # the runner's cycles hold its KV cache until collected
            torch.cuda.empty_cache()
            emit(after=f"{'eager' if eager else 'graphs'} runner",
                 reserved_mib=torch.cuda.memory_reserved() >> 20)


def prefill_speed(runner: ModelRunner, device: str, prefill: int, flops_per_token: float) -> None:
    seq = ScheduledSeq(0, list(range(1, prefill + 1)), 0, list(range(-(-prefill // 16))), True, reset=True,
                       num_prompt_tokens=prefill, sampling=SamplingParams())
    times = []
    for step in range(3):
        _sync(device)
        t0 = time.perf_counter()
        runner.execute(StepPlan(step, [seq], [0]))
        _sync(device)
        times.append(time.perf_counter() - t0)
    ms = min(times[1:]) * 1000
    tflops = flops_per_token * prefill / (ms / 1000) / 1e12
    emit(measure=f"prefill {prefill} tokens", ms=round(ms, 2), tflops=round(tflops, 1),
         share_of_bf16_peak=round(tflops / BF16_PEAK_TFLOPS, 3))


def decode_speed(runner: ModelRunner, device: str, batch: int, graphs: str) -> None:
    """The median of 20 decode steps of `batch` sequences 128 tokens in (after 4 warm-ups)."""
    plan = [ScheduledSeq(i, [5 + i] * 128, 0, list(range(i * 12, i * 12 + 12)), True, reset=True,
                         num_prompt_tokens=128, sampling=SamplingParams()) for i in range(batch)]
    result = runner.execute(StepPlan(100, plan, [0]))
    laps = []
    for step in range(24):
        seqs = [ScheduledSeq(i, [result.token_ids[i]], 128 + step, [], True) for i in range(batch)]
        _sync(device)
        t0 = time.perf_counter()
        result = runner.execute(StepPlan(101 + step, seqs))
        _sync(device)
        laps.append(time.perf_counter() - t0)
    ms = statistics.median(laps[4:]) * 1000
    emit(measure=f"decode step, batch {batch}", cuda_graphs=graphs, ms=round(ms, 3),
         tok_s=round(batch / ms * 1000))
    runner.execute(StepPlan(200, [], list(range(batch))))


def word_tokenizer(path: Path, vocab: int) -> None:
    """tokenizer.json: one word per id ("w0" ... ), so every id the model may sample decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{vocab - 1}"}))


def serving(path: Path, backend: str, loads: list[int], input_len: int, output_len: int, vocab: int) -> None:
    """One server (`--max-num-seqs` the largest load), then each load in turn: `c` concurrent
    streams of `c` requests from 64 up, else of `2c + 2` (c1: 4, c16: 34)."""
    extra = ["--backend", backend, "--max-num-seqs", str(max(loads)),
             "--max-model-len", str(input_len + output_len + 16)]  # the later flags win
    if backend != "cuda":
        extra += ["--kv-cache-memory", "256MiB"]
    server = Server("gpu-check", ours_command(str(path), extra), startup_timeout=600)
    try:
        server.start()
    except SystemExit as failed:  # the server's own log says why; it lives on the device only
        log = server.log_path
        emit(measure="serving", failed=str(failed), log_tail=log.read_text()[-4000:] if log.is_file() else "")
        return
    try:
        for streams in loads:
            cfg = BenchConfig(base_url=server.url, input_len=input_len, output_len=output_len,
                              num_prompts=streams if streams >= 64 else 2 * streams + 2,
                              concurrency=streams, temperature=0.0, ignore_eos=True, warmup=2,
                              vocab_low=10, vocab_high=min(5000, vocab), server_pid=server.pid)
            result = asyncio.run(run_benchmark(cfg))
            emit(measure=f"serving {streams} streams {input_len}/{output_len}", failed=result.failed,
                 first_error=result.first_error, output_tok_s=round(result.output_throughput),
                 ttft_p50_ms=round(result.ttft_ms.p50), ttft_p99_ms=round(result.ttft_ms.p99),
                 tpot_p50_ms=round(result.tpot_ms.p50, 2))
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the CPU, small shapes, the portable backend")
    p.add_argument("--parts", default="correctness,speed,serving",
                   help="which of (a), (b), (c) to run, comma-separated (default: all)")
    p.add_argument("--loads", default=None, help="the serving loads' concurrencies, comma-separated "
                   "(default 256, with --dry-run 1,4; 1,16,256 adds the latency ones)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 1
    backend, device = ("portable", "cpu") if dry else ("cuda", "cuda:0")
    emit(torch=torch.__version__, device=torch.cuda.get_device_name(0) if not dry else "cpu (dry run)")
    shape = SMALL if dry else QWEN_05B
    with tempfile.TemporaryDirectory() as tmp:
        ok = correctness(Path(tmp), backend, device) if "correctness" in parts else True
        model = Path(tmp) / "qwen-shape"
        torch.manual_seed(0)
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
        params = sum(p.numel() for p in hf.parameters())
        hf.to(torch.bfloat16).save_pretrained(model)
        word_tokenizer(model, shape["vocab_size"])
        if "speed" in parts:
            batches = [1, 4] if dry else [1, 16, 64, 256]
            speed(model, backend, device, batches, 256 if dry else 2048, 2 * params)
        loads = [int(c) for c in (args.loads or ("1,4" if dry else "256")).split(",")]
        if "serving" in parts:
            serving(model, backend, loads, *((32, 16) if dry else (128, 256)), shape["vocab_size"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
