"""GGUF `qwen3moe` files: the experts' metadata, the 3-D *_exps tensors, and the logits of a
tiny random model written as llama.cpp lays it out, against transformers."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
import transformers

from pypto_serving.loader.gguf_file import arch_from_gguf, load_gguf_tensors
from pypto_serving.models import build_model, load_weights
from tests.models.test_llama_model import prefill_logits
from tests.worker.test_moe_vs_transformers import MOE
from tests.worker.tiny_models import COMMON

IDS = [(11 * i + 5) % 256 for i in range(21)]
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def tiny_hf() -> torch.nn.Module:
    """Every layer MoE, top-k renormalized: what llama.cpp's qwen3moe computes."""
    config = transformers.Qwen3MoeConfig(**(COMMON | MOE), norm_topk_prob=True)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def gguf_tensors(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state as llama.cpp's converter names it: gate and up experts as separate stacks."""
    sd = hf.state_dict()
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    for name, tensor in sd.items():
        if not name.startswith("model.layers."):
            continue
        _, _, layer, rest = name.split(".", 3)
        part, kind = rest.rsplit(".", 1) if rest.endswith((".weight", ".bias")) else (rest, "weight")
        if part == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
        elif part == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = tensor
        else:
            out[f"blk.{layer}.{GGUF_NAMES[part]}.{kind}"] = tensor
    return out


def write_moe_gguf(path: Path, hf: torch.nn.Module) -> Path:
    c = hf.config
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads),
                       ("attention.key_length", c.head_dim),
                       ("vocab_size", c.vocab_size), ("expert_count", c.num_experts),
                       ("expert_used_count", c.num_experts_per_tok),
                       ("expert_feed_forward_length", c.moe_intermediate_size)):
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_float32("qwen3moe.rope.freq_base", 10000.0)
    for name, tensor in gguf_tensors(hf).items():
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_qwen3moe_gguf_metadata_gives_the_experts(tmp_path: Path) -> None:
    arch = arch_from_gguf(write_moe_gguf(tmp_path / "moe.gguf", tiny_hf()))
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 32)
    assert arch.norm_topk_prob and arch.qk_norm and arch.moe_layers == (0, 1) and arch.head_dim == 32


def test_qwen3moe_gguf_logits_match_transformers(tmp_path: Path) -> None:
    hf = tiny_hf()
    path = write_moe_gguf(tmp_path / "moe.gguf", hf)
    arch = arch_from_gguf(path)
    model = build_model(arch, torch.float32, torch.device("cpu"))
    load_weights(model, arch, load_gguf_tensors(path, arch))
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(prefill_logits(model, IDS), expected, atol=1e-4, rtol=0)
