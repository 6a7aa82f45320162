"""GGUF single-file models: the model shape from metadata, and the weights as Hugging Face
named float32 tensors, dequantized one at a time (gguf-py does the dequantization).

llama.cpp's converter permutes the Q and K rows of llama-family models so that rotary pairs
sit next to each other (GPT-J style); we undo that so every family uses HF's rotate-half.
For Gemma 3 it stores every RMSNorm weight plus one (llama.cpp multiplies by the weight, HF
by 1 + weight); we subtract the one again, as transformers' GGUF loader does.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pypto_serving.loader.arch import ModelArch, RopeScaling
from pypto_serving.loader.errors import UnsupportedModel
from pypto_serving.loader.gguf_reader import GGUFFile, read_gguf

if TYPE_CHECKING:  # torch and numpy are heavy: the API process reads model shapes without them
    import numpy as np
    import torch

__all__ = ["UnsupportedModel", "arch_from_gguf", "load_gguf_tensors"]

# GGUF arch -> our family
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
             "qwen3moe": "qwen3_moe"}
_PERMUTED_FAMILIES = ("llama",)
_NORM_PLUS_ONE_FAMILIES = ("gemma3",)
# llama.cpp hard-codes Gemma 3's layout where the file does not say: every 6th layer global,
# the sliding layers' rotary base 10000 (transformers' Gemma3TextConfig defaults agree).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, and each projection of every expert as one 3-D tensor
    # [experts, rows, cols] (models/weights.py splits them)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 3 normalises before and after the attention and the MLP, each.
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Present in some files but not weights of the network: rotary tables the model recomputes.
_IGNORED = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")


def arch_from_gguf(path: str | Path) -> ModelArch:
    return _arch(read_gguf(path))


def load_gguf_tensors(path: str | Path | GGUFFile, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(hf_name, float32 tensor)` in file order, one tensor in memory at a time (from
    a file already read, or read here: its header takes ~0.3 s for a 150k vocabulary)."""
    import torch

    gguf = path if isinstance(path, GGUFFile) else read_gguf(path)
    for name in gguf.tensors:
        if _IGNORED.fullmatch(name):
            continue
        hf_name = _hf_name(name, arch.family)
        values = gguf.dequantize(name)
        if arch.family in _PERMUTED_FAMILIES:
            values = _unpermute_rotary(name, values, arch)
        if arch.family in _NORM_PLUS_ONE_FAMILIES and name.endswith("norm.weight"):
            values = values - 1
        yield hf_name, torch.from_numpy(values)


