"""Mixture-of-experts families from config.json: detection, which layers are MoE, the routing
options; and tensor parallelism refused for them with a message saying what to change."""

from __future__ import annotations

import pytest
from transformers import Qwen3MoeConfig

from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.loader.hf import arch_from_hf_config
from pypto_serving.parallel.shapes import check_divisible
from pypto_serving.parallel.sharding import TensorParallel

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, head_dim=32, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32)


def test_qwen3_moe_config() -> None:
    arch = arch_from_hf_config(Qwen3MoeConfig(**SMALL, norm_topk_prob=True).to_dict())
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 32)
    assert arch.norm_topk_prob and arch.qk_norm and not arch.attention_bias
    assert arch.moe_layers == (0, 1, 2, 3) and arch.shared_expert_intermediate_size == 0
    assert arch.intermediate_size == 128  # the dense layers' MLP width


def test_published_configs_name_the_expert_count_num_experts() -> None:
    """transformers 5 writes num_local_experts; Qwen's own config.json files num_experts."""
    config = Qwen3MoeConfig(**SMALL).to_dict()
    config["num_experts"] = config.pop("num_local_experts")
    assert arch_from_hf_config(config).num_experts == 8


@pytest.mark.parametrize(("options", "moe_layers"), [
    (dict(mlp_only_layers=[1, 3]), (0, 2)),
    (dict(decoder_sparse_step=2), (1, 3)),
    (dict(decoder_sparse_step=2, mlp_only_layers=[3]), (1,)),
])
def test_dense_layers_follow_mlp_only_layers_and_the_sparse_step(options: dict, moe_layers: tuple) -> None:
    arch = arch_from_hf_config(Qwen3MoeConfig(**SMALL, **options).to_dict())
    assert arch.moe_layers == moe_layers
    assert [arch.is_moe_layer(i) for i in range(4)] == [i in moe_layers for i in range(4)]


def test_model_type_detects_qwen3_moe_without_architectures() -> None:
    config = Qwen3MoeConfig(**SMALL).to_dict() | {"architectures": None}
    assert arch_from_hf_config(config).family == "qwen3_moe"


def test_an_unsupported_moe_architecture_names_it_and_the_supported_ones() -> None:
    config = {**SMALL, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    with pytest.raises(UnsupportedModel, match="MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        arch_from_hf_config(config)


def test_tensor_parallelism_is_refused_for_experts_with_what_to_change() -> None:
    arch = arch_from_hf_config(Qwen3MoeConfig(**SMALL).to_dict())
    assert "--tensor-parallel-size 1" in check_divisible(arch, 2)
    assert check_divisible(arch, 1) is None
    with pytest.raises(ValueError, match="mixture-of-experts"):
        TensorParallel(0, 2).local_arch(arch)
