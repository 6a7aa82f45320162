"""Packed int8 / int5 / int4 weights: lossless packing of GGUF-style grids, and the CPU kernels
against the portable dequantize-then-F.linear path, including batch invariance."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.kernels import cpu
from pypto_serving.kernels.quant_linear import (
    GROUP,
    dequantize,
    pack,
    probe_rows,
    quant_embedding,
    quant_linear,
    unpack_levels,
)

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")


def on_grid(n: int, k: int, bits: int, seed: int = 0) -> torch.Tensor:
    """Weights as GGUF Q4_1 (q * d + m, q in 0..15), Q5_0 (d * (q - 16)) or Q8_0 (q * d) dequantize them: fp16
    scales, and every group reaching both ends of its range, as llama.cpp's quantizer makes it."""
    g = torch.Generator().manual_seed(seed)
    groups = k // GROUP
    d = (torch.rand(n, groups, 1, generator=g) * 0.02 + 0.001).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (n, groups, GROUP), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        m = (torch.randn(n, groups, 1, generator=g) * 0.1).half().float()
        return (q * d + m).view(n, k)
    if bits == 5:  # Q5_0: d * (q - 16), d of either sign, the largest |w| at q = 0
        d = torch.where(torch.rand(n, groups, 1, generator=g) < 0.5, -d, d)
        q = torch.randint(0, 32, (n, groups, GROUP), generator=g).float()
        q[..., 0] = 0
        return (d * (q - 16)).view(n, k)
    q = torch.randint(-127, 128, (n, groups, GROUP), generator=g).float()
    q[..., 0] = 127
    return (q * d).view(n, k)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_gguf_grids_pack_losslessly(bits: int) -> None:
    w = on_grid(40, 96, bits)
    packed, error = pack(w, bits)
    assert error < 1e-3
    assert torch.equal(dequantize(packed), w)


