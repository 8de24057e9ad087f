"""``group_norm`` over channel groups, for NCHW and NHWC inputs."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import ModelInput, error_model, norm_rows
from .._opdef import Tensor
from .._patterns import (
    ONES,
    ZEROS,
    affine_params,
    call_attr,
    const_value,
    either,
    float_tensor,
    reduced_axes,
    same_dims,
    scalar_value,
    shape_of,
    static_shape,
)
from ..te_utils import acc, rsqrt_finite
from ._convert import arg, covered_dtype, filled, tensor


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


# ---------------------------------------------------------------------------------------------
# Error model


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    x = m.inputs["x"]
    nhwc = m.attrs["layout"] == "NHWC"
    if nhwc:
        x = x.transpose(0, 3, 1, 2)
    N, C, H, W = x.shape
    groups = m.attrs["num_groups"]
    rows, n = N * groups, (C // groups) * H * W

    def chan(t: np.ndarray | None) -> np.ndarray | None:
        if t is None:
            return None
        return np.broadcast_to(t.reshape(1, C, 1, 1), x.shape).reshape(rows, n)

    E = norm_rows(x.reshape(rows, n), chan(m.inputs.get("gamma")), chan(m.inputs.get("beta")),
                  m.attrs["epsilon"], True, m.u).reshape(x.shape)
    return E.transpose(0, 2, 3, 1) if nhwc else E


# ---------------------------------------------------------------------------------------------
# torch: group_norm / native_group_norm (``keep``: native_group_norm is what torch's
# decomposition makes of group_norm)


def _torch_args(imp: Any, node: Any) -> tuple[Any, Any, Any, Any]:
    """(gamma, beta, groups, eps) of either torch group-norm op; gamma/beta may be None."""
    if node.target.__name__ == "native_group_norm.default":
        # (input, weight, bias, N, C, HxW, group, eps)
        return (tensor(imp, node.args[1]), tensor(imp, node.args[2]), node.args[6],
                node.args[7])
    # (input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True)
    return (tensor(imp, arg(node, 2, "weight")), tensor(imp, arg(node, 3, "bias")),
            arg(node, 1, "num_groups"), arg(node, 4, "eps", 1e-5))


def _tvm_from_torch(node: Any, imp: Any) -> relax.Expr:
    """TVM's own ``group_norm`` for a node opsdk's op does not cover (float64, not 4-D).
    Emitted here rather than through TVM's converter: in 0.27 it fails on absent weights."""
    x = imp.env[node.args[0]]
    dtype = str(x.ty.dtype)
    gamma, beta, groups, eps = _torch_args(imp, node)
    c = x.ty.shape[1]
    gamma = filled([c], dtype, 1.0) if gamma is None else gamma
    beta = filled([c], dtype, 0.0) if beta is None else beta
    axes = list(range(2, x.ty.ndim))
    return imp.block_builder.emit(
        relax.op.nn.group_norm(x, gamma, beta, int(groups), 1, axes, float(eps)))


