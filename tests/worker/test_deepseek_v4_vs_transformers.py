"""DeepSeek V4 through the ModelRunner against transformers on tiny random checkpoints (fp32,
CPU): sliding, compressed-sparse (with its indexer) and heavily-compressed layers,
hyper-connections, hash-routed and top-k MoE layers. Greedy tokens identical for 32 tokens,
logits within ATOL of transformers' generate (and of its full forward where the indexer keeps
every entry, so that no top-k tie can choose differently); chunked prefill beside other
sequences' decode rows, prefix-cache hits, and the compressed state's integrity check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pypto_serving.kernels.compressed_kv import CompressedStateError
from pypto_serving.worker.model_runner import ModelRunner
from tests.worker.tiny_models import BLOCK_SIZE, Driver, Oracle, mixed_batch, worker_config

ATOL = 1e-4
TOKENS = 32
PROMPT = [(7 * i + 3) % 96 + 1 for i in range(29)]  # 7 csa windows, 3 hca windows; beyond the window
TINY = dict(
    vocab_size=97,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=2,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=24,
    index_n_heads=8,
    index_head_dim=16,
    partial_rotary_factor=0.5,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
CHECKPOINTS = {
    # the indexer keeps every entry: transformers' full forward is a reference too
    "deepseek_v4": dict(index_topk=64),
    # it keeps 3 of up to 15: the top-k selection matters; YaRN on the compressed layers' rotary
    "deepseek_v4_sparse": dict(
        index_topk=3,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
    ),
}


def build_hf(name: str) -> torch.nn.Module:
    config = transformers.DeepseekV4Config(**(TINY | CHECKPOINTS[name]))
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts these at 0 / 1 / one table entry: random ones test them
        for param_name, p in model.named_parameters():
            if param_name.endswith(("position_bias", "sinks", "e_score_correction_bias", ".base", "hc_base")):
                p.normal_(0.0, 0.5)
            elif "norm" in param_name or param_name.endswith("scale"):
                p.uniform_(0.5, 1.5)
        for module in model.modules():
            if hasattr(module, "tid2eid"):
                module.tid2eid.copy_(torch.stack([torch.arange(97) % 4, (torch.arange(97) // 4 + 1) % 4], 1))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            path, model = tmp_path_factory.mktemp(name), build_hf(name)
            model.save_pretrained(path)  # the published checkpoints' names (attn.wq_a, ffn.experts.0.w1, ...)
            cache[name] = (path, model)
        return cache[name]

    return get


def generate_scores(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits each was picked from ([n, vocab])."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.scores)[:, 0].float()


def decode(
    d: Driver, seq_id: int, prompt: list[int], steps: int, chunk: int | None = None
) -> list[torch.Tensor]:
    """Prefill (in chunks of `chunk` tokens, else at once), then decode: `steps` sampled rows."""
    rows = []
    seq = d.add(seq_id, prompt, chunk=chunk or len(prompt))
    while True:
        result, logits = d.step([seq])
        if result.seq_ids:
            rows.append(logits[0])
        if len(rows) == steps:
            return rows
        left = len(d.tokens[seq_id]) - d.computed[seq_id]
        seq = d.next(seq_id, min(left, chunk or left))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_decode_matches_transformers(checkpoint: Callable, name: str) -> None:
    path, hf = checkpoint(name)
    d = Driver(ModelRunner(worker_config(path)))
    rows = decode(d, 1, PROMPT, TOKENS)
    tokens, scores = generate_scores(hf, PROMPT, TOKENS)
    assert d.tokens[1][len(PROMPT) :] == tokens
    torch.testing.assert_close(torch.stack(rows), scores, atol=ATOL, rtol=0)


def test_logits_match_a_full_forward_of_transformers(checkpoint: Callable) -> None:
    path, hf = checkpoint("deepseek_v4")
    d = Driver(ModelRunner(worker_config(path)))
    rows = decode(d, 1, PROMPT, TOKENS)
    first = len(PROMPT) - 1
    reference = Oracle(hf).logits(d.tokens[1])[first : first + TOKENS]
    torch.testing.assert_close(torch.stack(rows), reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [3, 6])
def test_chunked_prefill_matches_transformers(checkpoint: Callable, chunk: int) -> None:
    """Windows completed across chunks (and chunks ending inside a window) compress as one pass."""
    path, hf = checkpoint("deepseek_v4_sparse")
    d = Driver(ModelRunner(worker_config(path)))
    rows = decode(d, 1, PROMPT, 8, chunk=chunk)
    tokens, scores = generate_scores(hf, PROMPT, 8)
    assert d.tokens[1][len(PROMPT) :] == tokens
    torch.testing.assert_close(torch.stack(rows), scores, atol=ATOL, rtol=0)


def test_mixed_prefill_and_decode_batch_matches_transformers(checkpoint: Callable) -> None:
    path, hf = checkpoint("deepseek_v4_sparse")
    d = Driver(ModelRunner(worker_config(path)))
    prompts, rows = mixed_batch(d, PROMPT)
    for seq_id, prompt in prompts.items():
        tokens, scores = generate_scores(hf, prompt, len(rows[seq_id]))
        assert d.tokens[seq_id][len(prompt) :] == tokens
        torch.testing.assert_close(torch.stack(rows[seq_id]), scores, atol=ATOL, rtol=0)


def test_prefix_cache_hits_reuse_the_compressed_state(checkpoint: Callable) -> None:
    """A sequence whose first blocks are another's (their keys and entries) decodes as alone."""
    path, _ = checkpoint("deepseek_v4_sparse")
    d = Driver(ModelRunner(worker_config(path)))
    decode(d, 1, PROMPT, 4)
    shared = d.blocks[1][: len(PROMPT) // BLOCK_SIZE]
    prompt = PROMPT[: len(shared) * BLOCK_SIZE] + [5, 6, 7]
    seq = d.add(2, prompt, chunk=3, shared_blocks=shared)
    for _ in range(6):
        d.step([seq])
        seq = d.next(2)
    alone = Driver(ModelRunner(worker_config(path)))
    decode(alone, 2, prompt, 6)
    assert d.tokens[2] == alone.tokens[2]


def test_a_missing_compressed_entry_fails_the_step(checkpoint: Callable) -> None:
    path, _ = checkpoint("deepseek_v4")
    d = Driver(ModelRunner(worker_config(path)))
    decode(d, 1, PROMPT, 2)
    cache = d.runner.kv_caches[2]  # an hca layer: its window 1 ends in the sequence's block 3
    cache.written[d.blocks[1][3]] = 0
    with pytest.raises(CompressedStateError, match="window 1 .*tokens 8..15.* holds no window"):
        d.step([d.next(1)])


def test_block_sizes_that_split_a_compression_window_unevenly_are_refused(checkpoint: Callable) -> None:
    path, _ = checkpoint("deepseek_v4")
    with pytest.raises(
        ValueError, match="--block-size 6 must divide or be a multiple of the compression rate 4"
    ):
        ModelRunner(worker_config(path, block_size=6))


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_packed_int8_weights_stay_close_to_the_exact_path(checkpoint: Callable, activations: str) -> None:
    """The cpu backend's packed linears (the experts through the portable fused-MoE op, which
    applies their clamp). Measured: the same 32 greedy tokens, mean |difference| 0.02 (float
    activations) and 0.04 (int8) on logits of std 0.8."""
    path, _ = checkpoint("deepseek_v4")
    exact = Driver(ModelRunner(worker_config(path)))
    exact_rows = torch.stack(decode(exact, 1, PROMPT, TOKENS))
    config = worker_config(path, quantization="int8", activation_quantization=activations)
    packed = Driver(ModelRunner(config))
    rows = torch.stack(decode(packed, 1, PROMPT, TOKENS))
    assert type(packed.runner.model.model.layers[1].attn.wq_a).__name__ == "QuantLinear"
    agree = (rows.argmax(-1) == exact_rows.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agrees on {agree:.0%} of the positions"
    assert (rows - exact_rows).abs().mean() < 0.1
