"""One backend per `--backend`, chosen once in the device worker (see backends/portable.py)."""

from __future__ import annotations

import torch

from pypto_serving.backends.cpu import CpuBackend
from pypto_serving.backends.cuda import CudaBackend
from pypto_serving.backends.npu import NpuBackend
from pypto_serving.backends.portable import PortableBackend

BACKENDS: dict[str, type[PortableBackend]] = {
    b.name: b for b in (PortableBackend, CpuBackend, CudaBackend, NpuBackend)}


def make_backend(name: str, device: str, dtype: torch.dtype) -> PortableBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return BACKENDS[name](device, dtype)


__all__ = ["BACKENDS", "CpuBackend", "CudaBackend", "NpuBackend", "PortableBackend", "make_backend"]
