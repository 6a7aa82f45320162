"""CPU-specific kernels in C (AVX2 + FMA + F16C), built with the system C compiler on first use.

The shared library is cached by source hash under ~/.cache/pypto-serving/kernels and called
through ctypes (which releases the GIL). It uses OpenMP: torch has already loaded its own
`libgomp.so.1`, so the library binds to that runtime and shares torch's thread pool rather
than starting a second one. `available()` is False (and callers use the portable kernels)
when the CPU lacks the instructions or no compiler is found, and when the build or the load
fails: that is logged as a warning with the compiler's output, since the portable kernels are
several times slower and would otherwise go unnoticed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import structlog
import torch

from pypto_serving.process.cache_dirs import cache_dir

SOURCES = [Path(__file__).with_name(name)
           for name in ("qlinear.c", "qdot.c", "qhead.c", "decoder.c", "stack.c", "sampling.c", "moe.c")]
# part of the build's hash, not compiled alone
HEADERS = [Path(__file__).with_name(name) for name in ("group_max.h", "prefetch.h", "vnni.h", "vexp.h")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "qlinear": [_P, _I, _I, _I, _P, _P, _P, _I, _P, _P],
    "qlinear_q8": [_P, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I],
    "qlinear_a16": [_P, _I, _I, _I, _P, _P, _P, _P],
    "qhead_greedy": [_P, _I, _I, _I, _I, _P, _P, _P, _P],
    "qhead_l1max": [_I, _I, _P, _P, _P],
    "qgather": [_P, _I, _I, _P, _P, _P, _I, _P],
    "add_rms_norm": [_P, _P, _P, _F, _I, _I, _P],
    "silu_and_mul": [_P, _I, _I, _P],
    "gelu_tanh_and_mul": [_P, _I, _I, _P],
    "qk_norm": [_P, _I, _I, _I, _I, _I, _P, _P, _F],
    "gemma_qk_norm": [_P, _I, _I, _I, _I, _I, _P, _P, _F],
    "gemma_rms_norm": [_P, _P, _P, _F, _I, _I, _P],
    "rope_write_kv": [_P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I],
    "decode_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _P, _F, _P, _P, _I, _I],
    "prefill_attention": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _F, _P, _I, _I],
    "step_stack": [_P, _P, _P, _P, _P, _P, _P],
    "decode_scores_len": [_I, _I, _I],
    "argmax_rows": [_P, _I, _I, _I, _P],
    "sample_rows": [_P, _I, _I, _I, _P, _P, _P, _P, _P, _P],
    "mask_tokens": [_P, _I, _I, _I, _P, _I, _P, _I, _P, _I],
    "logprob_rows": [_P, _I, _I, _I, _P, _I, _P, _P, _P, _P],
    "stack_layout": [_P, _I],
    "moe_experts": [_P, _I, _I, _P, _I, _P, _P, _P, _I, _P],
    "qdot_use_vnni": [_I],
}


# a status (0, or -1 when out of memory) or a size
RETURNS_INT = {"step_stack", "qlinear_q8", "qlinear_a16", "qhead_greedy", "prefill_attention",
               "decode_scores_len", "stack_layout", "moe_experts", "qdot_use_vnni", "sample_rows",
               "logprob_rows"}
# the end of the compiler's output kept in the warning: where its last (often fatal) error is
STDERR_CHARS = 4000

log = structlog.get_logger()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _build(compiler: str) -> Path:
    return build(SOURCES, HEADERS, compiler)


def build(sources: list[Path], headers: list[Path], compiler: str) -> Path:
    """The library of these sources (the headers they include beside them count in its version),
    compiled once per version into the cache; concurrent builders race to an atomic rename.
    `benchmarks/kernel_ab.py` builds other versions' sources with it."""
    source = b"".join(path.read_bytes() for path in [*sources, *headers])
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir("kernels") / f"kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log.info("compiling the C kernels (once per version)", compiler=compiler, cache=str(target.parent))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = [compiler, *FLAGS, *map(str, sources), "-lm", "-o", str(out)]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(out, target)
    log.info("C kernels compiled", seconds=round(time.monotonic() - start, 2))
    return target


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def has_avx2() -> bool:
    """Whether this CPU runs the kernels (AVX2 with FMA and F16C)."""
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def _tail(output: bytes | None) -> str:
    """The compiler's output as text, trimmed to the end that holds its last error."""
    text = (output or b"").decode(errors="replace").strip()
    return text if len(text) <= STDERR_CHARS else "..." + text[-STDERR_CHARS:]


def _load(compiler: str) -> ctypes.CDLL | None:
    """The built and loaded library, or None after a warning saying why (the CPU and the compiler
    are fine here, so a failure is a broken build environment, not an expected fallback)."""
    try:
        path = _build(compiler)
    except subprocess.CalledProcessError as exc:
        log.warning("C kernels failed to compile; the portable kernels will run instead",
                    command=shlex.join(map(str, exc.cmd)), returncode=exc.returncode,
                    stderr=_tail(exc.stderr))
        return None
    except OSError as exc:  # the compiler cannot be started, or the cache is not writable
        log.warning("C kernels could not be built; the portable kernels will run instead",
                    compiler=compiler, cache=str(cache_dir("kernels")), error=str(exc))
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:  # dlopen's message: e.g. a missing libgomp
        log.warning("C kernels failed to load; the portable kernels will run instead",
                    path=str(path), error=str(exc))
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (one attempt per process)."""
    compiler = find_compiler()
    if not has_avx2() or compiler is None:
        return None
    torch.get_num_threads()  # torch (and with it its libgomp) is loaded before our library
    lib = _load(compiler)
    if lib is None:
        return None
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int64 if name in RETURNS_INT else None
    lib.qdot_use_vnni(1)
    return lib


def vnni() -> bool:
    """Whether the int8-activation matmuls run AVX-512 VNNI tiles (qdot.c) on this CPU."""
    lib = library()
    return lib is not None and bool(lib.qdot_use_vnni(-1))


def available() -> bool:
    return library() is not None
