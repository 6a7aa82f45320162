"""The CPU backend's fused decoder kernels against the portable set."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.backends import CpuBackend
from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.kernels import cpu
from pypto_serving.kernels.decoder_ops import PORTABLE
from pypto_serving.kernels.rotary import rope_cache, rope_inv_freq, rotary_cos_sin
from pypto_serving.messages.worker import ScheduledSeq
from pypto_serving.worker.batch import prepare
from pypto_serving.worker.seq_state import SeqState

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 64, 4
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fast():
    return CpuBackend("cpu", torch.float32).decoder_ops(packed=True)


def test_norms_and_activation_match(fast) -> None:
    x, residual, weight = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    torch.testing.assert_close(fast.rms_norm(x, weight, 1e-5), PORTABLE.rms_norm(x, weight, 1e-5), **CLOSE)
    expected = PORTABLE.add_rms_norm(x, residual.clone(), weight, 1e-5)
    got = fast.add_rms_norm(x, residual.clone(), weight, 1e-5)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)
    gate_up = torch.randn(7, 2 * 40) * 6  # large |x|: both branches of the stable sigmoid
    torch.testing.assert_close(fast.silu_and_mul(gate_up), PORTABLE.silu_and_mul(gate_up), **CLOSE)


def step(chunks: list[tuple[int, int]]) -> tuple:
    """A step of sequences (already cached tokens, new tokens): metadata, rotary, fused qkv."""
    seqs, states = [], []
    next_block = 1
    for i, (start, n) in enumerate(chunks):
        blocks = list(range(next_block, next_block + -(-(start + n) // BLOCK)))
        next_block += len(blocks)
        seqs.append(ScheduledSeq(i, list(range(n)), start, blocks, True))
        states.append(SeqState(blocks, list(range(start + n)), start + n, SamplingParams(), None))
    batch = prepare(seqs, states, BLOCK, torch.device("cpu"))
    cache = rope_cache(rope_inv_freq(DIM, 10000.0, None), 256)
    qkv = torch.randn(len(batch.input_ids), (HEADS + 2 * KV_HEADS) * DIM)
    return batch.attn, rotary_cos_sin(cache, batch.positions, torch.float32), qkv


def attend_with(ops, qkv: torch.Tensor, rotary, meta, kv) -> torch.Tensor:
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    t = qkv.shape[0]
    views = q.view(t, HEADS, DIM), k.view(t, KV_HEADS, DIM), v.view(t, KV_HEADS, DIM)
    return ops.attend(*views, rotary, kv, meta, DIM**-0.5)


@pytest.mark.parametrize("chunks", [
    [(0, 9), (0, 3)],  # prefills: fused rotary + KV write, C prefill attention
    [(5, 11)],  # a chunk after cached tokens
    [(8, 1), (3, 1), (13, 1)],  # all decode: fused attention over padded contexts
    [(10, 1)],  # one row: its views' row stride is arbitrary
    [(8, 1), (0, 6), (5, 1), (2, 7)],  # mixed
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_attend_matches_portable(fast, chunks: list[tuple[int, int]], kv_dtype: torch.dtype) -> None:
    meta, rotary, qkv = step(chunks)
    torch.manual_seed(0)
    kv = tuple(torch.randn(12, BLOCK, KV_HEADS, DIM).to(kv_dtype) for _ in range(2))
    fast_kv = tuple(t.clone() for t in kv)
    expected = attend_with(PORTABLE, qkv.clone(), rotary, meta, kv)
    got = attend_with(fast, qkv.clone(), rotary, meta, fast_kv)
    torch.testing.assert_close(got, expected, **CLOSE)
    for a, b in zip(fast_kv, kv, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: a last value chunk of 8, not 16
@pytest.mark.parametrize("heads", [6, 14])  # groups of 3 and of 7 query heads (3 + 3 + 1)
@pytest.mark.parametrize("width", [320, 60])
def test_decode_attention_rows_do_not_depend_on_the_batch(kv_dtype: torch.dtype, head_dim: int, heads: int,
                                                          width: int) -> None:
    """Bit for bit: a sequence alone (its passes split over the threads, keys in pieces; with
    under 96 keys one task per query head) and among 16 (one task per kv head's group of query
    heads, keys and values read once for the group). Together the longer ones are over 1 MiB
    of keys and values, so the batch also fetches the next task's keys ahead."""
    from pypto_serving.kernels.cpu.decoder import decode_attention_cpu

    torch.manual_seed(0)
    kv_heads = 2
    batch = max(16, 2 * torch.get_num_threads())  # enough kv groups to share out: grouped tasks
    k, v = (torch.randn(batch * width // BLOCK, BLOCK, kv_heads, head_dim).to(kv_dtype) for _ in range(2))
    slots = torch.arange(batch * width).view(batch, width)
    lens = torch.tensor([width - 3 * (i % 7) for i in range(batch)])  # some not a multiple of 8
    q = torch.randn(batch, heads, head_dim)
    together = decode_attention_cpu(q, k, v, slots, lens, 0.125)
    alone = torch.cat([decode_attention_cpu(q[i : i + 1], k, v, slots[i : i + 1], lens[i : i + 1], 0.125)
                       for i in range(batch)])
    assert torch.equal(together, alone)
    for i in range(batch):  # and right: plain softmax attention over the sequence's context
        keys, values = (t.view(-1, kv_heads, head_dim)[slots[i, : lens[i]]].float()
                        .repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[i], keys) * 0.125, -1)
        torch.testing.assert_close(together[i], torch.einsum("hl,lhd->hd", probs, values), **CLOSE)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_prefill_attention_rows_are_decode_rows_however_the_prompt_is_chunked(kv_dtype, head_dim) -> None:
    """Bit for bit: a prompt's attention prefilled whole, in two chunks, or token by token as
    decode steps; so a prompt gives the same tokens alone, chunked under load, or batched."""
    from pypto_serving.kernels.cpu.decoder import decode_attention_cpu, prefill_attention_cpu

    torch.manual_seed(1)
    heads, kv_heads, n = 6, 2, 45
    k, v = (torch.randn(64 // BLOCK, BLOCK, kv_heads, head_dim).to(kv_dtype) for _ in range(2))
    slots = torch.randperm(64)[:n]  # a context scattered over the cache
    q = torch.randn(n, heads, head_dim)
    whole = prefill_attention_cpu(q, k, v, slots, 0.125)
    chunked = torch.cat([prefill_attention_cpu(q[:20], k, v, slots[:20], 0.125),
                         prefill_attention_cpu(q[20:], k, v, slots, 0.125)])
    assert torch.equal(whole, chunked)
    decoded = torch.cat([decode_attention_cpu(q[i : i + 1], k, v, slots[None], torch.tensor([i + 1]), 0.125)
                         for i in range(n)])
    assert torch.equal(whole, decoded)
    for i in (0, 7, n - 1):  # and right: causal softmax attention
        keys, values = (t.view(-1, kv_heads, head_dim)[slots[: i + 1]].float()
                        .repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[i], keys) * 0.125, -1)
        torch.testing.assert_close(whole[i], torch.einsum("hl,lhd->hd", probs, values), **CLOSE)


# --- Gemma 3: norms scaled by 1 + weight, sliding-window attention ---------------------------

def test_gemma_norms_and_activation_match(fast) -> None:
    x, residual, weight = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    torch.testing.assert_close(fast.gemma_rms_norm(x, weight, 1e-6), PORTABLE.gemma_rms_norm(x, weight, 1e-6),
                               **CLOSE)
    gate_up = torch.randn(7, 2 * 40) * 6  # large |x|: both branches of the stable sigmoid
    torch.testing.assert_close(fast.gelu_tanh_and_mul(gate_up), PORTABLE.gelu_tanh_and_mul(gate_up), **CLOSE)
    torch.testing.assert_close(fast.gemma_add_norm(x, residual, weight, 1e-6),
                               PORTABLE.gemma_add_norm(x, residual, weight, 1e-6), **CLOSE)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * DIM)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    views = q.view(3, HEADS, DIM), k.view(3, KV_HEADS, DIM)
    q_weight, k_weight = torch.randn(DIM), torch.randn(DIM)
    expected = PORTABLE.gemma_qk_norm(*views, q_weight, k_weight, 1e-6)
    got = fast.gemma_qk_norm(*views, q_weight, k_weight, 1e-6)
    assert got[0].data_ptr() == q.data_ptr()  # in place: still the projection's views
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)


