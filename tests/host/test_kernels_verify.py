"""The rules for the kernels TVM's ops lower to pass the same verification as op rules:
float64 reference, schedule invariance, symbolic batch, vector / parallel lints (x86)."""

from __future__ import annotations

import pytest

from opsdk.kernels import KERNEL_OPS
from opsdk.verify import verify


@pytest.mark.parametrize("d", KERNEL_OPS, ids=lambda d: d.name)
def test_kernel_family_verifies_on_x86(d):
    report = verify([d], "x86", profile="ci", seed=0, database=None)
    bad = [c.failure.format(tir=False) for c in report.cells if c.failure]
    assert report.ok, "\n".join(bad) or report.lints
    assert {r for c in report.cells for r in c.rules} == {f"x86.{d.kind}"}
    claims = [x for x in report.lints if x.status != "skip"]
    assert claims and all(x.status == "pass" for x in claims), claims
    assert all(x.status == "pass" for x in report.refusals)
