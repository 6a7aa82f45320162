"""GGUF model shape and weights: the packaged models against transformers' own GGUF loader,
and small GGUF files written here with gguf-py against gguf-py's dequantization."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pypto_serving.app.packaged_models import qwen_coder_path, smollm2_path
from pypto_serving.loader.arch import ModelArch, RopeScaling
from pypto_serving.loader.gguf_file import UnsupportedModel, _hf_name, arch_from_gguf, load_gguf_tensors
from pypto_serving.loader.gguf_reader import read_gguf

# --- factories --------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN = 256, 4, 2, 512
BASE_METADATA = {
    "block_count": 1,
    "context_length": 128,
    "embedding_length": HIDDEN,
    "feed_forward_length": FFN,
    "attention.head_count": HEADS,
    "attention.head_count_kv": KV_HEADS,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "rope.freq_base": 10000.0,
    "vocab_size": 32,
}


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, Q]],
    arch: str = "qwen2",
    metadata: dict[str, int | float | str | None] | None = None,
) -> Path:
    """A GGUF with a tiny model's `{arch}.*` metadata (a None value drops a key) and the
    given tensors, already quantized to their type."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {**BASE_METADATA, **(metadata or {})}.items():
        if value is not None:
            _add_value(writer, f"{arch}.{key}", value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer: gguf.GGUFWriter, key: str, value: int | float | str) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, value)


def random_weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def random_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Raw bytes for types gguf-py cannot quantize (K-quants): any bytes are valid blocks."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(seed).integers(0, 256, (rows, cols // block * size), np.uint8)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `LlamaModel.permute`, which the loader must undo."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- the packaged models: shape -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_arch() -> ModelArch:
    return arch_from_gguf(smollm2_path())


@pytest.fixture(scope="module")
def qwen_arch() -> ModelArch:
    return arch_from_gguf(qwen_coder_path())


def test_smollm2_arch(smollm2_arch: ModelArch) -> None:
    assert smollm2_arch == ModelArch(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
    )


def test_qwen_coder_arch(qwen_arch: ModelArch) -> None:
    assert qwen_arch == ModelArch(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        attention_bias=True,
        qk_norm=False,
    )


def test_gemma3_arch(gemma3_gguf: str) -> None:
    """Every 6th layer global, the sliding layers' base 10000: llama.cpp's and transformers'
    defaults for what the file does not say."""
    sliding = tuple(i % 6 != 5 for i in range(18))
    assert arch_from_gguf(gemma3_gguf) == ModelArch(
        family="gemma3",
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_layers=18,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
        sliding_layers=sliding,
        sliding_window=512,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=256.0,
    )


# --- the packaged models: weights against transformers -----------------------------------


def test_gemma3_weights_equal_transformers(gemma3_gguf: str, hf_gemma3) -> None:
    """Every tensor, norms less llama.cpp's + 1, and the config transformers derives agrees."""
    arch = arch_from_gguf(gemma3_gguf)
    config = hf_gemma3.config
    assert [t == "sliding_attention" for t in config.layer_types] == list(arch.sliding_layers)
    assert config.sliding_window == arch.sliding_window and config.query_pre_attn_scalar == arch.head_dim
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == arch.rope_local_theta
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    expected = hf_gemma3.state_dict()
    ours = dict(load_gguf_tensors(gemma3_gguf, arch))
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_smollm2_weights_equal_transformers(smollm2_arch: ModelArch, hf_smollm2) -> None:
    """Every tensor, Q/K un-permuted: transformers dequantizes with its own torch code."""
    expected = hf_smollm2.state_dict()
    ours = dict(load_gguf_tensors(smollm2_path(), smollm2_arch))
    # Tied: transformers lists lm_head as an alias of the embedding; we leave tying to the model.
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name


