"""The CUDA backend's fused Triton kernels (RMSNorm with and without the residual add,
SiLU-and-mul, rotary with the KV write), run on the CPU by Triton's interpreter, against the
portable kernels they stand in for."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from pypto_serving.kernels import activation, rmsnorm, rotary  # noqa: E402
from pypto_serving.kernels.paged_kv import write_kv  # noqa: E402
from pypto_serving.kernels.triton import fused  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton without its interpreter (tests/conftest.py); no GPU here")
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 96])  # 96: no power of two, masked lanes
def test_rms_norms_equal_the_portable_ones(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(0)
    x, res = (torch.randn(5, width).to(dtype) for _ in range(2))
    w = (torch.rand(width) + 0.5).to(dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), rmsnorm.rms_norm(x, w, 1e-6), **TOLERANCE[dtype])
    got, want = fused.add_rms_norm(x, res, w, 1e-6), rmsnorm.add_rms_norm(x, res, w, 1e-6)
    # the residual sum rounds as torch's (in bf16 the interpreter truncates where a GPU rounds)
    exact = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(got[1], want[1], **exact)
    torch.testing.assert_close(got[0], want[0], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_equals_the_portable_one(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (4 * torch.randn(3, 2 * 1100)).to(dtype)  # two column tiles, the second partial
    torch.testing.assert_close(fused.silu_and_mul(x), activation.silu_and_mul(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_with_the_kv_write_equals_the_portable_pair(dtype: torch.dtype) -> None:
    """q, k, v are views into one fused qkv row, as the model makes them; 6 query heads share 2
    KV heads; the cache is float16 whatever the activations."""
    torch.manual_seed(0)
    tokens, heads, kv_heads, d = 7, 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)
    table = rotary.rope_cache(rotary.rope_inv_freq(d, 10000.0, None), 64)
    cos_sin = rotary.rotary_cos_sin(table, torch.tensor([0, 5, 9, 17, 33, 40, 63]), dtype)
    slots = torch.tensor([3, 17, 40, 8, 0, 63, 22])
    ours = tuple(torch.zeros(8, 8, kv_heads, d, dtype=torch.float16) for _ in range(2))
    theirs = tuple(torch.zeros(8, 8, kv_heads, d, dtype=torch.float16) for _ in range(2))
    got = fused.rotate_and_store(q, k, v, cos_sin, ours, slots)
    want = rotary.apply_rotary(q, *cos_sin)
    write_kv(*theirs, rotary.apply_rotary(k, *cos_sin), v, slots)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(ours[0], theirs[0], **TOLERANCE[dtype])
    torch.testing.assert_close(ours[1], theirs[1], atol=0, rtol=0)  # v is only copied
