"""Model kernels without compiling: kind classification, the kernel families, the fallback
rule's reach, and the channels-last rewrite."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax, te, topi

import opsdk
from opsdk.kernels import KERNEL_OPS
from opsdk.schedules import Kernel, classify, load_builtin_rules, rules_for


def _matmul(m=8, k=4, n=6, transpose=False):
    a = te.placeholder((m, k), name="a")
    b = te.placeholder((n, k) if transpose else (k, n), name="b")
    r = te.reduce_axis((0, k), name="r")
    if transpose:
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[j, r], axis=r), name="c")
    else:
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="c")
    d = te.compute((m, n), lambda i, j: te.max(c[i, j], 0.0), name="relu")
    return te.create_prim_func([a, b, d])


def test_classify_the_kernel_kinds():
    x = te.placeholder((1, 4, 8, 8), name="x")
    wd = te.placeholder((8, 4, 3, 3), name="w")
    wdw = te.placeholder((4, 1, 3, 3), name="wdw")
    conv = topi.nn.conv(x, wd, 1, 1, 1, 1, "NCHW", "OIHW")
    dw = topi.nn.conv(x, wdw, 2, 1, 1, 4, "NCHW", "OIHW")
    pool = topi.nn.pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), "max", False, "NCHW")
    mean = topi.sum(x, axis=[2, 3])
    tr = topi.transpose(x, (0, 2, 3, 1))
    assert classify(_matmul()) == "matmul"
    assert classify(_matmul(transpose=True)) == "matmul"
    assert classify(te.create_prim_func([x, wd, conv])) == "conv2d"
    assert classify(te.create_prim_func([x, wdw, dw])) == "conv2d"
    assert classify(te.create_prim_func([x, pool])) == "pool"
    assert classify(te.create_prim_func([x, mean])) == "reduction"
    assert classify(te.create_prim_func([x, tr])) == "elementwise"


def test_fallback_rules_take_model_kernels_not_ops():
    load_builtin_rules()
    fallbacks = {r.name for r in rules_for(Kernel("fused_split", "elementwise"))}
    assert {"x86.fallback", "neon.fallback"} <= fallbacks
    for d in opsdk.list_ops():
        assert not {r.name for r in rules_for(d)} & {"x86.fallback", "neon.fallback"}, d.name
    names = {r.name for r in rules_for(Kernel("k", "matmul"))}
    assert {"x86.matmul", "neon.matmul"} <= names


@pytest.mark.parametrize("d", KERNEL_OPS, ids=lambda d: d.name)
def test_kernel_families_are_defined_with_their_rules(d):
    load_builtin_rules()
    assert d.kind in ("matmul", "conv2d", "pool")
    names = {r.name for r in rules_for(d)}
    assert any(n.startswith("x86.") for n in names) and any(n.startswith("neon.") for n in names)
    # Not in the built-in op list: a model does not call them.
    assert d.name not in {o.name for o in opsdk.ops.BUILTIN_OPS}


def test_conv_family_reference_matches_a_direct_sum():
    from opsdk.kernels import tvm_conv2d

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 3, 5, 5))
    w = rng.normal(size=(2, 3, 3, 3))
    y = tvm_conv2d.reference(x, w, channels=2, kernel=3, stride=2, padding=1, activation="none")
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.einsum("chw,ochw->o", xp[0, :, 2:5, 0:3], w)  # output pixel (1, 0)
    np.testing.assert_allclose(y[0, :, 1, 0], want)
    nhwc = tvm_conv2d.reference(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0),
                                layout="NHWC", channels=2, kernel=3, stride=2, padding=1,
                                activation="none")
    np.testing.assert_allclose(nhwc.transpose(0, 3, 1, 2), y)


def test_channels_last_turns_relu6_convs_into_nhwc():
    x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    w = relax.const(np.ones((8, 8, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            y = bb.emit(relax.op.clip(y, 0.0, 6.0))
            y = bb.emit_output(relax.op.nn.conv2d(y, w, padding=1))
        bb.emit_func_output(y)
    mod = opsdk.transform.ChannelsLast()(bb.get())
    counts = opsdk.transform.op_counts(mod)
    assert "relax.clip" not in counts
    assert counts["relax.maximum"] == counts["relax.minimum"] == 1
    # one transpose in, one out, two weights (constants, folded at compile time)
    assert counts["relax.permute_dims"] == 4
    convs = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: convs.append(e) if isinstance(e, relax.Call)
        and getattr(e.op, "name", "") == "relax.nn.conv2d" else None)
    assert [str(c.attrs.data_layout) for c in convs] == ["NHWC", "NHWC"]


@pytest.mark.parametrize(
    "m,n,want",
    [
        (128, 768, (16, 3, 8)),  # 8 x 48: 24 accumulators, no partial tile (4 x 64 uses 16)
        (128, 1024, (16, 4, 4)),  # no 24-register tiling divides both: the widest 16
        (49, 96, (16, 3, 7)),
        (None, 768, (16, 4, 6)),  # symbolic M: the widest tile, rows to fill the registers
    ],
)
def test_gemm_tiles_fill_the_registers_without_a_partial_row_tile(m, n, want):
    from opsdk.schedules._gemm import tile_mn

    lanes, nv, mr = tile_mn(m, n, 16, 4, 8, 24)
    assert (lanes, nv, mr) == want
    assert mr * nv <= 24 and n % (lanes * nv) == 0
    assert m is None or m % mr == 0
