"""The model pipeline's front passes do the same work once: each distinct call legalized once,
a fusion rule run only where the ops it needs are present, a conv + BatchNorm fold that keeps
float64 rounding. Module facts only; no code generation."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

import opsdk
from opsdk._patterns import const_value
from opsdk.transform._fuse import _conv_bn_rule
from opsdk.transform._rewrite import _required_ops


def _model(convs: int = 3, scalars=(1.0, 2.0)):
    """NHWC 3x3 convs of one shape with different constant weights, then adds of scalar
    constants of different values (a legalization folds those into its kernel)."""
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 8, 8, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for _ in range(convs):
                w = relax.const(rng.standard_normal((3, 3, 16, 16)).astype("float32"))
                y = bb.emit(relax.op.nn.conv2d(y, w, padding=1, data_layout="NHWC",
                                               kernel_layout="HWIO"))
            for s in scalars:
                y = bb.emit(relax.op.add(y, relax.const(s, "float32")))
            y = bb.emit_output(y)
        bb.emit_func_output(y)
    return bb.get()


def _counting(op: str, calls: list[str]):
    fn = tvm.ir.Op.get(op).get_attr("FLegalize")

    def legalize(bb, call):
        calls.append(op)
        return fn(bb, call)

    return legalize


def test_each_distinct_call_is_legalized_once_and_the_module_is_legalize_ops_own():
    mod = _model()
    once_calls: list[str] = []
    plain_calls: list[str] = []
    custom = {o: _counting(o, once_calls) for o in ("relax.nn.conv2d", "relax.add")}
    once = opsdk.transform.LegalizeOpsOnce(custom)(mod)
    plain = relax.transform.LegalizeOps(customize_legalize_map={
        o: _counting(o, plain_calls) for o in ("relax.nn.conv2d", "relax.add")})(mod)
    assert tvm_ffi.structural_equal(once, plain)
    # Three convs of one shape built once; the adds fold their scalar, so each is built.
    assert plain_calls.count("relax.nn.conv2d") == 3
    assert once_calls.count("relax.nn.conv2d") == 1
    assert once_calls.count("relax.add") == plain_calls.count("relax.add") == 2
    kernels = [g.name_hint for g, f in once.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 3  # one conv, two adds (1.0 and 2.0 differ)


def test_calls_that_differ_in_attributes_get_their_own_kernels():
    x = relax.Var("x", relax.TensorType((1, 8, 8, 16), "float32"))
    w = relax.Var("w", relax.TensorType((3, 3, 16, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.conv2d(x, w, padding=1, data_layout="NHWC",
                                           kernel_layout="HWIO"))
            b = bb.emit(relax.op.nn.conv2d(x, w, padding=1, dilation=2, data_layout="NHWC",
                                           kernel_layout="HWIO"))
            y = bb.emit_output(relax.op.add(a, relax.op.nn.conv2d(
                x, w, padding=1, data_layout="NHWC", kernel_layout="HWIO")))
        bb.emit_func_output(relax.Tuple([y, b]))
    mod = bb.get()
    once = opsdk.transform.LegalizeOpsOnce()(mod)
    assert tvm_ffi.structural_equal(once, relax.transform.LegalizeOps()(mod))
    convs = [g for g, f in once.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv" in g.name_hint]
    assert len(convs) == 2  # dilation 1 (twice) and dilation 2


def test_a_rule_needs_the_ops_every_match_calls():
    # the fold takes a conv1d, conv2d or conv3d: only the BatchNorm is in every match
    assert _required_ops(_conv_bn_rule().pattern) == {"relax.nn.batch_norm"}
    either = is_op("relax.nn.relu")(is_op("relax.add")(wildcard(), wildcard())) | \
        is_op("relax.nn.relu")(is_op("relax.multiply")(wildcard(), wildcard()))
    assert _required_ops(either) == {"relax.nn.relu"}
    assert _required_ops(wildcard()) == frozenset()


_CONV = {1: relax.op.nn.conv1d, 2: relax.op.nn.conv2d, 3: relax.op.nn.conv3d}


def _conv_bn(dtype: str = "float32", rank: int = 2):
    rng = np.random.default_rng(1)
    x = relax.Var("x", relax.TensorType((1, 4) + (6,) * rank, dtype))
    w = rng.standard_normal((8, 4) + (3,) * rank).astype(dtype)
    stats = [rng.uniform(0.5, 2, 8), rng.standard_normal(8), rng.standard_normal(8),
             rng.uniform(0.1, 3, 8)]
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(_CONV[rank](x, relax.const(w), padding=1))
            bn = bb.emit(relax.op.nn.batch_norm(c, *(relax.const(s.astype(dtype))
                                                     for s in stats), axis=1, epsilon=1e-5,
                                                 training=False))
            y = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(y)
    return bb.get(), w, stats


@pytest.mark.parametrize(("dtype", "rank"), [("float32", 2), ("float16", 2), ("float32", 1),
                                             ("float32", 3)])
def test_conv_bn_fold_rounds_once_from_float64(dtype, rank):
    mod, w, (g, _b, _m, var) = _conv_bn(dtype, rank)
    fused = opsdk.transform.FuseIntoOps()(mod)
    convs = []
    relax.analysis.post_order_visit(fused["main"], lambda e: convs.append(e) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == f"relax.nn.conv{rank}d"
        else None)
    assert len(convs) == 1
    assert opsdk.transform.op_counts(fused, "relax.nn.batch_norm") == {}
    got = const_value(convs[0].args[1])
    g64, v64 = (np.asarray(a.astype(dtype), np.float64) for a in (g, var))
    scale = g64 / np.sqrt(v64 + 1e-5)
    want = (w.astype(np.float64) * scale.reshape((-1,) + (1,) * (rank + 1))).astype(dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)


def test_a_constant_is_looked_at_without_a_copy_and_cannot_be_written():
    c = relax.const(np.arange(6, dtype="float32"))
    v = const_value(c)
    assert v.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError):
        v[0] = 7.0
    assert c.value.numpy()[0] == 0.0
