"""The cuda backend: torch's kernels on an NVIDIA GPU, SDPA for prefill attention, paged decode
attention in Triton (kernels/triton/: it reads the paged cache through the slot table) where
Triton is installed, the KV cache sized from `--gpu-memory-utilization` after a forward of the
largest step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from pypto_serving.backends.portable import PortableBackend
from pypto_serving.kernels import triton as triton_kernels
from pypto_serving.kernels.decoder_ops import SDPA, DecoderOps, attend_sdpa_with


class CudaBackend(PortableBackend):
    name = "cuda"
    profiler_activities = ("cpu", "cuda")

    @property
    def memory(self) -> ModuleType:
        """The device's memory API (torch.cuda; torch.npu registers the same one)."""
        return torch.cuda

    paged_triton: bool = True  # the Triton decode attention, where Triton is installed

    def decoder_ops(self, packed: bool) -> DecoderOps:
        if not (self.paged_triton and triton_kernels.available()):
            return SDPA
        from pypto_serving.kernels.triton.paged_attention import paged_decode_attention

        kernel = functools.partial(paged_decode_attention, tensor_cores=self.device.type == "cuda")
        return DecoderOps(SDPA.rms_norm, SDPA.add_rms_norm, SDPA.silu_and_mul, attend_sdpa_with(kernel))

    def kv_budget(self, host_bytes: int, utilization: float, weight_bytes: int,
                  largest_step: Callable[[], None], sampler_bytes: int) -> int:
        """utilization x total device memory, less the weights, the largest step's peak
        activations (measured by running it) and the sampler's copies of the logits."""
        mem, device = self.memory, self.device
        mem.synchronize(device)
        mem.reset_peak_memory_stats(device)
        before = mem.memory_allocated(device)
        largest_step()
        peak = mem.max_memory_allocated(device) - before
        mem.empty_cache()
        total = mem.mem_get_info(device)[1]
        return int(utilization * total) - weight_bytes - peak - sampler_bytes