def _from_torch(node: Any, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    gamma, beta, groups, eps = _torch_args(imp, node)
    ty = x.ty
    static_c = ty.ndim == 4 and isinstance(ty.shape[1], tirx.IntImm)
    if not covered_dtype(x) or not static_c:  # opsdk.group_norm: 4-D, static channels
        return _tvm_from_torch(node, imp)
    call = group_norm(x, gamma, beta, num_groups=int(groups), epsilon=float(eps))
    return imp.block_builder.emit(call)


group_norm.torch("group_norm.default", "native_group_norm.default", convert=_from_torch,
                 keep=("group_norm",))


# ---------------------------------------------------------------------------------------------
# TVM's R.nn.group_norm (ONNX GroupNormalization): 4-D NCHW / NHWC, static channels, floats


@group_norm.replaces("relax.nn.group_norm", onnx="GroupNormalization", since=18)
def _tvm_group_norm() -> tuple[DFPattern, Any]:
    pattern = is_op("relax.nn.group_norm")(wildcard(), ONES | wildcard(), ZEROS | wildcard())

    def build(call: relax.Call, m: Any) -> relax.Expr | None:
        x = call.args[0]
        ty = float_tensor(x)
        if ty is None or ty.ndim != 4:
            return None
        caxis = call_attr(call, "channel_axis") % 4
        axes = sorted(a % 4 for a in call_attr(call, "axes"))
        layout = {(1, (2, 3)): "NCHW", (3, (1, 2)): "NHWC"}.get((caxis, tuple(axes)))
        shape = static_shape(x)
        params = affine_params(call, m)
        if layout is None or shape is None or params is None:  # opsdk: static channel count
            return None
        return group_norm(
            x,
            *params,
            num_groups=int(call_attr(call, "num_groups")),
            epsilon=float(call_attr(call, "epsilon")),
            layout=layout,
        )

    return pattern, build


# ---------------------------------------------------------------------------------------------
# Fusion: GroupNorm as exporters decompose it


def _decomposed_rule(affine: bool) -> tuple[DFPattern, Any]:
    """``reshape(x, [N, G, -1])`` normalized over the last axis (mean, ``variance`` + eps,
    sqrt, divide), optionally scaled / shifted by per-group ones / zeros (ONNX
    InstanceNormalization's own parameters), reshaped back to ``x``'s NCHW shape, then ``*
    gamma`` and ``+ beta`` per channel: what torch.onnx emits for GroupNorm at opset < 18."""
    x, shp, back = wildcard(), wildcard(), wildcard()
    r = is_op("relax.reshape")(x, shp)
    mean = is_op("relax.mean")(r)
    var = is_op("relax.variance")(r)
    eps = is_const()
    norm = is_op("relax.divide")(is_op("relax.subtract")(r, mean),
                                 is_op("relax.sqrt")(either("relax.add", var, eps)))
    ones = is_const() | is_op("relax.reshape")(is_const(), wildcard())
    zeros = is_const() | is_op("relax.reshape")(is_const(), wildcard())
    inorm = either("relax.add", either("relax.multiply", norm, ones), zeros) | norm
    restored = is_op("relax.reshape")(inorm, back)
    gamma, beta = wildcard(), wildcard()
    root = either("relax.add", either("relax.multiply", restored, gamma), beta) if affine \
        else restored

    def fused(orig: relax.Call, m: Any) -> relax.Expr | None:
        xv = m[x]
        ty = float_tensor(xv)
        rs = shape_of(m[r])
        if ty is None or ty.ndim != 4 or rs is None or len(rs) != 3:
            return None
        xs = shape_of(xv)
        if not same_dims(shape_of(m[restored]), xs) or not same_dims(rs[:1], xs[:1]):
            return None
        for ax in (mean, var):
            if reduced_axes(m[ax], 3) != [2]:
                return None
        if call_attr(m[var], "unbiased", False):
            return None  # a sample variance is not GroupNorm's
        if not isinstance(rs[1], tirx.IntImm) or not isinstance(xs[1], tirx.IntImm):
            return None
        groups, channels = int(rs[1].value), int(xs[1].value)
        if channels % groups:
            return None
        e = scalar_value(m[eps])
        if e is None or e < 0:
            return None
        if ones in m and not np.all(const_value(m[ones]) == 1):
            return None  # an InstanceNorm scale that is not 1: more than a GroupNorm
        if zeros in m and not np.all(const_value(m[zeros]) == 0):
            return None
        params: list[relax.Expr] = []
        for p in (gamma, beta) if affine else ():
            ps = shape_of(m[p])
            if ps is None or float_tensor(m[p]) is None or str(m[p].ty.dtype) != str(ty.dtype):
                return None
            dims = [int(d.value) if isinstance(d, tirx.IntImm) else -1 for d in ps]
            if dims[-3:] != [channels, 1, 1] or any(d != 1 for d in dims[:-3]):
                return None  # per channel (C, 1, 1) only
            params.append(relax.op.reshape(m[p], [channels]))
        return group_norm(xv, *params, num_groups=groups, epsilon=e, layout="NCHW")

    return root, fused


@group_norm.fusion()
def _decomposed() -> list[tuple[DFPattern, Any]]:
    # ONNX's InstanceNormalization form of GroupNorm (torch.onnx below opset 18), with and
    # without the per-channel gamma / beta
    return [_decomposed_rule(affine=True), _decomposed_rule(affine=False)]
