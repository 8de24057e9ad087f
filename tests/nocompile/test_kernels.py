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
    from opsdk.kernels.winograd import winograd_conv2d

    xh, wh = te.placeholder((1, 8, 8, 16), name="xh"), te.placeholder((3, 3, 16, 16), name="wh")
    y = winograd_conv2d(xh, wh, 1)
    relu = te.compute(y.shape, lambda *i: te.max(y(*i), 0.0), name="relu")
    assert classify(te.create_prim_func([xh, wh, relu])) == "winograd"


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
    assert d.kind in ("matmul", "conv2d", "winograd", "pool", "reduction")
    names = {r.name for r in rules_for(d)}
    assert any(n.startswith("x86.") for n in names) and any(n.startswith("neon.") for n in names)
    # Not in the built-in op list: a model does not call them.
    assert d.name not in {o.name for o in opsdk.ops.BUILTIN_OPS}


def test_winograd_transforms_compute_the_convolution():
    # The four stages in float64 numpy (the transforms the TE writes, U = G g G^T, V = B^T d B,
    # Y = A^T (U . V) A) against the direct reference, odd sizes and asymmetric padding.
    from opsdk.kernels import winograd as W

    rng = np.random.default_rng(1)
    x, w = rng.normal(size=(2, 7, 5, 3)), rng.normal(size=(3, 3, 3, 4))
    bt, g, at = (np.array(m, dtype=np.float64) for m in (W.BT, W.G, W.AT))
    for pads in [(1, 1, 1, 1), (0, 0, 0, 0), (2, 1, 0, 2)]:
        top, left, bottom, right = pads
        oh, ow = 7 + top + bottom - 2, 5 + left + right - 2
        th, tw = -(-oh // 2), -(-ow // 2)
        xp = np.pad(x, ((0, 0), (top, th * 2 + 2 - 7 - top), (left, tw * 2 + 2 - 5 - left),
                        (0, 0)))
        u = np.einsum("ai,ijck,bj->abck", g, w, g)
        y = np.zeros((2, th * 2, tw * 2, 4))
        for ty in range(th):
            for tx in range(tw):
                d = xp[:, ty * 2:ty * 2 + 4, tx * 2:tx * 2 + 4, :]
                v = np.einsum("ai,nijc,bj->nabc", bt, d, bt)
                m = np.einsum("nabc,abck->nabk", v, u)
                y[:, ty * 2:ty * 2 + 2, tx * 2:tx * 2 + 2] = np.einsum("ra,nabk,sb->nrsk", at,
                                                                       m, at)
        want = np.moveaxis(W._conv_np(np.moveaxis(xp[:, :oh + 2, :ow + 2], -1, 1),
                                      np.transpose(w, (3, 2, 0, 1)), 1, 0, 1), 1, -1)
        np.testing.assert_allclose(y[:, :oh, :ow], want, rtol=1e-12, atol=1e-12)
        assert W.winograd_abs(x, w, pads).shape == want.shape


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
