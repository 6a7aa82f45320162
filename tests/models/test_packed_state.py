"""A model's packed state goes back into a fresh model unchanged, or not at all."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.models import LayerFactory
from pypto_serving.models.packed_state import packed_state, restore_state
from pypto_serving.models.quant import PackedRows
from tests.models.test_llama_model import prefill_logits
from tests.models.test_quant_model import CPU, IDS, model_with
from tests.worker.tiny_models import build_hf_model


def fresh(quantization: str) -> torch.nn.Module:
    from pypto_serving.loader.hf import arch_from_hf_config
    from pypto_serving.models import build_model

    arch = arch_from_hf_config(build_hf_model("qwen2_tied").config.to_dict())
    return build_model(arch, torch.float32, CPU, layers=LayerFactory(quantization))


def test_a_restored_state_computes_the_same_logits() -> None:
    loaded = model_with(build_hf_model("qwen2_tied").state_dict(), "qwen2_tied", LayerFactory("int4"))
    restored = fresh("int4")
    restore_state(restored, *packed_state(loaded), CPU)
    assert torch.equal(prefill_logits(restored, IDS), prefill_logits(loaded, IDS))


def test_a_state_that_does_not_fit_leaves_the_model_untouched() -> None:
    int8 = model_with(build_hf_model("qwen2_tied").state_dict(), "qwen2_tied", LayerFactory("int8"))
    target = fresh("int4")
    before = {name: p.data_ptr() for name, p in target.named_parameters()}
    with pytest.raises(ValueError, match="int8 where the model packs to"):
        restore_state(target, *packed_state(int8), CPU)
    assert all(m.packed is None for m in target.modules() if isinstance(m, PackedRows))
    assert before == {name: p.data_ptr() for name, p in target.named_parameters()}
