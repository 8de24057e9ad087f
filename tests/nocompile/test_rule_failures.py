"""A schedule rule that raises is not silent: the driver warns, records the failure on the
decision and on the kernel (``opsdk.rule_failures``), and the next rule takes the function."""

from __future__ import annotations

import pytest
from tvm import te

import opsdk
from opsdk import schedules


def test_a_raising_rule_is_recorded_on_the_kernel_and_the_next_rule_takes_it():
    d = opsdk.get_op("gelu")
    x = te.placeholder((4, 64), "float32", name="x")
    func = te.create_prim_func([x, d.call_compute([x], d.default_attrs())])
    target = opsdk.target("x86")
    clean = schedules.apply_schedule(d, func, target)
    assert schedules.rule_failures(clean) == []

    @schedules.rule("gelu", "cpu", name="test.raises", priority=10_000)
    def _raises(func, target):
        return 1 // 0

    try:
        with pytest.warns(UserWarning, match="schedule rule test.raises failed on gelu"):
            out = schedules.apply_schedule(d, func, target)
    finally:
        schedules._RULES[:] = [r for r in schedules._RULES if r.name != "test.raises"]
    failure = "test.raises: ZeroDivisionError: integer division or modulo by zero"
    assert schedules.rule_failures(out) == [failure]
    assert schedules.last_choices()[-1].failures == [failure]
    # the rule that took it is the one that takes it without the broken rule
    assert str(out.attrs["opsdk.rule"]) == str(clean.attrs["opsdk.rule"]) != "generic"


def test_reused_decisions_give_back_the_same_schedule_until_a_rule_changes():
    """Inside ``reused_decisions`` (``opsdk build --watch``) a function scheduled before is
    not scheduled again; a rule defined anew (another function) is asked again, and outside
    the block every call runs the rules."""
    import tvm

    d = opsdk.get_op("gelu")
    x = te.placeholder((4, 64), "float32", name="x")
    func = te.create_prim_func([x, d.call_compute([x], d.default_attrs())])
    target = opsdk.target("x86")
    calls = []

    def define(tag):
        @schedules.rule("gelu", "cpu", name="test.counted", priority=10_000)
        def _counted(func, target):
            calls.append(tag)
            return None  # declines: the built-in rule takes it

    define("a")
    try:
        with schedules.reused_decisions():
            first = schedules.choose(d, func, target)
            again = schedules.choose(d, func, target)
            assert calls == ["a"] and again.rule == first.rule != "generic"
            tvm.ir.assert_structural_equal(again.func, first.func)
            # another name for the same code (a kernel's number in the next build)
            renamed = schedules.apply_schedule(d, func.with_attr("global_symbol", "k7"), target)
            assert calls == ["a"] and str(renamed.attrs["global_symbol"]) == "k7"
            define("b")  # the same name, another function: asked again
            schedules.choose(d, func, target)
            assert calls == ["a", "b"]
        schedules.choose(d, func, target)
        schedules.choose(d, func, target)
        assert calls == ["a", "b", "b", "b"]
    finally:
        schedules._RULES[:] = [r for r in schedules._RULES if r.name != "test.counted"]
