"""How a model splits over tensor-parallel ranks: pure arithmetic, no process group."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pypto_serving.loader.arch import ModelArch
from pypto_serving.parallel.shapes import check_divisible
from pypto_serving.parallel.sharding import TensorParallel

ARCH = ModelArch(family="qwen2", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1,
                 num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                 max_position_embeddings=32, tie_word_embeddings=True, attention_bias=True,
                 qk_norm=False)


def test_each_rank_holds_its_heads_mlp_slice_and_vocab_rows():
    local = TensorParallel(1, 2).local_arch(ARCH)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 6, 5)
    assert local.hidden_size == ARCH.hidden_size


def test_rows_and_columns_of_each_weight_go_to_their_rank():
    tp = TensorParallel(1, 2)
    q = torch.arange(8 * 8).view(8, 8)  # 4 heads of 2 rows
    assert torch.equal(tp.shard("model.layers.0.self_attn.q_proj.weight", q, ARCH), q[4:])
    kv = torch.arange(4 * 8).view(4, 8)  # 2 KV heads of 2 rows
    assert torch.equal(tp.shard("model.layers.0.self_attn.k_proj.bias", kv, ARCH), kv[2:])
    o = torch.arange(8 * 8).view(8, 8)
    assert torch.equal(tp.shard("model.layers.0.self_attn.o_proj.weight", o, ARCH), o[:, 4:])
    down = torch.arange(8 * 12).view(8, 12)
    assert torch.equal(tp.shard("model.layers.0.mlp.down_proj.weight", down, ARCH), down[:, 6:])
    norm = torch.ones(8)
    assert tp.shard("model.layers.0.input_layernorm.weight", norm, ARCH) is norm


def test_the_last_vocab_rows_are_padded_with_zeros():
    embed = torch.arange(10 * 8, dtype=torch.float32).view(10, 8)
    part = TensorParallel(2, 3).shard("model.embed_tokens.weight", embed, ARCH)  # rows 8..11 of 10
    assert part.shape == (4, 8)
    assert torch.equal(part[:2], embed[8:]) and not part[2:].any()


def test_fewer_kv_heads_than_ranks_are_replicated():
    arch = msgspec.structs.replace(ARCH, num_kv_heads=1)
    firsts = [TensorParallel(r, 4).first_kv_head(arch) for r in range(4)]
    assert firsts == [0, 0, 0, 0]
    arch = msgspec.structs.replace(ARCH, num_kv_heads=2)
    assert [TensorParallel(r, 4).first_kv_head(arch) for r in range(4)] == [0, 0, 1, 1]


def test_embedding_and_logits_of_one_rank_are_the_whole_model():
    tp = TensorParallel()
    ids = torch.tensor([1, 2])
    assert torch.equal(tp.embed(lambda i: i * 2, ids, ARCH), ids * 2)


@pytest.mark.parametrize(("change", "size", "words"), [
    (dict(num_heads=6), 4, "6 attention heads"),
    (dict(num_kv_heads=3, num_heads=6), 2, "3 KV heads"),
    (dict(num_kv_heads=2, num_heads=6), 3, "2 KV heads"),
    (dict(intermediate_size=10), 4, "MLP width 10"),
])
def test_a_model_that_does_not_divide_says_what(change: dict, size: int, words: str):
    reason = check_divisible(msgspec.structs.replace(ARCH, **change), size)
    assert reason is not None and words in reason
    assert check_divisible(ARCH, 2) is None and check_divisible(ARCH, 1) is None