def _arch(gguf: GGUFFile) -> ModelArch:
    meta = gguf.metadata
    name = meta.get("general.architecture")
    family = _FAMILIES.get(name)
    if family is None:
        raise UnsupportedModel(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(_FAMILIES)}"
        )
    key = _MetadataKeys(meta, name)
    hidden, heads = key.as_int("embedding_length"), key.as_int("attention.head_count")
    experts = _experts(key)
    arch = ModelArch(
        family=family,
        vocab_size=_vocab_size(gguf, key),
        hidden_size=hidden,
        intermediate_size=key.as_int("feed_forward_length", 0 if experts else None),
        num_layers=key.as_int("block_count"),
        num_heads=heads,
        num_kv_heads=key.as_int("attention.head_count_kv", heads),
        head_dim=key.as_int("attention.key_length", hidden // heads),
        rms_norm_eps=key.as_float("attention.layer_norm_rms_epsilon"),
        rope_theta=key.as_float("rope.freq_base", 10000.0),
        max_position_embeddings=key.as_int("context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
        rope_scaling=_rope_scaling(gguf, key),
        **experts,
    )
    return _gemma3_arch(arch, key) if family == "gemma3" else arch


def _gemma3_arch(arch: ModelArch, key: _MetadataKeys) -> ModelArch:
    """Sliding and global layers, the sliding layers' rotary base, soft-capping. The query
    scale is head_dim ** -0.5, as llama.cpp has it for every Gemma 3 but the 27B."""
    if key.get("attn_logit_softcapping"):
        raise UnsupportedModel("GGUF attn_logit_softcapping is not supported; "
                               "only final_logit_softcapping is")
    pattern = key.get("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if not isinstance(pattern, int):
        raise UnsupportedModel(f"GGUF {key.arch}.attention.sliding_window_pattern {pattern!r} is not "
                               "supported; supported: one number n (every n-th layer global)")
    return msgspec.structs.replace(
        arch,
        sliding_layers=tuple((i + 1) % pattern != 0 for i in range(arch.num_layers)),
        sliding_window=key.as_int("attention.sliding_window"),
        rope_local_theta=key.as_float("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA),
        query_pre_attn_scalar=float(arch.head_dim),
        final_logit_softcapping=key.as_float("final_logit_softcapping", 0.0),
    )


def _experts(key: _MetadataKeys) -> dict[str, object]:
    """The ModelArch fields of a mixture of experts (none for a dense model). llama.cpp's
    qwen3moe makes every layer MoE and always renormalizes the top-k weights."""
    if not key.get("expert_count"):
        return {}
    layers = key.as_int("block_count")
    return dict(num_experts=key.as_int("expert_count"), num_experts_per_tok=key.as_int("expert_used_count"),
                moe_intermediate_size=key.as_int("expert_feed_forward_length"), norm_topk_prob=True,
                moe_layers=tuple(range(layers)))


class _MetadataKeys:
    """Reads `{arch}.{key}` metadata, failing with the missing key's name."""

    def __init__(self, metadata: dict, arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def get(self, key: str, default: object = None) -> object:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def as_int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise UnsupportedModel(f"GGUF metadata lacks {self.arch}.{key}")
        return int(value)

    def as_float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if value is None:
            raise UnsupportedModel(f"GGUF metadata lacks {self.arch}.{key}")
        # Stored as float32: 1e-5 reads back as 9.99999974e-06. Keep the value the author wrote.
        return _shortest_float32(float(value))


def _shortest_float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (9.99999974e-06 -> 1e-05)."""
    def f32(x: float) -> float:
        return struct.unpack("<f", struct.pack("<f", x))[0]

    stored = f32(value)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        if f32(short := float(f"{stored:.{digits}g}")) == stored:
            return short
    return stored


def _vocab_size(gguf: GGUFFile, key: _MetadataKeys) -> int:
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    embedding = gguf.tensors.get("token_embd.weight")
    default = len(tokens) if tokens else embedding.shape[0] if embedding else None
    return key.as_int("vocab_size", default)


def _rope_scaling(gguf: GGUFFile, key: _MetadataKeys) -> RopeScaling | None:
    kind = key.get("rope.scaling.type")
    if "rope_freqs.weight" in gguf.tensors:
        return _llama3_scaling(gguf, key)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=key.as_float("rope.scaling.factor"))
    raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported; supported: linear, llama3")


def _llama3_scaling(gguf: GGUFFile, key: _MetadataKeys) -> RopeScaling:
    """llama.cpp stores Llama-3 scaling only as its per-frequency factors (`rope_freqs`);
    we accept them when Llama-3's usual parameters reproduce them exactly."""
    import numpy as np

    stored = gguf.dequantize("rope_freqs.weight")
    head_dim = stored.size * 2
    theta = key.as_float("rope.freq_base", 10000.0)
    scaling = RopeScaling(kind="llama3", factor=float(stored.max()))
    if not np.allclose(_llama3_factors(scaling, head_dim, theta), stored, rtol=1e-5):
        raise UnsupportedModel("GGUF rope_freqs do not match Llama-3 scaling with usual parameters")
    return scaling


def _llama3_factors(s: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter derives from Llama-3 rope_scaling."""
    import numpy as np

    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s.factor)
        else:
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.array(factors, dtype=np.float32)


def layer_names(family: str) -> dict[str, str]:
    """GGUF per-layer tensor names -> HF module names, for one family."""
    return _GEMMA3_LAYER_NAMES if family == "gemma3" else _LAYER_NAMES


def _hf_name(name: str, family: str = "llama") -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    names = layer_names(family)
    if match is None or match[2] not in names:
        raise UnsupportedModel(f"GGUF tensor {name!r} has no Hugging Face counterpart we know")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute_rotary(name: str, values: np.ndarray, arch: ModelArch) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: within each head, rows were reordered from
    [x0..x(d/2-1), y0..] (HF rotate-half) to interleaved pairs [x0, y0, x1, y1, ...]."""
    if ".attn_q." in name:
        heads = arch.num_heads
    elif ".attn_k." in name:
        heads = arch.num_kv_heads
    else:
        return values
    import numpy as np

    rows = values.shape[0]
    per_head = values.reshape(heads, rows // heads // 2, 2, *values.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(values.shape)
