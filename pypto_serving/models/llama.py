"""Llama-family decoder (Llama, SmolLM, Mistral; Qwen2 = q/k/v bias; Qwen3 = q/k RMSNorm).

Plain torch over flattened varlen tokens: every activation is [T, ...], T = tokens this step.
Module names follow Hugging Face except the fused `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving.kernels.activation import silu_and_mul
from pypto_serving.kernels.attention import AttentionMetadata, paged_attention
from pypto_serving.kernels.paged_kv import write_kv
from pypto_serving.kernels.rmsnorm import add_rms_norm, rms_norm
from pypto_serving.kernels.rotary import apply_rotary, rotary_cos_sin
from pypto_serving.loader.arch import ModelArch

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v [num_blocks, block_size, kv_heads, head_dim]
Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim / 2]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.sizes = [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.sizes), bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, arch.hidden_size, bias=False)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # [T, heads * head_dim], ...
        q = q.view(tokens, self.heads, self.head_dim)
        k = k.view(tokens, self.kv_heads, self.head_dim)
        v = v.view(tokens, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        out = paged_attention(q, kv[0], kv[1], meta, self.head_dim**-0.5)  # [T, heads, d]
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

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
            h, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, rotary, kv, meta)
        post = self.post_attention_layernorm
        h, residual = add_rms_norm(h, residual, post.weight, post.eps)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # [max_positions, 2, head_dim / 2] float32 cos/sin, filled by build_model.
        self.register_buffer("rope", torch.empty(0), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        rotary = rotary_cos_sin(self.rope, positions, h.dtype)  # once per step, not per layer
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rotary, kv, meta)
        norm = self.model.norm
        return add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]."""
        if self.arch.tie_word_embeddings:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)
