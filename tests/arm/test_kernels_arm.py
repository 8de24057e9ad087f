"""The kernel families' NEON rules run under emulated aarch64 and match the float64
reference and the unscheduled kernel; every claimed NEON lint holds."""

from __future__ import annotations

import pytest

from opsdk.kernels import KERNEL_OPS
from opsdk.verify import verify

pytestmark = pytest.mark.arm


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)


def test_kernel_families_verify_on_arm():
    # The corner cases only: the kernel corners (_kcorners) put every pair of attribute
    # values, the tile edges of NEON's 4-lane tiles and every epilogue into them on purpose,
    # which random draws (x86 runs those) reached by chance.
    from opsdk.verify._kcorners import kernel_corners

    report = verify(list(KERNEL_OPS), "arm", profile="dev", seed=0, database=None,
                    max_examples=0)
    bad = [c.failure.format(tir=False) for c in report.cells if c.failure]
    assert report.ok, "\n".join(bad) or report.lints
    by_name = {d.name: d for d in KERNEL_OPS}
    for c in report.cells:  # every cell ran at least its kernel corners
        assert c.examples >= len(kernel_corners(by_name[c.op], "arm", c.dtype, c.layout, 4)) > 0
    assert {r for c in report.cells for r in c.rules} == {
        "neon.matmul", "neon.conv2d", "neon.winograd", "neon.pool", "neon.rows", "neon.columns"}
    claims = [x for x in report.lints if x.status != "skip"]
    assert claims and all(x.status == "pass" for x in claims), claims


# One static case per family and layout, bias present: (op, layout, shape, attrs, activation).
# The two polynomials are shared code, so each family runs one of them on arm: SiLU (sigmoid's
# exp and a DAG that reads the pre-activation twice) and tanh (the other polynomial, a chain)
# each reach two families; x86 runs every activation in every family.
_EPILOGUE_CASES = [
    ("tvm_matmul", "kn", (5, 24), {"layout": "kn", "n": 33}, "silu"),
    ("tvm_conv2d", "NHWC", (1, 6, 7, 8), {"layout": "NHWC", "channels": 20, "kernel": 1,
                                          "stride": 1, "padding": 0}, "tanh"),
    ("tvm_conv2d", "NHWC_dw", (1, 9, 8, 16), {"layout": "NHWC_dw", "channels": 16,
                                              "kernel": 3, "stride": 2, "padding": 1}, "silu"),
    ("tvm_conv2d_winograd", "NHWC", (1, 6, 6, 16), {"channels": 16, "padding": 1}, "tanh"),
]


@pytest.mark.parametrize("case", _EPILOGUE_CASES, ids=lambda c: f"{c[1]}-{c[4]}")
def test_transcendental_epilogues_match_float64_on_arm(case):
    from opsdk.registry import register_kernels
    from opsdk.verify import Case, run_case

    register_kernels()
    name, layout, shape, attrs, activation = case
    d = {d.name: d for d in KERNEL_OPS}[name]
    c = Case(name, "arm", "float32", layout, shape, {**attrs, "activation": activation},
             ("bias",), {}, 3, static=True)
    res = run_case(c, op=d)
    assert res.ok, (name, layout, res.status, res.message)
    assert res.rule == f"neon.{d.kind}", (name, res.rule)
