"""The npu backend: torch_npu on an Ascend NPU (A2/A3, `--platform a2a3`). The decoder ops are
torch_npu's fused operators (kernels/npu.py): RMSNorm, add + RMSNorm, SwiGLU, rotary, the KV
write and the paged fused attention, which reads our blocks through the step's block tables;
float32 compute keeps the SDPA set, as the fused attention takes float16/bfloat16 only. The
KV cache is sized as the cuda backend's is, from `--gpu-memory-utilization` (alias
`--npu-memory-utilization`), through torch.npu, which torch_npu registers with CUDA's memory
API; collectives are hccl (parallel/group.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from pypto_serving.backends.cuda import CudaBackend
from pypto_serving.kernels.decoder_ops import SDPA, DecoderOps

FUSED_DTYPES = (torch.float16, torch.bfloat16)  # what the fused attention's queries may be


class NpuBackend(CudaBackend):
    name = "npu"
    profiler_activities = ("cpu",)
    block_tables = True  # the fused attention reads the cache through them
    paged_triton = False  # Triton's kernels are CUDA's here (triton-ascend is another build)
    cuda_graphs = False  # torch_npu's graphs (NPUGraph) are not wired in: every step eager

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        import torch_npu  # noqa: F401  - only on Ascend machines; registers the npu device type

        super().__init__(torch.device(device), dtype)

    def decoder_ops(self, packed: bool) -> DecoderOps:
        if self.dtype not in FUSED_DTYPES:
            return SDPA
        from pypto_serving.kernels.npu import npu_ops  # imports torch_npu

        return npu_ops(self.device)

    @property
    def memory(self) -> ModuleType:
        return torch.npu
