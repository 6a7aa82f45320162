"""How --activation-quantization resolves against the backend, dtype and weight packing."""

from __future__ import annotations

import pytest

from pypto_serving.cli import FlagError, build_parser
from pypto_serving.model_source import ModelSourceError, resolve_model
from pypto_serving.settings import build_settings


@pytest.fixture(scope="module")
def smollm2():
    try:
        return resolve_model("smollm2")
    except ModelSourceError as exc:
        pytest.skip(str(exc))


def worker(source, *flags: str):
    args = build_parser().parse_args(["--model", "smollm2", *flags])
    return build_settings(args, source).engine.worker


@pytest.mark.parametrize(("flags", "weights", "activations"), [
    ((), "auto", "int8"),  # the CPU default: packed weights, int8 inputs to their matmuls
    (("--activation-quantization", "none"), "auto", "none"),
    (("--quantization", "int8", "--activation-quantization", "int8"), "int8", "int8"),
    (("--quantization", "none"), "none", "none"),  # exact weights: exact activations
    (("--dtype", "float32"), "none", "none"),  # an explicit dtype asks for the exact path
])
def test_activation_quantization_follows_the_weights(smollm2, flags, weights, activations) -> None:
    cfg = worker(smollm2, *flags)
    assert (cfg.quantization, cfg.activation_quantization) == (weights, activations)


def test_int8_activations_without_packed_weights_are_refused(smollm2) -> None:
    with pytest.raises(FlagError, match="--activation-quantization int8"):
        worker(smollm2, "--quantization", "none", "--activation-quantization", "int8")
