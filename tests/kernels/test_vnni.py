"""The AVX-512 VNNI tiles of qdot.c and qhead.c, and decoder.c's AVX-512 prefill attention: used
where the CPU has the instructions, and equal to the AVX2 code bit for bit in every kind of
activations, weight width and row count, and every attention shape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pypto_serving.kernels import cpu
from pypto_serving.kernels.cpu import qlinear
from pypto_serving.kernels.quant_linear import pack

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")
VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
MATMULS = [qlinear.quant_linear_cpu_q8, qlinear.quant_linear_cpu_mixed, qlinear.quant_linear_cpu_q16]


@needs_kernels
def test_the_vnni_tiles_run_where_the_cpu_has_them() -> None:
    assert cpu.vnni() == (VNNI_FLAGS <= cpu._cpu_flags())


@pytest.fixture
def avx2_too() -> Iterator[None]:
    if not cpu.vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    yield
    cpu.library().qdot_use_vnni(1)


def both(kernel, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """kernel(*args) with the AVX-512 kernels, then with the AVX2 ones."""
    lib = cpu.library()
    lib.qdot_use_vnni(1)
    vnni = kernel(*args)
    lib.qdot_use_vnni(0)
    avx2 = kernel(*args)
    lib.qdot_use_vnni(1)
    return vnni, avx2


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("matmul", MATMULS, ids=["int8", "mixed", "int16"])
def test_vnni_tiles_equal_the_avx2_tiles_bit_for_bit(avx2_too, bits: int, matmul) -> None:
    g = torch.Generator().manual_seed(bits)
    w, _ = pack(torch.randn(48, 96, generator=g), bits)
    bias = torch.randn(w.q.shape[0] * 16, generator=g)
    for m in (1, 2, 3, 7, 8, 9, 13, 21):  # one row (gemv), whole tiles of 8 and every remainder
        x = torch.randn(m, 96, generator=g)
        x[:, ::13] *= 40  # outlier channels: mixed rows with wide groups, not all alike
        for b in (None, bias):
            vnni, avx2 = both(matmul, x, w, b)
            assert torch.equal(vnni, avx2), (m, b is None)


@needs_kernels
def test_the_heads_vnni_tiles_equal_its_avx2_tiles_bit_for_bit(avx2_too) -> None:
    """qhead.c: int8 panels against int16 activations (vpdpwssd)."""
    g = torch.Generator().manual_seed(0)
    w, _ = pack(torch.randn(80, 96, generator=g), 8)
    bias = torch.randn(w.q.shape[0] * 16, generator=g)
    for m in (2, 5, 8, 15, 16):
        x = torch.randn(m, 96, generator=g)
        for b in (None, bias):
            vnni, avx2 = both(qlinear.quant_linear_cpu_head, x, w, b)
            assert torch.equal(vnni, avx2), (m, b is None)



@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 40, 128, 8])  # whole 64s, a half vector left over, 2 passes
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (14, 2), (4, 1), (2, 2)])  # groups of 3, 7, 4, 1
def test_the_prefill_attention_on_512_bit_registers_equals_the_avx2_one(avx2_too, kv_dtype, head_dim: int,
                                                                        heads: int, kv_heads: int) -> None:
    """decoder.c's attend_rows_zmm: a prompt's rows, chunked or not, windowed or not, as the AVX2
    tiles give them (which test_decoder_ops holds equal to decode rows)."""
    from pypto_serving.kernels.cpu.decoder import prefill_attention_cpu

    g = torch.Generator().manual_seed(head_dim + heads)
    k, v = (torch.randn(24, 16, kv_heads, head_dim, generator=g).to(kv_dtype) for _ in range(2))
    slots = torch.randperm(24 * 16, generator=g)[:150]  # a context scattered over the cache
    q = torch.randn(150, heads, head_dim, generator=g)
    for rows, window in ((150, 0), (37, 0), (1, 0), (150, 21), (9, 40)):  # whole, a chunk, one row; windows
        zmm, avx2 = both(prefill_attention_cpu, q[-rows:], k, v, slots, 0.125, window)
        assert torch.equal(zmm, avx2), (rows, window)
