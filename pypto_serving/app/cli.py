"""`pypto-serving`: command-line flags, checked before any model loads."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from pypto_serving.app.packaged_models import DEFAULT_MODEL
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pypto-serving", description="OpenAI-compatible LLM inference server.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF checkpoint directory, .gguf file or packaged model name (smollm2, "
                        "qwen2.5-coder-0.5b)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--backend", choices=("portable", "cpu", "cuda", "npu"), default=None,
                   help="portable: the torch reference kernels on the CPU; cpu: packed weights and C "
                        "kernels (AVX2/FMA/F16C); cuda; npu (default: the accelerator found, else cpu)")
    p.add_argument("--platform", default="a2a3")
    p.add_argument("--device", type=_device_list, default=None, dest="device")
    p.add_argument("--devices", type=_device_list, default=None)
    p.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=1)
    p.add_argument("--data-parallel-size", "--dp", type=_positive_int, default=1)
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--kv-cache-dtype", choices=DTYPES, default="auto")
    p.add_argument("--quantization", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="weight-only packing of linears and embeddings; auto: on the cpu backend "
                        "with --dtype auto, int4 where lossless (Q4 GGUF) else int8; none: exact")
    p.add_argument("--activation-quantization", choices=("auto", "none", "int8"), default="auto",
                   help="int8: packed matmuls on the cpu quantize their inputs per row and group of "
                        "32 (as llama.cpp does; ~2x faster prefill and batched decode, slightly "
                        "inexact); auto: int8 wherever weights are packed on the cpu; none: float32")
    p.add_argument("--max-model-len", type=_positive_int, default=1024)
    p.add_argument("--block-size", type=_positive_int, default=None)
    p.add_argument("--max-num-seqs", type=_positive_int, default=16)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=4096)
    p.add_argument("--long-prefill-token-threshold", type=_positive_int, default=2048)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV cache budget on the CPU, e.g. 1GiB (default 1GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of accelerator memory for weights and KV cache")
    p.add_argument("--generate-config", default=None,
                   help="server sampling defaults: a JSON object or @path.json")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                   help="split <think> reasoning from the answer (default: from the model "
                        "family, qwen3 for Qwen3; none: never)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                   help="parse tool calls from replies (default: from the model family, hermes "
                        "for Qwen2/Qwen3; none: tool requests get a 400)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prompt", action="append", default=None,
                   help="offline mode: generate for this prompt (repeatable) and exit")
    p.add_argument("--log-format", choices=("console", "json"), default="console")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--profile", action="store_true",
                   help="enable POST /start_profile and POST /stop_profile")
    p.add_argument("--profile-output", default=None,
                   help="directory of trace.json and fragments/ (default ./profile_out)")
    p.add_argument("--profile-level", type=_profile_levels, default=None,
                   help="comma list of e2e, kernel, verbose (default e2e,kernel)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM/SIGINT before they "
                        "are aborted (default 30)")
    return p


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
