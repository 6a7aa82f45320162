"""The portable backend: plain torch on any device, the reference every other backend's
kernels are tested against.

A backend is chosen once, in the device worker, from `--backend`. It owns what differs
between devices: weight packing and the kernels that read it (linears, embedding gathers),
the decoder ops (norms, activation, rotary + KV write + attention, the fused-MoE op over a
layer's experts: `DecoderOps.fused_moe`, kernels/moe.py), argmax, the optional
whole-stack runner, the optional decode graphs (backends/graphs.py), whether the step's
metadata carries block tables for its kernels, KV cache allocation and its memory budget, the
heap policy of the worker process, and the profiler's activities.
Nothing outside `backends/` branches on the device type; the model runner calls these hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch

from pypto_serving.backends.budget import KVBudget, host_budget
from pypto_serving.backends.graphs import NO_GRAPHS, GraphSpec
from pypto_serving.kernels.attention import AttentionMetadata
from pypto_serving.kernels.decoder_ops import PORTABLE, DecoderOps
from pypto_serving.kernels.sampling import (
    SamplerKernels,
    SamplingTensors,
    TokenLogprobs,
    apply_token_bitmask,
    draw_portable,
    token_logprobs,
)
from pypto_serving.models.llama import LlamaForCausalLM
from pypto_serving.models.quant import ACTIVATION_QUANTIZATIONS, PORTABLE_KERNELS, LayerFactory, QuantKernels

KVCache = tuple[torch.Tensor, torch.Tensor]
LargestStep = Callable[[], int]  # runs the largest step (freeing what it made); returns its tokens


class StackRunner(Protocol):
    """A backend's whole decoder stack in one call (see backends/cpu_stack.py)."""

    def applies(self, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of `out_rows` (ascending) only."""
        ...


class PortableBackend:
    name: ClassVar[str] = "portable"
    profiler_activities: ClassVar[tuple[str, ...]] = ("cpu",)
    block_tables: ClassVar[bool] = False  # the step's metadata carries block tables for its kernels

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype

    # -- the model's layers ------------------------------------------------------
    def quant_kernels(self, activations: str) -> QuantKernels:
        """Packing and the matmul/gather over packed weights; `activations` (none, int8,
        int16) is what the matmuls may quantize their inputs to (float32 always, here)."""
        return PORTABLE_KERNELS

    def decoder_ops(self, packed: bool) -> DecoderOps:
        """The decoder's kernel set; `packed`: the linears are packed (not the exact path)."""
        return PORTABLE

    def layers(self, quantization: str, activations: str = "none") -> LayerFactory:
        """The model's linears, embedding and decoder ops for one quantization setting;
        `activations` "int8"/"int16": the packed matmuls quantize their inputs where they can."""
        if activations not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"unknown activation quantization {activations!r}; "
                             f"expected one of {ACTIVATION_QUANTIZATIONS}")
        return LayerFactory(quantization, self.quant_kernels(activations),
                            self.decoder_ops(quantization != "none"))

    def kernels_used(self, quantization: str, activations: str) -> tuple[str, str]:
        """(kernels, activation quantization) the packed matmuls really run, for the log."""
        if quantization == "none":
            return "portable", "none"
        kernels = self.quant_kernels(activations)
        native = kernels.matmul is not PORTABLE_KERNELS.matmul
        return ("c" if native else "portable"), kernels.activations

    def stack(self, model: LlamaForCausalLM, kv_caches: list[KVCache]) -> StackRunner | None:
        """A runner of the whole stack in one call, where this backend has one that fits."""
        return None

    def graph_sizes(self, model: LlamaForCausalLM, max_num_seqs: int) -> tuple[int, ...]:
        """Decode batch sizes to capture as graphs at start-up (none here: every step eager)."""
        return ()

    def decode_graphs(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                      spec: GraphSpec, scratch_slot: int) -> StackRunner | None:
        """The runner that replays them (`spec.sizes` from `graph_sizes`); padded rows write
        their k/v to `scratch_slot`, which no sequence owns."""
        return None

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def draw(self, logits: torch.Tensor, t: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
        """The sampled rows' tokens (kernels/sampling.py's `Draw`)."""
        return draw_portable(logits, t, u)

    def mask_tokens(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Grammars' token masks applied (kernels/sampling.py's `Mask`)."""
        return apply_token_bitmask(logits, rows, bitmask)

    def logprobs(self, logits: torch.Tensor, chosen: torch.Tensor, k: int,
                 ranks: bool = False) -> TokenLogprobs:
        """The logprobs fields of raw logits (kernels/sampling.py's `Logprobs`)."""
        return token_logprobs(logits, chosen, k, ranks)

    sampling_precision: ClassVar[torch.dtype] = torch.float64  # SamplerKernels.precision

    @property
    def sampler(self) -> SamplerKernels:
        return SamplerKernels(argmax=self.argmax, draw=self.draw, mask=self.mask_tokens,
                              logprobs=self.logprobs, precision=self.sampling_precision)

    # -- memory ------------------------------------------------------------------
    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """KV cache storage. Zeros, not empty: padded context slots are masked, but 0 * NaN
        garbage would still be NaN."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def kv_budget(self, host_bytes: int, utilization: float, weight_bytes: int,
                  largest_step: LargestStep, sampler_bytes: int, graphs: GraphSpec = NO_GRAPHS) -> KVBudget:
        """Bytes the KV cache may take: on the host, the `--kv-cache-memory` budget (this
        rank's share of it); `graphs`: the decode graphs that will be captured (none here)."""
        return host_budget(host_bytes)

    # -- the worker's life ---------------------------------------------------------
    def before_loading(self) -> None:
        """Before the weights load."""

    def after_loading(self) -> None:
        """The weights and the KV cache are in place."""

    def after_step(self, decode_only: bool) -> None:
        """After each step."""

    def idle(self) -> None:
        """No step came for a while."""
