"""`opsdk new-op` in a fresh package outside the SDK verifies green with no edit, for every
kind and for `--from`; a wrong edit is caught with a working reproducer, and a fix passes."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from opsdk._scaffold import new_op

KINDS = ["elementwise", "binary", "reduction", "norm", "residual_norm"]


def _package(tmp_path: pathlib.Path) -> pathlib.Path:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    return pkg


def _opsdk(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd), "OPSDK_CACHE": str(cwd / ".cache")}
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    return subprocess.run([sys.executable, "-m", "opsdk", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("kind", KINDS)
def test_scaffold_of_each_kind_verifies_without_edits(tmp_path, kind):
    pkg = _package(tmp_path)
    name = f"my_{kind}"
    new_op(name, kind=kind, directory=pkg)
    r = _opsdk(["verify", name, "--module", f"userpkg.{name}", "--target", "x86",
                "--profile", "ci", "--examples", "8"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS" in r.stdout
    assert f"[{name}.x86]" in r.stdout  # its own rule was chosen and linted
    if kind in ("norm", "reduction"):  # held to a composed model, not the heuristic fallback
        assert "author's (composed" in r.stdout and "fallback" not in r.stdout
    if kind == "residual_norm":  # two outputs, each held to its own composed model
        assert "author's (per output: composed rounding x1, composed norm)" in r.stdout


def test_scaffold_from_builtin_verifies(tmp_path):
    pkg = _package(tmp_path)
    new_op("my_ln", from_op="layer_norm", directory=pkg)
    r = _opsdk(["verify", "my_ln", "--module", "userpkg.my_ln", "--target", "x86",
                "--profile", "ci", "--examples", "8"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[my_ln.x86]" in r.stdout


def test_wrong_edit_fails_with_reproducer_then_fix_passes(tmp_path):
    pkg = _package(tmp_path)
    new_op("swish", kind="elementwise", directory=pkg)
    src = pkg / "swish.py"
    good = src.read_text()
    formula = "return (v / (1.0 + exp_f32(-beta * v))).astype(x.dtype)"
    assert formula in good
    src.write_text(good.replace(formula, "return (v / (1.0 + exp_f32(beta * v))).astype(x.dtype)"))
    args = ["verify", "swish", "--module", "userpkg.swish", "--target", "x86",
            "--dtypes", "float32", "--profile", "ci", "--examples", "8"]
    bad = _opsdk(args, tmp_path)
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "FAILED opsdk.swish" in bad.stdout
    m = re.search(r"reproduce: (opsdk verify .*)", bad.stdout)
    assert m, bad.stdout[-3000:]
    repro = shlex.split(m.group(1))[1:]  # drop the program name
    again = _opsdk(repro, tmp_path)
    assert again.returncode == 1, again.stdout[-2000:]
    assert "FAILED opsdk.swish" in again.stdout
    src.write_text(good)
    fixed = _opsdk(repro, tmp_path)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert _opsdk(args, tmp_path).returncode == 0
