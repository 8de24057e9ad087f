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


def test_a_kernel_with_polynomial_math_is_counted():
    # opsdk's vector math binds its intermediates with Let, which TVM's flop estimate
    # refuses: a matmul with a GELU epilogue (DeiT's MLP) had no count, and the report
    # judged it by its bytes alone (2 % of a roof it was at 93 % of).
    from tvm import te, tirx

    from opsdk._asm import kernel_work
    from opsdk._vecmath import has_let, polynomial_math

    a = te.placeholder((16, 32), "float32", name="a")
    b = te.placeholder((32, 24), "float32", name="b")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((16, 24), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    d = te.compute((16, 24), lambda i, j: c[i, j] * 0.5 * (1.0 + tirx.erf(c[i, j] * 0.7071)),
                   name="d")
    f = polynomial_math(te.create_prim_func([a, b, d]))
    from tvm_ffi.structural import structural_walk

    stores: list = []
    structural_walk(f, [(tirx.BufferStore, stores.append)])
    assert any(has_let(st.value) for st in stores)  # the case TVM's estimate refuses
    flops, nbytes = kernel_work(f)
    assert nbytes == (16 * 32 + 32 * 24 + 16 * 24) * 4
    mac = 2 * 16 * 24 * 32
    assert flops is not None and mac < flops < mac + 16 * 24 * 60  # the erf: tens per element
