"""Qwen3-MoE through the ModelRunner against transformers on tiny random checkpoints (fp32,
CPU): the exact path's logits within ATOL and its greedy tokens identical; the packed path
(int4 weights, float or int8 activations, the C fused-MoE op) close to the exact one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pypto_serving.kernels import cpu
from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import COMMON, Driver, Oracle, mixed_batch, worker_config

ATOL = 1e-4
PROMPT = [(7 * i + 3) % 256 for i in range(13)]
TOKENS = 32
MOE = dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CHECKPOINTS = {
    # layer 1 dense (mlp_only_layers), top-k weights renormalized
    "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    # every second layer MoE (decoder_sparse_step): layer 0 dense, layer 1 MoE; raw softmax weights
    "qwen3_moe_sparse_step": dict(decoder_sparse_step=2, norm_topk_prob=False),
}


def build_hf_moe(name: str) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(**(COMMON | MOE | CHECKPOINTS[name]))
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            path, model = tmp_path_factory.mktemp(name), build_hf_moe(name)
            model.save_pretrained(path)  # experts saved one by one, as published checkpoints are
            cache[name] = (path, model)
        return cache[name]

    return get


def runner(path: Path, **overrides: object) -> Driver:
    return Driver(ModelRunner(worker_config(path, **overrides)))


def generate(d: Driver, prompt: list[int], steps: int, forced: list[int] | None = None) -> list[torch.Tensor]:
    """Prefill then decode, `steps` logits rows; with `forced`, each sampled token is replaced
    by forced[i] (teacher forcing: both paths see the same contexts)."""
    rows = []
    seq = d.add(1, prompt, chunk=len(prompt))
    for i in range(steps):
        rows.append(d.step([seq])[1][0])
        if forced is not None:
            d.tokens[1][-1] = forced[i]
        seq = d.next(1)
    return rows


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_decode_matches_transformers(moe_checkpoint: Callable, name: str) -> None:
    path, hf = moe_checkpoint(name)
    d, o = runner(path), Oracle(hf)
    rows = generate(d, PROMPT, TOKENS)
    generated = d.tokens[1][len(PROMPT):]
    assert generated == o.greedy(PROMPT, TOKENS)
    first = len(PROMPT) - 1
    ref = o.logits(d.tokens[1])[first:first + TOKENS]
    torch.testing.assert_close(torch.stack(rows), ref, atol=ATOL, rtol=0)


def test_mixed_prefill_and_decode_batch_matches_transformers(moe_checkpoint: Callable) -> None:
    """Tokens of several sequences share the experts of one step."""
    path, hf = moe_checkpoint("qwen3_moe")
    d, o = runner(path), Oracle(hf)
    prompts, rows = mixed_batch(d, PROMPT)
    for seq_id, prompt in prompts.items():
        n = len(rows[seq_id])
        assert d.tokens[seq_id][len(prompt):] == o.greedy(prompt, n)
        first = len(prompt) - 1
        ref = o.logits(d.tokens[seq_id])[first:first + n]
        torch.testing.assert_close(torch.stack(rows[seq_id]), ref, atol=ATOL, rtol=0)


@pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_packed_path_stays_close_to_the_exact_path(moe_checkpoint: Callable, activations: str) -> None:
    from pypto_serving.kernels.cpu.moe import fused_moe_cpu

    path, _ = moe_checkpoint("qwen3_moe")
    exact = runner(path)
    exact_rows = torch.stack(generate(exact, PROMPT, TOKENS))
    packed = runner(path, quantization="int4", activation_quantization=activations)
    model = packed.runner.model
    assert model.model.layers[0].mlp.ops.fused_moe is fused_moe_cpu and packed.runner.stack is None
    assert model.model.layers[0].mlp.experts.packed.activations == activations
    rows = torch.stack(generate(packed, PROMPT, TOKENS, forced=exact.tokens[1][len(PROMPT):]))
    agree = (rows.argmax(-1) == exact_rows.argmax(-1)).float().mean().item()
    assert agree >= 0.85, f"top-1 agrees on {agree:.0%} of the positions"
    # int4 on random (gridless) weights: measured max 0.28, mean 0.06 on logits of std 0.38
    difference = (rows - exact_rows).abs()
    assert difference.max() < 0.5 and difference.mean() < 0.1, (difference.max(), difference.mean())


@pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
def test_cpu_backend_matches_portable_backend_on_packed_weights(moe_checkpoint: Callable) -> None:
    """The C fused-MoE op (and the other C kernels) in the model: what the portable backend
    computes over the same packed weights, up to summation order."""
    path, _ = moe_checkpoint("qwen3_moe")
    portable = runner(path, backend="portable", quantization="int4")
    portable_rows = torch.stack(generate(portable, PROMPT, 8))
    fast = runner(path, quantization="int4")
    rows = torch.stack(generate(fast, PROMPT, 8, forced=portable.tokens[1][len(PROMPT):]))
    torch.testing.assert_close(rows, portable_rows, atol=1e-4, rtol=0)