@pytest.mark.parametrize("n", [40, 300, 1001])
def test_the_probe_rows_error_never_exceeds_the_whole_weights(n: int) -> None:
    """--quantization auto trusts a probe that misses the lossless bound to prove the whole
    weight misses it: the probe's groups get the steps they get in the whole weight."""
    w = on_grid(n, 96, 4, seed=n)
    w[n // 3 :: 7] = torch.randn_like(w[n // 3 :: 7])  # some rows off the grid
    probe = probe_rows(w)
    assert probe.shape[0] == (n if n <= 64 else 64)  # a small weight is its own probe
    assert pack(probe, 4)[1] <= pack(w, 4)[1]
    for rows in (w[: n // 3], w):  # all on the grid: both lossless; else both off it
        assert (pack(probe_rows(rows), 4)[1] < 1e-3) == (pack(rows, 4)[1] < 1e-3)


def weights(n: int, k: int, bits: int) -> torch.Tensor:
    """Random weights; for int5 every other group on a Q5_0 grid (scales of either sign, zero
    -16 scale) and the rest off any grid (scale and zero from the group's range)."""
    w = torch.randn(n, k)
    if bits == 5:
        grid = on_grid(n, k, 5).view(n, k // GROUP, GROUP)
        w.view(n, k // GROUP, GROUP)[:, ::2] = grid[:, ::2]
    return w


def test_q5_0_tensors_pack_to_int5_exactly() -> None:
    """gguf-py's own Q5_0 quantizer and dequantizer: the int5 panels give its weights back bit
    for bit, and the levels are those of the Q5_0 blocks."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    q5_0 = gguf.GGMLQuantizationType.Q5_0
    x = np.random.default_rng(0).standard_normal((48, 320)).astype(np.float32)
    x[3, :GROUP] = 0.0  # an all-zero block
    w = torch.from_numpy(gguf_dequantize(gguf_quantize(x, q5_0), q5_0).copy())
    packed, error = pack(w, 5)
    assert error == 0.0
    assert torch.equal(dequantize(packed), w)
    assert packed.q.numel() == 48 * 320 * 5 // 8  # 5/8 of int8's bytes
    _, error4 = pack(w, 4)
    assert error4 > 0.3  # not on a 4-bit grid


def test_int5_levels_round_trip() -> None:
    torch.manual_seed(1)
    n, k = 40, 128
    levels = torch.randint(0, 32, (n, k)).float()
    step = (torch.rand(n, k // GROUP, 1) * 0.01 + 0.001).half().float()
    w = (step * (levels.view(n, k // GROUP, GROUP) - 16)).view(n, k)
    w.view(n, k // GROUP, GROUP)[..., 0] = -16 * step[..., 0]  # the largest |w| at level 0
    levels.view(n, k // GROUP, GROUP)[..., 0] = 0
    packed, error = pack(w, 5)
    assert error == 0.0
    assert torch.equal(unpack_levels(packed)[:n], levels)
    assert torch.equal(dequantize(packed), w)


def test_off_grid_weights_report_their_error() -> None:
    w = torch.randn(32, 64)
    packed, error = pack(w, 4)
    assert 0.3 < error <= 0.5  # rounding to the nearest of 16 levels: at most half a step
    step = (w.view(32, 2, 32).amax(-1) - w.view(32, 2, 32).amin(-1)) / 15
    assert ((dequantize(packed) - w).abs().view(32, 2, 32) <= step.unsqueeze(-1) * 0.51).all()


def test_portable_linear_is_f_linear_of_the_dequantized_weight() -> None:
    w, x, bias = torch.randn(24, 64), torch.randn(5, 64), torch.randn(24)
    packed, _ = pack(w, 8)
    expected = torch.nn.functional.linear(x, dequantize(packed), bias)
    assert torch.equal(quant_linear(x, packed, bias), expected)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 13, 40])
def test_cpu_kernel_matches_portable(bits: int, m: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu

    n, k = 40, 96  # n is not a whole number of 16-row panels: padded and cut
    packed, _ = pack(weights(n, k, bits), bits)
    x = torch.randn(m, k)
    bias = torch.randn(48)  # padded to the panels
    got = quant_linear_cpu(x, packed, bias)
    # outputs reach ~30: a different order of ~100 float additions moves them by up to ~2e-5
    torch.testing.assert_close(got, quant_linear(x, packed, bias), rtol=1e-5, atol=1e-4)
    assert got.shape == (m, n)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_cpu_kernel_rows_do_not_depend_on_the_batch(bits: int) -> None:
    """Bit for bit: one row alone (the decode path) equals that row among 40 (the tiled path,
    over more than one pass of rows since k is large)."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu

    packed, _ = pack(weights(64, 2048, bits), bits)
    x = torch.randn(40, 2048)
    together = quant_linear_cpu(x, packed)
    alone = torch.cat([quant_linear_cpu(x[i : i + 1], packed) for i in range(40)])
    pairs = torch.cat([quant_linear_cpu(x[i : i + 2], packed)[:1] for i in range(39)])
    assert torch.equal(together, alone)
    assert torch.equal(together[:39], pairs)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_cpu_gather_equals_portable_rows(bits: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_embedding_cpu

    packed, _ = pack(weights(50, 64, bits), bits)
    ids = torch.tensor([0, 7, 8, 15, 16, 49, 7])
    assert torch.equal(quant_embedding_cpu(ids, packed), quant_embedding(ids, packed))


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_int5_sums_past_16_bits(m: int) -> None:
    """Every level 31 against every input at +127: a group's integer dot (32 * 31 * 127) is
    past what 16-bit partial sums hold, in every activation mode."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu, quant_linear_cpu_q8, quant_linear_cpu_q16

    n, k = 32, 256
    w = torch.full((n, k), 15.0)
    w[:, ::GROUP] = -16.0  # Q5_0 with d = 1: levels 31 and, at the start of each group, 0
    packed, error = pack(w, 5)
    assert error == 0.0 and unpack_levels(packed).amax() == 31
    x = torch.ones(m, k)
    exact = quant_linear(x, packed)
    torch.testing.assert_close(quant_linear_cpu(x, packed), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(quant_linear_cpu_q8(x, packed), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(quant_linear_cpu_q16(x, packed), exact, rtol=1e-6, atol=0)


@needs_kernels
def test_cpu_kernel_takes_leading_dims_and_strided_input() -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu

    packed, _ = pack(torch.randn(32, 64), 4)
    x = torch.randn(3, 4, 128)[..., ::2]
    torch.testing.assert_close(quant_linear_cpu(x, packed), quant_linear(x, packed), rtol=1e-5, atol=1e-5)


def int8_activation_reference(x: torch.Tensor, w, top: int = 127) -> torch.Tensor:
    """What qdot.c computes, in plain torch: each row's groups of 32 quantized to
    round(x * top / max|x|), integer dot products with the levels, then per group
    d * scale * dot + d * sum(xq) * zero: the quantized row times the dequantized weight
    (summed in float64 here, so equal up to rounding). qhead.c's int16 rows: top 32767."""
    m, k = x.shape
    xg = x.view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = (xg * torch.where(amax > 0, top / amax, torch.zeros_like(amax))).round()
    levels = unpack_levels(w)[: w.n].view(w.n, k // GROUP, GROUP)
    dot = torch.einsum("mgk,ngk->mng", xq.double(), levels.double())
    scale = w.scale.transpose(1, 2).reshape(-1, k // GROUP)[: w.n].double()
    zero = w.zero.transpose(1, 2).reshape(-1, k // GROUP)[: w.n].double()
    d = (amax / top).squeeze(-1).double()
    xsum = xq.sum(-1).double() * d
    return (dot * d[:, None, :] * scale + xsum[:, None, :] * zero).sum(-1).float()


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 40])
def test_int8_activation_kernel_computes_the_quantized_product(bits: int, m: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_q8

    n, k = 40, 256
    packed, _ = pack(weights(n, k, bits), bits)
    x = torch.randn(m, k)
    x[0, :GROUP] = 0.0  # an all-zero group quantizes to zeros, not NaN
    bias = torch.randn(48)
    got = quant_linear_cpu_q8(x, packed, bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, int8_activation_reference(x, packed) + bias[:n], rtol=1e-5, atol=1e-4)
    # ... which is near the float32 product: off by the activations' rounding, not more
    exact = quant_linear(x, packed, bias)
    error = (got - exact).abs().max() / exact.abs().max()
    assert 1e-4 < error < 0.03


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_int8_activation_rows_do_not_depend_on_the_batch(bits: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_q8

    packed, _ = pack(weights(64, 4096, bits), bits)
    x = torch.randn(40, 4096)  # over one pass of rows (30 at this k)
    together = quant_linear_cpu_q8(x, packed)
    alone = torch.cat([quant_linear_cpu_q8(x[i : i + 1], packed) for i in range(40)])
    fives = torch.cat([quant_linear_cpu_q8(x[i : i + 5], packed) for i in range(0, 40, 5)])
    assert torch.equal(together, alone)
    assert torch.equal(together, fives)


def two_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of 32: d = max|x| / 127 [m, groups, 1], hi = round(x / d) and
    lo = round((x - d * hi) / (d / 254)) [m, groups, 32]."""
    m, k = x.shape
    xg = x.view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    hi = (xg * inv).round()
    return d, hi, ((xg - hi * d) * inv * 254).round()


def times_weights(quantized: torch.Tensor, w) -> torch.Tensor:
    """A quantized row [m, groups, 32] times the dequantized weights, in float64."""
    m = quantized.shape[0]
    return (quantized.double().view(m, w.k) @ quant_linear(torch.eye(w.k), w).double()).float()


def int16_activation_reference(x: torch.Tensor, w) -> torch.Tensor:
    """What qdot.c computes with two planes: the int8 reference's product with x replaced by
    (254 * hi + lo) * d / 254 (two_planes): the row as it is quantized, times the weights."""
    d, hi, lo = two_planes(x)
    return times_weights((254 * hi + lo) * (d / 254), w)


def errors_beside_int8(got: torch.Tensor, x: torch.Tensor, packed, bias: torch.Tensor) -> tuple[float, float]:
    """The largest error of `got`, and of the int8-activation kernel, against the float
    product, each relative to the product's largest value."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_q8

    exact = quant_linear(x, packed, bias)
    int8 = quant_linear_cpu_q8(x, packed, bias)
    return tuple(((y - exact).abs().max() / exact.abs().max()).item() for y in (got, int8))


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 40])
def test_int16_activation_kernel_is_near_the_float_product(bits: int, m: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_q16

    n, k = 40, 256
    packed, _ = pack(weights(n, k, bits), bits)
    x = torch.randn(m, k)
    x[0, :GROUP] = 0.0
    bias = torch.randn(48)
    got = quant_linear_cpu_q16(x, packed, bias)
    assert got.shape == (m, n)
    # a residual's rounding can fall the other way in float (one lo step, d / 254 x a weight)
    torch.testing.assert_close(got, int16_activation_reference(x, packed) + bias[:n], rtol=1e-5, atol=5e-4)
    error, int8_error = errors_beside_int8(got, x, packed, bias)
    assert error < int8_error / 50  # about 1/254 of int8's rounding


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_int16_activation_rows_do_not_depend_on_the_batch(bits: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_q16

    packed, _ = pack(weights(64, 4096, bits), bits)
    x = torch.randn(41, 4096)
    together = quant_linear_cpu_q16(x, packed)
    alone = torch.cat([quant_linear_cpu_q16(x[i : i + 1], packed) for i in range(41)])
    assert torch.equal(together, alone)


def mixed_activation_reference(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """What qdot.c computes with mixed activations: each group quantized as the int8
    reference's, except a row's wide groups, whose d^2 exceeds 1e-6 times the row's sum of
    x^2, which are (254 * hi + lo) * d / 254 as with two planes. Returns the product and the
    wide groups [m, k / 32]."""
    d, hi, lo = two_planes(x)
    d2 = d.squeeze(-1).double() ** 2
    wide = d2 > 1e-6 * x.double().square().sum(-1, keepdim=True)
    return times_weights(torch.where(wide[..., None], (254 * hi + lo) * (d / 254), hi * d), w), wide


def outlier_columns(k: int) -> torch.Tensor:
    return torch.randperm(k, generator=torch.Generator().manual_seed(k))[: k // 256]


def with_outliers(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows as a model's linears see them: most channels small, a few (1 in 256, the same in
    every row) past 40, so that their groups' int8 step dwarfs the others'."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    cols = outlier_columns(k)
    x[:, cols] += 40 * torch.sign(x[:, cols])
    return x


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 40])
def test_mixed_activation_kernel_widens_the_outlier_groups(bits: int, m: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_mixed

    n, k = 40, 512
    packed, _ = pack(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), bits)
    x = with_outliers(m, k)
    x[0, :GROUP] = 0.0
    bias = torch.randn(48)
    got = quant_linear_cpu_mixed(x, packed, bias)
    assert got.shape == (m, n)
    want, wide = mixed_activation_reference(x, packed)
    outlier_groups = torch.zeros_like(wide)
    outlier_groups[:, outlier_columns(k) // GROUP] = True
    assert torch.equal(wide, outlier_groups)  # the outliers' groups are wide, and no other
    torch.testing.assert_close(got, want + bias[:n], rtol=1e-5, atol=5e-4)
    # the outliers' groups carry much of int8's rounding error: nearer the float product
    error, int8_error = errors_beside_int8(got, x, packed, bias)
    assert error < int8_error / 3  # measured 4.5-6.8 times nearer


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_mixed_activation_rows_do_not_depend_on_the_batch(bits: int) -> None:
    """Bit for bit: which groups are wide is each row's own choice, and a tile that runs the
    second plane for one row's wide group adds nothing to the rows whose plane there is zeros."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_mixed

    packed, _ = pack(weights(64, 4096, bits), bits)
    x = with_outliers(41, 4096)
    x[::3] = torch.randn(14, 4096)  # rows with no outliers beside rows with them, in every tile
    together = quant_linear_cpu_mixed(x, packed)
    alone = torch.cat([quant_linear_cpu_mixed(x[i : i + 1], packed) for i in range(41)])
    fives = torch.cat([quant_linear_cpu_mixed(x[i : i + 5], packed) for i in range(0, 40, 5)])
    assert torch.equal(together, alone)
    assert torch.equal(together[:40], fives)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_mixed_activation_rows_each_widen_their_own_groups(bits: int) -> None:
    """Rows whose outliers sit in different channels, and rows with none: the residual pass
    takes the rows wide at a group together whichever tiles they are in, and each row still
    gets its own groups' planes, as the reference computes them and as it gets alone."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_mixed

    m, n, k = 40, 40, 1024
    packed, _ = pack(weights(n, k, bits), bits)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=gen)
    for i in range(0, m, 4):  # every fourth row has none
        cols = torch.randperm(k, generator=gen)[: 1 + i % 5]
        x[i + 1 : i + 4, cols] += 40 * torch.sign(x[i + 1 : i + 4, cols])  # three rows, not a tile's
    bias = torch.randn(48)
    got = quant_linear_cpu_mixed(x, packed, bias)
    want, wide = mixed_activation_reference(x, packed)
    assert len({tuple(row.tolist()) for row in wide}) > m // 4  # the rows' wide groups differ
    assert not wide[::4].any() and wide[1::4].any(1).all()  # rows without outliers: none at all
    torch.testing.assert_close(got, want + bias[:n], rtol=1e-5, atol=5e-4)
    alone = torch.cat([quant_linear_cpu_mixed(x[i : i + 1], packed, bias) for i in range(m)])
    assert torch.equal(got, alone)


def int16_head_reference(x: torch.Tensor, w) -> torch.Tensor:
    """What qhead.c computes: groups quantized to round(x * 32767 / max|x|), the exact
    integer dot with the int8 levels, scaled by d * scale (int8 panels' zero is 0)."""
    return int8_activation_reference(x, w, top=32767)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 40])
def test_head_kernel_computes_the_int16_product(m: int) -> None:
    """The lm_head's kernel: int8 weights against ~15-bit activations, far nearer the float
    product than int8 activations."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_head

    n, k = 40, 256
    packed, _ = pack(weights(n, k, 8), 8)
    x = torch.randn(m, k) * 3
    x[0, :GROUP] = 0.0  # an all-zero group quantizes to zeros, not NaN
    x[-1, GROUP : 2 * GROUP] *= 1000  # an outlier group keeps its own scale
    bias = torch.randn(48)
    got = quant_linear_cpu_head(x, packed, bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, int16_head_reference(x, packed) + bias[:n], rtol=1e-5, atol=1e-3)
    error, int8_error = errors_beside_int8(got, x, packed, bias)
    assert error < int8_error / 50


@needs_kernels
def test_head_kernel_rows_do_not_depend_on_the_batch() -> None:
    """A row's logits are the same bit for bit alone, in a batch of any size, or in the
    third pass of rows (64 rows of 1024 int16 inputs fill one)."""
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_head

    packed, _ = pack(weights(96, 1024, 8), 8)
    x = torch.randn(133, 1024)
    together = quant_linear_cpu_head(x, packed)
    alone = torch.cat([quant_linear_cpu_head(x[i : i + 1], packed) for i in range(133)])
    sevens = torch.cat([quant_linear_cpu_head(x[i : i + 7], packed) for i in range(0, 133, 7)])
    assert torch.equal(together, alone)
    assert torch.equal(together, sevens)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 5])
def test_head_kernel_on_narrower_panels_takes_two_int8_planes(bits: int) -> None:
    from pypto_serving.kernels.cpu.qlinear import quant_linear_cpu_head, quant_linear_cpu_q16

    packed, _ = pack(weights(40, 256, bits), bits)
    x = torch.randn(3, 256)
    assert torch.equal(quant_linear_cpu_head(x, packed), quant_linear_cpu_q16(x, packed))


def test_the_cpu_lm_head_takes_int16_activations_unless_activations_stay_float() -> None:
    from pypto_serving.backends.cpu import CpuBackend
    from pypto_serving.kernels.cpu import qlinear

    backend = CpuBackend("cpu", torch.float32)
    if not backend.native:
        pytest.skip("no AVX2/FMA/F16C CPU or no C compiler")
    assert backend.quant_kernels("int8").head is qlinear.quant_linear_cpu_head
    assert backend.quant_kernels("int16").head is qlinear.quant_linear_cpu_head
    assert backend.quant_kernels("none").head is qlinear.quant_linear_cpu


def test_gguf_k_grids_pack_onto_their_own_step() -> None:
    """Q4_K-like sub-blocks (fp16 step, a minimum, top levels unused) pack to int4 within the
    fp16 scale's rounding; weights on no grid keep the usual half-step rounding."""
    torch.manual_seed(0)
    n, k = 32, 256
    step = (torch.rand(n, k // GROUP, 1) * 0.02 + 0.001).half().float()
    minimum = (torch.rand(n, k // GROUP, 1) * 0.1).half().float()
    q4k = (step * torch.randint(0, 13, (n, k // GROUP, GROUP)) - minimum).view(n, k)
    _, error = pack(q4k, 4)
    assert error < 0.01
    _, error = pack(torch.randn(n, k), 4)
    assert 0.4 < error <= 0.5


def q4_0_grid(n: int, k: int) -> torch.Tensor:
    """Weights as GGUF Q4_0 dequantizes them, d * (q - 8), each group reaching level 0."""
    g = torch.Generator().manual_seed(1)
    d = (torch.rand(n, k // GROUP, 1, generator=g) * 0.02 + 0.001).half().float()
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * (q - 8)).view(n, k)


@needs_kernels
@pytest.mark.parametrize("grid", ["Q4_0", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("planes", ["int8", "int16", "mixed"])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("avx2", [False, True])
def test_symmetric_grids_zeros_are_computed_not_read(grid: str, planes: str, m: int, avx2: bool) -> None:
    """Q4_0, Q5_0 and Q8_0 weights pack onto symmetric grids (zero = -8 or -16 scale, 0): the
    int8-activation kernels take those zero terms in the integer dots (-8 or -16 times the
    group's sum of quantized inputs; int8's is 0), so a decode step does not stream the zeros
    and a tile saves a float fma per row and group. Spoiling the stored zeros afterwards
    changes nothing (nothing reads them); a grid with zeros of its own (Q4_1) keeps reading
    them. Against the same weights with their zeros read: int8 bit for bit, int4 and int5 as
    near the exact quantized product or nearer (the term is exact, not rounded in float). On
    the AVX-512 tiles and, forced, on the AVX2 ones."""
    from pypto_serving.kernels.cpu import qlinear
    from pypto_serving.kernels.quant_linear import symmetric_grid

    kernel = {"int8": qlinear.quant_linear_cpu_q8, "int16": qlinear.quant_linear_cpu_q16,
              "mixed": qlinear.quant_linear_cpu_mixed}[planes]
    bits = {"Q4_0": 4, "Q5_0": 5, "Q8_0": 8}[grid]
    weights = (lambda: q4_0_grid(40, 256)) if bits == 4 else (lambda: on_grid(40, 256, bits))
    x = torch.randn(m, 256)
    x[:, 7] *= 50  # an outlier channel: mixed activations widen its group
    packed, stored = pack(weights(), bits)[0], pack(weights(), bits)[0]
    qlinear._ARGS[stored] = (qlinear.weight_args(stored),) * 2  # reads its stored zeros
    assert symmetric_grid(packed)
    if avx2:
        cpu.library().qdot_use_vnni(0)
    try:
        want, got = kernel(x, stored), kernel(x, packed)
        if bits == 8:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if planes == "int8":
            exact = int8_activation_reference(x, packed)
            assert (got - exact).abs().mean() <= (want - exact).abs().mean()
        packed.zero.fill_(float("nan"))
        assert torch.equal(kernel(x, packed), got)
        asymmetric, _ = pack(on_grid(40, 256, 4), 4)
        assert not symmetric_grid(asymmetric)
        asymmetric.zero.fill_(float("nan"))
        assert kernel(x, asymmetric).isnan().all()
    finally:
        cpu.library().qdot_use_vnni(1)
