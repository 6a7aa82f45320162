"""Model families and how to build them: Llama, Qwen2, Qwen3 and Qwen3-MoE share
`llama.LlamaForCausalLM`; Gemma 3 is `gemma3.Gemma3ForCausalLM`, DeepSeek V4
`deepseek_v4.DeepseekV4ForCausalLM`; all are `llama.CausalLM`s (shape, head, logits)."""

from __future__ import annotations

import torch

from pypto_serving.loader.arch import FAMILIES, ModelArch
from pypto_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from pypto_serving.models.gemma3 import Gemma3ForCausalLM
from pypto_serving.models.llama import CausalLM, LlamaForCausalLM
from pypto_serving.models.quant import LayerFactory, PackedRows
from pypto_serving.models.weights import load_weights
from pypto_serving.parallel.sharding import SINGLE, TensorParallel

CLASSES: dict[str, type[CausalLM]] = {"gemma3": Gemma3ForCausalLM, "deepseek_v4": DeepseekV4ForCausalLM}


def build_model(
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int = 0,
    layers: LayerFactory | None = None,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """An uninitialised model on `device` (fill it with `load_weights`).

    `max_positions` sizes the rotary cache; 0 means the model's max_position_embeddings.
    `layers` picks plain or weight-only quantized linears (default: plain, in `dtype`); `tp`:
    the tensor-parallel rank whose part of the model this is.
    """
    if arch.family not in FAMILIES:
        raise ValueError(f"unknown model family {arch.family!r}; known: {', '.join(FAMILIES)}")
    with torch.device("meta"):
        model = CLASSES.get(arch.family, LlamaForCausalLM)(arch, layers, tp)
    # Built on meta, so no time or memory goes into a random init that loading overwrites.
    model = _materialize(model.to(dtype), torch.device(device)).eval().requires_grad_(False)
    model.keep_float32()
    model.build_rotary(max_positions or arch.max_position_embeddings)
    return model


def _materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Uninitialised storage for every meta parameter and buffer. (`Module.to_empty` goes
    through torch's Python reference ops, which import sympy: ~25 MiB more resident memory
    in the worker for nothing.)"""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            module.register_parameter(name, torch.nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            persistent = name not in module._non_persistent_buffers_set
            module.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device=device), persistent)
        if isinstance(module, PackedRows):  # packed once loaded, then placed here
            module.device = device
    return model


__all__ = ["CausalLM", "DeepseekV4ForCausalLM", "Gemma3ForCausalLM", "LayerFactory", "LlamaForCausalLM",
           "build_model", "load_weights"]
