"""Model families and how to build them; all three families share `llama.LlamaForCausalLM`."""

from __future__ import annotations

import torch

from pypto_serving.kernels.rotary import rope_cache, rope_inv_freq
from pypto_serving.loader.arch import FAMILIES, ModelArch
from pypto_serving.models.llama import LlamaForCausalLM
from pypto_serving.models.quant import LayerFactory
from pypto_serving.models.weights import load_weights


def build_model(
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int = 0,
    layers: LayerFactory | None = None,
) -> LlamaForCausalLM:
    """An uninitialised model on `device` (fill it with `load_weights`).

    `max_positions` sizes the rotary cache; 0 means the model's max_position_embeddings.
    `layers` picks plain or weight-only quantized linears (default: plain, in `dtype`).
    """
    if arch.family not in FAMILIES:
        raise ValueError(f"unknown model family {arch.family!r}; known: {', '.join(FAMILIES)}")
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, layers)
    # Built on meta, so no time or memory goes into a random init that loading overwrites.
    model = model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
    inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    model.rope = rope_cache(inv_freq, max_positions or arch.max_position_embeddings).to(device)
    return model


__all__ = ["LayerFactory", "LlamaForCausalLM", "build_model", "load_weights"]
