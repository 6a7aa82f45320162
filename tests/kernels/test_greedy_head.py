"""The greedy head (qhead.c `qhead_greedy`): each row's argmax of the int16 head's logits, found
from int8-activation logits, a bound on their error and the int16 logits of the candidates'
panels only. It equals torch.argmax of `quant_linear_cpu_head`'s logits in every case, ties to
the first index included, or steps aside (None) and the caller computes the logits."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.kernels import cpu
from pypto_serving.kernels.cpu import qlinear
from pypto_serving.kernels.quant_linear import pack

needs_vnni = pytest.mark.skipif(not cpu.available() or not cpu.vnni(), reason="no AVX-512 VNNI CPU")


def head_argmax(x: torch.Tensor, w) -> torch.Tensor:
    return qlinear.quant_linear_cpu_head(x, w).argmax(-1)


@needs_vnni
@pytest.mark.parametrize(("n", "k"), [(1000, 64), (4100, 96), (49152, 576)])
def test_the_argmax_is_the_int16_heads(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    w, _ = pack(torch.randn(n, k, generator=g) * 0.05, 8)
    for m in (1, 2, 3, 7, 8, 9, 16, 33):  # tiles of 8 and every remainder
        x = torch.randn(m, k, generator=g) * 3
        x[:, ::13] *= 30  # outlier channels: a row's groups far apart in scale
        assert torch.equal(qlinear.head_argmax_cpu(x, w), head_argmax(x, w)), m


@needs_vnni
def test_near_ties_and_ties_go_as_the_int16_logits_go() -> None:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(700, 64, generator=g)
    weights[[37, 400]] = weights[123].clone()  # equal rows: equal logits, the first index wins
    weights[500] = weights[123] * (1 + 1e-4)  # within int8's error of them: decided at int16
    w, _ = pack(weights, 8)
    x = torch.stack([weights[123] * s for s in (1.0, -1.0, 0.5)] + [torch.zeros(64)])
    assert qlinear.head_argmax_cpu(x, w).tolist() == head_argmax(x, w).tolist()
    assert head_argmax(x[:1], w).item() in (37, 500)


@needs_vnni
def test_it_steps_aside_for_values_it_cannot_bound() -> None:
    w, _ = pack(torch.randn(300, 64) * 0.05, 8)
    for bad in (float("nan"), float("inf"), 1e20):
        x = torch.randn(2, 64)
        x[1, 5] = bad
        assert qlinear.head_argmax_cpu(x, w) is None
    assert qlinear.head_argmax_cpu(torch.randn(2, 64), pack(torch.randn(64, 64), 4)[0]) is None  # int4


@needs_vnni
def test_rows_with_too_many_candidates_take_the_whole_head() -> None:
    """A row whose logits are flat within the bound keeps more candidates than it may (an
    eighth of the vocabulary): its logits are computed; the other rows still take the kernel."""
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(12000, 64, generator=g) * 0.01
    weights[:3000] = weights[7]  # 3000 equal rows: a row that favours them ties 3000 ways
    w, _ = pack(weights, 8)
    x = torch.stack([weights[7] * 400, -weights[7] * 400])  # the 3000 first, and last
    assert torch.equal(qlinear.head_argmax_cpu(x, w), head_argmax(x, w))
    assert qlinear.head_argmax_cpu(x[:1], w).item() == 0
    out = torch.empty(2, dtype=torch.int64)  # the kernel itself: the first row is left to the caller
    k, n_blocks, q, scale, _, _ = qlinear.weight_args(w)
    cpu.library().qhead_greedy(x.data_ptr(), 2, k, n_blocks, w.n, q, scale, qlinear._L1MAX[w].data_ptr(),
                               out.data_ptr())
    assert out[0] == -1 and out[1] == head_argmax(x[1:], w)


@needs_vnni
def test_without_the_vnni_tiles_it_steps_aside() -> None:
    w, _ = pack(torch.randn(300, 64), 8)
    lib = cpu.library()
    lib.qdot_use_vnni(0)
    try:
        assert qlinear.head_argmax_cpu(torch.randn(2, 64), w) is None
    finally:
        lib.qdot_use_vnni(1)
