"""How close a fast path's numbers are to the exact path's, teacher-forced over mixed text.

    python -m benchmarks.quality [--model smollm2] [--tokens 2048] [--window 512]
    python -m benchmarks.quality --api [--servers mixed,int8,int16,llama]

Both modes score the same windows of text (prose and code from this repository, frozen in
quality_corpus.txt) with prompt logprobs, and print, per path, top-1 agreement with the exact
path (the most likely token at a position is the same), perplexity (and its excess over the
exact path's) and the true tokens' mean |logprob - the exact path's| as JSON.

In process (the default), the device worker's own `ModelRunner` runs twice, configured as
the server configures it: the exact path (`--quantization none --activation-quantization
none`, float32 KV cache: equal to `transformers`) and the default on the cpu backend (`auto`
packing, `mixed` activations, float16 KV cache; `--activation-quantization` picks another).

With `--api` every path is a server started for the run and scored through HTTP: ours
(`/v1/completions` with `prompt_logprobs: 1` and `max_tokens: 1`; `exact`, `mixed` (the
default flags), `int8`, `int16`), and llama.cpp's llama-server on the same GGUF (`llama`): it has no prompt
logprobs, so each position is one `/completion` request for the window's tokens so far
(`n_predict: 1`, `n_probs`: the predicted token's logprob and the top candidates; its prompt
cache makes each request a one-token step). Its perplexity counts a position only when the
true token is among its top `--llama-probs`; positions where it is not are counted and
reported (`unscored`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.worker_step import BLOCK, MAX_LEN, runner_for
from pypto_serving.app.packaged_models import resolve_short_name
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import ScheduledSeq, StepPlan
from pypto_serving.tokenizer.tokenizer import Tokenizer
from pypto_serving.worker.model_runner import ModelRunner

OUR_FLAGS = {"exact": ["--quantization", "none", "--activation-quantization", "none"],
             "mixed": [], "int8": ["--activation-quantization", "int8"],
             "int16": ["--activation-quantization", "int16"]}


@dataclass(frozen=True, slots=True)
class Scores:
    """Per scored position: the true token's logprob (None: not known) and the top-1 id."""

    logprobs: list[float | None]
    top1: list[int]


CORPUS = Path(__file__).with_name("quality_corpus.txt")


def corpus() -> str:
    """Prose and code, as a server sees both: this repository's README, docs/architecture.md
    and core/*.py as they stood on 2026-12-03 (2dfea95), their first 48 KiB (~14,000 SmolLM2
    tokens). Frozen: read from the live files, the figures moved with every README edit."""
    return CORPUS.read_text()


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [w for i in range(0, len(ids) - 1, window) if len(w := ids[i:i + window]) > 1]


def compare(scores: dict[str, Scores], exact: str = "exact") -> dict:
    """Agreement, perplexity and logprob deviation (mean |logprob - `exact`'s| of the true
    tokens: it moves with every error, where agreement moves only when two candidates swap
    places) of every path against `exact`'s, over the same positions."""
    base = scores[exact]
    out = {"positions": len(base.top1), "paths": {}}
    for name, s in scores.items():
        known = [lp for lp in s.logprobs if lp is not None]
        ppl = math.exp(-sum(known) / len(known))
        same = [lp for lp, e in zip(s.logprobs, base.logprobs, strict=True) if lp is not None]
        base_ppl = math.exp(-sum(e for lp, e in zip(s.logprobs, base.logprobs, strict=True)
                                 if lp is not None) / len(same))
        agree = sum(a == b for a, b in zip(s.top1, base.top1, strict=True)) / len(base.top1)
        deviation = sum(abs(lp - e) for lp, e in zip(s.logprobs, base.logprobs, strict=True)
                        if lp is not None) / len(same)
        out["paths"][name] = {"top1_agreement": round(agree, 5), "perplexity": round(ppl, 4),
                              "perplexity_excess": round(ppl / base_ppl - 1, 5),
                              "logprob_deviation": round(deviation, 5),
                              "unscored": len(s.logprobs) - len(known)}
    return out


# -- in process ------------------------------------------------------------------------

