"""Weight-only quantized models: lossless on 4-bit grids, the C kernels equal to portable."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.backends import CpuBackend
from pypto_serving.kernels import cpu
from pypto_serving.loader.hf import arch_from_hf_config
from pypto_serving.models import LayerFactory, build_model, load_weights
from pypto_serving.models.quant import QuantEmbedding, QuantLinear
from tests.kernels.test_quant_linear import on_grid
from tests.models.test_llama_model import prefill_logits
from tests.worker.tiny_models import build_hf_model

CPU = torch.device("cpu")
IDS = [(7 * i + 3) % 256 for i in range(11)]


def model_with(state: dict[str, torch.Tensor], name: str, layers: LayerFactory) -> torch.nn.Module:
    arch = arch_from_hf_config(build_hf_model(name).config.to_dict())
    model = build_model(arch, torch.float32, CPU, layers=layers)
    load_weights(model, arch, state.items())
    return model


def grid_state(name: str) -> dict[str, torch.Tensor]:
    """The tiny checkpoint as a Q4_1 GGUF would hold it: linears on a 4-bit grid, the
    embedding and lm_head on a Q8_0 grid."""
    state = build_hf_model(name).state_dict()
    def bits(name: str) -> int:
        return 8 if "embed" in name or "lm_head" in name else 4

    return {k: on_grid(*v.shape, bits=bits(k), seed=i) if v.dim() == 2 else v
            for i, (k, v) in enumerate(state.items())}


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3"])
def test_auto_is_lossless_on_4bit_weights(name: str) -> None:
    state = grid_state(name)
    exact = prefill_logits(model_with(state, name, LayerFactory("none")), IDS)
    packed = model_with(state, name, LayerFactory("auto"))
    layers = [m for m in packed.model.layers.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.weight.packed.bits == 4 for m in layers)  # lm_head / embedding: int8
    torch.testing.assert_close(prefill_logits(packed, IDS), exact, rtol=1e-4, atol=1e-4)


def test_auto_falls_back_to_int8_off_the_grid() -> None:
    model = model_with(build_hf_model("llama").state_dict(), "llama", LayerFactory("auto"))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.weight.packed.bits == 8 for m in linears)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)


@pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])  # qwen2: q/k/v bias through the kernel
def test_cpu_kernels_match_portable_in_the_model(name: str) -> None:
    state = build_hf_model(name).state_dict()
    portable = prefill_logits(model_with(state, name, LayerFactory("int4")), IDS)
    fast = prefill_logits(model_with(state, name, CpuBackend("cpu", torch.float32).layers("int4")), IDS)
    torch.testing.assert_close(fast, portable, rtol=1e-4, atol=1e-4)


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="int3"):
        LayerFactory("int3")
