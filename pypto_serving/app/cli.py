"""`pypto-serving`: command-line flags, checked before any model loads."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pypto_serving.app.packaged_models import DEFAULT_MODEL
from pypto_serving.core.version import version
from pypto_serving.parsers import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

DTYPES = ("auto", "float32", "bfloat16", "float16")
PROFILE_LEVELS = ("e2e", "kernel", "verbose")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _size(value: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    text = value.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _device_list(value: str) -> list[int]:
    try:
        ids = [int(v) for v in value.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"device ids must be integers, got {value!r}") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"device ids must be distinct non-negative integers, got {value!r}")
    return ids


def _profile_levels(value: str) -> tuple[str, ...]:
    levels = tuple(v for v in value.replace(" ", "").split(",") if v)
    bad = [v for v in levels if v not in PROFILE_LEVELS]
    if not levels or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(PROFILE_LEVELS)}, "
                                         f"got {value!r}")
    return levels


def _seconds(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {value}")
    return number


_NO_HUB = ("no model hub is reachable from this server: give --model a local checkpoint directory or "
           ".gguf file")
# vLLM serve flags that cannot apply here, with why: a vLLM launch script fails on them with
# that reason (exit 2), not with "unrecognized arguments".
REFUSED_VLLM_FLAGS: dict[str, str] = {
    "--revision": _NO_HUB,
    "--tokenizer-revision": _NO_HUB,
    "--code-revision": _NO_HUB,
    "--download-dir": _NO_HUB,
    "--hf-token": _NO_HUB,
    "--pipeline-parallel-size": "pipeline parallelism is not supported (devices form tensor-parallel groups)",
    "--enable-lora": "LoRA adapters are not supported",
    "--lora-modules": "LoRA adapters are not supported",
    "--cpu-offload-gb": "weights stay on their device: there is no CPU offload",
    "--swap-space": "preempted sequences are recomputed, not swapped: there is no swap space",
}
UVICORN_LEVELS = {"critical": "error", "error": "error", "warning": "warning", "info": "info",
                  "debug": "debug", "trace": "debug"}


class _Refused(argparse.Action):
    """A vLLM flag that cannot apply here: the parse fails with the reason."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        raise argparse.ArgumentError(self, REFUSED_VLLM_FLAGS[self.option_strings[0]])


def _uvicorn_level(value: str) -> str:
    if value.lower() not in UVICORN_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(UVICORN_LEVELS)}, got {value!r}")
    return UVICORN_LEVELS[value.lower()]


def _vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's common serve flags, with the same meaning where they have one here."""
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or the template itself, instead of the model's")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer of another HF checkpoint directory or .gguf file (default: "
                        "the model's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto; here auto works wherever a tool-call "
                        "parser is set (refused with --tool-call-parser none)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave the declared tools out of the prompt of a request with tool_choice "
                        "none (default: the template renders them, the reply is text either way)")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the random seeds of requests that bring none, so a run is repeatable "
                        "(a request's own seed still wins)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted and ignored: no code is ever loaded from a checkpoint")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="accepted: this server logs no periodic stats (they are on /metrics)")
    p.add_argument("--max-log-len", type=_positive_int, default=None,
                   help="with --log-requests: cut logged prompts and outputs to this many characters "
                        "(without it, accepted: nothing else logs them)")
    p.add_argument("--enable-log-requests", action="store_true", dest="log_requests",
                   help="vLLM's name for --log-requests")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode steps on --backend cuda run eagerly, as every "
                        "step does on the other backends (starts faster, decodes slower)")
    p.add_argument("--uvicorn-log-level", type=_uvicorn_level, dest="log_level", default=argparse.SUPPRESS,
                   help="vLLM's name for the log level: critical, error, warning, info, debug, trace")
    for flag in REFUSED_VLLM_FLAGS:
        p.add_argument(flag, action=_Refused, nargs="?", help=f"refused: {REFUSED_VLLM_FLAGS[flag]}")


