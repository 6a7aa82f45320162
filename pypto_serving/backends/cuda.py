"""The cuda backend: torch's kernels on an NVIDIA GPU, SDPA for prefill attention; where Triton
is installed, paged decode attention in Triton (kernels/triton/: it reads the paged cache
through the slot table) and the elementwise kernels fused in Triton (RMSNorm with the residual
add, SiLU-and-mul, rotary with the KV write: kernels/triton/fused.py); all-decode steps
replayed from CUDA graphs captured at start-up (backends/graphs.py; not with
--enforce-eager), the KV cache sized from
`--gpu-memory-utilization` after a forward of the largest step (backends/budget.py)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pypto_serving.backends.budget import DeviceMemory, KVBudget, graph_reserve
from pypto_serving.backends.graphs import (
    NO_GRAPHS,
    Capture,
    CudaCapture,
    DecodeGraphs,
    GraphSpec,
    graph_sizes,
)
from pypto_serving.backends.portable import KVCache, LargestStep, PortableBackend, StackRunner
from pypto_serving.kernels import triton as triton_kernels
from pypto_serving.kernels.decoder_ops import SDPA, DecoderOps, attend_sdpa_with
from pypto_serving.models.llama import LlamaForCausalLM


class CudaBackend(PortableBackend):
    name = "cuda"
    profiler_activities = ("cpu", "cuda")
    sampling_precision = torch.float32  # (an NPU's kernels mostly lack float64 besides)

    @property
    def memory(self) -> ModuleType:
        """The device's memory API (torch.cuda; torch.npu registers the same one)."""
        return torch.cuda

    paged_triton: bool = True  # the Triton decode attention, where Triton is installed
    cuda_graphs: bool = True  # decode steps from captured graphs (backends/graphs.py)

    def decoder_ops(self, packed: bool) -> DecoderOps:
        if not (self.paged_triton and triton_kernels.available()):
            return SDPA
        from pypto_serving.kernels.triton import fused
        from pypto_serving.kernels.triton.paged_attention import paged_decode_attention

        kernel = functools.partial(paged_decode_attention, tensor_cores=self.device.type == "cuda")
        return DecoderOps(fused.rms_norm, fused.add_rms_norm, fused.silu_and_mul,
                          attend_sdpa_with(kernel, fused.rotate_and_store))

    def graph_sizes(self, model: LlamaForCausalLM, max_num_seqs: int) -> tuple[int, ...]:
        """The ladder up to --max-num-seqs, for dense models: a mixture-of-experts layer groups
        its routes on the host (kernels/moe.py), which a graph cannot replay."""
        if not self.cuda_graphs or model.arch.num_experts:
            return ()
        return graph_sizes(max_num_seqs)

    def decode_graphs(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                      spec: GraphSpec, scratch_slot: int) -> StackRunner | None:
        if not spec.sizes:
            return None
        return DecodeGraphs(model, kv_caches, spec, scratch_slot, self.device, self.capture())

    def capture(self) -> Capture:
        return CudaCapture(self.device)

    def kv_budget(self, host_bytes: int, utilization: float, weight_bytes: int,
                  largest_step: LargestStep, sampler_bytes: int, graphs: GraphSpec = NO_GRAPHS) -> KVBudget:
        """utilization x total device memory, less the weights, the largest step's peak
        activations (measured by running it), the sampler's copies of the logits and what the
        decode graphs will keep."""
        mem, device = self.memory, self.device
        mem.synchronize(device)
        mem.reset_peak_memory_stats(device)
        before = mem.memory_allocated(device)
        tokens = largest_step()
        peak = mem.max_memory_allocated(device) - before
        mem.empty_cache()
        free, total = mem.mem_get_info(device)
        reserve = graph_reserve(peak, tokens, graphs.rows, graphs.width)
        elsewhere = max(0, total - free - mem.memory_reserved(device))
        return DeviceMemory(total, utilization, weight_bytes, peak, sampler_bytes, reserve,
                            elsewhere).budget()
