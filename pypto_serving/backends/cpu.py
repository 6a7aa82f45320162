"""The cpu backend: packed weights read by the C kernels (AVX2, FMA, F16C; kernels/cpu), a
mixture-of-experts layer's experts in one C call, the whole (dense) decoder stack in one C
call, the C argmax, KV caches in lazily mapped zero pages, and
a heap policy for a worker process that shares a few cores and little memory.

Where the C kernels cannot run (another CPU, no compiler: kernels/cpu logs why) or the
model is not float32, each piece is the portable one.
"""

from __future__ import annotations

import math
import mmap
import time
from dataclasses import replace

import torch

from pypto_serving.backends.cpu_stack import DecoderStack
from pypto_serving.backends.portable import KVCache, PortableBackend, StackRunner
from pypto_serving.kernels import cpu
from pypto_serving.kernels.decoder_ops import PORTABLE, DecoderOps
from pypto_serving.kernels.sampling import SamplingTensors, TokenLogprobs
from pypto_serving.models.llama import LlamaForCausalLM
from pypto_serving.models.quant import LayerFactory, QuantKernels
from pypto_serving.process import heap

TRIM_INTERVAL_S = 2.0  # the heap goes back to the OS at most this often while serving


class CpuBackend(PortableBackend):
    name = "cpu"

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self._prefilled = False  # the last step had prefill rows (large activations)
        self._trimmed_at = float("-inf")

    @property
    def native(self) -> bool:
        """The C kernels run here, for this model's dtype."""
        return self.dtype == torch.float32 and cpu.available()

    def quant_kernels(self, activations: str) -> QuantKernels:
        if not self.native:
            return super().quant_kernels(activations)
        from pypto_serving.kernels.cpu import qlinear
        from pypto_serving.kernels.quant_linear import pack

        quantizing = {"int8": qlinear.quant_linear_cpu_q8, "int16": qlinear.quant_linear_cpu_q16,
                      "mixed": qlinear.quant_linear_cpu_mixed}
        matmul = quantizing.get(activations, qlinear.quant_linear_cpu)
        used = activations if activations in quantizing else "none"
        gather = qlinear.quant_embedding_cpu
        if used == "none":
            return QuantKernels(pack, matmul, gather, used, head=qlinear.quant_linear_cpu)
        return QuantKernels(pack, matmul, gather, used, head=qlinear.quant_linear_cpu_head,
                            head_argmax=qlinear.head_argmax_cpu)

    def layers(self, quantization: str, activations: str = "none") -> LayerFactory:
        """Under mixed activations the last decoder layer's linears take int16 ones: alone at
        int8 it moves SmolLM2's logprobs about as much as the other 29 layers together, and at
        int16 it takes the mixed default's mean deviation from the exact path's down by ~14%
        for ~2% of a prefill (docs/performance.md, "Accuracy of the fast path")."""
        make = super().layers(quantization, activations)
        if make.kernels.activations != "mixed":
            return make
        return replace(make, last_layer=self.quant_kernels("int16"))

    def decoder_ops(self, packed: bool) -> DecoderOps:
        """The fused C kernels come with packed weights; the exact path stays portable."""
        if not (packed and self.native):
            return PORTABLE
        from pypto_serving.kernels.cpu import decoder as c
        from pypto_serving.kernels.cpu.moe import fused_moe_cpu

        return DecoderOps(c.fp32_rows(c.rms_norm_cpu, PORTABLE.rms_norm),
                          c.fp32_rows(c.add_rms_norm_cpu, PORTABLE.add_rms_norm),
                          c.fp32_rows(c.silu_and_mul_cpu, PORTABLE.silu_and_mul), c.attend_cpu,
                          c.qk_norm_cpu, fused_moe_cpu,
                          gelu_tanh_and_mul=c.fp32_rows(c.gelu_tanh_and_mul_cpu, PORTABLE.gelu_tanh_and_mul),
                          gemma_rms_norm=c.fp32_rows(c.gemma_rms_norm_cpu, PORTABLE.gemma_rms_norm),
                          gemma_add_norm=c.fp32_rows(c.gemma_add_norm_cpu, PORTABLE.gemma_add_norm),
                          gemma_qk_norm=c.gemma_qk_norm_cpu)

    def stack(self, model: LlamaForCausalLM, kv_caches: list[KVCache]) -> StackRunner | None:
        """Every step in one C call where the per-layer path would use the C kernels anyway
        (dense models only: `DecoderStack.build` says no to experts)."""
        return DecoderStack.build(model, kv_caches) if self.native else None

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The C kernel for float32 rows (torch's argmax does not vectorize here)."""
        if _c_rows(logits):
            from pypto_serving.kernels.cpu.sampling import argmax_cpu

            return argmax_cpu(logits)
        return super().argmax(logits)

    def draw(self, logits: torch.Tensor, t: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
        """The C sampler for float32 rows: torch's sort and per-token noise cost a batch-16
        SmolLM2 step more than its forward (kernels/cpu/sampling.c)."""
        if _c_rows(logits):
            from pypto_serving.kernels.cpu.sampling import draw_cpu

            return draw_cpu(logits, t, u)
        return super().draw(logits, t, u)

    def mask_tokens(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """The C kernel for float32 rows: torch's bit unpacking took 2.6 ms for 16 rows of a
        49152-token vocabulary."""
        if _c_rows(logits):
            from pypto_serving.kernels.cpu.sampling import mask_tokens_cpu

            return mask_tokens_cpu(logits, rows, bitmask)
        return super().mask_tokens(logits, rows, bitmask)

    def logprobs(self, logits: torch.Tensor, chosen: torch.Tensor, k: int,
                 ranks: bool = False) -> TokenLogprobs:
        """The C kernel for float32 rows: torch's log_softmax, rank comparison and topk took
        ~60 ms of each 256-row piece of a SmolLM2 prompt's logprobs."""
        if _c_rows(logits):
            from pypto_serving.kernels.cpu.sampling import logprobs_cpu

            return logprobs_cpu(logits, chosen, k, ranks)
        return super().logprobs(logits, chosen, k, ranks)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return lazy_zeros(shape, dtype)

    def before_loading(self) -> None:
        heap.release_freed_memory()

    def after_loading(self) -> None:
        heap.trim_freed_memory()  # what loading freed below the mmap threshold
        heap.reuse_freed_memory()

    def idle(self) -> None:
        heap.trim_freed_memory()  # no step for a while: hand back what the last ones kept

    def after_step(self, decode_only: bool) -> None:
        """The first decode-only step after prefill steps returns the heap the prefill
        activations left (kept between prefill steps so they do not page-fault afresh): the
        KV cache grows during decoding, and the two would otherwise add up. At most every
        TRIM_INTERVAL_S, so steady arrivals do not page-fault every prefill afresh."""
        now = time.monotonic()
        if decode_only and self._prefilled and now - self._trimmed_at >= TRIM_INTERVAL_S:
            heap.trim_freed_memory()
            self._trimmed_at = now
        self._prefilled = not decode_only


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping: the OS maps zero pages on first touch, so the cache
    costs resident memory only as blocks are used (torch.zeros writes every byte up front).
    Not numpy's calloc: numpy asks for transparent huge pages on large arrays, and then the
    first token written to a layer's cache made 2 MiB of it resident at once."""
    count = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, count, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)  # even where THP is "always"
    raw = torch.frombuffer(pages, dtype=torch.uint8)  # the tensor keeps the map alive
    return raw.view(dtype).view(shape)


def _c_rows(logits: torch.Tensor) -> bool:
    """Whether sampling.c's kernels take these logits: float32 rows [B, V], V >= 1, here."""
    return logits.dtype == torch.float32 and logits.dim() == 2 and bool(logits.shape[1]) and cpu.available()
