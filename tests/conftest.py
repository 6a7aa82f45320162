from __future__ import annotations

import os
from pathlib import Path

import pytest

# No GPU runs the tests: Triton kernels (the cuda backend's) run under Triton's interpreter. It
# must be set before anything imports Triton (torch does, on first use of some ops): Triton's
# own @jit helpers (tl.max, tl.sum) are made interpretable only then.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pypto_serving.app.packaged_models import PackagedModelMissing, gemma3_path, smollm2_path
from tests.oracles import transformers_model, transformers_tokenizer


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    try:
        return str(smollm2_path())
    except PackagedModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """The packaged Gemma 3 270M (Q4_K_M), joined from its four parts."""
    try:
        return str(gemma3_path())
    except PackagedModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: str):
    from pypto_serving.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: str):
    """transformers' own load of the packaged SmolLM2 GGUF (fp32): the oracle. Slow, so shared."""
    return transformers_model(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_gguf: str):
    """transformers' own load of the packaged Gemma 3 GGUF (fp32): the oracle (~50 s on 2 cores)."""
    return transformers_model(gemma3_gguf)


@pytest.fixture(scope="session")
def hf_gemma3_tokenizer(gemma3_gguf: str):
    """transformers' tokenizer of the packaged Gemma 3 GGUF (the class AutoTokenizer picks)."""
    return transformers_tokenizer(Path(gemma3_gguf))


@pytest.fixture(scope="session")
def smollm2_source(smollm2_gguf: str):
    """The packaged SmolLM2 as `--model smollm2` resolves it."""
    from pypto_serving.app.model_source import resolve_model

    return resolve_model("smollm2")
