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


# Every scaffold kind (each has its own NEON rule template) and `--from`: one verify run
# over all six, so the emulator and TVM start once rather than six times.
_SCAFFOLDS = [
    ("swish", "elementwise", None),
    ("gated", "binary", None),
    ("lse", "reduction", None),
    ("l2n", "norm", None),
    ("resln", "residual_norm", None),
    ("ln_like", None, "layer_norm"),
]


def test_scaffolds_verify_on_emulated_arm(tmp_path: pathlib.Path):
    import json

    pkg = tmp_path / "armpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, kind, from_op in _SCAFFOLDS:
        if from_op:
            new_op(name, from_op=from_op, directory=pkg)
        else:
            new_op(name, kind=kind, directory=pkg)
    names = [n for n, _, _ in _SCAFFOLDS]
    modules = [a for n in names for a in ("--module", f"armpkg.{n}")]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "opsdk", "verify", *names, *modules, "--target", "arm",
         "--profile", "ci", "--examples", "4", "--seed", "0", "--report", str(tmp_path / "r.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "qemu-aarch64" in r.stdout
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    # every scaffold verified in every cell, and its own NEON rule scheduled cases in them. A
    # case the template's rule passes on (a rank-1 input for the elementwise kinds) goes to a
    # built-in rule, so a cell's rules are a set: the template's rule must be among them (a
    # user rule that raised fails the cell, checked above).
    assert {c["op"] for c in cells} == set(names), {c["op"] for c in cells}
    assert all(c["status"] == "pass" for c in cells), [
        (c["op"], c["dtype"], c["status"]) for c in cells if c["status"] != "pass"]
    for name in names:
        assert any(f"{name}.neon" in c["rules"] for c in cells if c["op"] == name), [
            c["rules"] for c in cells if c["op"] == name]


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
