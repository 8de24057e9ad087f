"""The machinery under the rewrite passes, against what TVM does: opsdk's Relax walk against
``post_order_visit``, opsdk's application of a rule's rewrites against TVM's
``rewrite_call`` (the same module, the same rewrite sites), and the rebuild memos of
``reused_decisions`` (legalizations and kernel kinds)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.relax.dpl import is_op, rewrite_call, wildcard

import opsdk
from opsdk import schedules
from opsdk._patterns import Rule
from opsdk._walk import calls_of, relax_exprs
from opsdk.transform import FuseIntoOps, rewrite_sites
from opsdk.transform import _rewrite as engine

R = relax.op


def _module(body, *shapes):
    """``main`` over fresh params of ``shapes``; ``body(bb, *params)`` emits in a dataflow
    block and returns the output."""
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _const(*shape, low=0.5):
    return relax.const(np.random.default_rng(len(shape)).uniform(low, 1.5, shape).astype("float32"))


def test_relax_exprs_is_post_order_visit_without_the_prim_parts():
    x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    c = relax.Var("c", relax.TensorType((), "bool"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, c]):
        t = bb.emit(relax.Tuple([x, R.reshape(x, (16,))]))
        y = bb.emit(relax.TupleGetItem(t, 0))
        branch = relax.If(c, relax.SeqExpr([], R.exp(y)), relax.SeqExpr([], R.add(y, _const(2, 8))))
        z = bb.emit(branch)
        bb.emit_func_output(z)
    func = bb.get()["main"]
    theirs: list = []
    relax.analysis.post_order_visit(func, theirs.append)
    ours = relax_exprs(func)

    def relax_only(e):  # IntImm and the other PrimExprs live in tvm.ir.prim
        return not isinstance(e, relax.ShapeExpr) and \
            not type(e).__module__.startswith("tvm.ir.prim")

    assert [e.__chandle__() for e in ours if relax_only(e)] == \
        [e.__chandle__() for e in theirs if relax_only(e)]
    # a shape argument is a Relax expression of its own (struct info's shapes are not)
    assert [str(e) for e in ours if isinstance(e, relax.ShapeExpr)] == ["R.shape([16])"]
    assert [str(e.op.name) for e in calls_of(func, "relax.exp", "relax.add")] == \
        ["relax.exp", "relax.add"]


def _with_tvm_rewriter(monkeypatch):
    """apply_rules as it was: TVM's rewrite_call applies each rule."""
    monkeypatch.setattr(engine, "_rewrite", lambda rule, cb, func, gv:
                        rewrite_call(rule.pattern, cb, func))


def _both(monkeypatch, mod, rules=None):
    ours = FuseIntoOps(rules)(mod)
    with monkeypatch.context() as m:
        _with_tvm_rewriter(m)
        theirs = FuseIntoOps(rules)(mod)
    return ours, theirs


def _sites(mod):
    return [(s.rule, s.var, s.op) for s in rewrite_sites(mod)]


def test_rewrites_are_tvm_s_for_chained_folds_and_an_output_alias(monkeypatch):
    """Three conv + BatchNorm folds in a row (each conv reads the binding the fold before
    rewrote, through a wildcard), the last one the function's output (``gv = lv``)."""

    def body(bb, x):
        for i in range(3):
            conv = bb.emit(R.nn.conv2d(x, _const(8, 8, 3, 3), padding=1))
            bn = bb.emit(R.nn.batch_norm(conv, _const(8), _const(8), _const(8), _const(8),
                                         axis=1, training=False))
            x = bb.emit(relax.TupleGetItem(bn, 0))
            if i < 2:
                x = bb.emit(R.nn.relu(x))
        return x

    mod = _module(body, (1, 8, 6, 6))
    ours, theirs = _both(monkeypatch, mod, ["conv_bn"])
    tvm.ir.assert_structural_equal(ours["main"], theirs["main"])
    assert _sites(ours) == _sites(theirs) and len(_sites(ours)) == 3
    assert opsdk.transform.op_counts(ours, "relax.nn.batch_norm") == {}


def test_a_rule_reusing_a_matched_value_reads_its_variable(monkeypatch):
    """A decomposed RMSNorm of a residual sum used again later: the rule builds from the
    matched sum (the bound value), which must not be computed a second time (TVM's rewriter
    eliminates the copy)."""

    def body(bb, a, b):
        s = bb.emit(R.add(a, b))
        ms = bb.emit(R.mean(R.multiply(s, s), axis=[-1], keepdims=True))
        inv = bb.emit(R.rsqrt(R.add(ms, relax.const(1e-6, "float32"))))
        y = bb.emit(R.multiply(R.multiply(s, inv), _const(16)))
        return R.add(y, s)

    mod = _module(body, (2, 16), (2, 16))
    ours, theirs = _both(monkeypatch, mod)
    tvm.ir.assert_structural_equal(ours["main"], theirs["main"])
    assert opsdk.transform.op_counts(ours) == {"opsdk.rms_norm": 1, "relax.add": 2}
    assert _sites(ours) == _sites(theirs)


