"""``group_norm`` over channel groups, for NCHW and NHWC inputs."""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, tirx

from .._dtypes import FLOAT_DTYPES
from .._opdef import Tensor, op
from ..te_utils import acc, rsqrt_finite


def _channel_axis(layout: str) -> int:
    return 1 if layout == "NCHW" else 3


_F32_MAX = float(np.finfo(np.float32).max)


def _reference(x, gamma=None, beta=None, *, num_groups, epsilon=1e-5, layout="NCHW"):
    if layout == "NHWC":
        x = x.transpose(0, 3, 1, 2)
    n, c, h, w = x.shape
    g = x.reshape(n, num_groups, c // num_groups, h, w)
    mean = g.mean(axis=(2, 3, 4), keepdims=True)
    sq = ((g - mean) ** 2).sum(axis=(2, 3, 4), keepdims=True)
    var = sq / ((c // num_groups) * h * w)
    # The documented semantics: a group whose float32 sum of squares overflows is NaN.
    y = np.where(sq > _F32_MAX, np.nan, (g - mean) / np.sqrt(var + epsilon)).reshape(n, c, h, w)
    if gamma is not None:
        y = y * gamma.reshape(1, c, 1, 1)
    if beta is not None:
        y = y + beta.reshape(1, c, 1, 1)
    return y.transpose(0, 2, 3, 1) if layout == "NHWC" else y


def _input_shapes(x_shape, attrs):
    c = x_shape[_channel_axis(attrs["layout"])]
    return {"gamma": (c,), "beta": (c,)}


def _check(shapes, dtypes, attrs):
    g = attrs["num_groups"]
    c = shapes["x"][_channel_axis(attrs["layout"])]
    if g < 1:
        raise ValueError(f"argument 'num_groups' is {g}; pass num_groups >= 1")
    if isinstance(c, tirx.IntImm):
        c = c.value
    if isinstance(c, int) and c % g:
        raise ValueError(
            f"argument 'num_groups' is {g} but {attrs['layout']} input 'x' has {c} channels; "
            "num_groups must divide the channel count"
        )
    if not isinstance(c, int):
        raise ValueError(
            "argument 'x' has a symbolic channel dim; the channel count must be static"
        )
    if attrs["epsilon"] < 0:
        raise ValueError(f"argument 'epsilon' is {attrs['epsilon']}; pass epsilon >= 0")


@op(
    reference=_reference,
    dtypes=FLOAT_DTYPES,
    ranks=(4, 4),
    input_shapes=_input_shapes,
    check=_check,
    layouts={"NCHW": {"layout": "NCHW"}, "NHWC": {"layout": "NHWC"}},
    domain={"x": (-4.0, 4.0), "gamma": (-2.0, 2.0), "beta": (-2.0, 2.0)},
    attr_domain={"num_groups": [2, 1, 4], "epsilon": [1e-5, 1e-3]},
    kind="norm",
    special_values=True,  # inf, NaN, huge inputs: docs/verification.md
    examples=[(2, 8, 3, 8)],
)
def group_norm(
    x: Tensor,
    gamma: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    num_groups: int,
    epsilon: float = 1e-5,
    layout: Literal["NCHW", "NHWC"] = "NCHW",
) -> te.Tensor:
    """Group normalization: statistics per (sample, group of ``C / num_groups`` channels).

    ``gamma``/``beta`` have shape ``(C,)``; accumulation is float32.
    """
    cax = _channel_axis(layout)
    c = int(x.shape[cax])
    cg = c // num_groups
    if layout == "NCHW":
        _, _, h, w = x.shape

        def at(nn, ch, hh, ww):
            return x(nn, ch, hh, ww)
    else:
        _, h, w, _ = x.shape

        def at(nn, ch, hh, ww):
            return x(nn, hh, ww, ch)

    count = (h * w).astype("float32") * float(cg)
    n = x.shape[0]

    def stats_axes(p):
        return (
            te.reduce_axis((0, cg), name=f"{p}c"),
            te.reduce_axis((0, h), name=f"{p}h"),
            te.reduce_axis((0, w), name=f"{p}w"),
        )

    rc, rh, rw = stats_axes("r")
    s = te.compute(
        (n, num_groups),
        lambda nn, g: te.sum(acc(at(nn, g * cg + rc, rh, rw)), axis=[rc, rh, rw]),
        name="sum",
    )
    mean = te.compute((n, num_groups), lambda nn, g: s(nn, g) / count, name="mean")
    kc, kh, kw = stats_axes("k")

    def dev2(nn, g):
        d = acc(at(nn, g * cg + kc, kh, kw)) - mean(nn, g)
        return te.sum(d * d, axis=[kc, kh, kw])

    sq = te.compute((n, num_groups), dev2, name="sqsum")
    rstd = te.compute(
        (n, num_groups), lambda nn, g: rsqrt_finite(sq(nn, g), count, epsilon), name="rstd"
    )

    if layout == "NHWC":
        # Channels are innermost: expand the per-group statistics to per-channel vectors once
        # per sample, so the output loop reads mean/scale contiguously (no ``c // cg`` gather
        # per element). ``(x - mean) * (rstd * gamma)`` keeps the subtraction first, which is
        # what stays accurate for inputs with a large common offset.
        c_total = cg * num_groups
        mean_c = te.compute((n, c_total), lambda nn, ch: mean(nn, ch // cg), name="mean_c")

        def scale(nn, ch):
            r = rstd(nn, ch // cg)
            return r * acc(gamma(ch)) if gamma is not None else r

        scale_c = te.compute((n, c_total), scale, name="scale_c")

        def out(*i):
            ch = i[cax]
            y = (acc(x(*i)) - mean_c(i[0], ch)) * scale_c(i[0], ch)
            if beta is not None:
                y = y + acc(beta(ch))
            return y.astype(x.dtype)

        return te.compute(x.shape, out, name="group_norm")

    def out(*i):
        ch = i[cax]
        g = ch // cg
        # rstd * gamma is constant along the (h, w) loop: LLVM hoists it, leaving a subtract
        # and an FMA per vector (instead of subtract, multiply, multiply-add).
        r = rstd(i[0], g) * acc(gamma(ch)) if gamma is not None else rstd(i[0], g)
        y = (acc(x(*i)) - mean(i[0], g)) * r
        if beta is not None:
            y = y + acc(beta(ch))
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name="group_norm")


@group_norm.fusion()
def _decomposed():
    # ONNX's InstanceNormalization form of GroupNorm (torch.onnx below opset 18)
    from ..transform._fuse import group_norm_patterns

    return group_norm_patterns()
