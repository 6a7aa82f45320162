"""DeepSeek V4 from config.json: detection, the attention and routing schedules, the two
rotary kinds (YaRN on the compressed layers', as transformers computes it), what is refused
with a message naming it, and the compressed state's share of each KV block."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pypto_serving.kernels.compressed_kv import LayerShape
from pypto_serving.kernels.rotary import rope_inv_freq
from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.loader.hf import arch_from_hf_config
from pypto_serving.parallel.shapes import check_divisible
from pypto_serving.worker.kv_cache import bytes_per_block
from tests.worker.test_deepseek_v4_vs_transformers import TINY

# the tiny checkpoints' shape with transformers' default schedules and rates, over 5 layers
SCHEDULES = ("layer_types", "mlp_layer_types", "compress_rates")
SMALL = {k: v for k, v in TINY.items() if k not in SCHEDULES + ("max_position_embeddings",)}
SMALL |= dict(num_hidden_layers=5, vocab_size=300)
YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
}


def test_deepseek_v4_config() -> None:
    arch = arch_from_hf_config(DeepseekV4Config(**SMALL).to_dict())
    shape = arch.deepseek_v4
    assert (arch.family, arch.num_kv_heads, arch.head_dim, arch.sliding_window) == ("deepseek_v4", 1, 32, 8)
    # transformers' defaults: two hca layers, then csa / hca alternating; three hash-routed layers
    assert shape.attention == ("hca", "hca", "hca", "csa", "hca")
    assert (shape.csa_rate, shape.hca_rate, shape.rate(3), shape.rate(0)) == (4, 128, 4, 128)
    assert shape.hash_layers == (0, 1, 2) and arch.moe_layers == (0, 1, 2, 3, 4)
    assert (shape.rope_dim, shape.q_lora_rank, shape.o_groups, shape.o_lora_rank) == (16, 48, 2, 24)
    assert (shape.scoring, shape.routed_scaling_factor, shape.swiglu_limit) == ("sqrtsoftplus", 1.5, 10.0)
    assert (arch.rope_theta, shape.compress_rope_theta, shape.compress_rope_scaling) == (
        10000.0,
        160000.0,
        None,
    )
    assert arch.shared_expert_intermediate_size == arch.intermediate_size == 32


def test_explicit_schedules_and_detection_by_model_type() -> None:
    config = DeepseekV4Config(
        **SMALL,
        layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention"] * 3,
        mlp_layer_types=["hash_moe"] + ["moe"] * 4,
    ).to_dict() | {"architectures": None}
    shape = arch_from_hf_config(config).deepseek_v4
    assert shape.attention == ("sliding", "sliding", "csa", "csa", "csa") and shape.hash_layers == (0,)


def test_yarn_on_the_compressed_layers_rotary_is_transformers() -> None:
    config = DeepseekV4Config(**SMALL, rope_parameters=dict(YARN), max_position_embeddings=4096)
    arch = arch_from_hf_config(config.to_dict())
    scaling = arch.deepseek_v4.compress_rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 16.0, 64)
    ours = rope_inv_freq(arch.deepseek_v4.rope_dim, arch.deepseek_v4.compress_rope_theta, scaling)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None, layer_type="compress")
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert attention_factor == 1.0  # DeepSeek V4 leaves its cos/sin unscaled, as we do


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(scoring_func="tanh"),
            "unsupported scoring_func 'tanh'; supported: sqrtsoftplus, sigmoid, softmax",
        ),
        (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu' for deepseek_v4"),
    ],
)
def test_unsupported_options_are_refused_by_name(change: dict, message: str) -> None:
    config = DeepseekV4Config(**SMALL).to_dict() | change
    with pytest.raises(UnsupportedModel, match=message):
        arch_from_hf_config(config)


def test_an_unknown_layer_type_is_refused_by_name() -> None:
    config = DeepseekV4Config(**SMALL).to_dict()
    config["layer_types"] = ["sliding_attention"] * 4 + ["linear_attention"]
    with pytest.raises(UnsupportedModel, match=r"unsupported DeepSeek V4 layer types \['linear_attention'\]"):
        arch_from_hf_config(config)


def test_tensor_parallelism_is_refused_with_what_to_change() -> None:
    arch = arch_from_hf_config(DeepseekV4Config(**SMALL).to_dict())
    assert "--tensor-parallel-size 1" in check_divisible(arch, 2)


def test_each_block_holds_the_keys_and_the_compressed_state_of_every_layer() -> None:
    """One key per token (K = V); csa layers add both series' projections, the indexer's, and
    an entry per 4 tokens; hca layers one series and an entry slot per block (rate 128 > 16)."""
    config = DeepseekV4Config(
        **SMALL,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
        + ["sliding_attention"] * 2,
    )
    arch = arch_from_hf_config(config.to_dict())
    f32, block = torch.float32, 16
    keys = block * 32 * 4
    csa = keys + block * (4 * 32 + 4 * 16) * 4 + 4 * (32 + 16) * 4 + 4 * 4
    hca = keys + block * 2 * 32 * 4 + 1 * 32 * 4 + 4
    assert LayerShape(block, 32, 4, (128, 64), 16).block_bytes(f32, f32) == csa
    assert bytes_per_block(arch, block, f32) == 3 * keys + csa + hca
