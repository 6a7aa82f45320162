"""Gemma 3 text decoder, over the same flattened varlen tokens and paged KV as llama.py.

What differs from Llama: RMSNorm scales by (1 + weight); each block normalises the attention
and the MLP outputs too (four norms a layer, no fused residual add); q/k RMSNorm; GELU-tanh
GeGLU; embeddings scaled by sqrt(hidden) in the model dtype; a query scale from
`query_pre_attn_scalar`; sliding-window layers (their own rotary base) between global ones;
optional final-logit soft-capping. Module names follow Hugging Face's but for the fused
`qkv_proj` and `gate_up_proj`; tensor parallelism splits the model as llama.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from pypto_serving.kernels.attention import AttentionMetadata, with_window
from pypto_serving.kernels.decoder_ops import PORTABLE, DecoderOps
from pypto_serving.kernels.rotary import rope_cache, rope_inv_freq, rotary_cos_sin
from pypto_serving.loader.arch import ModelArch
from pypto_serving.models.llama import MLP, Attention, CausalLM, KVCache, Rotary
from pypto_serving.models.quant import LayerFactory
from pypto_serving.parallel.sharding import SINGLE, TensorParallel


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: DecoderOps = PORTABLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # HF's: the scale is 1 + weight
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gemma_rms_norm(x, self.weight, self.eps)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + this norm of x."""
        return self.ops.gemma_add_norm(x, residual, self.weight, self.eps)


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's (1 + w) q/k norms and its query scale."""

    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, make, tp)
        self.qk_norm = True  # always, whatever the config says
        self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps)
        self.scale = arch.attention_scale

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.gemma_qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class Gemma3MLP(MLP):
    """GELU-tanh GeGLU in place of SiLU."""

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(gate_up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.window = arch.window(layer)  # 0: a global layer
        self.self_attn = Gemma3Attention(arch, make, tp)
        self.mlp = Gemma3MLP(arch, make, tp)
        norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")
        for name in norm_names:
            setattr(self, name, GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, make.decoder_ops()))

    def forward(self, x: torch.Tensor, rotary: Rotary, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `rotary` and `meta` are this layer's kind's."""
        x = self.post_attention_layernorm.add_to(self.self_attn(self.input_layernorm(x), rotary, kv, meta), x)
        return self.post_feedforward_layernorm.add_to(self.mlp(self.pre_feedforward_layernorm(x)), x)


class Gemma3Model(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = make.embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, i, make.for_layer(i, arch.num_layers), tp)
                                    for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, make.decoder_ops())


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, make: LayerFactory | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, make, tp, Gemma3Model)
        # the sliding layers' cos/sin beside the global layers' `rope`, filled by build_rotary
        self.register_buffer("rope_local", torch.empty(0), persistent=False)

    def build_rotary(self, positions: int) -> None:
        """The global layers' table, and the sliding layers' with their own base (unscaled)."""
        super().build_rotary(positions)
        if self.arch.sliding_window:
            local = rope_inv_freq(self.arch.head_dim, self.arch.rope_local_theta, None)
            self.rope_local = rope_cache(local, positions).to(self.rope.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        h = self.tp.embed(self.embed_inputs, input_ids, self.arch)
        # once per step, not per layer: each kind of layer's rotary and attention metadata
        rotary = {0: rotary_cos_sin(self.rope, positions, h.dtype)}
        metas = {0: meta}
        if self.arch.sliding_window:
            rotary[self.arch.sliding_window] = rotary_cos_sin(self.rope_local, positions, h.dtype)
            metas[self.arch.sliding_window] = with_window(meta, self.arch.sliding_window)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, rotary[layer.window], kv, metas[layer.window])
        return self.model.norm(h)

    def embed_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        # sqrt(hidden) rounded to float32, then to the model dtype, as HF has it
        return h * torch.tensor(self.arch.hidden_size**0.5).to(h.dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None under soft-capping: tanh can round two logits to one value, a tie the capped
        logits' argmax breaks otherwise."""
        return None if self.arch.final_logit_softcapping else super().greedy_tokens(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (gathered over the ranks), soft-capped."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
