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
    report = verify(list(KERNEL_OPS), "arm", profile="dev", seed=0, database=None)
    bad = [c.failure.format(tir=False) for c in report.cells if c.failure]
    assert report.ok, "\n".join(bad) or report.lints
    assert {r for c in report.cells for r in c.rules} == {"neon.matmul", "neon.conv2d",
                                                          "neon.winograd", "neon.pool"}
    claims = [x for x in report.lints if x.status != "skip"]
    assert claims and all(x.status == "pass" for x in claims), claims
