"""The rules for the kernels TVM's ops lower to pass the same verification as op rules:
float64 reference, schedule invariance, symbolic batch, vector / parallel lints (x86)."""

from __future__ import annotations

import pytest

from opsdk.kernels import KERNEL_OPS
from opsdk.verify import verify

# The rules each family's cells must land on (the mean: NCHW reduces along memory, rows;
# NHWC across it, columns).
_RULES = {"reduction": {"x86.rows", "x86.columns"}}


@pytest.mark.parametrize("d", KERNEL_OPS, ids=lambda d: d.name)
def test_kernel_family_verifies_on_x86(d):
    # The kernel corners (every pair of attribute values, the tile edges, every epilogue)
    # are deterministic; a few random examples per cell explore past them.
    report = verify([d], "x86", profile="ci", seed=0, database=None, max_examples=6)
    bad = [c.failure.format(tir=False) for c in report.cells if c.failure]
    assert report.ok, "\n".join(bad) or report.lints
    assert {r for c in report.cells for r in c.rules} == _RULES.get(d.kind, {f"x86.{d.kind}"})
    claims = [x for x in report.lints if x.status != "skip"]
    assert claims and all(x.status == "pass" for x in claims), claims
    assert all(x.status == "pass" for x in report.refusals)


def test_a_kernel_family_reproducer_reruns_through_the_cli(tmp_path):
    # A kernel family is found by `opsdk verify --kernels`; the printed one-line command
    # must say so (it named the family alone, which the CLI then refused as unknown).
    import json
    import shlex
    import subprocess
    import sys

    from opsdk.verify import Case
    from opsdk.verify._report import reproducer_command

    case = Case.from_json(json.dumps({
        "attrs": {"activation": "relu", "channels": 16, "padding": 1},
        "data": {"bias": "domain", "residual": "domain", "w": "domain", "x": "normal"},
        "dtype": "float32", "free": {}, "layout": "NHWC", "op": "tvm_conv2d_winograd",
        "present": ["bias", "residual"], "seed": 1, "shape": [2, 5, 6, 17], "static": False,
        "target": "x86"}))
    argv = shlex.split(reproducer_command(case, kernels=True))
    assert argv[:4] == ["opsdk", "verify", "--kernels", "tvm_conv2d_winograd"]
    out = subprocess.run([sys.executable, "-m", "opsdk.verify", *argv[2:], "--no-db"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("pass: opsdk.tvm_conv2d_winograd"), out.stdout
