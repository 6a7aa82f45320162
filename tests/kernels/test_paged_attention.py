"""Paged KV writes and paged attention against dense attention per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels.attention import (
    decode_attention,
    paged_attention,
    prefill_attention,
    sdpa_prefill_attention,
    with_window,
)
from pypto_serving.kernels.paged_kv import context_slots, gather_kv, token_slots, write_kv
from pypto_serving.messages.worker import ScheduledSeq
from pypto_serving.worker.batch import prepare
from pypto_serving.worker.seq_state import SeqState

BLOCK, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 4, 2, 6, 8, 40
SCALE = DIM**-0.5


def empty_cache() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    return torch.zeros(shape), torch.zeros(shape)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    window: int = 0) -> torch.Tensor:
    """q [q, H, d] at positions start.., k/v [L, kv_heads, d] dense -> [q, H, d]; with a
    window, a query sees the `window` positions up to its own."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    query_pos = torch.arange(start, start + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    if window:
        scores = scores.masked_fill(key_pos <= query_pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_write_then_gather_roundtrip_and_slot_arithmetic() -> None:
    k_cache, v_cache = empty_cache()
    tables = torch.tensor([[7, 3, 0], [12, 5, 9]])
    slots = torch.tensor(token_slots(tables.tolist(), [[0, 5], [3, 9]], BLOCK))  # rows 0, 0, 1, 1
    assert slots.tolist() == [7 * 4 + 0, 3 * 4 + 1, 12 * 4 + 3, 9 * 4 + 1]
    k, v = torch.randn(4, KV_HEADS, DIM), torch.randn(4, KV_HEADS, DIM)
    write_kv(k_cache, v_cache, k, v, slots)
    torch.testing.assert_close(gather_kv(k_cache, slots), k)
    torch.testing.assert_close(gather_kv(v_cache, slots), v)
    assert k_cache[3, 1, 0].tolist() == k[1, 0].tolist()
    assert context_slots(tables, BLOCK, 6)[1].tolist() == [48, 49, 50, 51, 20, 21]


def test_decode_attention_matches_dense() -> None:
    k_cache, v_cache = empty_cache()
    lens, tables = [5, 11], torch.tensor([[30, 2, 0], [8, 17, 25]])  # block 0 pads row 0
    dense = [(torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM)) for n in lens]
    for row, (k, v) in enumerate(dense):
        write_kv(k_cache, v_cache, k, v, context_slots(tables[row : row + 1], BLOCK, lens[row])[0])
    q = torch.randn(2, HEADS, DIM)
    slots = context_slots(tables, BLOCK, 11)
    mask = (torch.arange(11) < torch.tensor(lens)[:, None])[:, None, None, :]
    out = decode_attention(q, k_cache, v_cache, slots, mask, SCALE)
    for row, (k, v) in enumerate(dense):
        ref = naive_attention(q[row : row + 1], k, v, lens[row] - 1)
        torch.testing.assert_close(out[row : row + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 5, 200])  # none, shorter than a block of rows, longer
@pytest.mark.parametrize("start, n", [(0, 7), (6, 7), (0, 150), (20, 130)])  # > 128 rows: 2 blocks
def test_prefill_attention_with_and_without_prefix(start: int, n: int, window: int) -> None:
    k_cache, v_cache = empty_cache()
    length = start + n
    table = torch.randperm(NUM_BLOCKS)[: -(-length // BLOCK)].unsqueeze(0)
    k, v = torch.randn(length, KV_HEADS, DIM), torch.randn(length, KV_HEADS, DIM)
    slots = context_slots(table, BLOCK, length)[0]
    write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(n, HEADS, DIM)
    want = naive_attention(q, k, v, start, window)
    # the CPU's blocked kernel, and the accelerators' SDPA variant run here on CPU tensors
    for kernel in (prefill_attention, sdpa_prefill_attention):
        out = kernel(q, k_cache, v_cache, slots, SCALE, window)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shapes",  # (start_pos, tokens this step) per sequence
    [
        [(9, 1), (0, 7), (6, 5), (14, 1)],  # decodes, a fresh prefill, a chunk after a prefix
        [(3, 1), (17, 1), (0, 1)],  # decodes only: one batched SDPA, no scatter
    ],
)
@pytest.mark.parametrize("window", [0, 3])
def test_flattened_batch_through_prepare_matches_dense(shapes: list[tuple[int, int]], window: int) -> None:
    k_cache, v_cache = empty_cache()
    blocks = torch.randperm(NUM_BLOCKS).tolist()
    seqs, states, dense = [], [], []
    for i, (start, n) in enumerate(shapes):
        table = [blocks.pop() for _ in range(-(-(start + n) // BLOCK))]
        seqs.append(ScheduledSeq(i, [0] * n, start, table, sample=True))
        states.append(SeqState(table, [0] * (start + n), 0, SamplingParams(), None))
        dense.append((torch.randn(start + n, KV_HEADS, DIM), torch.randn(start + n, KV_HEADS, DIM)))
    batch = prepare(seqs, states, BLOCK, torch.device("cpu"))
    for (start, _), st, (k, v) in zip(shapes, states, dense, strict=True):
        prefix = context_slots(torch.tensor([st.block_table]), BLOCK, start)[0]
        write_kv(k_cache, v_cache, k[:start], v[:start], prefix)  # cached by earlier steps
    step_k = torch.cat([k[s:] for (s, _), (k, _) in zip(shapes, dense, strict=True)])
    step_v = torch.cat([v[s:] for (s, _), (_, v) in zip(shapes, dense, strict=True)])
    write_kv(k_cache, v_cache, step_k, step_v, batch.attn.slot_mapping)
    q = torch.randn(len(step_k), HEADS, DIM)
    out = paged_attention(q, k_cache, v_cache, with_window(batch.attn, window), SCALE)
    row = 0
    for (start, n), (k, v) in zip(shapes, dense, strict=True):
        ref = naive_attention(q[row : row + n], k, v, start, window)
        torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
        row += n
    assert batch.attn.all_decode == all(n == 1 for _, n in shapes)
    assert batch.sample_rows.tolist() == (torch.tensor([n for _, n in shapes]).cumsum(0) - 1).tolist()
