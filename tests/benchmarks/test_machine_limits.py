"""benchmarks/machine_limits.py: the integer dot-product roof and the int8-activation GEMM."""

from __future__ import annotations

import math

import pytest

from benchmarks.machine_limits import (
    int8_activation_measurement,
    int8_roof_measurements,
    vnni_roof_measurements,
)
from pypto_serving.kernels.cpu import available, find_compiler, has_avx2, vnni

needs_avx2 = pytest.mark.skipif(not has_avx2() or find_compiler() is None,
                                reason="int8_roof.c needs x86-64 with AVX2 and a C compiler")


@needs_avx2
def test_int8_roof_times_both_loops() -> None:
    alone, accumulate = int8_roof_measurements(iters=200_000)
    assert alone.name == "int8 dot roof, vpmaddubsw alone"
    assert accumulate.name == "int8 dot roof, vpmaddubsw + vpaddw"
    for m in (alone, accumulate):
        assert m.unit == "GMAC/s" and math.isfinite(m.value) and m.value > 1.0


@pytest.mark.skipif(not available(), reason="the C kernels cannot run here")
def test_int8_activation_gemm_is_measured() -> None:
    [m] = int8_activation_measurement()
    assert m.name == "int4 x int8-activation GEMM M=512" and m.unit == "GMAC/s" and m.value > 0


@pytest.mark.skipif(not available() or not vnni(), reason="no AVX-512 VNNI here")
def test_vnni_roof_times_vpdpbusd() -> None:
    [m] = vnni_roof_measurements(iters=100_000)
    assert m.name == "int8 dot roof, vpdpbusd (AVX-512 VNNI)"
    assert m.unit == "GMAC/s" and math.isfinite(m.value) and m.value > 1.0