def test_qwen_coder_names_and_shapes_match_hf_model(qwen_arch: ModelArch) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=qwen_arch.vocab_size,
        hidden_size=qwen_arch.hidden_size,
        intermediate_size=qwen_arch.intermediate_size,
        num_hidden_layers=qwen_arch.num_layers,
        num_attention_heads=qwen_arch.num_heads,
        num_key_value_heads=qwen_arch.num_kv_heads,
        tie_word_embeddings=qwen_arch.tie_word_embeddings,
    )
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Qwen2ForCausalLM(config).state_dict().items()}
    tensors = read_gguf(qwen_coder_path()).tensors.values()
    ours = {_hf_name(t.name): t.shape for t in tensors}
    assert ours == expected


QWEN_SAMPLES = {  # one tensor of each type transformers' own dequantizer knows
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.11.ffn_down.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_q.bias": "F32",
}


def test_qwen_coder_k_quant_weights_equal_transformers() -> None:
    """transformers' torch dequantizer is an independent implementation of these formats
    (it lacks Q5_0, and its reader refuses this file for that, so the bytes come from ours).
    The full 0.5B model matches `AutoModelForCausalLM` too, but that takes ~1 min to load."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    from transformers.integrations.gguf.dequant import row_bytes

    gguf_file = read_gguf(qwen_coder_path())
    raw = np.frombuffer(gguf_file.buffer, np.uint8)
    for name, type_name in QWEN_SAMPLES.items():
        info = gguf_file.tensors[name]
        assert Q(info.type_id).name == type_name
        ours = torch.from_numpy(gguf_file.dequantize(name))
        if type_name == "F32":
            expected = torch.from_numpy(raw[info.start : info.start + 4 * math.prod(info.shape)].copy())
            expected = expected.view(torch.float32)
        else:
            nbytes = math.prod(info.shape[:-1]) * row_bytes(info.type_id, info.shape[-1])
            data = torch.from_numpy(raw[info.start : info.start + nbytes].copy())
            expected = hf_dequantize(data, info.type_id)
        assert torch.equal(ours, expected.reshape(info.shape)), name


# --- synthetic files: dequantization and errors ------------------------------------------


def test_every_quant_type_gguf_py_writes_loads_as_gguf_py_dequantizes(tmp_path: Path) -> None:
    types = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
    layers = ["ffn_up", "ffn_gate", "attn_output", "attn_q", "attn_k", "attn_v"]
    names = [f"blk.{i}.{layer}.weight" for i in range(2) for layer in layers]
    source = {n: random_weights(64, HIDDEN, seed=i) for i, n in enumerate(names[: len(types)])}
    quantized = {n: (quantize(w, t), t) for (n, w), t in zip(source.items(), types, strict=True)}
    path = write_gguf(tmp_path / "m.gguf", quantized)
    loaded = dict(load_gguf_tensors(path, arch_from_gguf(path)))
    for (name, (data, qtype)), source_weights in zip(quantized.items(), source.values(), strict=True):
        expected = dequantize(data, qtype)
        np.testing.assert_array_equal(loaded[_hf_name(name)].numpy(), expected, err_msg=qtype.name)
        # and the values are the source's up to the format's error, not misplaced bytes
        assert np.abs(expected - source_weights).mean() < 0.15, qtype.name


def test_k_quant_bytes_load_as_gguf_py_dequantizes(tmp_path: Path) -> None:
    types = {
        "blk.0.ffn_up.weight": Q.Q4_K,
        "blk.0.ffn_down.weight": Q.Q6_K,
        "blk.0.ffn_gate.weight": Q.Q5_K,
        "blk.0.attn_v.weight": Q.Q2_K,
        "blk.0.attn_output.weight": Q.Q3_K,
    }
    blocks = {name: (random_blocks(8, HIDDEN, t, seed=i), t) for i, (name, t) in enumerate(types.items())}
    path = write_gguf(tmp_path / "k.gguf", blocks)
    with np.errstate(invalid="ignore", over="ignore"):  # random fp16 scales include NaN and inf
        loaded = dict(load_gguf_tensors(path, arch_from_gguf(path)))
        expected = {name: dequantize(data, qtype) for name, (data, qtype) in blocks.items()}
    for name, qtype in types.items():
        assert loaded[_hf_name(name)].shape == (8, HIDDEN)
        np.testing.assert_array_equal(loaded[_hf_name(name)].numpy(), expected[name], err_msg=qtype.name)


def test_llama_q_and_k_are_unpermuted_and_others_untouched(tmp_path: Path) -> None:
    head_dim = HIDDEN // HEADS
    q, k, v = (
        random_weights(n * head_dim, HIDDEN, seed=s) for s, n in enumerate([HEADS, KV_HEADS, KV_HEADS])
    )
    tensors = {
        "blk.0.attn_q.weight": (llama_permute(q, HEADS), Q.F32),
        "blk.0.attn_k.weight": (llama_permute(k, KV_HEADS), Q.F32),
        "blk.0.attn_v.weight": (v, Q.F32),
    }
    path = write_gguf(tmp_path / "llama.gguf", tensors, arch="llama")
    loaded = dict(load_gguf_tensors(path, arch_from_gguf(path)))
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.k_proj.weight"].numpy(), k)
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.v_proj.weight"].numpy(), v)


def test_qwen3_arch_has_qk_norm_and_names_its_norms(tmp_path: Path) -> None:
    norm = np.ones((1, 64), np.float32)
    tensors = {"blk.0.attn_q_norm.weight": (norm, Q.F32), "blk.0.attn_k_norm.weight": (norm, Q.F32)}
    path = write_gguf(tmp_path / "q3.gguf", tensors, arch="qwen3")
    arch = arch_from_gguf(path)
    assert (arch.family, arch.qk_norm, arch.attention_bias) == ("qwen3", True, False)
    names = [name for name, _ in load_gguf_tensors(path, arch)]
    assert names == ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"]


def test_unknown_architecture_is_rejected_with_supported_list(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "g.gguf", {}, arch="gpt2")
    with pytest.raises(UnsupportedModel) as info:
        arch_from_gguf(path)
    message = "GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3, gemma3, qwen3moe"
    assert str(info.value) == message


def test_gemma3_norms_lose_llama_cpps_plus_one_and_get_hf_names(tmp_path: Path) -> None:
    """llama.cpp stores Gemma's norm weights + 1 and names its four norms its own way."""
    norm = np.linspace(0.5, 2.0, HIDDEN, dtype=np.float32)
    tensors = {f"blk.0.{n}.weight": (norm, Q.F32) for n in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                             "post_ffw_norm")}
    tensors["blk.0.ffn_up.weight"] = (random_weights(FFN, HIDDEN), Q.F32)
    path = write_gguf(tmp_path / "g.gguf", tensors, arch="gemma3",
                      metadata={"attention.sliding_window": 4, "attention.key_length": 32})
    arch = arch_from_gguf(path)
    assert (arch.family, arch.head_dim, arch.sliding_window) == ("gemma3", 32, 4)
    assert arch.sliding_layers == (True,)
    loaded = dict(load_gguf_tensors(path, arch))
    hf_norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
    assert list(loaded) == [f"model.layers.0.{n}.weight" for n in (*hf_norms, "mlp.up_proj")]
    assert torch.equal(loaded["model.layers.0.input_layernorm.weight"], torch.from_numpy(norm - 1))
    up = tensors["blk.0.ffn_up.weight"][0]
    assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], torch.from_numpy(up))


