"""Scaffolded ops verify on emulated aarch64 with no edit (every kind, and `--from`)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from opsdk._scaffold import new_op

pytestmark = pytest.mark.arm


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)


@pytest.mark.parametrize(
    ("name", "kind", "from_op"),
    [
        ("swish", "elementwise", None),
        ("gated", "binary", None),
        ("lse", "reduction", None),
        ("l2n", "norm", None),
        ("resln", "residual_norm", None),
        ("ln_like", None, "layer_norm"),
    ],
)
def test_scaffold_verifies_on_emulated_arm(tmp_path: pathlib.Path, name, kind, from_op):
    pkg = tmp_path / "armpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if from_op:
        new_op(name, from_op=from_op, directory=pkg)
    else:
        new_op(name, kind=kind, directory=pkg)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "opsdk", "verify", name, "--module", f"armpkg.{name}",
         "--target", "arm", "--profile", "ci", "--examples", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "qemu-aarch64" in r.stdout and "PASS" in r.stdout
    assert f"[{name}.neon]" in r.stdout



def test_multi_output_op_on_the_builtin_neon_row_rule(tmp_path: pathlib.Path):
    # The residual_norm scaffold without its own rules: the built-in NEON row rule schedules
    # both outputs (the residual as a vector pass of its own); both are checked.
    import json

    new_op("add_ln", kind="residual_norm", directory=tmp_path, targets=())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "opsdk", "verify", "add_ln", "--module", "add_ln",
         "--target", "arm", "--profile", "ci", "--examples", "4",
         "--report", str(tmp_path / "r.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    assert {c["dtype"] for c in cells} == {"float32", "float16", "bfloat16"}
    assert all(c["rules"] == ["neon.rows"] and c["status"] == "pass" for c in cells)
