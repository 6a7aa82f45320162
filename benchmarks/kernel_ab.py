"""The C kernels of two or more versions, timed in one process, taking turns.

    python -m benchmarks.kernel_ab HEAD~1 .                  # "." is the working tree
    python -m benchmarks.kernel_ab 41a5d2d HEAD . --rows 16 512 --rounds 12
    python -m benchmarks.kernel_ab . /tmp/my-kernels          # a directory of kernel sources

On a shared machine two processes running the same build can differ by 10%: the host's state
moves between them, so a kernel change measured across processes (or servers) is mostly that.
Here every version is built as the package builds its own kernels (`kernels/cpu.build`, into
the same cache), loaded side by side, and run on the same inputs round after round, in turn and
in alternating order; each is reported by its median over the rounds, as a ratio to the first
version, and with whether its outputs are the first's bit for bit. The workloads are the
int8-activation matmul (`qlinear_q8`) over int4 weights with zeros of their own (Q4_1's kind)
at each activation kind (int8, mixed, int16), for each `--shapes` N x K (default: SmolLM2's
gate_up and down) and each `--rows`, the activations carrying outlier channels as real ones do.
Paths a change does not touch can still move by a few percent between two builds (where the
code lands in memory), so read a change against its untouched neighbours.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pypto_serving.kernels import cpu  # noqa: E402
from pypto_serving.kernels.cpu.qlinear import weight_args  # noqa: E402
from pypto_serving.kernels.quant_linear import pack  # noqa: E402

KERNELS = "pypto_serving/kernels/cpu"
PLANES = {"int8": 1, "mixed": 3, "int16": 2}  # qdot.c's planes per --activation-quantization
MACS_PER_ROUND = 2e9  # each version's calls in a round add up to about this much work (~10 ms)


@dataclass(frozen=True, slots=True)
class Row:
    """One workload's result for one version."""

    workload: str
    version: str
    gmacs: float  # median over the rounds
    low: float
    high: float
    ratio: float  # to the first version's median
    same_bits: bool  # its outputs are the first version's


def sources_of(version: str, into: Path) -> tuple[list[Path], list[Path]]:
    """The kernel sources and headers of `version`: "." the working tree's, a directory's own
    files, else a git revision's (written under `into`; a file that version lacks is empty)."""
    names = [p.name for p in cpu.SOURCES], [p.name for p in cpu.HEADERS]
    if version == ".":
        return list(cpu.SOURCES), list(cpu.HEADERS)
    directory = Path(version)
    if not directory.is_dir():
        directory = into / version.replace("/", "_")
        directory.mkdir(parents=True, exist_ok=True)
        for name in names[0] + names[1]:
            path = f"{version}:{KERNELS}/{name}"
            shown = subprocess.run(["git", "show", path], cwd=ROOT, capture_output=True)
            missing = b"does not exist" in shown.stderr or b"exists on disk" in shown.stderr
            if shown.returncode and not missing:
                raise SystemExit(f"git show {path}: {shown.stderr.decode().strip()}")
            (directory / name).write_bytes(b"" if shown.returncode else shown.stdout)
    return [directory / n for n in names[0]], [directory / n for n in names[1]]


def load(version: str, scratch: Path) -> ctypes.CDLL:
    compiler = cpu.find_compiler()
    if compiler is None or not cpu.has_avx2():
        raise SystemExit("the C kernels do not run here (no compiler, or no AVX2/FMA/F16C)")
    cpu.library()  # torch's libgomp first, as the package loads its own build
    lib = ctypes.CDLL(str(cpu.build(*sources_of(version, scratch), compiler)))
    lib.qlinear_q8.argtypes, lib.qlinear_q8.restype = cpu.SIGNATURES["qlinear_q8"], ctypes.c_int64
    if hasattr(lib, "qdot_use_vnni"):  # where the CPU has them, as the package's loader does
        lib.qdot_use_vnni.argtypes, lib.qdot_use_vnni.restype = [ctypes.c_int64], ctypes.c_int64
        lib.qdot_use_vnni(1)
    return lib


def activations(m: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Rows with an outlier channel they share and a few of their own."""
    x = torch.randn(m, k, generator=generator)
    x[:, 7 % k] *= 30
    x[torch.arange(m)[:, None], torch.randint(0, k, (m, 3), generator=generator)] *= 12
    return x


def compare(versions: list[str], shapes: list[tuple[int, int]], rows: list[int], rounds: int,
            kinds: tuple[str, ...] = tuple(PLANES)) -> list[Row]:
    with tempfile.TemporaryDirectory() as scratch:
        libs = {v: load(v, Path(scratch)) for v in versions}
    generator = torch.Generator().manual_seed(0)
    out: list[Row] = []
    for n, k in shapes:
        weight = pack(torch.randn(n, k, generator=generator) * 0.02, 4)[0]
        args = weight_args(weight, quantized=True)
        for m in rows:
            x = activations(m, k, generator)
            reps = max(1, round(MACS_PER_ROUND / (m * n * k)))
            for kind in kinds:
                out += _race(f"{n}x{k} rows {m} {kind}", libs, x, args, PLANES[kind], reps, rounds, m * n * k)
    return out


def _race(workload: str, libs: dict[str, ctypes.CDLL], x: torch.Tensor, args: tuple, planes: int, reps: int,
          rounds: int, macs: int) -> list[Row]:
    m = x.shape[0]
    y = {v: torch.full((m, args[1].value * 16), float("nan")) for v in libs}
    seconds: dict[str, list[float]] = {v: [] for v in libs}
    order = list(libs)
    for r in range(rounds + 1):  # round 0 warms each version up and is not counted
        for v in order if r % 2 else order[::-1]:
            start = time.perf_counter()
            for _ in range(reps):
                if libs[v].qlinear_q8(x.data_ptr(), m, *args, None, y[v].data_ptr(), planes):
                    raise MemoryError(f"{v}: qlinear_q8 could not allocate its scratch")
            if r:
                seconds[v].append((time.perf_counter() - start) / reps)
    rate = {v: [macs / s / 1e9 for s in ts] for v, ts in seconds.items()}
    first = statistics.median(rate[order[0]])
    return [Row(workload, v, statistics.median(r), min(r), max(r), statistics.median(r) / first,
                torch.equal(y[v], y[order[0]])) for v, r in rate.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("versions", nargs="+", help='git revisions, "." (the working tree) or source directories')
    p.add_argument("--shapes", default="3072x576,576x1536", help="N x K weights, comma-separated")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 512])
    p.add_argument("--kinds", nargs="+", default=list(PLANES), choices=list(PLANES))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = compare(args.versions, shapes, args.rows, args.rounds, args.kinds)
    for row in results:
        print(f"{row.workload:32s} {row.version:12s} {row.gmacs:7.1f} GMAC/s [{row.low:.1f}, {row.high:.1f}]"
              f"  x{row.ratio:.3f}  {'same bits' if row.same_bits else 'OTHER BITS'}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
