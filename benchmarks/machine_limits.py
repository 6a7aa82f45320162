"""The machine's physical limits for LLM serving: GEMM GFLOP/s per dtype, the integer dot-product
roof, and memory bandwidth.

Serving numbers mean little without them: decode at batch 1 is bound by the bytes of
weights read per token (bandwidth), prefill and large-batch decode by GEMM throughput.

    python benchmarks/machine_limits.py [--threads N] [--json out.json]

Measures with torch on the CPU (the threads torch would use by default): fp32 / bf16 / fp16
GEMM at a large square shape and at SmolLM2-135M's MLP shape, the weight-only int8 / int4
matmuls at decode and prefill sizes (fp32 activations, and the serving default: int8
activations), and the read, copy and write bandwidth of a buffer much larger than the
last-level cache. With AVX2 and a C compiler it also times `int8_roof.c`: how many vpmaddubsw
(32 int8 multiply-adds each) all threads retire per second, alone and with the add that
accumulates them, the ceiling of the AVX2 int8 x int4 matmuls; with AVX-512 VNNI, how many
512-bit vpdpbusd (64 each), the ceiling of the VNNI tiles.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

BANDWIDTH_BYTES = 512 << 20  # well past any L3
GEMM_SHAPES = {"square 1024": (1024, 1024, 1024), "mlp 512x576x3072": (512, 576, 3072)}


@dataclass(frozen=True, slots=True)
class Measurement:
    name: str
    value: float
    unit: str


def best_seconds(fn: Callable[[], object], min_time_s: float = 0.3, repeats: int = 3) -> float:
    """Fastest of `repeats` runs, each long enough (>= min_time_s / repeats) to time well."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        fn()
        calls += 1
    per_round = max(1, int(calls * min_time_s / repeats / 0.05))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_round)
    return best


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b)) / 1e9


def bandwidth_gbs() -> list[Measurement]:
    x = torch.ones(BANDWIDTH_BYTES // 4)
    y = torch.empty_like(x)
    read = BANDWIDTH_BYTES / best_seconds(lambda: x.sum(), repeats=3) / 1e9
    copy = 2 * BANDWIDTH_BYTES / best_seconds(lambda: y.copy_(x), repeats=3) / 1e9
    write = BANDWIDTH_BYTES / best_seconds(lambda: y.fill_(1.0), repeats=3) / 1e9
    return [Measurement("memory read", read, "GB/s"), Measurement("memory copy (read+write)", copy, "GB/s"),
            Measurement("memory write", write, "GB/s")]


def gemm_measurements() -> list[Measurement]:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for label, (m, k, n) in GEMM_SHAPES.items():
            name = f"GEMM {str(dtype).removeprefix('torch.')} {label}"
            out.append(Measurement(name, gemm_gflops(m, k, n, dtype), "GFLOP/s"))
    return out


def weight_only_measurements() -> list[Measurement]:
    """The packed int8 / int4 kernels (kernels/cpu): weight bytes/s at M=1, GFLOP/s at M=512."""
    from pypto_serving.kernels.cpu import available
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu
    from pypto_serving.kernels.quant_linear import pack

    if not available():
        return []
    k, n = 576, 3072
    w = torch.randn(n, k)
    out = []
    for bits in (8, 4):
        packed, _ = pack(w, bits)
        one, big = torch.randn(1, k), torch.randn(512, k)
        t1 = best_seconds(lambda p=packed, x=one: quant_linear_cpu(x, p))
        out.append(Measurement(f"packed int{bits} GEMV M=1", packed.nbytes / t1 / 1e9, "GB/s of weights"))
        t2 = best_seconds(lambda p=packed, x=big: quant_linear_cpu(x, p))
        out.append(Measurement(f"packed int{bits} GEMM M=512", 2 * 512 * k * n / t2 / 1e9, "GFLOP/s"))
    fp32_one = torch.randn(1, k)
    t3 = best_seconds(lambda: torch.nn.functional.linear(fp32_one, w))
    out.append(Measurement("fp32 GEMV M=1 (MKL)", w.numel() * 4 / t3 / 1e9, "GB/s of weights"))
    return out


def int8_activation_measurement() -> list[Measurement]:
    """The serving default on the CPU: int4 weights, int8 activations (kernels/cpu/qdot.c)."""
    from pypto_serving.kernels.cpu import available
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_q8
    from pypto_serving.kernels.quant_linear import pack

    if not available():
        return []
    m, k, n = 512, 576, 3072
    packed, _ = pack(torch.randn(n, k), 4)
    x = torch.randn(m, k)
    seconds = best_seconds(lambda: quant_linear_cpu_q8(x, packed))
    return [Measurement("int4 x int8-activation GEMM M=512", m * k * n / seconds / 1e9, "GMAC/s")]


def _roof_library() -> ctypes.CDLL | None:
    """int8_roof.c built and loaded, or None without AVX2 or a C compiler."""
    from pypto_serving.kernels.cpu import find_compiler, has_avx2

    compiler = find_compiler()
    if not has_avx2() or compiler is None:
        return None
    source = Path(__file__).with_name("int8_roof.c")
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "int8_roof.so"
        flags = ["-O2", "-mavx2", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run([compiler, *flags, str(source), "-o", str(lib_path)], check=True, capture_output=True)
        lib = ctypes.CDLL(str(lib_path))
    lib.int8_roof_gmacs.argtypes, lib.int8_roof_gmacs.restype = [ctypes.c_int64] * 3, ctypes.c_double
    lib.vnni_roof_gmacs.argtypes, lib.vnni_roof_gmacs.restype = [ctypes.c_int64] * 2, ctypes.c_double
    return lib


def int8_roof_measurements(iters: int = 20_000_000) -> list[Measurement]:
    """vpmaddubsw retired per second on all torch threads (int8_roof.c), in multiply-adds."""
    lib = _roof_library()
    if lib is None:
        return []
    threads = torch.get_num_threads()
    out = []
    for accumulate, label in ((0, "vpmaddubsw alone"), (1, "vpmaddubsw + vpaddw")):
        best = max(lib.int8_roof_gmacs(iters, threads, accumulate) for _ in range(3))
        out.append(Measurement(f"int8 dot roof, {label}", best, "GMAC/s"))
    return out


def vnni_roof_measurements(iters: int = 10_000_000) -> list[Measurement]:
    """vpdpbusd on 512-bit registers retired per second on all torch threads, in multiply-adds:
    the roof of the AVX-512 VNNI tiles (none where the CPU lacks them)."""
    from pypto_serving.kernels.cpu import vnni

    lib = _roof_library() if vnni() else None
    if lib is None:
        return []
    threads = torch.get_num_threads()
    best = max(lib.vnni_roof_gmacs(iters, threads) for _ in range(3))
    return [Measurement("int8 dot roof, vpdpbusd (AVX-512 VNNI)", best, "GMAC/s")]


def measure_all() -> list[Measurement]:
    results = []
    groups = (bandwidth_gbs, gemm_measurements, weight_only_measurements, int8_activation_measurement,
              int8_roof_measurements, vnni_roof_measurements)
    for group in groups:
        for m in group():
            print(f"{m.name:<40}{m.value:>10.1f} {m.unit}", flush=True)
            results.append(m)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    results = measure_all()
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([asdict(m) for m in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
