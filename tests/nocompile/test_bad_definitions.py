"""Bad op and rule definitions, and hand-edited ``--case`` text: refused where they enter, one
line naming the op, rule or field and the fix, never a silent wrong answer or a traceback."""

from __future__ import annotations

import json

import pytest
from tvm import te

import opsdk
from opsdk import schedules
from opsdk._opdef import OpDefinitionError
from opsdk._scaffold import ScaffoldError, _check_name
from opsdk.cli import main


def _ref(x):
    return x * 2.0


def _define(name: str = "bad_def_demo", **kw):
    def compute(x: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * 2.0, name="y")

    return opsdk.op(reference=_ref, name=name, **kw)(compute)


@pytest.fixture
def forget_rules():
    before = {r.name for r in schedules._RULES}
    yield
    schedules._RULES[:] = [r for r in schedules._RULES if r.name in before]


def test_a_rule_without_the_target_parameter_is_refused_at_definition(forget_rules):
    d = _define("bad_def_sig")
    with pytest.raises(TypeError, match=r"schedule rule cpu\.r for bad_def_sig: _r\(func\) "
                                        r"cannot be called as \(func, target\)"):
        @d.rule("cpu")
        def _r(func):
            return None


def test_a_rule_for_an_op_no_one_defined_is_refused(forget_rules):
    _define("bad_def_known")
    with pytest.raises(ValueError, match=r"no op named 'bad_def_knwon' is defined \(did you "
                                         r"mean 'bad_def_known'\?\)"):
        @opsdk.rule("bad_def_knwon", "cpu")
        def _r(func, target):
            return None


def test_a_rule_for_a_defined_but_unregistered_op_is_accepted(forget_rules):
    _define("bad_def_unregistered")

    @opsdk.rule("bad_def_unregistered", "cpu", name="test.bad_def_ok")
    def _r(func, target):
        return None

    assert any(r.name == "test.bad_def_ok" for r in schedules._RULES)


def test_a_rule_returning_a_non_schedule_is_recorded_as_a_failure(forget_rules):
    d = opsdk.get_op("gelu")
    x = te.placeholder((4, 8), "float32", name="x")
    func = te.create_prim_func([x, d.call_compute([x], d.default_attrs())])

    @schedules.rule("gelu", "cpu", name="test.bad_def_42", priority=10_000)
    def _bad(func, target):
        return 42

    with pytest.warns(UserWarning, match="returned a int"):
        out = schedules.apply_schedule(d, func, opsdk.target("x86"))
    assert schedules.rule_failures(out) == [
        "test.bad_def_42: TypeError: returned int 42, not an s_tir.Schedule or None"]


@pytest.mark.parametrize("name", ["m\u00fdop", "swi\u0301sh"])
def test_a_non_ascii_op_name_is_refused_at_definition(name):
    with pytest.raises(OpDefinitionError, match="ASCII letters, digits and _"):
        _define(name)


def test_new_op_says_ascii_for_a_non_ascii_identifier():
    with pytest.raises(ScaffoldError, match="must be ASCII letters, digits and _ only"):
        _check_name("sw\u00edsh")


def test_the_op_decorator_on_a_non_function_says_so():
    with pytest.raises(OpDefinitionError, match=r"@opsdk\.op decorates a function; got int 42"):
        opsdk.op(reference=_ref)(42)


def test_a_check_that_raises_is_blamed_not_the_compute():
    def check(shapes, dtypes, attrs):
        return 1 / 0

    with pytest.raises(OpDefinitionError,
                       match="op bad_def_check: check= raised ZeroDivisionError: division by "
                             "zero; check\\(shapes, dtypes, attrs\\) raises ValueError"):
        _define("bad_def_check", check=check)


_GELU = {"op": "gelu", "dtype": "float32", "layout": "erf", "shape": [3, 5], "seed": 0}


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ({"data": {"zz": "domain"}}, "data 'zz' is not an input of the op (x)"),
        ({"shape": [1] * 7}, "shape [1, 1, 1, 1, 1, 1, 1] has rank 7; the op takes rank 1..6"),
        ({"shape": [100000, 100000]}, "shape [100000, 100000] needs 74.5 GiB per float64 input"),
    ],
)
def test_verify_case_fields_the_op_cannot_take_are_refused(capsys, case, needle):
    assert main(["verify", "--target", "x86", "--case", json.dumps({**_GELU, **case})]) == 2
    assert needle in capsys.readouterr().err


def test_verify_case_target_conflicting_with_target_is_refused(capsys):
    case = json.dumps({**_GELU, "target": "arm"})
    assert main(["verify", "--target", "x86", "--case", case]) == 2
    assert ("the case is for target 'arm' but --target is 'x86'; drop --target"
            in capsys.readouterr().err)

