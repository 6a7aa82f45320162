"""The npu backend: torch_npu on an Ascend NPU; the cuda backend's memory accounting through
torch.npu, which torch_npu registers with the same API."""

from __future__ import annotations

from types import ModuleType

import torch

from pypto_serving.backends.cuda import CudaBackend


class NpuBackend(CudaBackend):
    name = "npu"
    profiler_activities = ("cpu",)
    paged_triton = False  # Triton's kernels are CUDA's here (triton-ascend is another build)
    cuda_graphs = False  # torch_npu's graphs (NPUGraph) are not wired in: every step eager

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        import torch_npu  # noqa: F401  - only on Ascend machines; registers the npu device type

        super().__init__(torch.device(device), dtype)

    @property
    def memory(self) -> ModuleType:
        return torch.npu