def score_in_process(r: ModelRunner, wins: list[list[int]]) -> Scores:
    logprobs, top1 = [], []
    for i, ids in enumerate(wins):
        blocks = list(range(-(-len(ids) // BLOCK)))
        seq = ScheduledSeq(i + 1, ids, 0, blocks, True, True, [], len(ids), SamplingParams(prompt_logprobs=1))
        [scored] = r.execute(StepPlan(i + 1, [seq], finished=[i])).prompt_logprobs
        logprobs += scored.logprobs
        top1 += [top[0].token_id for top in scored.top]
    return Scores(logprobs, top1)


def measure(path: str, ids: list[int], window: int, activations: str = "mixed") -> dict:
    """The exact path against `auto` packing with `activations` (mixed by default, as served)."""
    paths = {"exact": ("none", "none"), activations: ("auto", activations)}
    scores = {}
    for name, (quantization, acts) in paths.items():
        t0 = time.monotonic()
        scores[name] = score_in_process(runner_for(path, 1, quantization, acts), windows(ids, window))
        print(f"{name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return compare(scores)


# -- through HTTP ----------------------------------------------------------------------

def score_ours(url: str, wins: list[list[int]]) -> Scores:
    logprobs, top1 = [], []
    with httpx.Client(base_url=url, timeout=600) as client:
        for ids in wins:
            r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
            r.raise_for_status()
            for token_id, entry in zip(ids[1:], r.json()["choices"][0]["prompt_logprobs"][1:], strict=True):
                logprobs.append(entry[str(token_id)]["logprob"])
                top1.append(int(next(k for k, e in entry.items() if e["rank"] == 1)))
    return Scores(logprobs, top1)


def score_llama(url: str, wins: list[list[int]], n_probs: int) -> Scores:
    logprobs, top1 = [], []
    with httpx.Client(base_url=url, timeout=600) as client:
        for ids in wins:
            for t in range(1, len(ids)):
                r = client.post("/completion", json={
                    "prompt": ids[:t], "n_predict": 1, "n_probs": n_probs, "temperature": 0,
                    "cache_prompt": True, "samplers": ["top_k"], "top_k": 1})
                r.raise_for_status()
                probs = r.json()["completion_probabilities"][0]
                tops = probs["top_logprobs"]
                top1.append(tops[0]["id"])
                logprobs.append(next((c["logprob"] for c in tops if c["id"] == ids[t]), None))
    return Scores(logprobs, top1)


def measure_api(model: str, wins: list[list[int]], names: list[str], n_probs: int) -> dict:
    from benchmarks.servers import Server, llama_server_command, ours_command

    scores = {}
    for name in ["exact", *names]:
        command = (llama_server_command(model, None, 2) if name == "llama"
                   else ours_command(model, OUR_FLAGS[name]))
        server = Server(name, command).start()
        try:
            t0 = time.monotonic()
            scores[name] = (score_llama(server.url, wins, n_probs) if name == "llama"
                            else score_ours(server.url, wins))
            print(f"{name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        finally:
            server.stop()
    return compare(scores)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512, help=f"tokens per prefill (at most {MAX_LEN})")
    p.add_argument("--activation-quantization", default="mixed", choices=("mixed", "int8", "int16"),
                   help="in process: the fast path's activations (default mixed, the server's default)")
    p.add_argument("--api", action="store_true", help="score servers through HTTP")
    p.add_argument("--servers", default="mixed,int8,int16,llama",
                   help=f"with --api: comma list of {', '.join(OUR_FLAGS)}, llama (exact always runs)")
    p.add_argument("--llama-probs", type=int, default=20, help="llama-server's n_probs")
    args = p.parse_args()
    if not 1 < args.window <= MAX_LEN:
        p.error(f"--window must be in 2..{MAX_LEN}")
    path = str(resolve_short_name(args.model) or args.model)
    ids = Tokenizer.load(path).encode(corpus(), add_special_tokens=False)[: args.tokens + 1]
    if len(ids) <= args.tokens:
        p.error(f"--tokens: the corpus has {len(ids) - 1} positions for this tokenizer")
    if args.api:
        names = [n for n in args.servers.split(",") if n != "exact"]
        result = measure_api(path, windows(ids, args.window), names, args.llama_probs)
    else:
        result = measure(path, ids, args.window, args.activation_quantization)
    print(json.dumps({"model": args.model, **result}, indent=2))


if __name__ == "__main__":
    main()
