"""How close a fast path's numbers are to the exact path's, teacher-forced over mixed text.

    python -m benchmarks.quality [--model smollm2] [--tokens 2048] [--window 512]

Runs the model in this process twice through `ModelRunner` (the device worker's own code,
configured as the server configures it): the exact path (`--quantization none
--activation-quantization none`, float32 KV cache: equal to `transformers`) and the server's
default on the cpu backend (`auto` packing, `int8` activations, float16 KV cache), over the
same windows of text (prose and code from this repository), with logits at every position.
Prints top-1 agreement with the exact path and both perplexities as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.worker_step import BLOCK, MAX_LEN, runner_for
from pypto_serving.app.packaged_models import resolve_short_name
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import ScheduledSeq, StepPlan
from pypto_serving.tokenizer.tokenizer import Tokenizer
from pypto_serving.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parent.parent

EXACT = ("none", "none")


def corpus() -> str:
    """Prose and code, as a server sees both."""
    parts = [(ROOT / "README.md").read_text(), (ROOT / "docs" / "architecture.md").read_text()]
    parts += [p.read_text() for p in sorted((ROOT / "pypto_serving" / "core").glob("*.py"))]
    return "\n\n".join(parts)


def window_logits(r: ModelRunner, ids: list[int], seq_id: int) -> torch.Tensor:
    """Logits at every position of one window, prefilled in one step."""
    blocks = list(range(-(-len(ids) // BLOCK)))
    seq = ScheduledSeq(seq_id, ids, 0, blocks, True, True, [], len(ids), SamplingParams())
    forward, kept = r._forward, []

    def every_row(batch, kv_caches):  # logits at every row kept; the sampler sees the last
        kept.append(forward(dataclasses.replace(batch, sample_rows=torch.arange(len(ids))), kv_caches))
        return kept[0][-1:]

    r._forward = every_row
    try:
        r.execute(StepPlan(seq_id, [seq], finished=[seq_id - 1]))
    finally:
        r._forward = forward
    return kept[0]


def measure(path: str, ids: list[int], window: int, activations: str = "int8") -> dict:
    """The fast path: `auto` packing with `activations` (int8 by default, as served)."""
    paths = {"exact": EXACT, "default": ("auto", activations)}
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]
    out = {}
    for name, (quantization, activations) in paths.items():
        t0 = time.monotonic()
        r = runner_for(path, 1, quantization, activations)
        out[name] = [window_logits(r, w, i + 1) for i, w in enumerate(windows)]
        print(f"{name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    agree = total = 0
    nll = dict.fromkeys(paths, 0.0)
    for i, w in enumerate(windows):
        target = torch.tensor(w[1:])
        exact, fast = out["exact"][i][:-1], out["default"][i][:-1]
        agree += int((exact.argmax(-1) == fast.argmax(-1)).sum())
        total += len(target)
        for name in paths:
            logp = torch.log_softmax(out[name][i][:-1].double(), -1)
            nll[name] -= float(logp.gather(1, target[:, None]).sum())
    ppl = {name: math.exp(v / total) for name, v in nll.items()}
    return {"positions": total, "top1_agreement": agree / total, "perplexity": ppl,
            "perplexity_ratio": ppl["default"] / ppl["exact"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512, help=f"tokens per prefill (at most {MAX_LEN})")
    p.add_argument("--activation-quantization", default="int8", choices=("int8", "int16", "none"),
                   help="the fast path's activations (default int8, the server's default)")
    args = p.parse_args()
    if not 1 < args.window <= MAX_LEN:
        p.error(f"--window must be in 2..{MAX_LEN}")
    path = str(resolve_short_name(args.model))
    ids = Tokenizer.load(path).encode(corpus(), add_special_tokens=False)[: args.tokens + 1]
    result = measure(path, ids, args.window, args.activation_quantization)
    print(json.dumps({"model": args.model, "activations": args.activation_quantization, **result}, indent=2))


if __name__ == "__main__":
    main()
