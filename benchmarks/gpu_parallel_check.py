"""The device check of tensor and data parallelism on CUDA (run by gpu_parallel_check.sh on a
machine with NVIDIA GPUs; nothing is fetched there).

With two GPUs or more: a tiny random Llama and Qwen2 at `--tp 2` over nccl against `--tp 1`,
both on CUDA in float32: greedy tokens equal for 12 steps, top-5 logprobs within 1e-3. With
one GPU: one replica on CUDA (`--dp 1`) against the portable backend on the CPU, the same way.
Prints one JSON line per check and exits 1 if any differs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import msgspec
import torch

from pypto_serving.messages.worker import BackendName, ParallelConfig
from tests.parallel.test_tensor_parallel import _tiny, decode, group_config


def on(cfg, backend: str, device: str, tp: int = 1):
    dev = msgspec.structs.replace(cfg.device, backend=BackendName(backend), device=device)
    parallel = ParallelConfig(tp, list(range(tp)), timeout_s=120)
    return msgspec.structs.replace(cfg, device=dev, parallel=parallel)


def check(name: str, reference, candidate) -> bool:
    (tokens_a, tops_a), (tokens_b, tops_b) = asyncio.run(decode(reference)), asyncio.run(decode(candidate))
    worst = (torch.tensor(tops_a) - torch.tensor(tops_b)).abs().max().item()
    ok = tokens_a == tokens_b and worst < 1e-3
    print(json.dumps({"check": name, "tokens_equal": tokens_a == tokens_b, "max_logprob_diff": worst,
                      "ok": ok}), flush=True)
    return ok


def main() -> int:
    gpus = torch.cuda.device_count()
    print(json.dumps({"gpus": gpus, "torch": torch.__version__,
                      "nccl": torch.distributed.is_nccl_available()}), flush=True)
    if gpus == 0:
        print("no CUDA device", file=sys.stderr)
        return 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, extra in (("Llama", {}), ("Qwen2", {"tie_word_embeddings": True})):
            path = _tiny(Path(tmp) / kind, kind, **extra)
            cfg = group_config(path, 1)
            if gpus >= 2:
                results.append(check(f"{kind} tp=2 vs tp=1 on cuda", on(cfg, "cuda", "cuda:0"),
                                     on(cfg, "cuda", "cuda:0", tp=2)))
            else:
                results.append(check(f"{kind} dp=1 on cuda vs portable on the cpu",
                                     on(cfg, "portable", "cpu"), on(cfg, "cuda", "cuda:0")))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