def _offline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=None,
                   help="offline mode: generate for this prompt (repeatable) and exit")
    p.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="offline mode: tokens per prompt (default: from --generate-config)")
    p.add_argument("--temperature", type=float, default=None,
                   help="offline mode: sampling temperature (default: from --generate-config)")
    p.add_argument("--chat", action="store_true",
                   help="offline mode: each prompt is a user message, rendered with the chat template")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pypto-serving", description="OpenAI-compatible LLM inference server.")
    p.add_argument("--version", action="version",
                   version=f"pypto-serving {version()}")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint directory, .gguf file or packaged model name (smollm2, "
                        "qwen2.5-coder-0.5b, gemma3-270m)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's id in /v1/models, responses and metric labels (default: the "
                        "model's name)")
    p.add_argument("--backend", choices=("portable", "cpu", "cuda", "npu"), default=None,
                   help="portable: the torch reference kernels on the CPU; cpu: packed weights and C "
                        "kernels (AVX2/FMA/F16C); cuda; npu (default: the accelerator found, else cpu)")
    p.add_argument("--platform", default="a2a3", help="accelerator platform label, printed at startup")
    p.add_argument("--device", type=_device_list, default=None, dest="device",
                   help="device id(s) to serve on, e.g. 0 (default 0)")
    p.add_argument("--devices", type=_device_list, default=None, help="comma list of device ids")
    p.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=1,
                   help="devices per replica: the model's heads, MLP and vocabulary split over them "
                        "(torch.distributed: gloo on the CPU, nccl on CUDA, hccl on an NPU)")
    p.add_argument("--data-parallel-size", "--dp", type=_positive_int, default=1,
                   help="replicas, each with its own scheduler, KV cache and --tp devices; a "
                        "request goes to the one with the fewest pending tokens (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype; auto: float32 on the CPU, bfloat16 on accelerators")
    p.add_argument("--kv-cache-dtype", choices=DTYPES, default="auto",
                   help="KV cache dtype; auto: the compute dtype (float16 with packed CPU weights)")
    p.add_argument("--quantization", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="weight-only packing of linears and embeddings; auto: on the cpu backend "
                        "with --dtype auto, int4 where lossless (Q4 GGUF) else int8; none: exact")
    p.add_argument("--activation-quantization", choices=("auto", "none", "int8", "int16", "mixed"),
                   default="auto",
                   help="int8: packed matmuls on the cpu quantize their inputs per row and group of "
                        "32 (as llama.cpp does; ~2x faster prefill and batched decode, slightly "
                        "inexact); mixed: int8, plus a second int8 plane for each row's outlier "
                        "groups and int16 for the last layer (nearer exact, a little slower); "
                        "int16: two int8 planes everywhere, near exact, ~1.7x slower prefill than "
                        "int8 and still faster than none; "
                        "auto: mixed wherever weights are packed on the cpu; none: float32")
    p.add_argument("--weight-cache-dir", default=None, metavar="DIR",
                   help="where packed weights are kept across starts, so the next start maps them "
                        "instead of dequantizing and packing the checkpoint again (default "
                        "$XDG_CACHE_HOME/pypto-serving/weights, else ~/.cache/pypto-serving/weights)")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="neither read nor write the weight cache")
    p.add_argument("--max-model-len", type=_positive_int, default=1024,
                   help="prompt plus generated tokens per request (default 1024)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="KV page size in tokens (default 16; on npu 128, and 128, 256, 384 or 512: "
                        "torch_npu's paged attention)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16,
                   help="running requests (per --dp replica; default 16)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="tokens per engine step (default 512 on the CPU, 4096 on accelerators)")
    p.add_argument("--long-prefill-token-threshold", type=_positive_int, default=2048,
                   help="prefill chunk size per request (default 2048)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan each step while the one before runs (default on; not with "
                        "--speculative-config)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding without a draft model, as vLLM spells it: '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (optional: '
                        'prompt_lookup_min 2, prompt_lookup_max 5, disable_by_batch_size)')
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default on)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps (default on)")
    p.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV cache budget on the CPU, e.g. 1GiB, for each --dp replica (default 1GiB)")
    p.add_argument("--gpu-memory-utilization", "--npu-memory-utilization", type=float, default=0.9,
                   dest="gpu_memory_utilization",
                   help="fraction of accelerator memory (cuda or npu) for weights, activations and KV "
                        "cache (default 0.9)")
    p.add_argument("--generate-config", default=None,
                   help="server sampling defaults: a JSON object or @path.json")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                   help="split <think> reasoning from the answer (default: from the model "
                        "family, qwen3 for Qwen3; none: never)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                   help="parse tool calls from replies (default: from the model family, hermes "
                        "for Qwen2/Qwen3; none: tool requests get a 400)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    _offline_flags(p)
    p.add_argument("--log-format", choices=("console", "json"), default="console",
                   help="console lines for a person, or one JSON object per line")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="the least severe log level written (default info)")
    p.add_argument("--profile", action="store_true",
                   help="enable POST /start_profile and POST /stop_profile")
    p.add_argument("--profile-output", default=None,
                   help="directory of trace.json and fragments/ (default ./profile_out)")
    p.add_argument("--profile-level", type=_profile_levels, default=None,
                   help="comma list of e2e, kernel, verbose (default e2e,kernel)")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="responses kept in memory for previous_response_id (default 1000; 0: none)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM/SIGINT before they "
                        "are aborted (default 30)")
    _operations_flags(p)
    _distributed_flags(p)
    _vllm_flags(p)
    return p


