"""ModelRunner against transformers on tiny random checkpoints (fp32, CPU).

Every logits row we sample from must equal the transformers row for the same context within
ATOL, and greedy decoding must give exactly the tokens of `generate(do_sample=False)`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.worker.tiny_models import CHECKPOINTS, Driver, Oracle, mixed_batch

ATOL = 1e-4  # fp32; measured max difference is ~1e-6
PROMPT = [(7 * i + 3) % 256 for i in range(13)]


def decode(d: Driver, seq_id: int, steps: int) -> list[torch.Tensor]:
    """Run `steps` decode steps of one sequence; its logits rows."""
    return [d.step([d.next(seq_id)])[1][0] for _ in range(steps)]


def assert_logits_match(o: Oracle, ids: list[int], rows: list[torch.Tensor], first: int) -> None:
    """rows[k] is our prediction after ids[: first + k + 1]."""
    ref = o.logits(ids)[first : first + len(rows)]
    torch.testing.assert_close(torch.stack(rows), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_decode_matches_transformers(driver, name: str) -> None:
    d, o = driver(name)
    rows = [d.step([d.add(1, PROMPT, chunk=len(PROMPT))])[1][0]]
    rows += decode(d, 1, 31)
    generated = d.tokens[1][len(PROMPT) :]
    assert generated == o.greedy(PROMPT, 32)
    assert_logits_match(o, d.tokens[1], rows, len(PROMPT) - 1)


def test_chunked_prefill_matches_transformers(driver) -> None:
    d, o = driver("llama_rope_llama3")
    prompt = PROMPT + PROMPT[:6]  # 19 tokens: chunks of 5, 5, 5, 4
    result, _ = d.step([d.add(1, prompt, chunk=5)])
    assert result.seq_ids == []  # no token is sampled before the prompt is complete
    d.step([d.next(1, 5)])
    d.step([d.next(1, 5)])
    rows = [d.step([d.next(1, 5)])[1][0]]
    rows += decode(d, 1, 7)
    assert d.tokens[1][len(prompt) :] == o.greedy(prompt, 8)
    assert_logits_match(o, d.tokens[1], rows, len(prompt) - 1)


def test_prefix_cache_hit_reuses_blocks(driver) -> None:
    d, o = driver("qwen3")
    first = PROMPT + [1, 2, 3]  # 16 tokens = 4 full blocks
    d.step([d.add(1, first, chunk=16)])
    second = first[:12] + [9, 8, 7, 6, 5, 4, 3]
    # The second sequence starts after 3 cached blocks of the first: only 7 tokens computed.
    hit = d.add(2, second, chunk=7, shared_blocks=d.blocks[1][:3])
    assert hit.start_pos == 12 and len(hit.token_ids) == 7
    _, logits = d.step([hit, d.next(1)])
    rows2, rows1 = [logits[0]], [logits[1]]
    for _ in range(5):
        _, logits = d.step([d.next(2), d.next(1)])
        rows2.append(logits[0])
        rows1.append(logits[1])
    assert_logits_match(o, d.tokens[2], rows2, len(second) - 1)
    assert_logits_match(o, d.tokens[1], rows1, len(first))
    assert d.tokens[2][len(second) :] == o.greedy(second, 6)


def test_mixed_prefill_and_decode_batch(driver) -> None:
    d, o = driver("qwen2_tied")
    prompts, rows = mixed_batch(d, PROMPT)
    for seq_id, prompt in prompts.items():
        n = len(rows[seq_id])
        assert d.tokens[seq_id][len(prompt) :] == o.greedy(prompt, n)
        assert_logits_match(o, d.tokens[seq_id], rows[seq_id], len(prompt) - 1)


def test_bfloat16_logits_close_to_transformers_bfloat16(driver) -> None:
    d, o = driver("llama", dtype="bfloat16")
    rows = [d.step([d.add(1, PROMPT, chunk=len(PROMPT))])[1][0]]
    rows += decode(d, 1, 3)
    # A copy: the session's checkpoint fixture shares the fp32 model with other tests.
    ref = Oracle(copy.deepcopy(o.hf).to(torch.bfloat16)).logits(d.tokens[1])
    first = len(PROMPT) - 1
    torch.testing.assert_close(torch.stack(rows), ref[first : first + 4], atol=0.05, rtol=0)


# --- Gemma 3: sliding-window layers (window 5) between a global one --------------------------

LONG_PROMPT = (PROMPT * 2)[:23]  # 4.6 windows


def test_gemma3_chunked_prefill_across_the_window(driver) -> None:
    """Chunks shorter and longer than the window, after a cached prefix that is longer too."""
    d, o = driver("gemma3")
    d.step([d.add(1, LONG_PROMPT, chunk=3)])
    d.step([d.next(1, 7)])
    d.step([d.next(1, 2)])
    rows = [d.step([d.next(1, 11)])[1][0]]
    rows += decode(d, 1, 9)
    assert d.tokens[1][len(LONG_PROMPT) :] == o.greedy(LONG_PROMPT, 10)
    assert_logits_match(o, d.tokens[1], rows, len(LONG_PROMPT) - 1)


def test_gemma3_mixed_batch_and_prefix_hit(driver) -> None:
    """Decode rows (windowed masks) and prefill chunks in one step; a prefix-cache hit."""
    d, o = driver("gemma3_softcap")
    first = LONG_PROMPT[:16]
    prefilled = d.step([d.add(1, first, chunk=16)])[1][0]
    second = first[:12] + [9, 8, 7, 6, 5, 4, 3]
    hit = d.add(2, second, chunk=7, shared_blocks=d.blocks[1][:3])
    _, logits = d.step([d.next(1), hit, d.add(3, PROMPT[:4], chunk=4)])
    rows = {1: [prefilled, logits[0]], 2: [logits[1]], 3: [logits[2]]}
    for _ in range(6):
        _, logits = d.step([d.next(3), d.next(1), d.next(2)])
        for i, seq_id in enumerate((3, 1, 2)):
            rows[seq_id].append(logits[i])
    for seq_id, prompt in {1: first, 2: second, 3: PROMPT[:4]}.items():
        assert d.tokens[seq_id][len(prompt) :] == o.greedy(prompt, len(rows[seq_id]))
        assert_logits_match(o, d.tokens[seq_id], rows[seq_id], len(prompt) - 1)


def test_gemma3_bfloat16_logits_close_to_transformers_bfloat16(driver) -> None:
    d, o = driver("gemma3", dtype="bfloat16")
    rows = [d.step([d.add(1, LONG_PROMPT, chunk=len(LONG_PROMPT))])[1][0]]
    rows += decode(d, 1, 3)
    ref = Oracle(copy.deepcopy(o.hf).to(torch.bfloat16)).logits(d.tokens[1])
    first = len(LONG_PROMPT) - 1
    torch.testing.assert_close(torch.stack(rows), ref[first : first + 4], atol=0.05, rtol=0)


def test_gemma3_packed_weights_stay_close_to_transformers(driver) -> None:
    """int8 weights (the cpu backend's packed path: C matmuls, norms, GeGLU and windowed attention)."""
    d, o = driver("gemma3", quantization="int8")
    rows = [d.step([d.add(1, LONG_PROMPT, chunk=len(LONG_PROMPT))])[1][0]]
    rows += decode(d, 1, 5)
    ref = o.logits(d.tokens[1])[len(LONG_PROMPT) - 1 :][:6]
    diff = (torch.stack(rows) - ref).abs()
    assert 1e-6 < diff.max() < 0.03 * (ref.max() - ref.min())
