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
    # one transpose in, one out, one of the weight both convs share (a constant, folded at
    # compile time; ChannelsLast's common-subexpression pass merges its two copies)
    assert counts["relax.permute_dims"] == 3
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


@pytest.mark.parametrize(
    "m,n,min_vecs,want",
    [
        (64, 50257, 1, (16, 3, 8)),  # a vocabulary: 24 accumulators for 48 more columns
        (197, 197, 1, (16, 1, 8)),  # 208 columns; 224 or 256 would waste 8-30 %
        (1, 1000, 3, (16, 3, 1)),  # a classifier GEMV: 1008, not 1024
    ],
)
def test_padded_gemm_tiles_trade_little_padding_for_accumulators(m, n, min_vecs, want):
    from opsdk.schedules._gemm import _PAD_SLACK, _padded_tile

    lanes, nv, mr = _padded_tile(m, n, 16, 4, 8, 24, min_vecs=min_vecs)
    assert (lanes, nv, mr) == want
    least = min(-(-n // (16 * v)) * 16 * v for v in range(min_vecs, 5))
    assert -(-n // (lanes * nv)) * lanes * nv - least <= _PAD_SLACK * n


# ------------------------------------------------------------------ the new attributes
def _direct_conv(x, w, stride, pads, dilation, groups):
    """NCHW x OIHW, one output at a time (the definition, no vectorized slicing)."""
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    top, left, bottom, right = pads
    oh = (h + top + bottom - dilation * (kh - 1) - 1) // stride + 1
    ow = (wd + left + right - dilation * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for oc in range(o):
        g = oc // og
        for i in range(oh):
            for j in range(ow):
                for ci in range(cg):
                    for a in range(kh):
                        for b in range(kw):
                            r = i * stride + a * dilation - top
                            s = j * stride + b * dilation - left
                            if 0 <= r < h and 0 <= s < wd:
                                out[:, oc, i, j] += x[:, g * cg + ci, r, s] * w[oc, ci, a, b]
    return out


@pytest.mark.parametrize("layout,groups,mult,dil,pads,stride", [
    ("NCHW", 2, 1, 2, (1, 0, 2, 1), 2),
    ("NHWC", 4, 1, 1, (0, 2, 1, 0), 1),
    ("NCHW_dw", 1, 3, 2, (1, 1, 0, 2), 2),
    ("NHWC_dw", 1, 2, 1, (2, 0, 0, 1), 3),
])
def test_conv_reference_handles_dilation_groups_multiplier_and_uneven_padding(
        layout, groups, mult, dil, pads, stride):
    from opsdk.kernels import tvm_conv2d

    rng = np.random.default_rng(3)
    c, o = 8, 12
    dw = layout.endswith("dw")
    x = rng.normal(size=(2, c, 9, 7))
    w = rng.normal(size=(c * mult if dw else o, 1 if dw else c // groups, 3, 3))
    want = _direct_conv(x, w, stride, pads, dil, c if dw else groups)
    nchw = layout.startswith("NCHW")
    attrs = dict(layout=layout, channels=o, kernel=3, stride=stride, padding=pads[0],
                 pad_left=pads[1], pad_bottom=pads[2], pad_right=pads[3], dilation=dil,
                 groups=groups, multiplier=mult, activation="none")
    y = tvm_conv2d.reference(x if nchw else x.transpose(0, 2, 3, 1),
                             w if nchw else w.transpose(2, 3, 1, 0), **attrs)
    np.testing.assert_allclose(y if nchw else y.transpose(0, 3, 1, 2), want, rtol=1e-12,
                               atol=1e-12)
    # the shapes the family declares are the ones the reference takes and gives
    shape = x.shape if nchw else x.transpose(0, 2, 3, 1).shape
    shapes = tvm_conv2d.example_shapes(shape, attrs)
    assert tuple(shapes["w"]) == (w.shape if nchw else w.transpose(2, 3, 1, 0).shape)
    assert tuple(shapes["residual"]) == y.shape


def test_winograd_reference_takes_four_value_padding():
    from opsdk.kernels import tvm_conv2d_winograd as W

    rng = np.random.default_rng(4)
    x, w = rng.normal(size=(1, 7, 6, 3)), rng.normal(size=(3, 3, 3, 5))
    y = W.reference(x, w, channels=5, padding=0, pad_left=2, pad_bottom=1, pad_right=-1,
                    activation="none")
    want = _direct_conv(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), 1, (0, 2, 1, 0),
                        1, 1)
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), want, rtol=1e-12, atol=1e-12)


def _direct_pool(x, pool, k, s, p, ceil_mode, include_pad):
    """torch's pooling rules, one output at a time."""
    n, c, h, w = x.shape

    def out_len(m):
        span = m + 2 * p - k
        o = (-(-span // s) if ceil_mode else span // s) + 1
        return o - 1 if ceil_mode and (o - 1) * s >= m + p else o

    oh, ow = out_len(h), out_len(w)
    y = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            r0, c0 = i * s - p, j * s - p
            rows = [r for r in range(r0, r0 + k) if 0 <= r < h]
            cols = [q for q in range(c0, c0 + k) if 0 <= q < w]
            win = x[:, :, rows][:, :, :, cols].reshape(n, c, -1)
            if pool == "max":
                y[:, :, i, j] = win.max(axis=-1)
            else:
                cnt = ((min(r0 + k, h + p) - r0) * (min(c0 + k, w + p) - c0)
                       if include_pad else len(rows) * len(cols))
                y[:, :, i, j] = win.sum(axis=-1) / cnt
    return y


@pytest.mark.parametrize("h,w,k,s,p", [(7, 8, 3, 2, 1), (5, 6, 2, 2, 1), (9, 9, 7, 3, 3),
                                       (6, 7, 3, 3, 0), (1, 4, 3, 2, 1)])
def test_pool_reference_ceil_mode_and_count_include_pad(h, w, k, s, p):
    from opsdk.kernels import tvm_pool2d

    x = np.random.default_rng(5).normal(size=(2, 3, h, w))
    for pool in ("max", "avg"):
        for ceil_mode in (False, True):
            for inc in ((False, True) if pool == "avg" else (False,)):
                want = _direct_pool(x, pool, k, s, p, ceil_mode, inc)
                got = tvm_pool2d.reference(x, pool=pool, kernel=k, stride=s, padding=p,
                                           ceil_mode=ceil_mode, count_include_pad=inc)
                np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
                nhwc = tvm_pool2d.reference(x.transpose(0, 2, 3, 1), layout="NHWC", pool=pool,
                                            kernel=k, stride=s, padding=p,
                                            ceil_mode=ceil_mode, count_include_pad=inc)
                np.testing.assert_allclose(nhwc.transpose(0, 3, 1, 2), want, rtol=1e-13)


def test_new_attribute_references_agree_with_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    from opsdk.kernels import tvm_conv2d, tvm_pool2d

    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 8, 9, 10))
    w = rng.normal(size=(16, 1, 3, 3))  # depthwise, multiplier 2
    want = F.conv2d(F.pad(torch.from_numpy(x), (2, 1, 0, 1)), torch.from_numpy(w), stride=2,
                    dilation=2, groups=8).numpy()
    got = tvm_conv2d.reference(x, w, layout="NCHW_dw", kernel=3, stride=2, padding=0,
                               pad_left=2, pad_bottom=1, pad_right=1, dilation=2, multiplier=2,
                               activation="none")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for ceil_mode, inc in ((True, True), (True, False), (False, True)):
        want = F.avg_pool2d(torch.from_numpy(x), 3, 2, 1, ceil_mode=ceil_mode,
                            count_include_pad=inc).numpy()
        got = tvm_pool2d.reference(x, pool="avg", kernel=3, stride=2, padding=1,
                                   ceil_mode=ceil_mode, count_include_pad=inc)
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_new_attributes_are_refused_where_they_cannot_hold():
    from opsdk.kernels import tvm_conv2d, tvm_pool2d
    from opsdk.verify._strategies import is_valid, layout_attrs

    base = layout_attrs(tvm_conv2d, "NCHW")
    assert is_valid(tvm_conv2d, (1, 8, 9, 9), "float32", {**base, "groups": 4,
                                                           "channels": 12}, ())
    # groups must divide the input and the output channels
    assert not is_valid(tvm_conv2d, (1, 6, 9, 9), "float32", {**base, "groups": 4}, ())
    assert not is_valid(tvm_conv2d, (1, 8, 9, 9), "float32", {**base, "groups": 4,
                                                              "channels": 6}, ())
    # a dilated window larger than the padded input
    assert not is_valid(tvm_conv2d, (1, 8, 4, 4), "float32", {**base, "dilation": 3,
                                                              "padding": 0}, ())
    assert not is_valid(tvm_conv2d, (1, 8, 9, 9), "float32", {**base, "pad_right": -2}, ())
    # a drawn channel count is rounded up to the groups
    from opsdk.verify._strategies import round_dims

    assert round_dims(tvm_conv2d, [2, 7, 5, 5], {**base, "groups": 4}) == [2, 8, 5, 5]
    assert round_dims(tvm_conv2d, [2, 5, 5, 7], {**layout_attrs(tvm_conv2d, "NHWC"),
                                                 "groups": 2}) == [2, 5, 5, 8]
    # a ceil-mode window never starts past the input and its leading padding
    pool = layout_attrs(tvm_pool2d, "NCHW_avg")
    y = tvm_pool2d.reference(np.ones((1, 1, 5, 5)), **{**pool, "kernel": 2, "stride": 2,
                                                         "padding": 1, "ceil_mode": True})
    assert y.shape == (1, 1, 3, 3)


# ------------------------------------------------------------------ kernel corners
def test_pairwise_covers_every_allowed_pair_and_only_allowed_rows():
    import itertools

    from opsdk.verify._kcorners import pairwise

    factors = {"a": [0, 1, 2, 3], "b": [0, 1, 2], "c": [0, 1], "d": [0, 1, 2], "e": [5, 6]}

    def ok(r):  # a = 3 never with b = 0 (like a padding wider than half a pool window)
        return not (r.get("a") == 3 and r.get("b") == 0)

    rows = pairwise(factors, ok, balance="a")
    assert all(ok(r) and set(r) == set(factors) for r in rows)
    for (f, fv), (g, gv) in itertools.combinations(factors.items(), 2):
        for x in fv:
            for y in gv:
                hit = any(r[f] == x and r[g] == y for r in rows)
                assert hit == ok({f: x, g: y}), (f, x, g, y)
    # far fewer rows than every combination (4 * 3 * 2 * 3 * 2 = 144), as balanced as the
    # pairs allow
    assert len(rows) <= 16
    counts = [sum(r["a"] == v for r in rows) for v in factors["a"]]
    assert max(counts) - min(counts) <= 2, counts


def _pairs_covered(cases, factors):
    import itertools

    missing = []
    for (f, fv), (g, gv) in itertools.combinations(factors.items(), 2):
        for x in fv:
            for y in gv:
                if not any(c.attrs.get(f, c.layout) == x and c.attrs.get(g, c.layout) == y
                           if f != "layout" else c.layout == x and c.attrs[g] == y
                           for c in cases):
                    missing.append((f, x, g, y))
    return missing


@pytest.mark.parametrize("lanes", [16, 4])
def test_kernel_corners_cover_every_pair_of_attribute_values(lanes):
    from opsdk.kernels import tvm_conv2d, tvm_conv2d_winograd, tvm_pool2d
    from opsdk.verify._kcorners import kernel_rows

    pads = {"padding": [0, 1, 2, 3], "pad_left": [-1, 0, 2], "pad_bottom": [-1, 0, 2],
            "pad_right": [-1, 0, 1]}
    conv = kernel_rows(tvm_conv2d, "x86", lanes)
    dense = [c for c in conv if not c.layout.endswith("dw")]
    dw = [c for c in conv if c.layout.endswith("dw")]
    assert not _pairs_covered(dense, {"layout": ["NCHW", "NHWC"], "kernel": [1, 3, 5, 7],
                                      "stride": [1, 2, 3], **pads, "dilation": [1, 2],
                                      "groups": [1, 2, 4]})
    assert not _pairs_covered(dw, {"layout": ["NCHW_dw", "NHWC_dw"], "kernel": [1, 3, 5, 7],
                                   "stride": [1, 2, 3], **pads, "dilation": [1, 2],
                                   "multiplier": [1, 2, 3]})
    wino = kernel_rows(tvm_conv2d_winograd, "x86", lanes)
    assert not _pairs_covered(wino, {"padding": [0, 1, 2], "pad_left": [-1, 0, 2],
                                     "pad_bottom": [-1, 0, 2], "pad_right": [-1, 0, 1]})
    pool = kernel_rows(tvm_pool2d, "x86", lanes)
    missing = _pairs_covered(pool, {"layout": list(tvm_pool2d.layouts), "kernel": [2, 3, 7],
                                    "stride": [1, 2, 3], "padding": [0, 1, 3],
                                    "ceil_mode": [False, True]})
    # only the pairs a pool refuses: a padding wider than half its window
    assert set(missing) == {("kernel", 2, "padding", 3), ("kernel", 3, "padding", 3)}, missing
    avg = [c for c in pool if c.attrs["pool"] == "avg"]
    assert not _pairs_covered(avg, {"count_include_pad": [False, True],
                                    "ceil_mode": [False, True], "kernel": [2, 3, 7],
                                    "stride": [1, 2, 3]})
    # the combinations random draws almost never make: a 1x1 window with stride 2, a dilated
    # window with uneven padding, a grouped conv with stride 3
    assert any(c.attrs["kernel"] == 1 and c.attrs["stride"] == 2 for c in dense)
    assert any(c.attrs["dilation"] == 2 and c.attrs["pad_bottom"] != c.attrs["padding"]
               for c in dense)
    assert any(c.attrs["groups"] == 4 and c.attrs["stride"] == 3 for c in dense)


def _out_channels(c):
    return c.attrs["channels"] if not c.layout.endswith("dw") else (
        c.shape[1 if c.layout.startswith("NCHW") else 3] * c.attrs["multiplier"])


@pytest.mark.parametrize("lanes", [16, 4])
def test_kernel_corners_hit_the_tile_edges(lanes):
    from opsdk.kernels import tvm_conv2d, tvm_conv2d_winograd, tvm_matmul
    from opsdk.verify._kcorners import kernel_rows, tile_edges

    mm = kernel_rows(tvm_matmul, "x86", lanes)
    ns = {c.attrs["n"] for c in mm}
    # one below / at / above every tile width the rule builds (1 to 4 vectors), and heads
    # no tile divides (the padded last tile)
    assert set(tile_edges([lanes, 2 * lanes, 3 * lanes, 4 * lanes])) <= ns
    assert {1000, 1001} <= ns and any(n > 4 * lanes and n % lanes for n in ns)
    # M around the 8-row tile on static builds (M is symbolic otherwise)
    assert {7, 8, 9} <= {c.shape[-2] for c in mm}
    conv = kernel_rows(tvm_conv2d, "x86", lanes)
    dense = [c for c in conv if not c.layout.endswith("dw")]
    outs = {c.attrs["channels"] for c in dense}
    assert set(tile_edges([lanes, 2 * lanes, 3 * lanes, 4 * lanes, 12 * lanes])) <= outs
    assert any(o > 64 for o in outs)  # the wide tile paths
    cins = {c.shape[1 if c.layout.startswith("NCHW") else 3] for c in conv}
    assert {lanes - 1, lanes + 1, 3} <= cins  # no vector width divides; a stem
    widths = {c.shape[3 if c.layout.startswith("NCHW") else 2] for c in conv}
    heights = {c.shape[2 if c.layout.startswith("NCHW") else 1] for c in conv}
    assert 1 in widths and 1 in heights  # 1x1 spatial
    assert any(w > 32 and w % 2 for w in widths) and any(h > 32 for h in heights)
    assert any(_out_channels(c) > c.shape[1 if c.layout.startswith("NCHW") else 3]
               for c in conv if c.layout.endswith("dw"))  # depthwise multipliers
    wino = kernel_rows(tvm_conv2d_winograd, "x86", lanes)
    ows = set()
    for c in wino:
        left, right = (c.attrs["padding"] if c.attrs[k] < 0 else c.attrs[k]
                       for k in ("pad_left", "pad_right"))
        ows.add(c.shape[2] + left + right - 2)
    tiles = {-(-ow // 2) for ow in ows}
    assert {7, 8, 9} <= tiles  # 2x2 tiles per row around the 8-row register tile
    assert any(ow % 2 for ow in ows) and any(ow % 2 == 0 for ow in ows) and 1 in ows


def test_kernel_corners_run_every_epilogue_both_weight_paths_and_batches():
    from opsdk.kernels import KERNEL_OPS
    from opsdk.kernels._epilogue import ACTIVATIONS
    from opsdk.verify._kcorners import kernel_corners, kernel_rows

    for d in KERNEL_OPS:
        rows = kernel_rows(d, "x86", 16)
        assert rows, d.name
        # every cell gets some, together at most a bounded number of compiles
        for layout in d.layouts:
            assert kernel_corners(d, "x86", "float32", layout, 16), (d.name, layout)
        assert len(rows) <= 48, (d.name, len(rows))
        assert len({c.to_json() for c in rows}) == len(rows)
        assert any(c.shape[0] > 1 and not c.static for c in rows)  # a symbolic batch of 2+
        assert any(c.static for c in rows)
        if not d.weights:
            continue
        assert {c.attrs["activation"] for c in rows} == set(ACTIVATIONS), d.name
        # chains: bias and residual, then a non-trivial activation
        assert any(set(c.present) == {"bias", "residual"} and c.attrs["activation"] != "none"
                   for c in rows)
        assert {c.present for c in rows} >= {(), ("bias",), ("residual",)}
        assert any(c.packed for c in rows) and any(not c.packed for c in rows)
    assert sum(len(kernel_rows(d, "x86", 16)) for d in KERNEL_OPS) <= 110


# ------------------------------------------------------------------ rule fixes the corners found
def _vector_extents(sch):
    """The extents of the scheduled function's vectorized loops."""
    from tvm import tirx
    from tvm_ffi.structural import structural_mutate

    out = []

    def visit(node, mut):
        if node.kind == tirx.ForKind.VECTORIZED:
            out.append(int(node.extent))
        return mut.default_mutate(node)

    structural_mutate(sch.mod["main"], [(tirx.For, visit)])
    return out


def test_winograd_rule_schedules_runtime_weights_with_padded_output_channels():
    # 65 output channels (4 x 16 + 1): the padded weight transform runs over the packed
    # layout's four loops, which the runtime-weights path unpacked as three (the rule raised
    # and the generic lowering ran instead).
    from opsdk.kernels.winograd import winograd_conv2d
    from opsdk.schedules._winograd import schedule_winograd

    x, w = te.placeholder((1, 8, 8, 3), name="x"), te.placeholder((3, 3, 3, 65), name="w")
    sch = schedule_winograd(te.create_prim_func([x, w, winograd_conv2d(x, w, [1, 2, 1, 0])]),
                            opsdk.target("x86"), acc_regs=24)
    assert sch is not None and max(_vector_extents(sch)) == 16


def test_depthwise_multiplier_tiles_by_full_vectors():
    # 31 channels x 3: one 93-lane vector of every output channel (a gather of o // 3) took
    # LLVM 43 s; full 16-lane vectors, the last tile partial. Without a multiplier too: the
    # last tile overlaps the one before it (one odd 31-lane vector kept its accumulator tile
    # on the stack, 2-5 % of the roof).
    from opsdk.schedules._conv import schedule_conv2d

    for mult, widest in ((3, 16), (1, 16)):
        x = te.placeholder((1, 9, 9, 31), name="x")
        w = te.placeholder((3, 3, 1, 31 * mult), name="w")
        y = topi.nn.conv(x, w, 1, 1, 1, 31, "NHWC", "HWIO")
        sch = schedule_conv2d(te.create_prim_func([x, w, y]), opsdk.target("x86"), acc_regs=24)
        assert sch is not None and max(_vector_extents(sch)) == widest, mult


@pytest.mark.parametrize("width,lanes", [(66, 33), (150, 50), (64, 16)])
def test_depthwise_nchw_rows_avoid_a_predicated_partial_pixel_tile(width, lanes):
    # 65 = 4 x 16 + 1 pixels were predicated lane by lane (18 s of LLVM); one odd vector that
    # divides the row instead where there is one (66 = 2 x 33), whole 16-lane tiles as before.
    from opsdk.schedules._conv import schedule_conv2d

    x = te.placeholder((1, 8, 5, width), name="x")
    w = te.placeholder((8, 1, 3, 3), name="w")
    y = topi.nn.conv(x, w, 1, 1, 1, 8, "NCHW", "OIHW")
    sch = schedule_conv2d(te.create_prim_func([x, w, y]), opsdk.target("x86"), acc_regs=24)
    assert sch is not None and lanes in _vector_extents(sch)


def _scatter_func():
    # TOPI's index_put: te.extern IR, loops written without blocks
    data = te.placeholder((6,), name="data")
    idx = te.placeholder((3,), name="idx", dtype="int64")
    val = te.placeholder((3,), name="val")
    out = topi.index_put(data, [idx], val)
    return te.create_prim_func([data, idx, val, out]).with_attr("layout_free_buffers", [1])


def test_extern_kernels_run_as_written_under_a_root_block():
    # An index_put / scatter kernel has no root block: x86.fallback raised on it, and
    # SplitLayoutRewritePreproc stopped the build ("There should be a compute block ...").
    from tvm import s_tir

    from opsdk.schedules._fallback import schedule_extern, schedule_fallback
    from opsdk.targets import target as resolve_target

    load_builtin_rules()
    names = {r.name for r in rules_for(Kernel("index_put", "opaque"))}
    assert {"x86.extern", "neon.extern"} <= names
    func, tgt = _scatter_func(), resolve_target("x86")
    assert classify(func) == "opaque"
    assert schedule_fallback(func, tgt) is None  # declines instead of raising
    sch = schedule_extern(func, tgt)
    out = sch.mod["main"]
    assert "layout_free_buffers" not in (out.attrs or {})
    again = s_tir.Schedule(out)
    assert len(again.get_child_blocks(again.get_sblock("root"))) == 1
    a = te.placeholder((8,), name="a")
    plain = te.create_prim_func([a, te.compute((8,), lambda i: a[i] + 1, name="b")])
    assert schedule_extern(plain, tgt) is None


def test_elementwise_keeps_a_step_whose_math_two_consumers_read():
    # h1 = tanh(x), h2 = tanh(h1 * a + y), out = h1 + h2: inlining h1 ran its tanh in both
    # consumers; a 3-step recurrence stacked kept LLVM busy for minutes.
    from opsdk.schedules._elementwise import schedule_elementwise
    from opsdk.targets import target as resolve_target

    x, y = te.placeholder((4, 64), name="x"), te.placeholder((4, 64), name="y")
    h1 = te.compute(x.shape, lambda i, j: te.tanh(x[i, j]), name="h1")
    h2 = te.compute(x.shape, lambda i, j: te.tanh(h1[i, j] * 0.5 + y[i, j]), name="h2")
    out = te.compute(x.shape, lambda i, j: h1[i, j] + h2[i, j], name="out")
    sch = schedule_elementwise(te.create_prim_func([x, y, out]), resolve_target("x86"))
    kept = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    assert "h1" in kept and "h2" not in kept, kept  # h2 has one consumer: inlined
    cheap = te.compute(x.shape, lambda i, j: x[i, j] * 2.0, name="cheap")
    out2 = te.compute(x.shape, lambda i, j: cheap[i, j] + te.tanh(cheap[i, j] + y[i, j]),
                      name="out2")
    sch2 = schedule_elementwise(te.create_prim_func([x, y, out2]), resolve_target("x86"))
    assert [sch2.get(b).name_hint for b in sch2.get_child_blocks(sch2.get_sblock("root"))] \
        == ["out2"]  # a multiply costs less than a round trip through memory


def test_only_half_width_vectors_dividing_n_pads_to_full_width_tiles():
    # RegNetX's 152 channels: 19 x 8 lanes divide them, 16 do not. The tiles ran 8-lane
    # vectors, one a row (half the AVX-512 FMA width: a 1x1 conv at 14 x 14 at 99 GF/s where
    # 160 channels ran 221); N is padded to 160 in 16-lane vectors instead, in the matmul
    # rule and the conv rule alike. A classifier's GEMV (M = 1) keeps its 3-vector tiles.
    import tvm
    from tvm import tirx
    from tvm_ffi.structural import structural_walk

    from opsdk.schedules._conv import schedule_conv2d
    from opsdk.schedules._gemm import schedule_matmul

    avx512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                "mcpu": "skylake-avx512"})

    def vector_extents(mod) -> set[int]:
        loops: list = []
        structural_walk(mod["main"], [(tirx.For, lambda n: loops.append(n))])
        return {int(lp.extent.value) for lp in loops if lp.kind == tirx.ForKind.VECTORIZED}

    def matmul(m: int, n: int):
        a, b = te.placeholder((m, 64), name="a"), te.placeholder((64, n), name="b")
        k = te.reduce_axis((0, 64), name="k")
        c = te.compute((m, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
        return te.create_prim_func([a, b, c])

    for m, n in ((196, 152), (784, 56), (1, 1000)):
        with avx512:
            sch = schedule_matmul(matmul(m, n), avx512, acc_regs=24)
        assert 16 in vector_extents(sch.mod), (m, n, vector_extents(sch.mod))
    from opsdk.kernels import tvm_conv2d

    x = te.placeholder((1, 14, 14, 64), name="x")
    w = te.placeholder((1, 1, 64, 152), name="w")
    y = tvm_conv2d.compute(x, w, None, None, layout="NHWC", channels=152, kernel=1, stride=1,
                           padding=0)
    with avx512:
        sch = schedule_conv2d(te.create_prim_func([x, w, y]), avx512, acc_regs=24)
    # the tile's 16-lane vectors (an 8-lane one is only the copy of channels 144..151 out)
    assert 16 in vector_extents(sch.mod), vector_extents(sch.mod)
