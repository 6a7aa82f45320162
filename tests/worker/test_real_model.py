"""The packaged SmolLM2 GGUF through ModelRunner gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.actors.device_worker import ScheduledSeq, StepPlan, WorkerConfig
from pypto_serving.loader.gguf_file import arch_from_gguf
from pypto_serving.packaged_models import PackagedModelMissing, smollm2_path
from pypto_serving.sampling import SamplingParams
from pypto_serving.worker.model_runner import ModelRunner

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return str(smollm2_path())
    except PackagedModelMissing as exc:
        pytest.skip(str(exc))


def runner_greedy(path: str, n: int, quantization: str = "none") -> list[int]:
    cfg = WorkerConfig(
        model_path=path, model_format="gguf", arch=arch_from_gguf(path), dtype="float32",
        kv_cache_dtype="auto", backend="cpu", device="cpu", block_size=2, max_num_blocks=64,
        kv_cache_bytes=1 << 26, gpu_memory_utilization=0.9, max_num_seqs=1, max_model_len=64,
        max_num_batched_tokens=64, quantization=quantization,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    first = ScheduledSeq(1, PROMPT, 0, [0, 1, 2], True, True, [], len(PROMPT), SamplingParams())
    tokens = runner.execute(StepPlan(0, [first])).token_ids
    for step in range(1, n):
        pos = len(PROMPT) + step - 1
        new_blocks = [pos // 2] if pos % 2 == 0 else []
        seq = ScheduledSeq(1, tokens[-1:], pos, new_blocks, True)
        tokens += runner.execute(StepPlan(step, [seq])).token_ids
    return tokens


@pytest.fixture(scope="module")
def transformers_tokens(hf_smollm2) -> list[int]:
    with torch.no_grad():
        out = hf_smollm2.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def test_smollm2_greedy_tokens_equal_transformers(smollm2: str, transformers_tokens: list[int]) -> None:
    assert runner_greedy(smollm2, NEW_TOKENS) == transformers_tokens


def test_packed_smollm2_greedy_tokens_equal_transformers(
    smollm2: str, transformers_tokens: list[int]
) -> None:
    """The server's CPU default: Q4_1 linears packed losslessly to int4, the Q8_0 embedding to
    int8, so only the order of additions differs from the fp32 path."""
    assert runner_greedy(smollm2, NEW_TOKENS, quantization="auto") == transformers_tokens
