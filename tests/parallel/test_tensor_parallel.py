"""Tensor parallelism over real process groups (gloo, loopback): rank 0 on the pipe, the other
ranks started by the client, every plan handed on by rank 0.

tp=2 (and tp=3) gives the greedy tokens and, within float tolerance, the logprobs of tp=1 on
tiny random checkpoints; plans come as the async scheduler sends them (the next one, with a
placeholder, before the last result is back).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import torch
import transformers

from pypto_serving.actors.device_client import DeviceWorkerClient
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.messages.worker import (
    PLACEHOLDER,
    ParallelConfig,
    ScheduledSeq,
    StepPlan,
    StepResult,
    WorkerConfig,
)
from tests.worker.tiny_models import BLOCK_SIZE, COMMON, build_hf_model, worker_config

PROMPTS = [[3, 17, 42, 99, 7, 1, 200, 5], [11, 250, 9, 64, 33]]
NEW_TOKENS = 12
TOP = 5


def _tiny(path: Path, kind: str, **extra: object) -> Path:
    config = getattr(transformers, f"{kind}Config")(**(COMMON | extra))
    torch.manual_seed(1)
    getattr(transformers, f"{kind}ForCausalLM")(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {
        "llama": _tiny(root / "llama", "Llama"),
        "qwen2": _tiny(root / "qwen2", "Qwen2", tie_word_embeddings=True, vocab_size=257),  # odd vocab
        "qwen3": _tiny(root / "qwen3", "Qwen3", head_dim=32),
        # 6 heads and 1 KV head: tp=3 splits the heads and replicates the KV head on every rank
        "llama_6_heads": _tiny(root / "llama6", "Llama", hidden_size=96, num_attention_heads=6,
                               num_key_value_heads=1, intermediate_size=192),
        "gemma3": _saved(build_hf_model("gemma3"), root / "gemma3"),  # sliding window 5, tied
    }


def _saved(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def group_config(path: Path, tp: int, **overrides: object) -> WorkerConfig:
    cfg = worker_config(path, **overrides)
    return msgspec.structs.replace(cfg, parallel=ParallelConfig(tp, list(range(tp)), timeout_s=60))


class Results:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[StepResult] = asyncio.Queue()
        self.deaths: list[str] = []

    async def next(self) -> StepResult:
        result = await asyncio.wait_for(self.queue.get(), 60)
        assert result.error is None, result.error
        return result


async def decode(cfg: WorkerConfig, n: int = NEW_TOKENS) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Greedy tokens and each step's top logprobs of PROMPTS, batched, plans sent one ahead."""
    results = Results()
    client = DeviceWorkerClient(cfg, results.queue.put_nowait, results.deaths.append)
    await client.start()
    try:
        params = SamplingParams(logprobs=TOP)
        blocks = -(-(max(map(len, PROMPTS)) + n) // BLOCK_SIZE)
        first = [ScheduledSeq(i, p, 0, list(range(i * blocks, (i + 1) * blocks)), True, reset=True,
                              num_prompt_tokens=len(p), sampling=params) for i, p in enumerate(PROMPTS)]
        client.send(StepPlan(0, first))
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        tops: list[list[list[float]]] = [[] for _ in PROMPTS]
        for step in range(1, n + 1):
            if step < n:  # the next step goes out before this one's result is back
                client.send(StepPlan(step, [ScheduledSeq(i, [PLACEHOLDER], len(p) + step - 1, [], True)
                                            for i, p in enumerate(PROMPTS)]))
            result = await results.next()
            for i, (token, top) in enumerate(zip(result.token_ids, result.top_logprobs, strict=True)):
                tokens[i].append(token)
                tops[i].append([t.logprob for t in top])
        assert results.deaths == []
        return tokens, tops
    finally:
        await client.stop()


@pytest.mark.parametrize(("name", "tp", "quantization"), [
    ("llama", 2, "none"),
    ("qwen2", 2, "none"),
    ("qwen3", 2, "none"),
    ("llama_6_heads", 3, "none"),
    ("llama", 2, "int4"),
    ("gemma3", 2, "none"),
])
def test_tensor_parallel_ranks_give_the_tokens_of_one(checkpoints: dict[str, Path], name: str, tp: int,
                                                      quantization: str):
    path = checkpoints[name]
    one = asyncio.run(decode(group_config(path, 1, quantization=quantization)))
    many = asyncio.run(decode(group_config(path, tp, quantization=quantization)))
    assert many[0] == one[0]
    assert len(set(one[0][0] + one[0][1])) > 2  # not one repeated token: the test can tell
    torch.testing.assert_close(torch.tensor(many[1]), torch.tensor(one[1]), atol=1e-4, rtol=0)


def test_a_rank_that_dies_is_the_death_of_its_worker(checkpoints: dict[str, Path]):
    async def run() -> tuple[list[str], float]:
        results = Results()
        client = DeviceWorkerClient(group_config(checkpoints["llama"], 2), results.queue.put_nowait,
                                    results.deaths.append)
        await client.start()
        try:
            os.kill(client.ranks[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not results.deaths and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            return results.deaths, time.monotonic() - t0
        finally:
            await client.stop()

    deaths, seconds = asyncio.run(run())
    assert len(deaths) == 1 and "tensor-parallel rank 1" in deaths[0]
    assert seconds < 5
