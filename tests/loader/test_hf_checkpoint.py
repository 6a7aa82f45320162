"""config.json -> ModelArch, and reading sharded safetensors checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pypto_serving.loader.arch import RopeScaling
from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.loader.hf import arch_from_hf_config, load_safetensors

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)


def test_llama_config() -> None:
    arch = arch_from_hf_config(LlamaConfig(**SMALL, rms_norm_eps=1e-5).to_dict())
    assert (arch.family, arch.head_dim, arch.num_kv_heads, arch.rms_norm_eps) == ("llama", 16, 2, 1e-5)
    assert not arch.attention_bias and not arch.qk_norm and arch.rope_scaling is None


def test_mistral_is_llama_family_and_tolerates_null_head_dim() -> None:
    config = MistralConfig(**SMALL).to_dict() | {"head_dim": None}
    arch = arch_from_hf_config(config)
    assert (arch.family, arch.head_dim) == ("llama", 16)


def test_qwen2_has_attention_bias_and_may_tie_embeddings() -> None:
    arch = arch_from_hf_config(Qwen2Config(**SMALL, tie_word_embeddings=True).to_dict())
    assert (arch.family, arch.attention_bias, arch.tie_word_embeddings) == ("qwen2", True, True)


def test_qwen3_has_qk_norm_and_its_own_head_dim() -> None:
    arch = arch_from_hf_config(Qwen3Config(**SMALL, head_dim=32).to_dict())
    assert (arch.family, arch.qk_norm, arch.attention_bias, arch.head_dim) == ("qwen3", True, False, 32)


def test_classic_config_keys_rope_theta_and_llama3_scaling() -> None:
    """config.json as written by transformers 4.x (Llama 3.1 style)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        **SMALL,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
    }
    arch = arch_from_hf_config(config)
    assert arch.rope_theta == 500000.0 and arch.max_position_embeddings == 131072
    assert arch.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_linear_scaling_and_transformers5_rope_parameters() -> None:
    config = LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    ).to_dict()
    arch = arch_from_hf_config(config)
    assert arch.rope_theta == 1234.0 and arch.rope_scaling == RopeScaling("linear", 2.0)


def test_model_type_is_the_fallback_for_missing_architectures() -> None:
    config = Qwen2Config(**SMALL).to_dict() | {"architectures": None}
    assert arch_from_hf_config(config).family == "qwen2"


@pytest.mark.parametrize("architecture, model_type", [
    ("GPT2LMHeadModel", "gpt2"),
    ("Gemma3ForConditionalGeneration", "gemma3"),  # the multimodal checkpoint: not its text part
])
def test_unsupported_architecture_names_it_and_the_supported_ones(architecture: str, model_type: str) -> None:
    config = {**SMALL, "architectures": [architecture], "model_type": model_type}
    with pytest.raises(UnsupportedModel) as info:
        arch_from_hf_config(config)
    message = str(info.value)
    assert message == (f"unsupported model architecture ['{architecture}']; supported: LlamaForCausalLM, "
                       "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, "
                       "Qwen3MoeForCausalLM, DeepseekV4ForCausalLM")


def test_gemma3_config() -> None:
    config = Gemma3TextConfig(**SMALL | dict(num_hidden_layers=7), head_dim=32, sliding_window=16,
                              query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                              architectures=["Gemma3ForCausalLM"])
    arch = arch_from_hf_config(config.to_dict())
    assert (arch.family, arch.head_dim, arch.qk_norm, arch.tie_word_embeddings) == ("gemma3", 32, True, True)
    assert arch.sliding_layers == (True,) * 5 + (False, True)  # every 6th layer global
    assert (arch.window(0), arch.window(5), arch.sliding_window) == (16, 0, 16)
    assert (arch.rope_theta, arch.rope_local_theta, arch.rope_scaling) == (1e6, 1e4, None)
    assert arch.attention_scale == 24**-0.5 and arch.final_logit_softcapping == 30.0


def test_gemma3_config_before_transformers5() -> None:
    """rope_theta / rope_local_base_freq / rope_scaling and a sliding_window_pattern."""
    config = {**SMALL, "model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2,
              "sliding_window": 8, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    arch = arch_from_hf_config(config)
    assert arch.sliding_layers == (True, False, True, False) and arch.attention_scale == 16**-0.5
    assert (arch.rope_theta, arch.rope_local_theta) == (1e6, 1e4)
    assert arch.rope_scaling == RopeScaling("linear", 8.0)  # of the global layers only


@pytest.mark.parametrize("extra, named", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "relu"}, "'relu'"),
])
def test_unsupported_gemma3_options_are_named(extra: dict, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        arch_from_hf_config({**SMALL, "model_type": "gemma3_text", **extra})


def test_unsupported_rope_scaling_is_named() -> None:
    config = {**SMALL, "model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModel, match="yarn"):
        arch_from_hf_config(config)


def test_load_safetensors_reads_every_shard_in_its_dtype(tmp_path: Path) -> None:
    a = {"x": torch.randn(3, 2).bfloat16(), "y": torch.arange(4, dtype=torch.float16)}
    b = {"z": torch.randn(5)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    loaded = dict(load_safetensors(tmp_path))
    assert loaded.keys() == {"x", "y", "z"}
    for name, tensor in (a | b).items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_load_safetensors_without_files_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        list(load_safetensors(tmp_path))
