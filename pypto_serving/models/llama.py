"""Llama-family decoder (Llama, SmolLM, Mistral; Qwen2 = q/k/v bias; Qwen3 = q/k RMSNorm;
Qwen3-MoE = Qwen3 with a mixture of experts as the MLP of its MoE layers: models/moe.py).

Plain torch over flattened varlen tokens: every activation is [T, ...], T = tokens this step.
Module names follow Hugging Face except the fused `qkv_proj` and `gate_up_proj`. With tensor
parallelism (parallel/sharding.py) a rank's modules hold its heads, its slice of the MLP and
of the vocabulary; o_proj and down_proj sum their partial products over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving.kernels.attention import AttentionMetadata
from pypto_serving.kernels.decoder_ops import PORTABLE, DecoderOps
from pypto_serving.kernels.rotary import rope_cache, rope_inv_freq, rotary_cos_sin
from pypto_serving.loader.arch import ModelArch
from pypto_serving.models.moe import SparseMoeBlock
from pypto_serving.models.quant import LayerFactory, QuantEmbedding
from pypto_serving.parallel.sharding import SINGLE, TensorParallel

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v [num_blocks, block_size, kv_heads, head_dim]
Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim / 2]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: DecoderOps = PORTABLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.sizes = [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2
        self.qkv_proj = make.linear(arch.hidden_size, sum(self.sizes), bias=arch.attention_bias)
        self.o_proj = make.linear(self.heads * self.head_dim, arch.hidden_size)
        self.ops = make.decoder_ops()
        self.scale = self.head_dim**-0.5
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's q/k RMSNorm (in place where the backend can, so q, k and v stay the
        projection's views for `attend`); q and k as they are without one."""
        if not self.qk_norm:
            return q, k
        return self.ops.qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # [T, heads * head_dim], ...
        q = q.view(tokens, self.heads, self.head_dim)
        k = k.view(tokens, self.kv_heads, self.head_dim)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        out = self.ops.attend(q, k, v, rotary, kv, meta, self.scale)  # [T, heads, d]
        return self.tp.all_reduce(self.o_proj(out.reshape(tokens, self.heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = make.linear(arch.hidden_size, 2 * arch.intermediate_size)
        self.down_proj = make.linear(arch.intermediate_size, arch.hidden_size)
        self.ops = make.decoder_ops()

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.activation(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE,
                 index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(arch, make, tp)
        self.mlp = SparseMoeBlock(arch, make, tp) if arch.is_moe_layer(index) else MLP(arch, make, tp)
        self.ops = make.decoder_ops()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, self.ops)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, self.ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: Rotary,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block; the residual add is fused into the next norm."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, rotary, kv, meta)
        post = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, post.weight, post.eps)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, make: LayerFactory, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = make.embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, make.for_layer(i, arch.num_layers), tp, i)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, make.decoder_ops())


class CausalLM(nn.Module):
    """What every family's model shares: the whole model's shape and this rank's part of it,
    the decoder body (`body(local arch, make, tp)`, named `model` as in HF), the head, the logits."""

    def __init__(self, arch: ModelArch, make: LayerFactory | None, tp: TensorParallel,
                 body: Callable[[ModelArch, LayerFactory, TensorParallel], nn.Module]) -> None:
        super().__init__()
        make = make or LayerFactory()
        self.arch, self.tp = arch, tp
        self.local_arch = local = tp.local_arch(arch)
        self.model = body(local, make, tp)
        if not arch.tie_word_embeddings:
            self.lm_head = make.linear(arch.hidden_size, local.vocab_size, head=True)
        # [max_positions, 2, head_dim / 2] float32 cos/sin, filled by build_rotary.
        self.register_buffer("rope", torch.empty(0), persistent=False)

    # Parameters (by a part of their name) kept in float32 whatever the model dtype.
    float32_parameters: tuple[str, ...] = ()

    def keep_float32(self) -> None:
        for name, p in self.named_parameters():
            if p.is_floating_point() and any(part in name for part in self.float32_parameters):
                p.data = p.data.float()

    def build_rotary(self, positions: int) -> None:
        """The cos/sin table of positions 0 .. positions - 1, on the model's device."""
        inv_freq = rope_inv_freq(self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)
        self.rope = rope_cache(inv_freq, positions).to(self.rope.device)

    def embed_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's embeddings of `ids`, as the first layer takes them."""
        return self.model.embed_tokens(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (gathered over the ranks)."""
        return self.tp.logits(self._local_logits(hidden), self.arch)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's `compute_logits(hidden)` argmax (first index on ties), where the head's
        kernels find it without computing most logits (the CPU's int8 head); else None."""
        if self.tp.size > 1:
            return None
        head = self.model.embed_tokens if self.arch.tie_word_embeddings else self.lm_head
        argmax = getattr(head, "argmax", None)
        return argmax(hidden) if argmax is not None else None

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        if self.arch.tie_word_embeddings and isinstance(embed, QuantEmbedding):
            return embed.as_linear(hidden)
        if self.arch.tie_word_embeddings:
            return F.linear(hidden, embed.weight)
        return self.lm_head(hidden)


class LlamaForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, make: LayerFactory | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, make, tp, LlamaModel)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        h = self.tp.embed(self.embed_inputs, input_ids, self.arch)
        rotary = rotary_cos_sin(self.rope, positions, h.dtype)  # once per step, not per layer
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rotary, kv, meta)
        norm = self.model.norm
        return norm.ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]
