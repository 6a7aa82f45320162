"""The C argmax gives torch.argmax's answer on every kind of row, and greedy sampling uses it."""

from __future__ import annotations

import pytest
import torch

from pypto_serving.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no AVX2/FMA/F16C CPU or no C compiler")


def rows_of_every_kind(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1] = x[1].round()  # ties: the first one wins
    x[1, width // 2] = x[1, -1] = x[1].max() + 1
    x[2] = float("-inf")  # every token masked
    x[3, width // 3] = float("nan")  # NaN beats everything, as in torch
    x[3, -1] = float("nan")
    x[4, -1] = float("inf")  # in the tail after the last 8 lanes
    x[5] = 0.0
    x[5, width // 2] = -0.0
    x[6, 0] = 1e30  # the first lane
    x[7, width - 1] = x[7].max() + 1e-3  # the last one
    x[8] = float("-inf")
    x[8, -1] = -1e38
    return x


@pytest.mark.parametrize("width", [1, 7, 8, 13, 64, 1000, 49152])
def test_argmax_equals_torch(width: int) -> None:
    from pypto_serving.kernels.cpu.sampling import argmax_cpu

    x = rows_of_every_kind(width)
    assert torch.equal(argmax_cpu(x), x.argmax(dim=-1))
    wide = torch.randn(9, width + 5)
    wide[:, :width] = x
    view = wide[:, :width]  # a row stride wider than the row
    assert torch.equal(argmax_cpu(view), x.argmax(dim=-1))
    assert torch.equal(argmax_cpu(x.t().contiguous().t()), x.argmax(dim=-1))  # column-major


def test_greedy_sampling_takes_the_c_argmax(monkeypatch) -> None:
    from pypto_serving.backends import CpuBackend
    from pypto_serving.kernels.cpu import sampling as c

    calls = []
    real = c.argmax_cpu
    monkeypatch.setattr(c, "argmax_cpu", lambda x: calls.append(x.shape) or real(x))
    x = torch.randn(4, 100)
    greedy = CpuBackend("cpu", torch.float32).argmax
    assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert calls == [(4, 100)]
    assert torch.equal(greedy(x.double()), x.argmax(dim=-1))  # not float32: torch's
    assert len(calls) == 1
