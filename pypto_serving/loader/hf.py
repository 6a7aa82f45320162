"""Hugging Face checkpoint directories: `config.json` -> ModelArch, `*.safetensors` -> tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from safetensors import safe_open

from pypto_serving.loader.arch import DeepseekV4Shape, ModelArch, RopeScaling
from pypto_serving.loader.errors import UnsupportedModel

if TYPE_CHECKING:  # torch is heavy: the API process reads model shapes without it
    import torch

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
MODEL_TYPES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe", "deepseek_v4": "deepseek_v4"}
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"
QK_NORM_FAMILIES = ("qwen3", "gemma3", "qwen3_moe")


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    """The ModelArch of a `config.json`; UnsupportedModel for anything we cannot run."""
    family = _family(config)
    _check_supported_options(config, family)
    if family == "deepseek_v4":
        return _deepseek_v4_arch(config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    arch = ModelArch(
        family=family,
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        # Mistral configs carry "head_dim": null; Qwen3 sets it independently of hidden/heads.
        head_dim=config.get("head_dim") or hidden // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(config),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and its config has no attention_bias key.
        attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=family in QK_NORM_FAMILIES,
        rope_scaling=_rope_scaling(_global_rope_params(config, family)),
        **_experts(config),
    )
    return _gemma3_arch(arch, config) if family == "gemma3" else arch


def _experts(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelArch fields of a mixture of experts (none for a dense model). A layer's MLP
    is the experts unless it is in `mlp_only_layers` or off the `decoder_sparse_step` grid
    (as transformers decides it)."""
    # transformers 5 writes "num_local_experts"; the published checkpoints "num_experts".
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if not experts:
        return {}
    step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=config["num_experts_per_tok"],
                moe_intermediate_size=config["moe_intermediate_size"],
                norm_topk_prob=bool(config.get("norm_topk_prob", False)), moe_layers=layers,
                shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0)


def _family(config: dict[str, Any]) -> str:
    for name in config.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    found = config.get("architectures") or config.get("model_type") or "unknown"
    raise UnsupportedModel(f"unsupported model architecture {found!r}; supported: {', '.join(ARCHITECTURES)}")


def _check_supported_options(config: dict[str, Any], family: str) -> None:
    gemma = family == "gemma3"
    key, supported = ("hidden_activation", GEMMA3_ACTIVATION) if gemma else ("hidden_act", "silu")
    act = config.get(key, supported)
    if act != supported:
        raise UnsupportedModel(f"unsupported {key} {act!r} for {family}; only {supported!r} is supported")
    if config.get("mlp_bias"):
        raise UnsupportedModel("unsupported mlp_bias=true; only bias-free MLPs are supported")
    if config.get("attn_logit_softcapping"):
        raise UnsupportedModel("unsupported attn_logit_softcapping; only final_logit_softcapping is")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel("unsupported use_bidirectional_attention=true; only causal attention is")


def _gemma3_arch(arch: ModelArch, config: dict[str, Any]) -> ModelArch:
    """Sliding and global layers, their two rotary bases, the query scale, soft-capping."""
    types = config.get("layer_types") or _gemma3_layer_types(config, arch.num_layers)
    local = _rope_params_of(config, "sliding_attention")
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedModel(f"unsupported rope type {local['rope_type']!r} for sliding layers; "
                               "supported: default")
    return msgspec.structs.replace(
        arch,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),  # Gemma 3's default
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        sliding_window=int(config.get("sliding_window") or 0),
        rope_theta=_rope_theta(_rope_params_of(config, "full_attention") or config),
        rope_local_theta=float(local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or arch.head_dim),
        final_logit_softcapping=float(config.get("final_logit_softcapping") or 0.0),
    )


DEEPSEEK_V4_ATTENTION = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                         "heavily_compressed_attention": "hca"}
DEEPSEEK_V4_SCORING = ("sqrtsoftplus", "sigmoid", "softmax")


