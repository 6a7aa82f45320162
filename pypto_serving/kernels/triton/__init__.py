"""Kernels written in Triton for the CUDA backend (backends/cuda.py).

Imported only where they run: on a CUDA device, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, set before this package is first imported), which the tests use.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Triton is installed (the CUDA backend falls back to the portable kernels otherwise)."""
    return importlib.util.find_spec("triton") is not None
