"""Weight-only quantized models: lossless on 4- and 5-bit grids, the C kernels equal to portable."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.backends import CpuBackend
from pypto_serving.kernels import cpu
from pypto_serving.kernels.quant_linear import dequantize
from pypto_serving.loader.hf import arch_from_hf_config
from pypto_serving.models import LayerFactory, build_model, load_weights
from pypto_serving.models.quant import QuantEmbedding, QuantLinear
from tests.kernels.test_quant_linear import on_grid
from tests.models.test_llama_model import prefill_logits
from tests.worker.tiny_models import build_hf_model

CPU = torch.device("cpu")
IDS = [(7 * i + 3) % 256 for i in range(11)]


def model_with(state: dict[str, torch.Tensor], name: str, layers: LayerFactory,
               device: torch.device = CPU) -> torch.nn.Module:
    arch = arch_from_hf_config(build_hf_model(name).config.to_dict())
    model = build_model(arch, torch.float32, device, layers=layers)
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


def gguf_state(name: str, linear_type: str) -> dict[str, torch.Tensor]:
    """The tiny checkpoint as gguf-py quantizes and dequantizes it: the decoder linears as
    `linear_type`, the embedding and lm_head as Q8_0."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    def through(w: torch.Tensor, kind: str) -> torch.Tensor:
        qtype = gguf.GGMLQuantizationType[kind]
        return torch.from_numpy(dequantize(quantize(w.float().numpy(), qtype), qtype).copy())

    state = build_hf_model(name).state_dict()
    return {k: v if v.dim() != 2 else
            through(v, linear_type if "layers" in k else "Q8_0")
            for k, v in state.items()}


@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
def test_auto_packs_q5_0_linears_to_int5_exactly(name: str) -> None:
    state = gguf_state(name, "Q5_0")
    exact = prefill_logits(model_with(state, name, LayerFactory("none")), IDS)
    packed = model_with(state, name, LayerFactory("auto"))
    linears = [m for m in packed.model.layers.modules() if isinstance(m, QuantLinear)]
    assert linears and {m.weight.packed.bits for m in linears} == {5}
    for n, m in packed.model.layers.named_modules():
        if isinstance(m, QuantLinear) and n.endswith("o_proj"):
            assert torch.equal(dequantize(m.weight.packed), state[f"model.layers.{n}.weight"])
    torch.testing.assert_close(prefill_logits(packed, IDS), exact, rtol=1e-4, atol=1e-4)


def test_auto_falls_back_to_int8_off_the_grid() -> None:
    model = model_with(build_hf_model("llama").state_dict(), "llama", LayerFactory("auto"))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.weight.packed.bits == 8 for m in linears)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)


@pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_cpu_kernels_match_portable_on_int5_weights(activations: str) -> None:
    state = gguf_state("qwen2_tied", "Q5_0")
    portable = prefill_logits(model_with(state, "qwen2_tied", LayerFactory("auto")), IDS)
    fast = model_with(state, "qwen2_tied", CpuBackend("cpu", torch.float32).layers("auto", activations))
    assert any(m.weight.packed.bits == 5 for m in fast.modules() if isinstance(m, QuantLinear))
    tolerance = 1e-4 if activations == "none" else 0.05  # int8 activations: their own rounding
    torch.testing.assert_close(prefill_logits(fast, IDS), portable, rtol=tolerance, atol=tolerance)


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
