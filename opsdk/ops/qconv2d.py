"""``qconv2d``: int8 x int8 -> int32 2-D convolution with fused bias and requantize / dequantize.

``acc[n, o, y, x] = sum_{c, i, j} (xp[n, c, y*s + i, x*s + j] - x_zero_point) * w[o, c, i, j]
+ bias[o]`` in int32, where ``xp`` is the input padded by ``padding`` on each side with the
zero point (a padded value is a real zero: it adds nothing). The data layout is ``NCHW`` or
``NHWC``; the weight is ``OIHW`` in both (``(C, 1, KH, KW)`` for a depthwise conv, where
output channel ``c`` reads input channel ``c``). The epilogue is :mod:`~opsdk.ops.qdense`'s:
``int32`` (``acc``), ``float32`` (``acc * x_scale * w_scale[o]``) or ``int8`` (requantized to
``out_scale`` / ``out_zero_point``), every float step one float32 rounding the reference
repeats, so all outputs are compared bit-exactly.

The compute below is the definition (and the generic lowering). :func:`qconv2d_packed`
computes the same values in the shape int8 dot-product instructions want (see
:func:`~opsdk.ops.qdense.qdense_packed`): the input re-biased and padded once in a
channel-blocked layout ``(N, C/4, H', W', 4)`` (4 channels of one pixel are one 32-bit word),
the weights packed in 16-channel x 4-byte groups per window tap, the zero point folded into a
per-channel compensation. Schedule rules rebuild it from the attributes recorded on the output
block under :data:`ATTRS_KEY`.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._domains import log_uniform
from .._errmodel import error_model
from .._opdef import Tensor
from ._quant import QRANGE, QUANT_ATTR_DOMAIN, exact_model, rint_f32, round_to_te
from .qdense import BLOCK, KGROUP, packed_channel_terms, packed_epilogue

__all__ = [
    "ATTRS_KEY",
    "conv2d_nchw",
    "conv_geometry",
    "qconv2d",
    "qconv2d_depthwise_padded",
    "qconv2d_packed",
]

#: Annotation on the output block holding the op's attributes (see qdense's ``ATTRS_KEY``).
ATTRS_KEY = "opsdk.qconv2d"


def _nchw(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout == "NCHW" else x.transpose(0, 3, 1, 2)


def conv2d_nchw(x: np.ndarray, w: np.ndarray, *, stride: int = 1, padding: int = 0,
                depthwise: bool = False) -> np.ndarray:
    """A 2-D convolution in numpy (NCHW data, OIHW weights, zero padding), in the inputs'
    dtype: int64 for the qconv2d reference, float64 for a float layer.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.ops.qconv2d import conv2d_nchw
    >>> conv2d_nchw(np.ones((1, 2, 3, 3)), np.ones((1, 2, 3, 3)), padding=1)[0, 0, 1]
    array([12., 18., 12.])
    """
    s, p = stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    o, _, kh, kw = w.shape
    oh = (xp.shape[2] - kh) // s + 1
    ow = (xp.shape[3] - kw) // s + 1
    out = np.zeros((x.shape[0], o, oh, ow), np.result_type(x, w))
    for i in range(kh):
        for j in range(kw):
            win = xp[:, :, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s]
            if depthwise:
                out += win * w[:, 0, i, j][None, :, None, None]
            else:
                out += np.einsum("nchw,oc->nohw", win, w[:, :, i, j])
    return out


def _reference(
    x, w, w_scale, bias=None, *, layout="NCHW", stride=1, padding=0, depthwise=False,
    x_scale=1.0, x_zero_point=0, out_dtype="int8", out_scale=1.0, out_zero_point=0,
    per_channel=True,
):
    # Shifted by the zero point first, so the zero padding is the zero point's.
    xc = _nchw(x, layout).astype(np.int64) - x_zero_point
    acc = conv2d_nchw(xc, w.astype(np.int64), stride=stride, padding=padding,
                      depthwise=depthwise)
    if bias is not None:
        acc += bias.astype(np.int64)[None, :, None, None]
    acc = acc.astype(np.int32)  # int32 accumulation (no overflow for C*KH*KW < 2**16)
    if out_dtype == "int32":
        out = acc
    else:
        sc = (np.float32(x_scale) * w_scale.astype(np.float32))[None, :, None, None]
        if out_dtype == "float32":
            out = acc.astype(np.float32) * sc
        else:
            r = sc / np.float32(out_scale)
            q = rint_f32(acc.astype(np.float32) * r).astype(np.int64) + out_zero_point
            lo, hi = QRANGE[out_dtype]
            out = np.clip(q, lo, hi).astype(out_dtype)
    return out if layout == "NCHW" else out.transpose(0, 2, 3, 1)


def _static(d: Any) -> int | None:
    if isinstance(d, tirx.IntImm):
        return int(d.value)
    return d if isinstance(d, int) else None


def conv_geometry(x_shape, w_shape, attrs, *, static_weight: bool = True) -> dict[str, Any]:
    """Sizes of a ``qconv2d``: ``C, H, W`` (input), ``O, KH, KW`` (weight), ``OH, OW``.

    Raises ``ValueError`` naming the argument when a size is symbolic (only the batch may
    be, and with ``static_weight=False`` the weight's: those sizes are then None) or the
    window does not fit the padded input.

    Examples
    --------
    >>> from opsdk.ops.qconv2d import conv_geometry
    >>> g = conv_geometry((1, 8, 10, 10), (16, 8, 3, 3), {"layout": "NCHW", "stride": 2,
    ...                   "padding": 1})
    >>> g["OH"], g["OW"], g["O"]
    (5, 5, 16)
    """
    layout = attrs["layout"]
    c, h, w = (x_shape[1], x_shape[2], x_shape[3]) if layout == "NCHW" else (
        x_shape[3], x_shape[1], x_shape[2])
    dims = {"C": _static(c), "H": _static(h), "W": _static(w)}
    for name, v in dims.items():
        if v is None:
            raise ValueError(
                f"argument 'x' ({layout}) has a symbolic {name} dim; qconv2d needs static "
                "channels, height and width (only the batch may be symbolic)"
            )
    o, kh, kw = (_static(d) for d in (w_shape[0], w_shape[2], w_shape[3]))
    if static_weight and None in (o, kh, kw):
        raise ValueError("argument 'w' must have a static shape (O, C, KH, KW)")
    s, p = attrs["stride"], attrs["padding"]
    if s < 1 or p < 0:
        raise ValueError(f"arguments stride={s}, padding={p}: pass stride >= 1, padding >= 0")
    if kh is None or kw is None:
        return {**dims, "O": o, "KH": kh, "KW": kw, "OH": None, "OW": None}
    if dims["H"] + 2 * p < kh or dims["W"] + 2 * p < kw:
        raise ValueError(
            f"argument 'w': its {kh}x{kw} window does not fit the input's "
            f"{dims['H']}x{dims['W']} with padding {p}; pad more or use a smaller kernel"
        )
    return {**dims, "O": o, "KH": kh, "KW": kw,
            "OH": (dims["H"] + 2 * p - kh) // s + 1, "OW": (dims["W"] + 2 * p - kw) // s + 1}


def _input_shapes(s, a):
    c = s[1] if a["layout"] == "NCHW" else s[3]
    o = c if a["depthwise"] else "O"
    per = (o,) if a["per_channel"] else (1,)
    return {"w": (o, 1 if a["depthwise"] else c, "KH", "KW"), "w_scale": per, "bias": (o,)}


def _check(shapes, dtypes, attrs):
    conv_geometry(shapes["x"], shapes["w"], attrs, static_weight=False)
    if not attrs["x_scale"] > 0 or not attrs["out_scale"] > 0:
        raise ValueError("arguments 'x_scale' and 'out_scale' must be > 0")
    lo, hi = QRANGE[dtypes["x"]]
    if not lo <= attrs["x_zero_point"] <= hi:
        raise ValueError(
            f"argument 'x_zero_point' is {attrs['x_zero_point']}; it must lie in the range of "
            f"{dtypes['x']} [{lo}, {hi}]"
        )


def _epilogue(v, oc, w_scale, x_scale, out_dtype, out_scale, out_zero_point, per_channel):
    """int32 ``v`` (bias added) of output channel ``oc`` as the op's output dtype."""
    if out_dtype == "int32":
        return v
    sc = tirx.const(x_scale, "float32") * w_scale(oc if per_channel else 0)
    f = v.astype("float32")
    if out_dtype == "float32":
        return f * sc
    return round_to_te(f * (sc / tirx.const(out_scale, "float32")), out_zero_point, out_dtype)


@op(
    reference=_reference,
    dtypes={"x": ("int8", "uint8"), "w": ("int8",), "w_scale": ("float32",), "bias": ("int32",)},
    ranks=(4, 4),
    free_dims={"O": (1, 64), "KH": (1, 3), "KW": (1, 3)},
    input_shapes=_input_shapes,
    check=_check,
    layouts={
        "NCHW": {"layout": "NCHW", "out_dtype": "int8"},
        "NHWC": {"layout": "NHWC", "out_dtype": "float32"},
        "NHWC_per_tensor": {"layout": "NHWC", "out_dtype": "int8", "per_channel": False},
        "NCHW_depthwise": {"layout": "NCHW", "depthwise": True, "out_dtype": "float32"},
        "NHWC_depthwise": {"layout": "NHWC", "depthwise": True, "out_dtype": "int8"},
    },
    # As qdense's domain (see there): bit-exact over all of it, |acc| <= C*KH*KW * 255 * 127
    # + 5000 < 2**31 for every drawn shape.
    domain={
        "x": (-128, 255),
        "w": (-127, 127),
        "w_scale": log_uniform(1e-5, 1.0),
        "bias": (-5000, 5000),
    },
    attr_domain={
        "stride": [1, 2],
        "padding": [1, 0],
        **QUANT_ATTR_DOMAIN,
    },
    kind="conv2d",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "w_scale", "bias"),
    output_dtype="out_dtype",
    examples=[(1, 4, 5, 6)],
)
def qconv2d(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    layout: Literal["NCHW", "NHWC"] = "NCHW",
    stride: int = 1,
    padding: int = 0,
    depthwise: bool = False,
    x_scale: float = 1.0,
    x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8",
    out_scale: float = 1.0,
    out_zero_point: int = 0,
    per_channel: bool = True,
) -> te.Tensor:
    """Quantized 2-D convolution (x: NCHW or NHWC int8/uint8, w: OIHW int8) with int32
    accumulation, zero-point padding, optional int32 bias and a fused requantize (int8) or
    dequantize (float32)."""
    nchw = layout == "NCHW"
    n, h, wd = (x.shape[0], x.shape[2], x.shape[3]) if nchw else x.shape[:3]
    o, ci, kh, kw = w.shape
    p, s = padding, stride
    oh = (h + 2 * p - kh) // s + 1
    ow = (wd + 2 * p - kw) // s + 1
    rc = te.reduce_axis((0, ci), name="rc")
    ri = te.reduce_axis((0, kh), name="ri")
    rj = te.reduce_axis((0, kw), name="rj")

    def tap(b, ch, y, xx):  # (x - zero point) at a padded position; 0 in the padding
        iy, ix = y - p, xx - p
        inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < wd)
        v = x[b, ch, iy, ix] if nchw else x[b, iy, ix, ch]
        return tirx.if_then_else(inside, v.astype("int32") - x_zero_point, 0)

    def acc_f(b, oc, y, xx):
        ch = oc if depthwise else rc
        return te.sum(
            tap(b, ch, y * s + ri, xx * s + rj) * w[oc, rc, ri, rj].astype("int32"),
            axis=[rc, ri, rj],
        )

    acc = te.compute((n, o, oh, ow), acc_f, name="acc")

    def body(b, oc, y, xx):
        v = acc(b, oc, y, xx) if bias is None else acc(b, oc, y, xx) + bias(oc)
        return _epilogue(v, oc, w_scale, x_scale, out_dtype, out_scale, out_zero_point,
                         per_channel)

    attrs = {
        "layout": layout, "stride": stride, "padding": padding, "depthwise": depthwise,
        "x_scale": x_scale, "x_zero_point": x_zero_point, "out_dtype": out_dtype,
        "out_scale": out_scale, "out_zero_point": out_zero_point, "per_channel": per_channel,
        "has_bias": bias is not None,
    }
    shape = (n, o, oh, ow) if nchw else (n, oh, ow, o)
    if nchw:
        return te.compute(shape, body, name="qconv2d", attrs={ATTRS_KEY: attrs})
    return te.compute(shape, lambda b, y, xx, oc: body(b, oc, y, xx), name="qconv2d",
                      attrs={ATTRS_KEY: attrs})


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def qconv2d_packed(
    x: te.Tensor,
    w: te.Tensor,
    w_scale: te.Tensor,
    bias: te.Tensor | None = None,
    *,
    act_dtype: Literal["uint8", "int8"],
    rows: int,
    cols: int,
    layout: Literal["NCHW", "NHWC"] = "NCHW",
    stride: int = 1,
    padding: int = 0,
    x_scale: float = 1.0,
    x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8",
    out_scale: float = 1.0,
    out_zero_point: int = 0,
    per_channel: bool = True,
) -> te.Tensor:
    """:func:`qconv2d` (not depthwise) as a direct convolution on packed operands: bit-identical.

    Stages (block names): ``xa`` the input moved into ``act_dtype`` (as in
    :func:`~opsdk.ops.qdense.qdense_packed`), padded with the (shifted) zero point and laid
    out ``(N, ceil(C/4), H', W', 4)``, its width padded so the output row is whole
    ``rows``-pixel tiles; ``wp`` the weights ``(ceil(O/16), ceil(C/4)*KH*KW, 16*4)`` (one group
    per 4 input channels and window tap); ``wsum_lanes``/``wsum``/``comp`` the per-channel
    compensation ``bias[o] - (x_zero_point + offset) * sum w[o]``; ``oscale`` the float32
    factors;
    ``acc`` ``(N, OH, OW', O')`` the raw int32 sums (no im2col: each tap of a pixel tile reads
    one word per pixel); ``qtile`` the epilogue; ``qconv2d`` the copy of the valid part in the
    op's layout.

    Examples
    --------
    >>> import numpy as np, tvm
    >>> from tvm import te
    >>> from opsdk.ops.qconv2d import qconv2d, qconv2d_packed
    >>> x = te.placeholder((1, 5, 6, 7), "int8", name="x")
    >>> w = te.placeholder((3, 5, 3, 3), "int8", name="w")
    >>> s = te.placeholder((3,), "float32", name="w_scale")
    >>> attrs = {"x_zero_point": -7, "out_dtype": "int32", "padding": 1}
    >>> y = qconv2d_packed(x, w, s, act_dtype="uint8", rows=4, cols=16, **attrs)
    >>> f = tvm.compile(te.create_prim_func([x, w, s, y]), target={"kind": "llvm"})
    >>> rng = np.random.default_rng(0)
    >>> ins = {"x": rng.integers(-128, 128, (1, 5, 6, 7)).astype("int8"),
    ...        "w": rng.integers(-128, 128, (3, 5, 3, 3)).astype("int8"),
    ...        "w_scale": np.ones(3, "float32")}
    >>> out = tvm.runtime.empty((1, 3, 6, 7), "int32")
    >>> f["main"](*[tvm.runtime.tensor(a) for a in ins.values()], out)
    >>> bool(np.array_equal(out.numpy(), qconv2d.run_reference(ins, attrs)))
    True
    """
    if cols % BLOCK or rows < 1:
        raise ValueError(f"qconv2d_packed: cols must be a multiple of {BLOCK}, rows >= 1")
    g = conv_geometry(x.shape, w.shape, {"layout": layout, "stride": stride,
                                         "padding": padding})
    n = x.shape[0]
    idx = str(n.ty.dtype) if hasattr(n, "ty") else "int32"

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    c, h, wd, o, kh, kw = (g[k] for k in ("C", "H", "W", "O", "KH", "KW"))
    oh, s, p = g["OH"], stride, padding
    owp = _cdiv(g["OW"], rows) * rows
    cb = _cdiv(c, KGROUP)
    op_ = _cdiv(o, cols) * cols
    hp, wpd = (oh - 1) * s + kh, (owp - 1) * s + kw
    lo = QRANGE[str(x.dtype)][0]
    off = 0 if QRANGE[act_dtype][0] == lo else (128 if act_dtype == "uint8" else -128)
    zp_eff = x_zero_point + off
    nchw = layout == "NCHW"

    def xa_f(b, q, y, xx, e):
        ch, iy, ix = q * KGROUP + e, y - p, xx - p
        inside = tirx.all(ch < c, iy >= 0, iy < h, ix >= 0, ix < wd)
        v = x[b, ch, iy, ix] if nchw else x[b, iy, ix, ch]
        return tirx.if_then_else(inside, (v.astype("int32") + off).astype(act_dtype),
                                 tirx.const(zp_eff, act_dtype))

    xa = te.compute((n, dim(cb), dim(hp), dim(wpd), dim(KGROUP)), xa_f, name="xa")
    taps = kh * kw

    def wp_f(bb, gg, e):
        oc, ch = bb * BLOCK + e // KGROUP, (gg // taps) * KGROUP + e % KGROUP
        t = gg % taps
        return tirx.if_then_else(tirx.all(oc < o, ch < c), w[oc, ch, t // kw, t % kw],
                                 tirx.const(0, "int8"))

    wp = te.compute((dim(_cdiv(op_, BLOCK)), dim(cb * taps), dim(BLOCK * KGROUP)), wp_f,
                    name="wp")
    comp, osc = packed_channel_terms(
        wp, w_scale, bias, n=o, padded=op_, zp_eff=zp_eff, x_scale=x_scale,
        out_dtype=out_dtype, out_scale=out_scale, per_channel=per_channel)
    rq = te.reduce_axis((dim(0), dim(cb)), name="rq")
    rh = te.reduce_axis((dim(0), dim(kh)), name="rh")
    rw = te.reduce_axis((dim(0), dim(kw)), name="rw")
    re = te.reduce_axis((dim(0), dim(KGROUP)), name="re")
    acc = te.compute(
        (n, dim(oh), dim(owp), dim(op_)),
        lambda b, y, xx, j: te.sum(
            xa[b, rq, y * s + rh, xx * s + rw, re].astype("int32")
            * wp[j // BLOCK, (rq * kh + rh) * kw + rw, (j % BLOCK) * KGROUP + re].astype("int32"),
            axis=[rq, rh, rw, re],
        ),
        name="acc",
    )

    def body(b, y, xx, j):
        return packed_epilogue(acc[b, y, xx, j], j, comp, osc, out_dtype, out_zero_point)

    tile = te.compute((n, dim(oh), dim(owp), dim(op_)), body, name="qtile")
    if nchw:
        return te.compute((n, dim(o), dim(oh), dim(g["OW"])),
                          lambda b, j, y, xx: tile[b, y, xx, j], name="qconv2d")
    return te.compute((n, dim(oh), dim(g["OW"]), dim(o)),
                      lambda b, y, xx, j: tile[b, y, xx, j], name="qconv2d")


def qconv2d_depthwise_padded(
    x: te.Tensor,
    w: te.Tensor,
    w_scale: te.Tensor,
    bias: te.Tensor | None = None,
    *,
    layout: Literal["NCHW", "NHWC"] = "NCHW",
    stride: int = 1,
    padding: int = 0,
    x_scale: float = 1.0,
    x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8",
    out_scale: float = 1.0,
    out_zero_point: int = 0,
    per_channel: bool = True,
) -> te.Tensor:
    """A depthwise :func:`qconv2d` reading a padded copy of its input: bit-identical.

    Stages: ``xp`` the input minus the zero point as int16 (``|x - zp| <= 383``), zero in the
    padding, in the op's layout (so the window has no bounds test); ``wt`` the weights as
    int32 ``(KH, KW, C)``; ``acc`` the int32 window sums, the ``KH x KW`` taps written out
    (sizes are static); ``qconv2d`` the epilogue (the definition's float32 steps).

    Examples
    --------
    >>> import numpy as np, tvm
    >>> from tvm import te
    >>> from opsdk.ops.qconv2d import qconv2d, qconv2d_depthwise_padded
    >>> x = te.placeholder((1, 6, 7, 5), "uint8", name="x")
    >>> w = te.placeholder((5, 1, 3, 3), "int8", name="w")
    >>> s = te.placeholder((5,), "float32", name="w_scale")
    >>> attrs = {"x_zero_point": 9, "out_dtype": "int32", "padding": 1, "layout": "NHWC"}
    >>> y = qconv2d_depthwise_padded(x, w, s, **attrs)
    >>> f = tvm.compile(te.create_prim_func([x, w, s, y]), target={"kind": "llvm"})
    >>> rng = np.random.default_rng(0)
    >>> ins = {"x": rng.integers(0, 256, (1, 6, 7, 5)).astype("uint8"),
    ...        "w": rng.integers(-128, 128, (5, 1, 3, 3)).astype("int8"),
    ...        "w_scale": np.ones(5, "float32")}
    >>> out = tvm.runtime.empty((1, 6, 7, 5), "int32")
    >>> f["main"](*[tvm.runtime.tensor(a) for a in ins.values()], out)
    >>> bool(np.array_equal(out.numpy(), qconv2d.run_reference(ins, {**attrs, "depthwise": True})))
    True
    """
    g = conv_geometry(x.shape, w.shape, {"layout": layout, "stride": stride,
                                         "padding": padding})
    n = x.shape[0]
    idx = str(n.ty.dtype) if hasattr(n, "ty") else "int32"

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    c, h, wd, kh, kw, s, p = (g["C"], g["H"], g["W"], g["KH"], g["KW"], stride, padding)
    nchw = layout == "NCHW"
    hp, wpd = (g["OH"] - 1) * s + kh, (g["OW"] - 1) * s + kw

    def xp_f(b, i1, i2, i3):
        ch, y, xx = (i1, i2, i3) if nchw else (i3, i1, i2)
        iy, ix = y - p, xx - p
        inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < wd)
        v = x[b, ch, iy, ix] if nchw else x[b, iy, ix, ch]
        return tirx.if_then_else(inside, (v.astype("int32") - x_zero_point).astype("int16"),
                                 tirx.const(0, "int16"))

    pshape = (n, dim(c), dim(hp), dim(wpd)) if nchw else (n, dim(hp), dim(wpd), dim(c))
    xp = te.compute(pshape, xp_f, name="xp")
    # Weights tap-major, channels contiguous (OIHW would be gathered with stride KH*KW).
    wt = te.compute((dim(kh), dim(kw), dim(c)), lambda i, j, ch: w[ch, 0, i, j].astype("int32"),
                    name="wt")

    def tap(b, ch, y, xx):
        return (xp[b, ch, y, xx] if nchw else xp[b, y, xx, ch]).astype("int32")

    def acc_f(b, i1, i2, i3):
        # The window written out (static): an injective block the epilogue inlines, so the
        # whole sum vectorizes along the last axis with no reduction loop.
        ch, y, xx = (i1, i2, i3) if nchw else (i3, i1, i2)
        terms = [tap(b, ch, y * s + i, xx * s + j) * wt[i, j, ch]
                 for i in range(kh) for j in range(kw)]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        return total

    oshape = ((n, dim(c), dim(g["OH"]), dim(g["OW"])) if nchw
              else (n, dim(g["OH"]), dim(g["OW"]), dim(c)))
    acc = te.compute(oshape, acc_f, name="acc")

    def body(b, i1, i2, i3):
        ch = i1 if nchw else i3
        v = acc[b, i1, i2, i3] if bias is None else acc[b, i1, i2, i3] + bias[ch]
        return _epilogue(v, ch, w_scale, x_scale, out_dtype, out_scale, out_zero_point,
                         per_channel)

    return te.compute(oshape, body, name="qconv2d")


# Keyed by the reference: variants (same math) share it.
error_model(_reference)(exact_model)
