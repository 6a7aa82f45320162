"""The CUDA backend's Triton paged decode attention, run on the CPU by Triton's interpreter,
against the portable kernel."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from pypto_serving.kernels.attention import decode_attention  # noqa: E402
from pypto_serving.kernels.triton.paged_attention import BLOCK_N, paged_decode_attention  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton without its interpreter (tests/conftest.py); no GPU here")


@pytest.mark.parametrize(("heads", "kv_heads", "d", "kv_dtype"), [
    (8, 2, 64, torch.float32),   # groups of 4
    (14, 2, 64, torch.float16),  # Qwen2.5-0.5B: groups of 7, a float16 cache
    (4, 4, 128, torch.float32),  # no GQA, wide heads
    (6, 3, 40, torch.float32),   # a head width that is no power of two
])
def test_paged_decode_attention_equals_the_portable_kernel(heads: int, kv_heads: int, d: int,
                                                          kv_dtype: torch.dtype):
    torch.manual_seed(0)
    blocks, block_size = 24, 16
    k, v = (torch.randn(blocks, block_size, kv_heads, d).to(kv_dtype) for _ in range(2))
    lens = torch.tensor([1, BLOCK_N, BLOCK_N + 1, 200])  # one key, whole tiles, a partial tile
    width = int(lens.max())
    slots = torch.stack([torch.randperm(blocks * block_size)[:width] for _ in lens])  # scattered pages
    rows = torch.randn(len(lens), heads * d + 32)  # q rows with a stride wider than the heads
    q = rows[:, : heads * d].view(len(lens), heads, d)
    mask = (torch.arange(width) < lens[:, None]).view(len(lens), 1, 1, width)
    want = decode_attention(q, k, v, slots, mask, d**-0.5)
    got = paged_decode_attention(q, k, v, slots, lens, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
