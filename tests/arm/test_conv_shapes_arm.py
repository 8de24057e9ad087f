"""The conv shapes real nets have on NEON (cross-compiled, run under qemu): a 3-channel stem
(padding read in place, kw x c unrolled), a wide 1x1 at 7x7 (the pixel x channel-vector
tile), a grouped 3x3 (vectors inside a group) and odd channel counts (padded to whole
vectors) take the NEON conv rule, in 4-lane vectors,
and match float64. Small: the arm tests are the suite's slowest (depthwise 5x5 is verified
on x86 in tests/host/test_conv_shapes.py)."""

from __future__ import annotations

import pytest
from tvm import te, tirx
from tvm_ffi.structural import structural_walk

import opsdk
from opsdk.kernels import tvm_conv2d
from opsdk.schedules._conv import schedule_conv2d
from opsdk.verify import Case, run_case

pytestmark = pytest.mark.arm

# (input shape NHWC, attrs), bias present.
CASES = [
    ((1, 10, 9, 3), {"layout": "NHWC", "channels": 8, "kernel": 3, "stride": 2, "padding": 1,
                     "activation": "hardswish"}),
    ((1, 7, 7, 24), {"layout": "NHWC", "channels": 48, "kernel": 1, "stride": 1,
                     "padding": 0, "activation": "silu"}),
    # grouped, RegNet's 8-wide groups: 4-lane vectors inside a group, the input broadcast
    ((1, 7, 7, 32), {"layout": "NHWC", "channels": 32, "kernel": 3, "stride": 1,
                     "padding": 1, "groups": 4, "activation": "relu"}),
    # 10 output channels (RexNet's odd counts): padded to 12, 3 whole NEON vectors
    ((1, 6, 7, 8), {"layout": "NHWC", "channels": 10, "kernel": 1, "stride": 1,
                    "padding": 0, "activation": "silu"}),
    # depthwise over 18 channels: 4-lane vectors, the last tile moved back over channel 14
    ((1, 7, 6, 18), {"layout": "NHWC_dw", "channels": 18, "kernel": 3, "stride": 1,
                     "padding": 1, "activation": "relu6"}),
]


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.registry import register_kernels
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)
    register_kernels()


def test_stem_wide_1x1_and_grouped_match_float64_on_neon():
    for shape, attrs in CASES:
        case = Case("tvm_conv2d", "arm", "float32", attrs["layout"], shape, attrs, ("bias",),
                    {}, 3, static=True)
        res = run_case(case, op=tvm_conv2d)
        assert res.ok, (shape, res.status, res.message)
        assert res.rule == "neon.conv2d", (shape, res.rule)


def test_stem_on_neon_is_vectorized_with_its_window_row_unrolled():
    shape, attrs = CASES[0]
    x = te.placeholder(shape, name="x")
    w = te.placeholder((3, 3, 3, 8), name="w")
    b = te.placeholder((8,), name="bias")
    y = tvm_conv2d.compute(x, w, b, None, **attrs)
    sch = schedule_conv2d(te.create_prim_func([x, w, b, y]), opsdk.target("arm"), acc_regs=24)
    loops: list = []
    structural_walk(sch.mod["main"], [(tirx.For, lambda n: loops.append(n))])
    vec = {int(lp.extent.value) for lp in loops if lp.kind == tirx.ForKind.VECTORIZED}
    assert 4 in vec  # 128-bit NEON vectors over the output channels
    unrolled = {str(lp.loop_var.name): int(lp.extent.value) for lp in loops
                if lp.kind == tirx.ForKind.UNROLLED}
    assert unrolled.get("rc") == 3 and unrolled.get("rx") == 3
    assert any(lp.kind == tirx.ForKind.PARALLEL for lp in loops)
