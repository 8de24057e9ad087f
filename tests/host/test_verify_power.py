"""Verification power: deliberately wrong ops are flagged, correct ones never are.

- every mutant in ``verify_mutants`` (wrong compute, or a wrong schedule rule) is flagged by
  the default profile; the newer kernel-rule ones (``CORNER_MUTANTS``) by one cell's corner
  cases (``scripts/kernel-mutants.py`` measures them all over many seeds);
- the built-in ops pass under 5 different seeds (20 with ``OPSDK_TEST_SEEDS=20``);
- a failure is shrunk, and its printed reproducer re-runs it and fails the same way;
- the example database replays a past failure first.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys

import pytest
from hypothesis.database import DirectoryBasedExampleDatabase

import opsdk
from opsdk.verify import Profile, StrategyKnobs, run_case, verify, verify_op

_HERE = pathlib.Path(__file__).parent
# The mutants are a plain module beside this file, so that `opsdk verify --module
# verify_mutants` (the printed reproducer) can load them in a fresh process too.
sys.path.insert(0, str(_HERE))
import verify_mutants as M  # noqa: E402

_MUTANTS = {d.name: d for d in M.OPS}
_BUILTINS = [d.name for d in opsdk.list_ops() if d.module.startswith("opsdk.ops")]


@pytest.fixture
def registered(request):
    d = _MUTANTS[request.param]
    opsdk.register(d, replace=True)
    yield d
    opsdk.unregister(d)


@pytest.mark.parametrize(
    "registered", [n for n in M.BUGS if n not in M.CORNER_MUTANTS and n not in M.BY_HAND],
    indirect=True)
def test_mutant_is_flagged_by_the_default_profile(registered) -> None:
    report = verify_op(registered, "host", profile="dev", seed=0, database=None, lints=False,
                       refusals=False, fail_fast=True)
    assert not report.ok, f"{registered.name} ({M.BUGS[registered.name]}) was not flagged"
    (f,) = report.failures
    want = (M.STATUS[registered.name],) if registered.name in M.STATUS else ("mismatch",
                                                                             "invariance")
    assert f.status in want, f.format(tir=False)
    assert f.reproducer.startswith(f"opsdk verify {registered.name} ")
    if registered.name in M.STATUS:  # names the op, the cell and the contract
        assert f.case.dtype in f.message and "output dtype rule" in f.message, f.message
        assert f"opsdk.{registered.name}" in f.message
    else:
        assert f.tir and f.index is not None


@pytest.mark.parametrize("registered", list(M.CORNER_MUTANTS), indirect=True)
def test_kernel_rule_mutant_fails_a_corner_case(registered) -> None:
    # One cell, verify's corner cases only (scripts/kernel-mutants.py runs every cell with
    # the random search, over many seeds): the bug shows in the mutant's own rule.
    dtype, layout, _ = M.CORNER_MUTANTS[registered.name]
    res = M.first_failing_corner(registered, "x86", dtype, layout)
    assert res is not None, f"{registered.name} ({M.BUGS[registered.name]}) was not flagged"
    assert res.status in ("mismatch", "invariance"), res.format(tir=False)
    assert res.rule == "mut." + registered.name.removeprefix("mut_"), res.rule


@pytest.mark.parametrize("registered", list(M.EQUIVALENTS), indirect=True)
def test_equivalent_rewrite_passes(registered) -> None:
    # Another evaluation order of a built-in's math is held to the built-in's model (keyed
    # by the shared reference) and must pass: a failure is a false alarm of the model.
    report = verify_op(registered, "host", profile="dev", seed=0, database=None, lints=False,
                       refusals=False)
    bad = [f.format(tir=False) for f in report.failures]
    bad += [f"{c.op} {c.dtype} {c.layout}: {c.error}" for c in report.cells if c.error]
    assert report.ok, f"{registered.name} ({M.EQUIVALENTS[registered.name]}):\n" + "\n".join(bad)
    assert all(c.model.startswith(("built-in", "exact")) for c in report.cells), [
        c.model for c in report.cells]


# The suite sweeps 5 seeds (CI's 30 minutes); `OPSDK_TEST_SEEDS=20 pytest -k seeds` runs the
# full 20-seed false-alarm sweep.
_SEEDS = int(os.environ.get("OPSDK_TEST_SEEDS", "5"))


def test_builtin_ops_pass_under_many_seeds() -> None:
    # Random examples only (the corner cases are the same for every seed), two per cell.
    profile = Profile("seeds", 2, StrategyKnobs(p_common=75, p_long=15, p_static=3),
                      corners=False, invariance="corners")
    for seed in range(_SEEDS):
        report = verify(_BUILTINS, "host", profile=profile, seed=seed, database=None,
                        lints=False, refusals=False)
        bad = [f.format(tir=False) for f in report.failures]
        bad += [f"{c.op} {c.dtype} {c.layout}: {c.error}" for c in report.cells if c.error]
        assert report.ok, f"seed {seed}:\n" + "\n\n".join(bad)


_RANDOM_ONLY = Profile("random", 60, StrategyKnobs(), corners=False)


def _shrunk_failure(name: str, **kw):
    d = _MUTANTS[name]
    opsdk.register(d, replace=True)
    try:
        report = verify_op(d, "host", dtypes=["float32"], profile=_RANDOM_ONLY, lints=False,
                           refusals=False, fail_fast=True, **kw)
    finally:
        opsdk.unregister(d)
    assert not report.ok
    return report, report.failures[0]


def test_failure_is_shrunk_and_its_reproducer_fails_the_same_way(tmp_path) -> None:
    _, f = _shrunk_failure("mut_ln_vec_tail", seed=3, database=None)
    c = f.case
    # Shrunk: the smallest shape with a vector tail, ordinary data.
    assert len(c.shape) <= 2 and max(c.shape) <= 17, c.to_json()
    assert c.shape[-1] % 16 != 0
    assert "mut.rows_without_tail" in f.tir or f.rule == "mut.rows_without_tail"
    # The printed one-line command, run as a fresh process.
    argv = shlex.split(f.reproducer)
    assert argv[:2] == ["opsdk", "verify"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_HERE), os.environ.get(
        "PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "opsdk.verify", *argv[2:], "--no-db"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"FAILED opsdk.{c.op}" in out.stdout and f.status in out.stdout
    # The same element, the same expected value (what the kernel left in an element it never
    # wrote is whatever memory held, so "got" may differ).
    assert f"worst at index {f.index}: got " in out.stdout
    assert f"expected {f.expected!r}" in out.stdout
    opsdk.register(_MUTANTS["mut_ln_vec_tail"], replace=True)
    try:
        again = run_case(c)
    finally:
        opsdk.unregister("mut_ln_vec_tail")
    assert (again.status, again.index, again.expected) == (f.status, f.index, f.expected)


def test_example_database_replays_past_failures_first(tmp_path) -> None:
    # (No seed: a hypothesis seed switches the database off.) The simplest example of this
    # mutant passes (one row, one bias value), so only a replayed failure can fail the
    # second run, which is allowed a single example.
    db = DirectoryBasedExampleDatabase(str(tmp_path))
    _, f1 = _shrunk_failure("mut_bias_gelu_wrong_axis", database=db)
    assert any(tmp_path.iterdir()), "the failure was not saved"
    d = _MUTANTS["mut_bias_gelu_wrong_axis"]
    opsdk.register(d, replace=True)
    try:
        again = verify_op(d, "host", dtypes=["float32"], layouts=[f1.case.layout],
                          profile=_RANDOM_ONLY, max_examples=1, database=db, lints=False,
                          refusals=False)
    finally:
        opsdk.unregister(d)
    assert not again.ok
    assert again.failures[0].case == f1.case
    assert again.cells[0].examples <= 2