def _exp_exp_rule(build=lambda m, x: R.sigmoid(m[x])):
    x = wildcard()
    pattern = is_op("relax.exp")(is_op("relax.exp")(x))
    return Rule("test.exp_exp", pattern, lambda orig, m: build(m, x))


def test_a_match_looking_into_a_rewritten_binding_waits_for_the_next_round(monkeypatch):
    """exp(exp(exp(exp(x)))): the match at the third exp looks into the second, rewritten
    in the same round; TVM skips it (a rewritten binding is not looked through), and so
    does opsdk: the fourth exp's match folds the third instead."""
    rule = _exp_exp_rule()

    def body(bb, x):
        for _ in range(4):
            x = bb.emit(R.exp(x))
        return x

    mod = _module(body, (4,))
    ours = engine.apply_rules(mod, [rule])
    with monkeypatch.context() as m:
        _with_tvm_rewriter(m)
        theirs = engine.apply_rules(mod, [rule])
    tvm.ir.assert_structural_equal(ours["main"], theirs["main"])
    assert opsdk.transform.op_counts(ours) == {"relax.sigmoid": 2}  # sigmoid(sigmoid(x))
    assert _sites(ours) == _sites(theirs)


def test_a_match_cast_bound_root_is_rewritten_as_tvm_does(monkeypatch):
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        e = bb.emit(R.exp(x))
        bb.emit_func_output(bb.match_cast(R.exp(e), relax.TensorType((4,), "float32")))
    mod, rule = bb.get(), _exp_exp_rule()
    ours = engine.apply_rules(mod, [rule])
    with monkeypatch.context() as m:
        _with_tvm_rewriter(m)
        theirs = engine.apply_rules(mod, [rule])
    tvm.ir.assert_structural_equal(ours["main"], theirs["main"])
    assert opsdk.transform.op_counts(ours) == {"relax.sigmoid": 1}


def test_a_rule_that_keeps_matching_its_own_result_is_refused():
    """exp(x) -> a new exp(x) matches again in every round: TVM's rewriter would loop for
    ever; opsdk names the rule."""
    x = wildcard()
    rule = Rule("test.exp_again", is_op("relax.exp")(x), lambda orig, m: R.exp(m[x]))
    with pytest.raises(ValueError, match=r"fusion rule test\.exp_again: its pattern still matches"):
        engine.apply_rules(_module(lambda bb, x: R.exp(x), (4,)), [rule])


def _exp_module(n):
    return _module(lambda bb, x: R.exp(x), (n, 8))


def test_legalizations_are_reused_between_builds_only_inside_reused_decisions():
    calls = []
    tvm_exp = tvm.ir.Op.get("relax.exp").get_attr("FLegalize")

    def counted(bb, call):
        calls.append(call)
        return tvm_exp(bb, call)

    legalize = opsdk.transform.LegalizeOpsOnce({"relax.exp": counted})
    fresh = legalize(_exp_module(3))
    assert len(calls) == 1
    with schedules.reused_decisions():
        legalize(_exp_module(3))
        again = legalize(_exp_module(3))  # a new module: the kernel of the build before
        assert len(calls) == 2
        tvm.ir.assert_structural_equal(again, fresh)
        legalize(_exp_module(5))  # another shape: legalized
        assert len(calls) == 3
    legalize(_exp_module(3))
    assert len(calls) == 4


def test_kernel_kinds_are_reused_inside_reused_decisions(monkeypatch):
    from opsdk.schedules import _kernels

    seen = []
    real = _kernels._classify
    monkeypatch.setattr(_kernels, "_classify", lambda f: seen.append(f) or real(f))
    a = te.placeholder((8, 4), name="a")
    func = te.create_prim_func([a, te.compute((8, 4), lambda i, j: a[i, j] * 2.0)])
    with schedules.reused_decisions():
        assert schedules.classify(func) == "elementwise"
        renamed = func.with_attr("global_symbol", "fused_7")
        assert schedules.classify(renamed) == "elementwise"
        assert len(seen) == 1
    schedules.classify(func)
    assert len(seen) == 2
