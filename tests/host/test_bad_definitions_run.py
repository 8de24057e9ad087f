"""Bad definitions that only show when verify compiles: a user's schedule rule that raises or
returns nonsense fails verify (the generic lowering ran in its place, unverified), a known
TVM internal check is said in the op's terms, and ``database=None`` writes nothing to the
working folder."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from tvm import te

import opsdk
from opsdk import schedules
from opsdk.verify import verify_op


def _ref(x):
    return x * 2.0


def _double(name: str) -> opsdk.OpDef:
    def compute(x: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * 2.0, name=name)

    return opsdk.op(reference=_ref, name=name, kind="elementwise", examples=[(2, 8)])(compute)


def _verify(d: opsdk.OpDef):
    return verify_op(d, "x86", dtypes=["float32"], max_examples=1, database=None, lints=False,
                     refusals=False)


@pytest.fixture
def forget_rules():
    before = {r.name for r in schedules._RULES}
    yield
    schedules._RULES[:] = [r for r in schedules._RULES if r.name in before]


@pytest.mark.filterwarnings("ignore:opsdk. schedule rule")
def test_a_user_rule_that_raises_fails_verify_naming_it(forget_rules):
    d = _double("bad_run_raises")

    @d.rule("cpu", name="test.bad_run_raises", priority=10_000)
    def _r(func, target):
        raise RuntimeError("boom in my rule")

    r = _verify(d)
    assert not r.ok
    msg = r.cells[0].failure.message
    assert msg.startswith("schedule rule test.bad_run_raises: RuntimeError: boom in my rule "
                          "(on bad_run_raises")


@pytest.mark.filterwarnings("ignore:opsdk. schedule rule")
def test_a_user_rule_returning_a_non_schedule_fails_verify(forget_rules):
    d = _double("bad_run_42")

    @d.rule("cpu", name="test.bad_run_42", priority=10_000)
    def _r(func, target):
        return 42

    r = _verify(d)
    assert not r.ok
    assert "test.bad_run_42: TypeError: returned int 42, not an s_tir.Schedule" \
        in r.cells[0].failure.message


def test_a_divisor_tvm_folds_to_zero_is_said_plainly():
    def ref(x):
        return np.full_like(x, np.nan)

    def bad_run_div0(x: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: (x(*i) - x(*i)) / (x(*i) - x(*i)),
                          name="bad_run_div0")

    d = opsdk.op(reference=ref, kind="elementwise", examples=[(2, 8)])(bad_run_div0)
    r = _verify(d)
    assert not r.ok
    assert r.cells[0].failure.message == \
        "compute of bad_run_div0 divides by zero (TVM folded the divisor to 0)"


_MOD = """
import numpy as np
from tvm import te
import opsdk

def _ref(x, *, beta=1.0):
    return x / (1.0 + np.exp(-beta * x))

@opsdk.op(reference=_ref, domain={"x": (-8.0, 8.0)}, attr_domain={"beta": [1.0, 0.5, 2.0]},
          kind="elementwise")
def bad_run_nodb(x: opsdk.Tensor, *, beta: float = 1.0) -> te.Tensor:
    # wrong: ignores beta; the failure makes hypothesis search and shrink the attribute
    return te.compute(x.shape, lambda *i: x(*i) * te.sigmoid(x(*i)), name="bad_run_nodb")

OPS = [bad_run_nodb]
"""


def test_no_database_writes_nothing_to_the_working_folder(tmp_path):
    # A fresh process: hypothesis fixes its default home (./.hypothesis) at import.
    (tmp_path / "mod.py").write_text(_MOD)
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    p = subprocess.run([sys.executable, "-m", "opsdk", "verify", "bad_run_nodb", "--module",
                        "mod", "--target", "x86", "--dtypes", "float32", "--no-db", "--brief"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "FAIL" in p.stdout, p.stdout + p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mod.py"]