def _env(*names: str) -> str | None:
    """The first of these environment variables that is set (argparse parses a string default
    as it parses the flag: a bad value fails naming the flag)."""
    return next((os.environ[n] for n in names if os.environ.get(n, "").strip()), None)


def _distributed_flags(p: argparse.ArgumentParser) -> None:
    """A tensor-parallel group spanning hosts, with torchrun's names (and its env:// variables:
    one pypto-serving per node, so WORLD_SIZE and RANK count nodes)."""
    p.add_argument("--nnodes", type=_positive_int, default=_env("NNODES", "WORLD_SIZE") or 1,
                   help="hosts one replica's tensor-parallel group spans; node 0 serves HTTP, the "
                        "others run only their device workers (default 1; env NNODES, WORLD_SIZE)")
    p.add_argument("--node-rank", type=int, default=_env("NODE_RANK", "RANK") or 0,
                   help="this host's index among --nnodes (default 0; env NODE_RANK, RANK)")
    p.add_argument("--master-addr", default=_env("MASTER_ADDR") or "127.0.0.1",
                   help="node 0's address, where the ranks meet (default 127.0.0.1; env MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=_env("MASTER_PORT") or 0,
                   help="the port they meet on (default: a free one on one node, 29500 across "
                        "nodes; env MASTER_PORT)")
    p.add_argument("--distributed-timeout", type=_seconds, default=120.0,
                   help="seconds the ranks wait for each other at startup (default 120)")


def _operations_flags(p: argparse.ArgumentParser) -> None:
    """Bounds, timeouts, access control and recovery: what an operator sets."""
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="requests that may wait for a running slot; more get 503 with Retry-After "
                        "(default 4 x --max-num-seqs; 0: no bound)")
    p.add_argument("--request-timeout", type=_seconds, default=0.0,
                   help="seconds a request may take from arrival to its last token, queue time "
                        "included; then it ends with an error, 504 if nothing was sent (default 0: "
                        "no limit)")
    p.add_argument("--max-request-bytes", type=_size, default=8 << 20,
                   help="largest request body accepted, e.g. 8MiB; larger gets 413 (default 8MiB)")
    p.add_argument("--request-body-timeout", type=_seconds, default=30.0,
                   help="seconds a request body may take to arrive; then 408 (default 30)")
    p.add_argument("--keep-alive-timeout", type=_seconds, default=15.0,
                   help="seconds an idle connection, or one still sending its headers, stays open "
                        "(default 15)")
    p.add_argument("--restart-worker", action="store_true",
                   help="start the device worker again after it dies (or the engine fails), "
                        "with a growing backoff; without it /health stays 503")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "and the profile routes; repeatable; @path reads one key per line")
    p.add_argument("--metrics-require-auth", action="store_true",
                   help="with --api-key: /metrics and /metrics/json need a key too")
    p.add_argument("--allowed-origins", default=None,
                   help="CORS: origins browsers may call from, comma list or JSON list, * for any "
                        "(default: none, no CORS headers)")
    p.add_argument("--log-requests", action="store_true",
                   help="log each request's prompt and output (never logged otherwise)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # heavy imports only after the flags parse
    from pypto_serving.app.launch import launch
    from pypto_serving.app.settings import FlagError

    try:
        return launch(args)
    except FlagError as exc:
        print(f"pypto-serving: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