def _deepseek_v4_arch(config: dict[str, Any]) -> ModelArch:
    """DeepSeek V4's shape, with transformers' defaults where the config is silent (its
    configuration_deepseek_v4.py): 3 hash-routed layers first, the V4-Pro attention schedule,
    csa every 4 and hca every 128 tokens."""
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or 512
    rotary_share = config.get("partial_rotary_factor") or 64 / 512
    rope_dim = config.get("qk_rope_head_dim") or int(head_dim * rotary_share)
    types = config.get("layer_types") or _deepseek_v4_schedule(config, layers)
    if unknown := sorted(set(types) - set(DEEPSEEK_V4_ATTENTION)):
        raise UnsupportedModel(f"unsupported DeepSeek V4 layer types {unknown}; supported: "
                               f"{', '.join(DEEPSEEK_V4_ATTENTION)}")
    hashed = min(layers, config.get("num_hash_layers", 3))
    mlp_types = config.get("mlp_layer_types") or ["hash_moe"] * hashed + ["moe"] * (layers - hashed)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates |= config.get("compress_rates") or {}
    scoring = config.get("scoring_func", "sqrtsoftplus")
    if scoring not in DEEPSEEK_V4_SCORING:
        raise UnsupportedModel(f"unsupported scoring_func {scoring!r}; supported: "
                               f"{', '.join(DEEPSEEK_V4_SCORING)}")
    rope = config.get("rope_parameters") or {}
    main = rope.get("main") or {"rope_theta": config.get("rope_theta", 10000.0)}
    compress = rope.get("compress") or {"rope_theta": config.get("compress_rope_theta", 160000.0)}
    if (main.get("rope_type") or "default") != "default":
        raise UnsupportedModel(f"unsupported rope type {main['rope_type']!r} for sliding layers; "
                               "supported: default")
    experts = config.get("n_routed_experts", 256)
    shape = DeepseekV4Shape(
        q_lora_rank=config.get("q_lora_rank", 1024), o_groups=config.get("o_groups", 8),
        o_lora_rank=config.get("o_lora_rank", 1024), rope_dim=rope_dim,
        attention=tuple(DEEPSEEK_V4_ATTENTION[t] for t in types[:layers]),
        csa_rate=int(rates["compressed_sparse_attention"]),
        hca_rate=int(rates["heavily_compressed_attention"]),
        compress_rope_theta=float(compress.get("rope_theta") or 160000.0),
        compress_rope_scaling=_yarn_scaling(compress),
        hc_mult=config.get("hc_mult", 4), hc_sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
        hc_eps=float(config.get("hc_eps", 1e-6)),
        hash_layers=tuple(i for i, t in enumerate(mlp_types[:layers]) if t == "hash_moe"),
        swiglu_limit=float(config.get("swiglu_limit", 10.0)), index_heads=config.get("index_n_heads", 64),
        index_head_dim=config.get("index_head_dim", 128), index_topk=config.get("index_topk", 512),
        scoring=scoring, routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
    )
    moe_width = config.get("moe_intermediate_size", 2048)
    return ModelArch(
        family="deepseek_v4", vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=moe_width,  # the shared expert's width (transformers reads it so)
        num_layers=layers, num_heads=config["num_attention_heads"], num_kv_heads=1, head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(main.get("rope_theta") or 10000.0),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), attention_bias=False,
        qk_norm=False, sliding_window=int(config.get("sliding_window", 128)),
        num_experts=experts, num_experts_per_tok=config.get("num_experts_per_tok", 6),
        moe_intermediate_size=moe_width, norm_topk_prob=True, moe_layers=tuple(range(layers)),
        shared_expert_intermediate_size=moe_width if config.get("n_shared_experts", 1) else 0,
        deepseek_v4=shape,
    )


def _deepseek_v4_schedule(config: dict[str, Any], layers: int) -> list[str]:
    if ratios := config.get("compress_ratios"):  # older configs: 0 / 4 / 128 per layer
        kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
        return [kinds.get(r, "heavily_compressed_attention") for r in ratios]
    interleave = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                  for i in range(max(layers - 2, 0))]
    return ["heavily_compressed_attention"] * min(layers, 2) + interleave


def _yarn_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise UnsupportedModel(f"unsupported rope type {kind!r} for compressed layers; "
                               "supported: default, yarn")
    if float(params.get("attention_factor", 1.0)) != 1.0:
        raise UnsupportedModel("unsupported YaRN attention_factor != 1 (DeepSeek V4 leaves cos/sin unscaled)")
    return RopeScaling(kind="yarn", factor=float(params.get("factor") or 1.0),
                       original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                       fast_rotations=float(params.get("beta_fast") or 32),
                       slow_rotations=float(params.get("beta_slow") or 1))


def _gemma3_layer_types(config: dict[str, Any], layers: int) -> list[str]:
    # Configs before `layer_types`: every n-th layer is global.
    n = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]


def _rope_params_of(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """transformers 5 writes Gemma 3's rope_parameters per layer type."""
    params = config.get("rope_parameters") or {}
    return params.get(layer_type) or {}


def _global_rope_params(config: dict[str, Any], family: str) -> dict[str, Any]:
    # transformers 5 writes "rope_parameters" (theta inside); older configs use
    # top-level "rope_theta" and "rope_scaling".
    if family == "gemma3" and (per_type := _rope_params_of(config, "full_attention")):
        return per_type
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def _rope_theta(config: dict[str, Any]) -> float:
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return float(theta or 10000.0)


def _rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModel(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def load_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every `*.safetensors` shard, as stored (bf16/fp16/fp32), on the CPU."""
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def count_safetensors(model_dir: str | Path) -> int:
    """How many tensors `load_safetensors` will yield (reads only the shard headers)."""
    total = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            total += len(f.keys())
    return total
