"""Every backend's kernels against the portable reference: the same model, weights and
prompt give the same logits (packed and exact), the same argmax, zeroed KV storage. The
cuda and npu backends run where their device exists and skip, naming the backend, elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pypto_serving.backends import BACKENDS, PortableBackend, make_backend
from tests.models.test_llama_model import prefill_logits
from tests.models.test_quant_model import model_with
from tests.worker.tiny_models import build_hf_model

IDS = [(5 * i + 1) % 256 for i in range(13)]


def device_of(name: str) -> str:
    """The device a backend is tested on here; skips with the reason where there is none."""
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("cuda backend: no CUDA device on this machine")
    if name == "npu" and importlib.util.find_spec("torch_npu") is None:
        pytest.skip("npu backend: torch_npu is not installed (no Ascend NPU on this machine)")
    return {"cuda": "cuda:0", "npu": "npu:0"}.get(name, "cpu")


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_backend_logits_equal_portable(name: str, quantization: str) -> None:
    backend = make_backend(name, device_of(name), torch.float32)
    state = build_hf_model("qwen2_tied").state_dict()
    reference = prefill_logits(model_with(state, "qwen2_tied", PortableBackend("cpu", torch.float32)
                                          .layers(quantization)), IDS)
    got = prefill_logits(model_with(state, "qwen2_tied", backend.layers(quantization), backend.device), IDS,
                         backend)
    torch.testing.assert_close(got.cpu(), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_argmax_and_kv_storage(name: str) -> None:
    backend = make_backend(name, device_of(name), torch.float32)
    logits = torch.randn(5, 300)
    logits[2, 7] = logits[2, 9] = 1e9  # a tie: the first one wins, as torch.argmax says
    assert torch.equal(backend.argmax(logits.to(backend.device)).cpu(), logits.argmax(dim=-1))
    cache = backend.zeros((3, 4, 2, 16), torch.float16)
    assert cache.shape == (3, 4, 2, 16) and cache.dtype == torch.float16 and not cache.any()
    assert backend.profiler_activities[0] == "cpu"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="tpu"):
        make_backend("tpu", "cpu", torch.float32)


def test_the_cpu_backend_packs_for_its_kernels_and_portable_does_not() -> None:
    from pypto_serving.kernels import cpu

    if not cpu.available():
        pytest.skip("cpu backend: no AVX2/FMA/F16C CPU or no C compiler, so it runs the portable kernels")
    assert make_backend("cpu", "cpu", torch.float32).kernels_used("int4", "int8") == ("c", "int8")
    assert make_backend("portable", "cpu", torch.float32).kernels_used("int4", "int8") == ("portable", "none")
    assert make_backend("cpu", "cpu", torch.bfloat16).kernels_used("int4", "int8") == ("portable", "none")
