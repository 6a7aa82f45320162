"""Rotary embedding against transformers' rope init functions and apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pypto_serving.kernels.rotary import apply_rotary, rope_cache, rope_inv_freq, rotary_cos_sin
from pypto_serving.loader.arch import RopeScaling

HEAD_DIM, THETA = 32, 10000.0
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * 2,
        num_attention_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": THETA, **rope},
    )


@pytest.mark.parametrize(
    ("scaling", "hf_rope"),
    [
        (None, {"rope_type": "default"}),
        (RopeScaling("linear", factor=4.0), {"rope_type": "linear", "factor": 4.0}),
        (RopeScaling("llama3", **LLAMA3), {"rope_type": "llama3", **LLAMA3}),
    ],
)
def test_inv_freq_matches_transformers(scaling: RopeScaling | None, hf_rope: dict) -> None:
    expected = LlamaRotaryEmbedding(hf_config(hf_rope)).inv_freq
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM, THETA, scaling), expected)


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    plain = rope_inv_freq(HEAD_DIM, THETA, None)
    scaled = rope_inv_freq(HEAD_DIM, THETA, RopeScaling("llama3", **LLAMA3))
    assert scaled[0] == plain[0]  # the fastest rotation is kept
    assert scaled[-1] == pytest.approx(plain[-1].item() / 8.0)  # the slowest is slowed 8x


def test_apply_rotary_matches_transformers_on_flattened_tokens() -> None:
    inv_freq = rope_inv_freq(HEAD_DIM, THETA, RopeScaling("llama3", **LLAMA3))
    positions = torch.tensor([0, 1, 2, 7, 100, 3, 511])  # several sequences, flattened
    q, k = torch.randn(7, 4, HEAD_DIM), torch.randn(7, 2, HEAD_DIM)
    cos, sin = rotary_cos_sin(rope_cache(inv_freq, 512), positions, torch.float32)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)  # HF layout [T, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref)
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_ref)


def test_rotation_preserves_norm_and_position_zero_is_identity() -> None:
    cache = rope_cache(rope_inv_freq(HEAD_DIM, THETA, None), 16)
    x = torch.randn(2, 3, HEAD_DIM)
    cos, sin = rotary_cos_sin(cache, torch.tensor([0, 9]), torch.float32)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[0], x[0])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
