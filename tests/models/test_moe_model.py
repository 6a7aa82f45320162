"""The mixture-of-experts model and block against transformers' modules; loading experts
stored one by one or stacked; the weight cache's packed state of experts."""

from __future__ import annotations

import msgspec
import torch
import transformers
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from pypto_serving.backends import CpuBackend
from pypto_serving.kernels import cpu
from pypto_serving.loader.hf import arch_from_hf_config
from pypto_serving.models import LayerFactory, build_model, load_weights
from pypto_serving.models.moe import SparseMoeBlock
from pypto_serving.models.packed_state import packed_state, restore_state
from pypto_serving.models.weights import split_experts
from tests.models.test_llama_model import prefill_logits
from tests.worker.test_moe_vs_transformers import build_hf_moe

CPU = torch.device("cpu")
IDS = [(11 * i + 5) % 256 for i in range(21)]


def ours(hf: torch.nn.Module, layers: LayerFactory | None = None) -> torch.nn.Module:
    arch = arch_from_hf_config(hf.config.to_dict())
    model = build_model(arch, torch.float32, CPU, layers=layers)
    load_weights(model, arch, hf.state_dict().items())
    return model


def test_prefill_logits_match_transformers_from_stacked_experts() -> None:
    """transformers 5 holds each layer's experts as 3-D tensors in memory: they load too."""
    hf = build_hf_moe("qwen3_moe")
    assert any(name.endswith("experts.gate_up_proj") for name in hf.state_dict())
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(prefill_logits(ours(hf), IDS), expected, atol=1e-4, rtol=0)


def test_stacked_experts_split_into_the_published_names() -> None:
    gate_up, down = torch.randn(3, 2 * 4, 5), torch.randn(3, 5, 4)
    split = dict(split_experts([("m.mlp.experts.gate_up_proj", gate_up), ("m.mlp.experts.down_proj", down),
                                ("m.mlp.gate.weight", torch.zeros(3, 5))]))
    assert torch.equal(split["m.mlp.experts.2.gate_proj.weight"], gate_up[2, :4])
    assert torch.equal(split["m.mlp.experts.2.up_proj.weight"], gate_up[2, 4:])
    assert torch.equal(split["m.mlp.experts.1.down_proj.weight"], down[1])
    assert len(split) == 3 * 3 + 1


def test_a_shared_expert_block_matches_qwen2_moe() -> None:
    """Shared experts fit the block: Qwen2-MoE's sigmoid-gated one, against transformers'."""
    sizes = dict(hidden_size=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
    config = transformers.Qwen2MoeConfig(**sizes, shared_expert_intermediate_size=64, norm_topk_prob=False)
    torch.manual_seed(0)
    hf_block = Qwen2MoeSparseMoeBlock(config).eval()
    for p in hf_block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    arch = arch_from_hf_config(transformers.Qwen3MoeConfig(**sizes).to_dict())
    arch = msgspec.structs.replace(arch, shared_expert_intermediate_size=64)
    layer = torch.nn.Module()  # names as in a decoder layer: mlp.experts.N., mlp.shared_expert.
    layer.mlp = SparseMoeBlock(arch, LayerFactory())
    load_weights(layer, arch, ((f"mlp.{name}", t) for name, t in hf_block.state_dict().items()))
    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer.mlp(x[0]), hf_block(x)[0], atol=1e-5, rtol=0)


def test_a_restored_packed_state_keeps_the_experts_packed() -> None:
    """The weight cache's path: the packed experts the fused op reads are rebuilt."""
    hf = build_hf_moe("qwen3_moe")
    layers = CpuBackend("cpu", torch.float32).layers("int4") if cpu.available() else LayerFactory("int4")
    loaded = ours(hf, layers)
    restored = build_model(loaded.arch, torch.float32, CPU, layers=layers)
    restore_state(restored, *packed_state(loaded), CPU)
    experts = restored.model.layers[0].mlp.experts
    assert experts.packed is not None and experts.packed.gate_up[0] is experts[0].gate_up_proj.weight.packed
    assert torch.equal(prefill_logits(restored, IDS), prefill_logits(loaded, IDS))
