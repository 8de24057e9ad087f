"""The roofline arithmetic of the model report (opsdk._roofline): a kernel is judged by its
GFLOP/s against min(GEMM peak, intensity x bandwidth at its working-set size), a copy by
its GB/s; the machine's ceilings are measured elsewhere (tests/host/test_model_report)."""

from __future__ import annotations

import pytest

from opsdk._roofline import Roof

ROOF = Roof(gflops=200.0, gbps={1 << 18: 100.0, 1 << 24: 50.0}, threads=2)


def test_bandwidth_is_the_smallest_measured_size_that_holds_the_working_set():
    assert ROOF.bandwidth(1000) == 100.0
    assert ROOF.bandwidth(1 << 18) == 100.0
    assert ROOF.bandwidth((1 << 18) + 1) == 50.0
    assert ROOF.bandwidth(1 << 30) == 50.0  # beyond the largest: the largest's


@pytest.mark.parametrize(("flops", "nbytes", "unit", "top"), [
    (4e9, 1e6, "GFLOP/s", 200.0),  # 4000 flops a byte: the GEMM peak bounds it
    (1e6, 1e6, "GFLOP/s", 50.0),  # 1 flop a byte at 50 GB/s
    (0.0, 1e5, "GB/s", 100.0),  # a copy in L2
])
def test_attainable_is_the_lower_of_peak_and_intensity_times_bandwidth(flops, nbytes, unit,
                                                                      top):
    assert ROOF.attainable(flops, int(nbytes)) == (unit, pytest.approx(top))


def test_percent_of_the_roof():
    # 1e6 flops and 1e6 bytes in 40 us: 25 GFLOP/s of an attainable 50.
    assert ROOF.percent(1e6, 10**6, 40e-6) == pytest.approx(50.0)
    assert ROOF.percent(0.0, 10**5, 2e-6) == pytest.approx(50.0)  # 50 of 100 GB/s
    assert ROOF.percent(1e6, 10**6, 0.0) is None