@pytest.mark.parametrize("chunks", [
    [(0, 9), (0, 3)],  # prefills longer and shorter than the window
    [(5, 11)],  # a chunk after cached tokens
    [(8, 1), (3, 1), (13, 1)],  # all decode
    [(8, 1), (0, 6), (5, 1), (2, 7)],  # mixed
])
@pytest.mark.parametrize("window", [4, 7])
def test_windowed_attend_matches_portable(fast, chunks: list[tuple[int, int]], window: int) -> None:
    """A sliding-window layer's rows (`with_window`) take the C attention as every other layer's."""
    from pypto_serving.kernels.attention import with_window

    meta, rotary, qkv = step(chunks)
    meta = with_window(meta, window)
    torch.manual_seed(0)
    kv = tuple(torch.randn(12, BLOCK, KV_HEADS, DIM).half() for _ in range(2))
    fast_kv = tuple(t.clone() for t in kv)
    expected = attend_with(PORTABLE, qkv.clone(), rotary, meta, kv)
    got = attend_with(fast, qkv.clone(), rotary, meta, fast_kv)
    torch.testing.assert_close(got, expected, **CLOSE)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [5, 16, 37])  # under one tile of rows, a tile's keys, across tiles
def test_windowed_rows_are_decode_rows_over_the_window(kv_dtype: torch.dtype, window: int) -> None:
    """Bit for bit: a windowed decode row is an unwindowed one over its last `window` keys, and
    a windowed prompt prefilled whole, in two chunks or token by token gives the same rows."""
    from pypto_serving.kernels.cpu.decoder import decode_attention_cpu, prefill_attention_cpu

    torch.manual_seed(2)
    heads, kv_heads, head_dim, n = 6, 2, 64, 45
    k, v = (torch.randn(64 // BLOCK, BLOCK, kv_heads, head_dim).to(kv_dtype) for _ in range(2))
    slots = torch.randperm(64)[:n]
    q = torch.randn(n, heads, head_dim)
    decoded = torch.cat([decode_attention_cpu(q[i : i + 1], k, v, slots[None], torch.tensor([i + 1]), 0.125,
                                              window) for i in range(n)])
    trimmed = torch.cat([decode_attention_cpu(q[i : i + 1], k, v, slots[None, max(0, i + 1 - window) : i + 1],
                                              torch.tensor([min(i + 1, window)]), 0.125) for i in range(n)])
    assert torch.equal(decoded, trimmed)
    whole = prefill_attention_cpu(q, k, v, slots, 0.125, window)
    chunked = torch.cat([prefill_attention_cpu(q[:20], k, v, slots[:20], 0.125, window),
                         prefill_attention_cpu(q[20:], k, v, slots, 0.125, window)])
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, decoded)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_windowed_decode_rows_do_not_depend_on_the_batch(kv_dtype: torch.dtype) -> None:
    """Bit for bit, a windowed sequence alone and among 16 (grouped tasks, the next task's
    window fetched ahead) is an unwindowed one over its last `window` keys."""
    from pypto_serving.kernels.cpu.decoder import decode_attention_cpu

    torch.manual_seed(3)
    heads, kv_heads, head_dim, width, window = 6, 2, 64, 320, 100
    batch = max(16, 2 * torch.get_num_threads())
    k, v = (torch.randn(batch * width // BLOCK, BLOCK, kv_heads, head_dim).to(kv_dtype) for _ in range(2))
    slots = torch.arange(batch * width).view(batch, width)
    lens = torch.tensor([width - 37 * (i % 7) for i in range(batch)])  # some shorter than the window
    q = torch.randn(batch, heads, head_dim)
    together = decode_attention_cpu(q, k, v, slots, lens, 0.125, window)
    for i in range(batch):
        first = max(0, int(lens[i]) - window)
        alone = decode_attention_cpu(q[i : i + 1], k, v, slots[i : i + 1, first : lens[i]],
                                     (lens[i : i + 1] - first), 0.125)
        assert torch.equal(together[i : i + 1], alone)


@pytest.mark.parametrize("shape", [(64, 4, 4, DIM), (64 * BLOCK, KV_HEADS, DIM)])
def test_attention_kernels_refuse_caches_the_heads_cannot_share(shape: tuple[int, ...]) -> None:
    """Caches whose kv heads do not divide the queries' heads (6 over 4), or without the block
    axis, are refused with a ValueError; the kernel would have divided by zero or read past the
    cache, and taken the process down."""
    from pypto_serving.kernels.cpu.decoder import decode_attention_cpu, prefill_attention_cpu

    cache = torch.zeros(shape, dtype=torch.float16)
    slots = torch.arange(8).repeat(2, 1)
    with pytest.raises(ValueError, match="kv heads|KV caches"):
        decode_attention_cpu(torch.randn(2, HEADS, DIM), cache, cache, slots, torch.tensor([8, 8]), 0.125)
    with pytest.raises(ValueError, match="kv heads|KV caches"):
        prefill_attention_cpu(torch.randn(8, HEADS, DIM), cache, cache, torch.arange(8), 0.125)