def test_tensor_type_gguf_py_cannot_dequantize_names_tensor_and_type(tmp_path: Path) -> None:
    ints = np.zeros((4, 32), np.int8)
    path = write_gguf(tmp_path / "i8.gguf", {"blk.0.ffn_up.weight": (ints, Q.I8)})
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.ffn_up\.weight'.*I8"):
        list(load_gguf_tensors(path, arch_from_gguf(path)))


def test_truncated_files_are_rejected_with_a_reason(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (random_weights(64, HIDDEN), Q.F32)})
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])  # the tensor data is cut short
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.ffn_up\.weight'.*truncated"):
        list(load_gguf_tensors(path, arch_from_gguf(path)))
    path.write_bytes(whole[:200])  # the metadata is cut short
    with pytest.raises(UnsupportedModel, match="truncated or corrupt"):
        arch_from_gguf(path)
    path.write_bytes(b"not a model at all")
    with pytest.raises(UnsupportedModel, match="not a GGUF file"):
        arch_from_gguf(path)


def test_unknown_tensor_name_is_rejected(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", {"blk.0.mystery.weight": (np.ones((1, 32), np.float32), Q.F32)})
    with pytest.raises(UnsupportedModel, match="mystery"):
        list(load_gguf_tensors(path, arch_from_gguf(path)))


def test_head_dim_and_vocab_size_fall_back_when_keys_are_missing(tmp_path: Path) -> None:
    embed = np.zeros((100, HIDDEN), np.float32)
    meta = {"attention.head_count_kv": None, "vocab_size": None}
    path = write_gguf(tmp_path / "a.gguf", {"token_embd.weight": (embed, Q.F32)}, metadata=meta)
    arch = arch_from_gguf(path)
    assert (arch.head_dim, arch.vocab_size, arch.tie_word_embeddings) == (HIDDEN // HEADS, 100, True)
    assert arch.num_kv_heads == HEADS  # no head_count_kv: plain multi-head attention


def test_head_dim_and_vocab_size_come_from_their_keys(tmp_path: Path) -> None:
    lm_head = np.zeros((77, HIDDEN), np.float32)
    meta = {"attention.key_length": 128, "vocab_size": 77}
    path = write_gguf(tmp_path / "b.gguf", {"output.weight": (lm_head, Q.F32)}, metadata=meta)
    arch = arch_from_gguf(path)
    assert (arch.head_dim, arch.vocab_size, arch.tie_word_embeddings) == (128, 77, False)


def test_linear_rope_scaling(tmp_path: Path) -> None:
    meta = {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
    arch = arch_from_gguf(write_gguf(tmp_path / "r.gguf", {}, metadata=meta))
    assert arch.rope_scaling == RopeScaling(kind="linear", factor=4.0)


def test_unsupported_rope_scaling_is_rejected(tmp_path: Path) -> None:
    meta = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
    with pytest.raises(UnsupportedModel, match="yarn"):
        arch_from_gguf(write_gguf(tmp_path / "y.gguf", {}, metadata=meta))


def test_llama3_rope_freqs_become_llama3_scaling(tmp_path: Path) -> None:
    factors = _llama3_rope_factors(factor=32.0, head_dim=HIDDEN // HEADS, theta=10000.0)
    tensors = {"rope_freqs.weight": (factors, Q.F32)}
    path = write_gguf(tmp_path / "l3.gguf", tensors, arch="llama")
    assert arch_from_gguf(path).rope_scaling == RopeScaling(kind="llama3", factor=32.0)
    assert list(load_gguf_tensors(path, arch_from_gguf(path))) == []  # not a weight


def test_rope_freqs_that_are_not_llama3_scaling_are_rejected(tmp_path: Path) -> None:
    factors = np.linspace(1.0, 8.0, HIDDEN // HEADS // 2, dtype=np.float32)
    path = write_gguf(tmp_path / "f.gguf", {"rope_freqs.weight": (factors, Q.F32)}, arch="llama")
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        arch_from_gguf(path)


def _llama3_rope_factors(factor: float, head_dim: int, theta: float) -> np.ndarray:
    """As llama.cpp's converter computes them for Llama 3.1 (low 1, high 4, 8192 positions)."""
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)
