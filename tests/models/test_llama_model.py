"""The Llama-family model and its weight loading, against transformers' modules."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.backends import PortableBackend
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.loader.arch import ModelArch
from pypto_serving.loader.hf import arch_from_hf_config
from pypto_serving.messages.worker import ScheduledSeq
from pypto_serving.models import build_model, load_weights
from pypto_serving.models.llama import LlamaForCausalLM
from pypto_serving.worker.batch import prepare
from pypto_serving.worker.kv_cache import allocate_kv_cache
from pypto_serving.worker.seq_state import SeqState
from tests.worker.tiny_models import CHECKPOINTS, build_hf_model

CPU = torch.device("cpu")


def ours(name: str) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    hf = build_hf_model(name)
    arch = arch_from_hf_config(hf.config.to_dict())
    model = build_model(arch, torch.float32, CPU)
    load_weights(model, arch, hf.state_dict().items())
    return model, hf


def prefill_logits(model: LlamaForCausalLM, ids: list[int],
                   backend: PortableBackend | None = None) -> torch.Tensor:
    """Logits at every position of one prompt run as a single prefill, on `backend`'s device
    (the portable backend's CPU by default), where `model` lies."""
    backend = backend or PortableBackend(CPU, torch.float32)
    blocks = list(range(-(-len(ids) // 4)))
    seq = ScheduledSeq(0, ids, 0, blocks, sample=True)
    state = SeqState(blocks, ids, len(ids), SamplingParams(), None)
    batch = prepare([seq], [state], 4, backend.device, backend.block_tables)
    zeros = backend.zeros
    caches = allocate_kv_cache(model.arch, len(blocks), 4, torch.float32, zeros)
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, batch.attn, caches)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_prefill_logits_match_transformers_at_every_position(name: str) -> None:
    model, hf = ours(name)
    ids = [(11 * i + 5) % 256 for i in range(21)]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=1e-4, rtol=0)


def test_fused_projections_hold_the_checkpoint_rows_in_order() -> None:
    model, hf = ours("qwen2_tied")
    sd = hf.state_dict()
    attn = model.model.layers[1].self_attn.qkv_proj
    parts = [sd[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]
    assert torch.equal(attn.bias, torch.cat(parts))
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    parts = [sd[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(gate_up, torch.cat(parts))
    assert not hasattr(model, "lm_head")  # tied: the embedding is the head


def test_weights_are_cast_to_the_model_dtype() -> None:
    hf = build_hf_model("llama")
    arch = arch_from_hf_config(hf.config.to_dict())
    model = build_model(arch, torch.bfloat16, CPU)
    load_weights(model, arch, hf.state_dict().items())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.dtype == torch.float32  # angles stay exact


def weights_and_arch(name: str) -> tuple[dict[str, torch.Tensor], ModelArch]:
    hf = build_hf_model(name)
    return dict(hf.state_dict()), arch_from_hf_config(hf.config.to_dict())


def test_missing_tensor_is_named() -> None:
    sd, arch = weights_and_arch("llama")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_weights(build_model(arch, torch.float32, CPU), arch, sd.items())


def test_unknown_tensor_is_named() -> None:
    sd, arch = weights_and_arch("llama")
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_weights(build_model(arch, torch.float32, CPU), arch, sd.items())


def test_wrong_shape_is_named() -> None:
    sd, arch = weights_and_arch("llama")
    sd["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(3,\)"):
        load_weights(build_model(arch, torch.float32, CPU), arch, sd.items())


def test_a_stored_head_of_a_tied_model_is_ignored() -> None:
    sd, arch = weights_and_arch("qwen2_tied")
    sd["lm_head.weight"] = torch.zeros_like(sd["model.embed_tokens.weight"])
    model = build_model(arch, torch.float32, CPU)
    load_weights(model, arch, sd.items())
    assert torch.equal(model.model.embed_tokens.weight, sd["model.embed_tokens.weight"])
