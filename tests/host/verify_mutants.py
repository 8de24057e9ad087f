"""Deliberately wrong variants of the built-in ops: verify must flag every one (and a few
correct rewrites, ``EQUIVALENTS``, that it must pass).

Each mutant is an op with a bug in its compute (or a schedule rule with a bug, registered for
the mutant's name only) and the *correct* reference of the op it imitates, so the built-in
error model applies (models are keyed by the reference function). Importing this module
registers the mutant schedule rules; the ops themselves are registered by the tests (or by
``opsdk verify --module verify_mutants``) and unregistered after.
"""

from __future__ import annotations

import math
from typing import Literal

from tvm import s_tir, te, tirx
from tvm.target import Target
from tvm_ffi.structural import structural_mutate

import opsdk
from opsdk import Axis, Tensor
from opsdk.te_utils import acc, prod, reduce_axes, rsqrt_finite

_LN = opsdk.get_op("layer_norm")
_RMS = opsdk.get_op("rms_norm")
_GN = opsdk.get_op("group_norm")
_SOFTMAX = opsdk.get_op("softmax")
_GELU = opsdk.get_op("gelu")
_BIAS_GELU = opsdk.get_op("bias_gelu")
_QUANTIZE = opsdk.get_op("quantize")
_DEQUANTIZE = opsdk.get_op("dequantize")
_REQUANTIZE = opsdk.get_op("requantize")


def _like(base: opsdk.OpDef, **over):
    """``opsdk.op`` settings of a built-in (its reference, dtypes, layouts, domains, ...)."""
    kw = dict(
        reference=base.reference,
        dtypes={base.primary: base.dtypes, **base.input_dtypes} if base.input_dtypes
        else base.dtypes,
        output_dtype=base.output_dtype,
        free_dims=base.free_dims,
        ranks=base.ranks,
        input_shapes=base.input_shapes,
        check=base.check,
        layouts=base.layouts,
        domain=base.domain,
        attr_domain=base.attr_domain,
        kind=base.kind,
        examples=base.examples,
        special_values=base.special_values,
    )
    kw.update(over)
    return opsdk.op(**kw)


# ------------------------------------------------------------------------------ layer norm


def _layer_norm(x, gamma, beta, begin_axis, epsilon, *, bug: str, name: str) -> te.Tensor:
    """The built-in layer_norm compute with one bug switched on (or, for the equivalents,
    one harmless rewrite: ``gamma_folded``, ``div_sqrt``)."""
    a = (lambda v: v) if bug == "fp16_acc" else acc  # no float32 upcast
    outer, inner = x.shape[:begin_axis], x.shape[begin_axis:]
    n = prod(inner)
    if bug == "fp16_acc":
        n = n.astype(x.dtype)
    r1 = reduce_axes(inner, "r")
    s = te.compute(outer, lambda *o: te.sum(a(x(*o, *r1)), axis=r1), name="sum")
    mean = te.compute(outer, lambda *o: s(*o) / n, name="mean")
    r2 = reduce_axes(inner, "k")
    if bug == "one_pass":
        sq = te.compute(
            outer, lambda *o: te.sum(a(x(*o, *r2)) * a(x(*o, *r2)), axis=r2), name="sqsum"
        )
        var = te.compute(outer, lambda *o: sq(*o) / n - mean(*o) * mean(*o), name="var")
    else:

        def dev2(*o):
            d = a(x(*o, *r2)) - mean(*o)
            return te.sum(d * d, axis=r2)

        sq = te.compute(outer, dev2, name="sqsum")
        count = n - 1.0 if bug == "unbiased" else n
        var = te.compute(outer, lambda *o: sq(*o) / count, name="var")
    if bug == "eps_outside":
        rstd = te.compute(outer, lambda *o: 1.0 / (tirx.sqrt(var(*o)) + epsilon), name="rstd")
    elif bug == "div_sqrt":  # with the documented NaN for an overflowed sum of squares
        rstd = te.compute(outer, lambda *o: tirx.Select(
            var(*o) < float("inf"), 1.0 / tirx.sqrt(var(*o) + epsilon), float("nan")),
            name="rstd")
    elif bug == "overflow_zero":  # rsqrt(inf) = 0: a row of zeros where NaN is documented
        rstd = te.compute(outer, lambda *o: tirx.rsqrt(var(*o) + epsilon), name="rstd")
    else:
        rstd = te.compute(outer, lambda *o: rsqrt_finite(var(*o), 1, epsilon), name="rstd")
    b = len(outer)

    def out(*i):
        if bug == "gamma_folded" and gamma is not None:  # (x - m) * (rstd * gamma)
            y = (a(x(*i)) - mean(*i[:b])) * (rstd(*i[:b]) * a(gamma(*i[b:])))
        else:
            y = (a(x(*i)) - mean(*i[:b])) * rstd(*i[:b])
            if gamma is not None:
                y = y * a(gamma(*i[b:]))
        if beta is not None and bug != "no_beta":
            y = y + a(beta(*i[b:]))
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name=name)


def _ln_mutant(bug: str, name: str) -> opsdk.OpDef:
    def compute(
        x: Tensor,
        gamma: Tensor | None = None,
        beta: Tensor | None = None,
        *,
        begin_axis: Axis = -1,
        epsilon: float = 1e-5,
    ) -> te.Tensor:
        return _layer_norm(x, gamma, beta, begin_axis, epsilon, bug=bug, name=name)

    compute.__name__ = name
    return _like(_LN)(compute)


mut_ln_eps_outside = _ln_mutant("eps_outside", "mut_ln_eps_outside")
mut_ln_unbiased = _ln_mutant("unbiased", "mut_ln_unbiased")
mut_ln_fp16_acc = _ln_mutant("fp16_acc", "mut_ln_fp16_acc")
mut_ln_one_pass = _ln_mutant("one_pass", "mut_ln_one_pass")
mut_ln_no_beta = _ln_mutant("no_beta", "mut_ln_no_beta")
#: Correct compute; its schedule rule (below) forgets the vector tail.
def _drop_partial_tile(sch: s_tir.Schedule, outer, n, factor: int) -> s_tir.Schedule:
    """Shorten the ``outer`` loop of a ``[None, factor]`` split of a length-``n`` loop to
    ``n // factor`` iterations: the partial last tile is silently skipped (the bug)."""
    var = sch.get(outer).loop_var

    def cut(node: tirx.For, mut) -> tirx.For:
        if not node.loop_var.same_as(var):
            return mut.default_mutate(node)
        return tirx.For(node.loop_var, node.min, tirx.floordiv(n, factor), node.kind,
                        mut.mutate(node.body), node.thread_binding, node.annotations)

    return s_tir.Schedule(structural_mutate(sch.mod["main"], [(tirx.For, cut)]))


mut_ln_vec_tail = _ln_mutant("none", "mut_ln_vec_tail")
mut_ln_overflow_zero = _ln_mutant("overflow_zero", "mut_ln_overflow_zero")
eq_ln_gamma_folded = _ln_mutant("gamma_folded", "eq_ln_gamma_folded")
eq_ln_div_sqrt = _ln_mutant("div_sqrt", "eq_ln_div_sqrt")


@opsdk.rule(
    "mut_ln_vec_tail", "cpu", name="mut.rows_without_tail", priority=1000, claims=("vectorize",)
)
def _rows_without_tail(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Vectorize the output's last axis by 16 lanes, dropping the partial last vector."""
    sch = s_tir.Schedule(func)
    loop = sch.get_loops(sch.get_sblock("mut_ln_vec_tail"))[-1]
    n = sch.get(loop).extent
    outer, inner = sch.split(loop, factors=[None, 16])
    sch.vectorize(inner)
    return _drop_partial_tile(sch, outer, n, 16)


# ------------------------------------------------------------------------------ rms norm


def _rms_norm(x, gamma, begin_axis, epsilon, *, bug: str, name: str) -> te.Tensor:
    """The built-in rms_norm compute with one bug: ``no_eps`` (epsilon forgotten) or
    ``no_sqrt`` (divides by the mean square itself)."""
    outer, inner = x.shape[:begin_axis], x.shape[begin_axis:]
    r = reduce_axes(inner, "r")
    ss = te.compute(outer, lambda *o: te.sum(acc(x(*o, *r)) * acc(x(*o, *r)), axis=r), name="ss")
    n = prod(inner)
    if bug == "no_eps":
        scale = te.compute(outer, lambda *o: tirx.rsqrt(ss(*o) / n), name="rrms")
    else:
        scale = te.compute(outer, lambda *o: 1.0 / (ss(*o) / n + epsilon), name="rms")
    b = len(outer)

    def out(*i):
        y = acc(x(*i)) * scale(*i[:b])
        if gamma is not None:
            y = y * acc(gamma(*i[b:]))
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name=name)


@_like(_RMS)
def mut_rms_no_eps(
    x: Tensor, gamma: Tensor | None = None, *, begin_axis: Axis = -1, epsilon: float = 1e-6
) -> te.Tensor:
    """rms_norm that forgets epsilon."""
    return _rms_norm(x, gamma, begin_axis, epsilon, bug="no_eps", name="mut_rms_no_eps")


@_like(_RMS)
def mut_rms_no_sqrt(
    x: Tensor, gamma: Tensor | None = None, *, begin_axis: Axis = -1, epsilon: float = 1e-6
) -> te.Tensor:
    """rms_norm that divides by the mean square instead of its square root."""
    return _rms_norm(x, gamma, begin_axis, epsilon, bug="no_sqrt", name="mut_rms_no_sqrt")


# ------------------------------------------------------------------------------ group norm


@_like(_GN)
def mut_gn_nhwc_axis(
    x: Tensor,
    gamma: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    num_groups: int,
    epsilon: float = 1e-5,
    layout: Literal["NCHW", "NHWC"] = "NCHW",
) -> te.Tensor:
    """group_norm whose NHWC output step takes the channel from axis 1 (the NCHW position)."""
    cax = 1 if layout == "NCHW" else 3
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
    rc, rh, rw = (
        te.reduce_axis((0, cg), "rc"),
        te.reduce_axis((0, h), "rh"),
        te.reduce_axis((0, w), "rw"),
    )
    s = te.compute(
        (n, num_groups),
        lambda nn, g: te.sum(acc(at(nn, g * cg + rc, rh, rw)), axis=[rc, rh, rw]),
        name="sum",
    )
    mean = te.compute((n, num_groups), lambda nn, g: s(nn, g) / count, name="mean")
    kc, kh, kw = (
        te.reduce_axis((0, cg), "kc"),
        te.reduce_axis((0, h), "kh"),
        te.reduce_axis((0, w), "kw"),
    )

    def dev2(nn, g):
        d = acc(at(nn, g * cg + kc, kh, kw)) - mean(nn, g)
        return te.sum(d * d, axis=[kc, kh, kw])

    sq = te.compute((n, num_groups), dev2, name="sqsum")
    rstd = te.compute(
        (n, num_groups), lambda nn, g: rsqrt_finite(sq(nn, g), count, epsilon), name="rstd"
    )

    def out(*i):
        ch = i[1] % c  # the bug: axis 1 is H in NHWC (kept in range, so no stray reads)
        g = ch // cg
        y = (acc(x(*i)) - mean(i[0], g)) * rstd(i[0], g)
        if gamma is not None:
            y = y * acc(gamma(ch))
        if beta is not None:
            y = y + acc(beta(ch))
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name="mut_gn_nhwc_axis")


# ------------------------------------------------------------------------------ softmax


@_like(_SOFTMAX)
def mut_softmax_no_max(x: Tensor, *, axis: Axis = -1) -> te.Tensor:
    """softmax without subtracting the row maximum: exp overflows for large inputs."""
    nd = len(x.shape)
    outer = [x.shape[i] for i in range(nd) if i != axis]
    rs = te.reduce_axis((0, x.shape[axis]), name="rs")

    def at(o, r):
        return (*o[:axis], r, *o[axis:])

    ex = te.compute(outer, lambda *o: te.sum(tirx.exp(acc(x(*at(o, rs)))), axis=rs), name="expsum")

    def out(*i):
        o = (*i[:axis], *i[axis + 1 :])
        return (tirx.exp(acc(x(*i))) / ex(*o)).astype(x.dtype)

    return te.compute(x.shape, out, name="mut_softmax_no_max")


@_like(_SOFTMAX)
def mut_softmax_last_axis(x: Tensor, *, axis: Axis = -1) -> te.Tensor:
    """softmax that always normalizes over the last axis, whatever ``axis`` says."""
    return _SOFTMAX.compute(x, axis=len(x.shape) - 1)


@_like(_SOFTMAX)
def eq_softmax_divide(x: Tensor, *, axis: Axis = -1) -> te.Tensor:
    """Equivalent: softmax dividing each exp by the row sum (the textbook form) instead of
    multiplying by one reciprocal per row."""
    nd = len(x.shape)
    outer = [x.shape[i] for i in range(nd) if i != axis]

    def at(o, r):
        return (*o[:axis], r, *o[axis:])

    rm = te.reduce_axis((0, x.shape[axis]), name="rm")
    mx = te.compute(outer, lambda *o: te.max(acc(x(*at(o, rm))), axis=rm), name="max")
    e = te.compute(x.shape, lambda *i: tirx.exp(acc(x(*i)) - mx(*i[:axis], *i[axis + 1:])),
                   name="exp")
    rs = te.reduce_axis((0, x.shape[axis]), name="rs")
    ex = te.compute(outer, lambda *o: te.sum(e(*at(o, rs)), axis=rs), name="expsum")
    return te.compute(x.shape, lambda *i: (e(*i) / ex(*i[:axis], *i[axis + 1:])).astype(x.dtype),
                      name="eq_softmax_divide")


# ------------------------------------------------------------------------------ gelu


def _gelu_tanh(v):
    inner = math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v)
    return 0.5 * v * (1.0 + tirx.tanh(inner))


def _gelu_erf(v):
    return 0.5 * v * (1.0 + tirx.erf(v * (1.0 / math.sqrt(2.0))))


@_like(_GELU)
def mut_gelu_tanh_as_erf(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """gelu that computes the tanh approximation when asked for the exact (erf) form."""
    return te.compute(
        x.shape, lambda *i: _gelu_tanh(acc(x(*i))).astype(x.dtype), name="mut_gelu_tanh_as_erf"
    )


def _round_bf16_truncating(v: tirx.PrimExpr) -> tirx.PrimExpr:
    bits = tirx.reinterpret("uint32", v)
    kept = tirx.bitwise_and(bits, tirx.const(0xFFFF0000, "uint32"))
    return tirx.reinterpret("float32", kept)


@_like(_GELU)
def mut_gelu_f32_out(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """gelu that computes float16/bfloat16 in float32 and returns the float32 result: its
    traced type is self-consistent, but the contract (output dtype = input dtype) breaks."""
    f = _gelu_tanh if approximate == "tanh" else _gelu_erf
    return te.compute(x.shape, lambda *i: f(acc(x(*i))), name="mut_gelu_f32_out")


def _round_half_away(v: tirx.PrimExpr) -> tirx.PrimExpr:
    # C's round(); TVM's tirx.round lowers to nearbyint (ties to even), the correct mode
    return tirx.Select(v < 0, -tirx.floor(0.5 - v), tirx.floor(v + 0.5))


def _quantize_mutant(name: str, doc: str, *, rnd=tirx.nearbyint, last_axis: bool = False,
                     fixed_dtype: str | None = None, saturate: bool = True,
                     reciprocal: bool = False) -> opsdk.OpDef:
    """The built-in quantize compute with one bug: another rounding, the channel always from
    the last axis, a fixed output dtype, no saturation, or a multiplication by the rounded
    reciprocal of the scale instead of the division."""
    from opsdk.ops._quant import clamp_te, per_channel_index

    def compute(
        x: Tensor,
        scale: Tensor,
        zero_point: Tensor,
        *,
        axis: Axis = -1,
        per_channel: bool = False,
        out_dtype: Literal["int8", "uint8"] = "int8",
    ) -> te.Tensor:
        a = {"axis": len(x.shape) - 1 if last_axis else axis, "per_channel": per_channel}
        dt = fixed_dtype or out_dtype

        def body(*i):
            c = per_channel_index(i, a)
            q = x(*i) * (1.0 / scale(c)) if reciprocal else x(*i) / scale(c)
            r = tirx.max(tirx.min(rnd(q), 2.0**30), -(2.0**30))
            v = r.astype("int32") + zero_point(c)
            return clamp_te(v, dt) if saturate else v.astype(dt)

        return te.compute(x.shape, body, name=name)

    compute.__doc__ = doc
    return _like(_QUANTIZE, name=name)(compute)


@_like(_QUANTIZE)
def eq_quantize_float_clamp(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    *,
    axis: Axis = -1,
    per_channel: bool = False,
    out_dtype: Literal["int8", "uint8"] = "int8",
) -> te.Tensor:
    """Equivalent: quantize adding the zero point and saturating in float32 before one cast
    (exact: rounded quotients and zero points are integers far below 2**24 after the clamp)."""
    from opsdk.ops._quant import QRANGE, per_channel_index

    a = {"axis": axis, "per_channel": per_channel}
    lo, hi = QRANGE[out_dtype]

    def body(*i):
        c = per_channel_index(i, a)
        v = tirx.nearbyint(x(*i) / scale(c)) + zero_point(c).astype("float32")
        return tirx.max(tirx.min(v, float(hi)), float(lo)).astype(out_dtype)

    return te.compute(x.shape, body, name="eq_quantize_float_clamp")


mut_quantize_int8_only = _quantize_mutant(
    "mut_quantize_int8_only", "quantize that ignores ``out_dtype`` and always returns int8.",
    fixed_dtype="int8")
mut_quantize_half_away = _quantize_mutant(
    "mut_quantize_half_away", "quantize that rounds ties away from zero instead of to even.",
    rnd=_round_half_away)
mut_quantize_half_up = _quantize_mutant(
    "mut_quantize_half_up", "quantize that rounds ties up (``floor(v + 0.5)``).",
    rnd=lambda v: tirx.floor(v + 0.5))
mut_quantize_last_axis = _quantize_mutant(
    "mut_quantize_last_axis", "per-channel quantize that takes the channel from the last axis.",
    last_axis=True)
mut_quantize_reciprocal = _quantize_mutant(
    "mut_quantize_reciprocal", "quantize that multiplies by ``1 / scale`` (rounded) instead of "
    "dividing: off by one where x / scale is within an ulp of a tie.", reciprocal=True)
mut_quantize_wraps = _quantize_mutant(
    "mut_quantize_wraps", "quantize without saturation: out-of-range values wrap in the cast.",
    saturate=False)


@_like(_GELU)
def eq_gelu_distributed(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """Equivalent: GELU as ``v * (0.5 + 0.5 f)`` (f = erf or tanh) instead of
    ``0.5 v (1 + f)``."""

    def out(*i):
        v = acc(x(*i))
        if approximate == "tanh":
            f = tirx.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v))
        else:
            f = tirx.erf(v * (1.0 / math.sqrt(2.0)))
        return (v * (0.5 + 0.5 * f)).astype(x.dtype)

    return te.compute(x.shape, out, name="eq_gelu_distributed")


@_like(_GELU)
def mut_gelu_bf16_trunc(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """gelu whose bfloat16 output is truncated (round toward zero) instead of rounded."""
    f = _gelu_tanh if approximate == "tanh" else _gelu_erf

    def out(*i):
        y = f(acc(x(*i)))
        if str(x.dtype) == "bfloat16":
            y = _round_bf16_truncating(y)
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name="mut_gelu_bf16_trunc")


@_like(_GELU)
def mut_gelu_last_tile(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """Correct gelu; its schedule rule (below) skips the last partial tile of rows."""
    f = _gelu_tanh if approximate == "tanh" else _gelu_erf
    return te.compute(x.shape, lambda *i: f(acc(x(*i))).astype(x.dtype), name="mut_gelu_last_tile")


@opsdk.rule(
    "mut_gelu_last_tile", "cpu", name="mut.tiles_without_last", priority=1000, claims=("parallel",)
)
def _tiles_without_last(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Tiles of 4 along the first axis in parallel, forgetting the partial last tile."""
    sch = s_tir.Schedule(func)
    loop = sch.get_loops(sch.get_sblock("mut_gelu_last_tile"))[0]
    n = sch.get(loop).extent
    outer, _ = sch.split(loop, factors=[None, 4])
    sch.parallel(outer)
    return _drop_partial_tile(sch, outer, n, 4)


# ------------------------------------------------------------------------------ bias_gelu


@_like(_BIAS_GELU)
def mut_bias_gelu_wrong_axis(
    x: Tensor, bias: Tensor, *, approximate: Literal["none", "tanh"] = "none"
) -> te.Tensor:
    """bias_gelu that broadcasts the bias along the first axis instead of the last."""
    f = _gelu_tanh if approximate == "tanh" else _gelu_erf
    c = bias.shape[0]
    return te.compute(
        x.shape,
        lambda *i: f(acc(x(*i)) + acc(bias(i[0] % c))).astype(x.dtype),
        name="mut_bias_gelu_wrong_axis",
    )


# ------------------------------------------------------------------------- more realistic bugs


@_like(_DEQUANTIZE)
def mut_dequantize_no_zp(
    q: Tensor, scale: Tensor, zero_point: Tensor, *, axis: Axis = -1, per_channel: bool = False
) -> te.Tensor:
    """dequantize that forgets to subtract the zero point."""
    from opsdk.ops._quant import per_channel_index

    a = {"axis": axis, "per_channel": per_channel}
    return te.compute(
        q.shape,
        lambda *i: q(*i).astype("float32") * scale(per_channel_index(i, a)),
        name="mut_dequantize_no_zp",
    )


@_like(_REQUANTIZE)
def mut_requantize_truncate(
    x: Tensor,
    multiplier: Tensor,
    shift: Tensor,
    *,
    axis: Axis = -1,
    per_channel: bool = False,
    input_zero_point: int = 0,
    output_zero_point: int = 0,
    out_dtype: Literal["int8", "uint8"] = "int8",
) -> te.Tensor:
    """requantize that shifts right without adding half first (rounds toward -inf)."""
    from opsdk.ops._quant import clamp_te, per_channel_index

    a = {"axis": axis, "per_channel": per_channel}

    def body(*i):
        c = per_channel_index(i, a)
        n = shift(c).astype("int64") + 31
        v = (x(*i).astype("int64") - input_zero_point) * multiplier(c).astype("int64")
        return clamp_te(tirx.shift_right(v, n) + output_zero_point, out_dtype)

    return te.compute(x.shape, body, name="mut_requantize_truncate")


@_like(_SOFTMAX)
def mut_softmax_narrow_sum(x: Tensor, *, axis: Axis = -1) -> te.Tensor:
    """softmax that sums the exponentials in the input dtype (float16/bfloat16)."""
    nd = len(x.shape)
    ax = axis % nd

    def idx(o, r):
        return (*o[:ax], r, *o[ax:])

    outer = [x.shape[i] for i in range(nd) if i != ax]
    rm = te.reduce_axis((0, x.shape[ax]), name="rm")
    mx = te.compute(outer, lambda *o: te.max(x(*idx(o, rm)), axis=rm), name="max")
    e = te.compute(x.shape, lambda *i: tirx.exp(acc(x(*i)) - acc(mx(*i[:ax], *i[ax + 1:]))),
                   name="exp")
    rs = te.reduce_axis((0, x.shape[ax]), name="rs")
    s = te.compute(outer, lambda *o: te.sum(e(*idx(o, rs)).astype(x.dtype), axis=rs),
                   name="sum")
    return te.compute(
        x.shape,
        lambda *i: (e(*i) / acc(s(*i[:ax], *i[ax + 1:]))).astype(x.dtype),
        name="mut_softmax_narrow_sum",
    )


@_like(_BIAS_GELU)
def mut_bias_gelu_bias_after(
    x: Tensor, bias: Tensor, *, approximate: Literal["none", "tanh"] = "none"
) -> te.Tensor:
    """bias_gelu that adds the bias after the activation: gelu(x) + b."""
    f = _gelu_tanh if approximate == "tanh" else _gelu_erf
    nd = len(x.shape)
    return te.compute(
        x.shape,
        lambda *i: (f(acc(x(*i))) + acc(bias(i[nd - 1]))).astype(x.dtype),
        name="mut_bias_gelu_bias_after",
    )


@_like(_GELU)
def mut_gelu_tanh_coeff(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """tanh GELU with a rounded cubic coefficient (0.0447 for 0.044715)."""

    def f(v):
        if approximate != "tanh":
            return _gelu_erf(v)
        inner = math.sqrt(2.0 / math.pi) * (v + 0.0447 * v * v * v)
        return 0.5 * v * (1.0 + tirx.tanh(inner))

    return te.compute(x.shape, lambda *i: f(acc(x(*i))).astype(x.dtype),
                      name="mut_gelu_tanh_coeff")


#: What each mutant gets wrong (for the test table).
# ------------------------------------------------------------------------- kernel families
# The rules for the kernels TVM's own ops lower to (x86.matmul, x86.conv2d, x86.winograd) with
# one bug each, registered for a copy of the kernel family (same compute, reference and error
# model).
from opsdk.kernels import tvm_conv2d, tvm_conv2d_winograd, tvm_matmul  # noqa: E402
from opsdk.schedules._conv import schedule_conv2d  # noqa: E402
from opsdk.schedules._gemm import schedule_matmul  # noqa: E402
from opsdk.schedules._winograd import schedule_winograd  # noqa: E402


def _family_copy(base: opsdk.OpDef, name: str, **over) -> opsdk.OpDef:
    d = _like(base, free_dims=base.free_dims, name=name, **over)(base.compute)
    from opsdk.verify import error_model
    from opsdk.verify._tolerance import _MODELS

    error_model(name)(_MODELS[base.name])
    return d


def _shorten(func: tirx.PrimFunc, pick, new_extent) -> tirx.PrimFunc:
    """Replace the extent of the first loop ``pick(node)`` selects by ``new_extent(extent)``."""
    done = []

    def cut(node: tirx.For, mut) -> tirx.For:
        if done or not pick(node):
            return mut.default_mutate(node)
        done.append(node)
        return tirx.For(node.loop_var, node.min, new_extent(node.extent), node.kind,
                        mut.mutate(node.body), node.thread_binding, node.annotations)

    return structural_mutate(func, [(tirx.For, cut)])


def _writeback_loops(func: tirx.PrimFunc) -> list:
    """The loops of the tile write-back: the last top-level nest's innermost loops."""
    from tvm_ffi.structural import structural_walk

    loops: list = []
    structural_walk(func, [(tirx.For, lambda n: loops.append(n))])
    return loops


mut_matmul_drop_tail = _family_copy(tvm_matmul, "mut_matmul_drop_tail")
mut_matmul_tile_edge = _family_copy(tvm_matmul, "mut_matmul_tile_edge")
mut_conv_tile_edge = _family_copy(tvm_conv2d, "mut_conv_tile_edge")


@opsdk.rule("mut_matmul_drop_tail", "cpu", name="mut.matmul_drop_tail", priority=1000,
            claims=("vectorize",))
def _matmul_drop_tail(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.matmul with 6-row tiles whose row-tile loop forgets the partial last tile."""
    sch = schedule_matmul(func, target, acc_regs=24, mr_max=6)
    if sch is None:
        return None
    f = sch.mod["main"]
    # The row axis is the output's second to last (te.compute names it i<rank - 2>); its
    # tile loop is i<rank - 2>_0 after the split. One tile fewer: the last (partial) tile.
    m_name = f"i{len(func.params[0].shape) - 2}_0"
    return s_tir.Schedule(_shorten(f, lambda n: str(n.loop_var.name) == m_name,
                                   lambda e: e - 1))


@opsdk.rule("mut_matmul_tile_edge", "cpu", name="mut.matmul_tile_edge", priority=1000,
            claims=("vectorize",))
def _matmul_tile_edge(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.matmul whose write-back covers one column fewer than its tile (a wrong edge)."""
    sch = schedule_matmul(func, target, acc_regs=24)
    if sch is None:
        return None
    f = sch.mod["main"]
    last = _writeback_loops(f)[-1]
    return s_tir.Schedule(_shorten(f, lambda n: n.same_as(last),
                                   lambda e: tirx.max(e - 1, 1)))


@opsdk.rule("mut_conv_tile_edge", "cpu", name="mut.conv_tile_edge", priority=1000,
            claims=("vectorize",))
def _conv_tile_edge(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.conv2d whose write-back skips the last pixel row of each tile (a wrong edge)."""
    sch = schedule_conv2d(func, target, acc_regs=24)
    if sch is None:
        return None
    f = sch.mod["main"]
    loops = _writeback_loops(f)
    serial = [lp for lp in loops[-3:] if lp.kind == tirx.ForKind.SERIAL
              and isinstance(lp.extent, tirx.IntImm) and int(lp.extent.value) > 1]
    if not serial:
        return sch
    return s_tir.Schedule(_shorten(f, lambda n: n.same_as(serial[0]),
                                   lambda e: e - 1))


mut_matmul_short_k = _family_copy(tvm_matmul, "mut_matmul_short_k")
mut_conv_short_rc = _family_copy(tvm_conv2d, "mut_conv_short_rc")


@opsdk.rule("mut_matmul_short_k", "cpu", name="mut.matmul_short_k", priority=1000,
            claims=("vectorize",))
def _matmul_short_k(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.matmul whose reduction loop stops one step early (the last k is never added)."""
    sch = schedule_matmul(func, target, acc_regs=24)
    if sch is None:
        return None
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: str(n.loop_var.name) == "k",
                                   lambda e: tirx.max(e - 1, 1)))


@opsdk.rule("mut_conv_short_rc", "cpu", name="mut.conv_short_rc", priority=1000,
            claims=("vectorize",))
def _conv_short_rc(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.conv2d whose input-channel loop forgets the last channel."""
    sch = schedule_conv2d(func, target, acc_regs=24)
    if sch is None:
        return None
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: str(n.loop_var.name) == "rc",
                                   lambda e: tirx.max(e - 1, 1)))


mut_winograd_short_c = _family_copy(tvm_conv2d_winograd, "mut_winograd_short_c")
mut_winograd_tile_edge = _family_copy(tvm_conv2d_winograd, "mut_winograd_tile_edge")


def _winograd_loop(sch: s_tir.Schedule, block: str, pick) -> tirx.Var | None:
    """The variable of the first loop around ``block`` that ``pick(loop)`` selects."""
    for lp in sch.get_loops(sch.get_sblock(block)):
        if pick(sch.get(lp)):
            return sch.get(lp).loop_var
    return None


@opsdk.rule("mut_winograd_short_c", "cpu", name="mut.winograd_short_c", priority=1000,
            claims=("vectorize",))
def _winograd_short_c(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.winograd whose GEMMs forget the last input channel."""
    sch = schedule_winograd(func, target, acc_regs=24)
    if sch is None:
        return None
    c = int(func.params[0].shape[3])
    var = _winograd_loop(sch, "wino_gemm_update", lambda lp: isinstance(lp.extent, tirx.IntImm)
                         and int(lp.extent.value) == c and lp.kind == tirx.ForKind.SERIAL)
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: n.loop_var.same_as(var),
                                   lambda e: tirx.max(e - 1, 1)))


@opsdk.rule("mut_winograd_tile_edge", "cpu", name="mut.winograd_tile_edge", priority=1000,
            claims=("vectorize",))
def _winograd_tile_edge(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.winograd whose output transform writes the left column of each 2x2 tile only."""
    sch = schedule_winograd(func, target, acc_regs=24)
    if sch is None:
        return None
    loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("wino_output"))]
    pairs = [lp.loop_var for lp in loops if lp.kind == tirx.ForKind.UNROLLED]
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: n.loop_var.same_as(pairs[-1]),
                                   lambda e: e - 1))


@_like(_SOFTMAX)
def mut_softmax_merge_short(x: Tensor, *, axis: Axis = -1) -> te.Tensor:
    """Correct softmax; its rule (below) drops the last chunk of the merged exp-and-sum loop."""
    return _SOFTMAX.compute(x, axis=axis)


@opsdk.rule("mut_softmax_merge_short", "cpu", name="mut.merge_short", priority=1000,
            claims=("vectorize", "parallel"))
def _merge_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The rows rule whose merged exp-and-sum loop (built only on static, round extents up to
    32 MB) stops one chunk early: those exps are neither stored nor summed."""
    from opsdk.schedules._rows import schedule_rows

    sch = schedule_rows(func, target, accumulators=4 if "arm_cpu" in target.keys else 2)
    if sch is None:
        return None
    # (a row of one chunk, as in the arm corner, loses all of it)
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: str(n.loop_var.name).endswith("_m"),
                                   lambda e: e - 1))


from opsdk.kernels import tvm_mean  # noqa: E402

mut_mean_columns_short = _family_copy(tvm_mean, "mut_mean_columns_short")


@opsdk.rule("mut_mean_columns_short", "cpu", name="mut.mean_columns_short", priority=1000,
            claims=("vectorize",))
def _mean_columns_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The columns rule (channels-last mean) whose outer reduction loop stops one step early:
    the last row of the window is never added (NCHW keeps the built-in rows rule)."""
    from opsdk.schedules._rows import schedule_columns

    sch = schedule_columns(func, target)
    if sch is None:
        return None
    # topi.sum names its reduction loops k<axis>: the first one met is the outermost
    return s_tir.Schedule(_shorten(sch.mod["main"],
                                   lambda n: str(n.loop_var.name).startswith("k"),
                                   lambda e: e - 1))


from opsdk.kernels import tvm_reduce  # noqa: E402

mut_reduce_rows_short = _family_copy(tvm_reduce, "mut_reduce_rows_short")


@opsdk.rule("mut_reduce_rows_short", "cpu", name="mut.reduce_rows_short", priority=1000,
            claims=("vectorize",))
def _reduce_rows_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The rows rule on a plain reduction (no epilogue: the row results copied out) whose
    outer partial-sum loop runs one chunk short (the middle axis keeps the columns rule)."""
    from opsdk.schedules._rows import schedule_rows

    sch = schedule_rows(func, target)
    if sch is None:
        return None
    # the first serial loop around the partial sums' update (the outer chunk loop)
    return s_tir.Schedule(_shorten(
        sch.mod["main"],
        lambda n: n.kind == tirx.ForKind.SERIAL and "rf_update" in str(n.body),
        lambda e: e - 1))


# ------------------------------------------------------------- compile-time weight packing
# Bugs in the packing of constant weights only (the block annotated
# meta_schedule.layout_rewrite_preproc, which a model folds at compile time): runtime weights
# take the other path and are right, so only verify's packed cases (Case.packed) see them.


def _short_preproc(sch: s_tir.Schedule, loop: int) -> s_tir.Schedule:
    """``sch`` with loop ``loop`` of its compile-time weight packing one iteration short (as
    it is when the weights are not constant: no such block)."""
    pre = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
           if "meta_schedule.layout_rewrite_preproc" in sch.get(b).annotations]
    if not pre:
        return sch
    var = sch.get(sch.get_loops(pre[0])[loop]).loop_var
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: n.loop_var.same_as(var),
                                   lambda e: e - 1))


# Without n = 1: a rank-3 tanh matmul with one output feature takes x86.matmul ~40 s to
# compile (TVM / LLVM, the same at HEAD), which the random search after the failing packed
# corner would otherwise pay.
mut_matmul_packed_k = _family_copy(
    tvm_matmul, "mut_matmul_packed_k", weights=tvm_matmul.weights,
    attr_domain={**tvm_matmul.attr_domain, "n": [n for n in tvm_matmul.attr_domain["n"] if n > 1]})
mut_winograd_packed_e = _family_copy(tvm_conv2d_winograd, "mut_winograd_packed_e",
                                     weights=tvm_conv2d_winograd.weights)


@opsdk.rule("mut_matmul_packed_k", "cpu", name="mut.matmul_packed_k", priority=1000,
            claims=("vectorize",))
def _matmul_packed_k(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.matmul whose packing of a constant B skips B's last row (k)."""
    sch = schedule_matmul(func, target, acc_regs=24)
    return None if sch is None else _short_preproc(sch, 0)


# Not in BUGS (the suite's time budget: 17-30 s of shrinking over static conv shapes); by
# hand: PYTHONPATH=tests/host opsdk verify mut_winograd_packed_e --module verify_mutants
@opsdk.rule("mut_winograd_packed_e", "cpu", name="mut.winograd_packed_e", priority=1000,
            claims=("vectorize",))
def _winograd_packed_e(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.winograd whose transform of constant weights skips the last of the 16 points."""
    sch = schedule_winograd(func, target, acc_regs=24)
    return None if sch is None else _short_preproc(sch, 0)


# ------------------------------------------------------------------------------ qconv2d

_QCONV = opsdk.get_op("qconv2d")
_QCONV_ATTRS = ("layout", "stride", "padding", "depthwise", "x_scale", "x_zero_point",
                "out_dtype", "out_scale", "out_zero_point", "per_channel")


@_like(_QCONV)
def mut_qconv2d_zp_sign(
    x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None, *,
    layout: Literal["NCHW", "NHWC"] = "NCHW", stride: int = 1, padding: int = 0,
    depthwise: bool = False, x_scale: float = 1.0, x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8", out_scale: float = 1.0,
    out_zero_point: int = 0, per_channel: bool = True,
) -> te.Tensor:
    """qconv2d adding the input zero point instead of subtracting it."""
    a = dict(zip(_QCONV_ATTRS, (layout, stride, padding, depthwise, x_scale, -x_zero_point,
                                out_dtype, out_scale, out_zero_point, per_channel)))
    return _QCONV.compute(x, w, w_scale, bias, **a)


@_like(_QCONV)
def mut_qconv2d_int16_acc(
    x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None, *,
    layout: Literal["NCHW", "NHWC"] = "NCHW", stride: int = 1, padding: int = 0,
    depthwise: bool = False, x_scale: float = 1.0, x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8", out_scale: float = 1.0,
    out_zero_point: int = 0, per_channel: bool = True,
) -> te.Tensor:
    """qconv2d accumulating in int16: the sums wrap modulo 2**16 (then bias and epilogue)."""
    from opsdk.ops._quant import round_to_te

    a = dict(zip(_QCONV_ATTRS, (layout, stride, padding, depthwise, x_scale, x_zero_point,
                                "int32", out_scale, out_zero_point, per_channel)))
    acc = _QCONV.compute(x, w, w_scale, None, **a)
    ch = 1 if layout == "NCHW" else 3

    def body(*i):
        v = acc(*i).astype("int16").astype("int32")
        if bias is not None:
            v = v + bias(i[ch])
        if out_dtype == "int32":
            return v
        sc = tirx.const(x_scale, "float32") * w_scale(i[ch] if per_channel else 0)
        if out_dtype == "float32":
            return v.astype("float32") * sc
        return round_to_te(v.astype("float32") * (sc / tirx.const(out_scale, "float32")),
                           out_zero_point, out_dtype)

    return te.compute(acc.shape, body, name="mut_qconv2d_int16_acc")


@_like(_QCONV)
def mut_qconv2d_short_k(
    x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None, *,
    layout: Literal["NCHW", "NHWC"] = "NCHW", stride: int = 1, padding: int = 0,
    depthwise: bool = False, x_scale: float = 1.0, x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8", out_scale: float = 1.0,
    out_zero_point: int = 0, per_channel: bool = True,
) -> te.Tensor:
    """Correct qconv2d; its rule (below) forgets the last block of 4 input channels."""
    a = dict(zip(_QCONV_ATTRS, (layout, stride, padding, depthwise, x_scale, x_zero_point,
                                out_dtype, out_scale, out_zero_point, per_channel)))
    return _QCONV.compute(x, w, w_scale, bias, **a)


@opsdk.rule("mut_qconv2d_short_k", "cpu", name="mut.qconv2d_short_k", priority=1000,
            claims=("vectorize", "parallel"))
def _qconv2d_short_k(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The host's int8 qconv2d rule (VNNI, else AVX2 on x86; sdot, else smull on aarch64)
    whose register kernel stops one input-channel block early."""
    from opsdk.schedules._qconv import schedule_qconv2d

    kernel, act, rows, cols = _int8_kernel(target)
    sch = schedule_qconv2d(func, target, kernel, act_dtype=act, rows=rows, cols=cols)
    if sch is None:
        return None
    return s_tir.Schedule(_shorten(
        sch.mod["main"], lambda n: n.loop_var.name == "q" and int(n.extent) > 1,
        lambda e: e - 1))


# ------------------------------------------------------------- more kernel-rule bug classes
# One bug each in a real rule's schedule (the rule's own function, then one node of its
# output changed): the fused epilogue's order, the padding, the weight packing, the pooling
# window, a Winograd transform coefficient, the int8 zero-point compensation.

from tvm.ir import Call, TensorLoad  # noqa: E402

from opsdk.kernels import tvm_pool2d  # noqa: E402
from opsdk.schedules._fallback import schedule_fallback  # noqa: E402


def _store_values(func: tirx.PrimFunc, pick, change) -> tirx.PrimFunc:
    """``func`` with ``change(value)`` for the value of every BufferStore ``pick(store)``
    selects."""
    def store(node: tirx.BufferStore, mut) -> tirx.BufferStore:
        node = mut.default_mutate(node)
        if not pick(node):
            return node
        return tirx.BufferStore(node.buffer, change(node.value), node.indices)

    return structural_mutate(func, [(tirx.BufferStore, store)])


def _replace(expr: tirx.PrimExpr, typ, change) -> tirx.PrimExpr:
    """``expr`` with each ``typ`` node ``n`` replaced by ``change(n)`` (None: kept)."""
    def visit(node, mut):
        node = mut.default_mutate(node)
        out = change(node)
        return node if out is None else out

    return structural_mutate(expr, [(typ, visit)])


mut_matmul_epilogue_order = _family_copy(tvm_matmul, "mut_matmul_epilogue_order")


@opsdk.rule("mut_matmul_epilogue_order", "cpu", name="mut.matmul_epilogue_order",
            priority=1000, claims=("vectorize",))
def _matmul_epilogue_order(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.matmul whose fused write-back applies the activation before the residual add:
    ``act(acc + bias) + residual`` for ``act(acc + bias + residual)``."""
    sch = schedule_matmul(func, target, acc_regs=24)
    if sch is None:
        return None
    f = sch.mod["main"]
    if not any(p.name == "residual" for p in f.params):
        return sch
    out = f.params[-1].name

    def reorder(v: tirx.PrimExpr) -> tirx.PrimExpr:
        loads: list = []

        def drop(n):  # (pre + residual) -> pre, remembering the residual's load
            if isinstance(n.b, TensorLoad) and n.b.source.name == "residual":
                loads.append(n.b)
                return n.a
            return None

        v = _replace(v, tirx.Add, drop)
        return v + loads[0] if loads else v

    return s_tir.Schedule(_store_values(f, lambda st: st.buffer.name == out, reorder))


mut_conv_pad_edge = _family_copy(tvm_conv2d, "mut_conv_pad_edge")


@opsdk.rule("mut_conv_pad_edge", "cpu", name="mut.conv_pad_edge", priority=1000,
            claims=("vectorize",))
def _conv_pad_edge(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.conv2d whose padding bounds are one short at the far edges: the padded copy (or
    the in-place bounds test of a depthwise NHWC or few-channel conv) reads the input's
    last row and last column as zeros."""
    sch = schedule_conv2d(func, target, acc_regs=24)
    if sch is None:
        return None

    def short_bound(n):  # `i < H + p` -> `i < H + p - 1`
        if isinstance(n.b, tirx.IntImm):
            return n.a < n.b.value - 1
        return None

    def pad(n):
        if getattr(n.op, "name", "") != "prim.if_then_else":
            return None
        return tirx.if_then_else(_replace(n.args[0], tirx.LT, short_bound), *n.args[1:])

    return s_tir.Schedule(_store_values(sch.mod["main"], lambda st: True,
                                        lambda v: _replace(v, Call, pad)))


mut_conv_pack_short = _family_copy(tvm_conv2d, "mut_conv_pack_short",
                                   weights=tvm_conv2d.weights)


@opsdk.rule("mut_conv_pack_short", "cpu", name="mut.conv_pack_short", priority=1000,
            claims=("vectorize",))
def _conv_pack_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.conv2d whose weight packing (at run time, or folded at compile time for constant
    weights) leaves its last element block short: the innermost copy loop of the last
    packing nest (the last output channel in HWIO, the last window column in OIHW, the
    channel tail's block where the channels do not fill the tile) runs one step fewer."""
    sch = schedule_conv2d(func, target, acc_regs=24)
    if sch is None:
        return None
    f = sch.mod["main"]
    from tvm_ffi.structural import structural_walk

    loops: list = []
    structural_walk(f, [(tirx.For, lambda n: loops.append(n))])
    # the packing is the cache_read of the weight (blocks w_global*); its innermost loops
    # hold no other loop
    pack = [lp for lp in loops if 'sblock("w_global' in str(lp.body)
            and "for " not in str(lp.body)]
    if not pack:
        return sch
    return s_tir.Schedule(_shorten(f, lambda n: n.same_as(pack[-1]), lambda e: e - 1))


mut_pool_window_short = _family_copy(tvm_pool2d, "mut_pool_window_short")


@opsdk.rule("mut_pool_window_short", "cpu", name="mut.pool_window_short", priority=1000,
            claims=("vectorize",))
def _pool_window_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.pool (the fallback schedule) whose window-column loop stops one tap early: each
    window's last column is never read (an average still divides by the full count)."""
    sch = schedule_fallback(func, target)
    if sch is None:
        return None
    # topi.nn.pool2d names its window loops rv0 (rows), rv1 (columns)
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: str(n.loop_var.name) == "rv1",
                                   lambda e: e - 1))


mut_winograd_input_sign = _family_copy(tvm_conv2d_winograd, "mut_winograd_input_sign")


@opsdk.rule("mut_winograd_input_sign", "cpu", name="mut.winograd_input_sign", priority=1000,
            claims=("vectorize",))
def _winograd_input_sign(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """x86.winograd whose input transform has one wrong coefficient: the first -1 of
    B^T d B's table (point 2, ``-d[0][1]``) written as +1."""
    sch = schedule_winograd(func, target, acc_regs=24)
    if sch is None:
        return None
    done: list = []

    def flip(n):
        if done or n.value != -1.0:
            return None
        done.append(n)
        return tirx.const(1.0, "float32")

    return s_tir.Schedule(_store_values(
        sch.mod["main"], lambda st: st.buffer.name == "wino_input",
        lambda v: _replace(v, tirx.FloatImm, flip)))


_QDENSE = opsdk.get_op("qdense")
mut_qdense_comp_short = _like(_QDENSE, name="mut_qdense_comp_short",
                              weights=_QDENSE.weights)(_QDENSE.compute)


def _int8_kernel(target: Target):
    """The micro-kernel, activation dtype and tile (rows, cols) the host's real int8 rules
    use on ``target``: VNNI or AVX2 on x86, sdot or smull on aarch64."""
    from opsdk.targets import target_arch, target_features

    feats = target_features(target)
    if target_arch(target) == "aarch64":
        from opsdk.schedules.arm_cpu.dotprod import COLS, NEON_SMULL, ROWS, SDOT

        return (SDOT if "dotprod" in feats else NEON_SMULL), "int8", ROWS, COLS
    if "avx512vnni" in feats:
        from opsdk.schedules.cpu.vnni import COLS, ROWS, VNNI

        return VNNI, "uint8", ROWS, COLS
    from opsdk.schedules.cpu.avx2 import AVX2_PMADDWD, COLS, ROWS

    return AVX2_PMADDWD, "int8", ROWS, COLS


@opsdk.rule("mut_qdense_comp_short", "cpu", name="mut.qdense_comp_short", priority=1000,
            claims=("vectorize", "parallel"))
def _qdense_comp_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The int8 qdense rule (VNNI / AVX2 on x86, sdot / smull on aarch64) whose zero-point
    compensation ``(x_zero_point + shift) * sum_k w`` sums the weights over all 4-byte K
    groups but the last (the GEMM itself is right)."""
    from opsdk.schedules._qgemm import schedule_qdense

    kernel, act, rows, cols = _int8_kernel(target)
    sch = schedule_qdense(func, target, kernel, act_dtype=act, rows=rows, cols=cols)
    if sch is None:
        return None
    # wsum_lanes' reduction over the K groups (absent when the zero point cancels the shift)
    return s_tir.Schedule(_shorten(sch.mod["main"], lambda n: str(n.loop_var.name) == "rg",
                                   lambda e: tirx.max(e - 1, 0)))


_DENSE_Q4 = opsdk.get_op("dense_q4")
mut_q4_scale_short = _like(_DENSE_Q4, name="mut_q4_scale_short",
                           weights=_DENSE_Q4.weights)(_DENSE_Q4.compute)


@opsdk.rule("mut_q4_scale_short", "cpu", name="mut.q4_scale_short", priority=1000,
            claims=("vectorize", "parallel"))
def _q4_scale_short(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The weight-only dense rule (x86.wdense / neon.wdense, float32 activations) whose
    packing of the q4_0 group scales (``dp``) stops one group early: the last 32 weights of
    every row are scaled by whatever the buffer held."""
    from tvm_ffi.structural import structural_walk

    from opsdk.schedules._core import accumulator_registers
    from opsdk.schedules._wgemm import schedule_wdense

    sch = schedule_wdense(func, target, acc_regs=accumulator_registers(target))
    if sch is None:
        return None
    f = sch.mod["main"]
    group_vars: list = []  # the loop variables dp's group index (its 2nd axis) is bound to

    def realize(n):
        if n.block.name_hint == "dp":
            structural_walk(n.iter_values[1], [(tirx.Var, lambda v: group_vars.append(v))])

    structural_walk(f, [(s_tir.SBlockRealize, realize)])
    if not group_vars:
        return sch
    return s_tir.Schedule(_shorten(f, lambda n: any(n.loop_var.same_as(v) for v in group_vars),
                                   lambda e: e - 1))


#: Mutants whose bug is in a schedule rule (the compute is correct): checked on arm too.
RULE_MUTANTS = ("mut_ln_vec_tail", "mut_gelu_last_tile", "mut_matmul_drop_tail",
                "mut_matmul_tile_edge", "mut_conv_tile_edge", "mut_matmul_short_k",
                "mut_conv_short_rc", "mut_softmax_merge_short", "mut_winograd_short_c",
                "mut_winograd_tile_edge", "mut_mean_columns_short", "mut_reduce_rows_short")

#: Kernel-rule mutants checked in the suite on one cell, by verify's corner cases alone (no
#: random search, no shrinking: the suite's time budget): name -> (dtype, layout, arm
#: target). ``scripts/kernel-mutants.py`` runs them like the others (every cell,
#: many seeds; arm's int8 rules on arm-dotprod). The suite's arm runs share one emulated
#: Cortex-A72: the compensation on the smull rule (the sdot rule's code but the
#: micro-kernel; a Cortex-A76 server would cost another start).
CORNER_MUTANTS = {
    "mut_matmul_epilogue_order": ("float32", "kn", "arm"),
    "mut_conv_pad_edge": ("float32", "NHWC", "arm"),
    "mut_conv_pack_short": ("float32", "NCHW", "arm"),
    "mut_pool_window_short": ("float32", "NHWC_avg", "arm"),
    "mut_qdense_comp_short": ("uint8", "float32", "arm"),
    "mut_q4_scale_short": ("float32", "float32", "arm"),
}

#: Not run by the suite (its time budget: a Winograd kernel and its generic lowering take
#: 4-9 s to compile per signature): measured by scripts/kernel-mutants.py.
BY_HAND = ("mut_winograd_packed_e", "mut_winograd_input_sign")


def first_failing_corner(d: opsdk.OpDef, target: str, dtype: str, layout: str,
                         runner=None):
    """The first of verify's corner cases for the cell that fails on ``target`` (a
    CaseResult), or None: verify's deterministic examples without its random search and
    shrinking. ``d`` must be registered."""
    from opsdk._dtypes import np_dtype
    from opsdk.schedules import vector_lanes
    from opsdk.verify import run_case
    from opsdk.verify._strategies import corner_cases

    lanes = vector_lanes(opsdk.target(target), np_dtype(dtype).itemsize * 8)
    for case in corner_cases(d, target, dtype, layout, lanes):
        res = run_case(case, runner=runner, op=d)
        if not res.ok:
            return res
    return None


#: Every kernel-rule mutant (a real rule's schedule with one bug), by bug class: what
#: ``scripts/kernel-mutants.py`` measures.
KERNEL_MUTANTS = {
    "mut_matmul_drop_tail": "tail",
    "mut_matmul_tile_edge": "tile edge",
    "mut_conv_tile_edge": "tile edge",
    "mut_matmul_short_k": "reduction",
    "mut_conv_short_rc": "reduction",
    "mut_winograd_short_c": "reduction",
    "mut_winograd_tile_edge": "tile edge",
    "mut_matmul_packed_k": "layout packing",
    "mut_winograd_packed_e": "Winograd weight transform",
    "mut_mean_columns_short": "reduction",
    "mut_reduce_rows_short": "reduction",
    "mut_qconv2d_short_k": "int8 reduction",
    "mut_matmul_epilogue_order": "epilogue order",
    "mut_conv_pad_edge": "padding",
    "mut_conv_pack_short": "layout packing",
    "mut_pool_window_short": "pool window",
    "mut_winograd_input_sign": "Winograd input transform",
    "mut_qdense_comp_short": "int8 compensation",
    "mut_q4_scale_short": "weight-only dequant scale",
}

#: Mutants caught by a check other than the numbers (mismatch / invariance).
STATUS = {"mut_gelu_f32_out": "type", "mut_quantize_int8_only": "type"}

BUGS = {
    "mut_ln_eps_outside": "epsilon added outside the sqrt",
    "mut_ln_unbiased": "unbiased variance (divides by n - 1)",
    "mut_ln_vec_tail": "schedule drops the vector tail (axis not a multiple of 16)",
    "mut_ln_fp16_acc": "accumulates in the input dtype (float16/bfloat16)",
    "mut_ln_one_pass": "one-pass variance E[x^2] - E[x]^2",
    "mut_ln_no_beta": "ignores beta",
    "mut_rms_no_eps": "rms_norm without epsilon",
    "mut_gn_nhwc_axis": "NHWC group_norm takes the channel from axis 1",
    "mut_softmax_no_max": "softmax without max subtraction",
    "mut_gelu_tanh_as_erf": "tanh GELU posing as the erf form",
    "mut_gelu_bf16_trunc": "bfloat16 output truncated instead of rounded",
    "mut_gelu_f32_out": "float16/bfloat16 input, float32 output (dtype contract)",
    "mut_quantize_int8_only": "ignores out_dtype, always int8 (dtype contract)",
    "mut_quantize_half_away": "rounds ties away from zero instead of to even",
    "mut_quantize_half_up": "rounds ties up (floor(v + 0.5)) instead of to even",
    "mut_quantize_last_axis": "per-channel quantize ignores axis (uses the last)",
    "mut_softmax_last_axis": "softmax ignores axis (normalizes the last)",
    "mut_dequantize_no_zp": "dequantize forgets the zero point",
    "mut_requantize_truncate": "requantize shifts without rounding (toward -inf)",
    "mut_quantize_wraps": "quantize without saturation (wraps in the cast)",
    "mut_quantize_reciprocal": "quantize multiplies by a rounded 1 / scale instead of dividing",
    "mut_rms_no_sqrt": "rms_norm divides by the mean square, no square root",
    "mut_softmax_narrow_sum": "softmax sums in float16/bfloat16",
    "mut_bias_gelu_bias_after": "bias added after the activation",
    "mut_gelu_tanh_coeff": "tanh GELU coefficient 0.0447 instead of 0.044715",
    "mut_matmul_short_k": "matmul rule stops the reduction one k early",
    "mut_conv_short_rc": "conv2d rule forgets the last input channel",
    "mut_gelu_last_tile": "schedule skips the last tile of rows",
    "mut_bias_gelu_wrong_axis": "bias broadcast along the wrong axis",
    "mut_matmul_drop_tail": "matmul rule skips the last row tile (a dropped tail)",
    "mut_matmul_tile_edge": "matmul rule writes one column fewer per tile",
    "mut_conv_tile_edge": "conv2d rule writes one pixel row fewer per tile",
    "mut_winograd_short_c": "winograd rule's GEMMs forget the last input channel",
    "mut_winograd_tile_edge": "winograd rule writes the left column of each output tile only",
    "mut_matmul_packed_k": "matmul rule packs a constant B without its last row (packed cases)",
    "mut_softmax_merge_short": "softmax rule's merged exp-and-sum loop stops a chunk early",
    "mut_mean_columns_short": "channels-last mean rule forgets the last row of the window",
    "mut_reduce_rows_short": "rows rule on a plain reduction drops a partial-sum chunk",
    "mut_ln_overflow_zero": "layer_norm returns zeros, not NaN, when the sum of squares overflows",
    "mut_qconv2d_zp_sign": "qconv2d adds the input zero point instead of subtracting it",
    "mut_qconv2d_int16_acc": "qconv2d accumulates in int16 (wraps)",
    "mut_qconv2d_short_k": "qconv2d rule's kernel forgets the last 4-channel block",
    "mut_matmul_epilogue_order": "matmul rule applies the activation before the residual add",
    "mut_conv_pad_edge": "conv2d rule's padding reads the input's last row and column as 0",
    "mut_conv_pack_short": "conv2d rule's weight packing leaves its last element unpacked",
    "mut_pool_window_short": "pool rule skips the last column of each window",
    "mut_winograd_input_sign": "winograd rule's input transform has +1 for one -1",
    "mut_qdense_comp_short": "int8 qdense rule's compensation misses the last K group",
    "mut_q4_scale_short": "dense_q4 rule's scale packing skips the last group",
    "mut_winograd_packed_e": "winograd rule's constant weight transform skips a point",
}

#: Correct rewrites of built-ins (another evaluation order, a division for a reciprocal,
#: saturation in float): verify must pass them (a false alarm here is a model too tight).
EQUIVALENTS = {
    "eq_ln_gamma_folded": "layer_norm scaling by (rstd * gamma) in one product",
    "eq_ln_div_sqrt": "layer_norm with 1 / sqrt(var + eps) instead of rsqrt",
    "eq_softmax_divide": "softmax dividing by the sum, TVM's libm exp",
    "eq_gelu_distributed": "erf GELU as v * (0.5 + 0.5 erf(v / sqrt 2))",
    "eq_quantize_float_clamp": "quantize adding the zero point and saturating in float32",
}

OPS = [
    mut_ln_eps_outside,
    mut_ln_unbiased,
    mut_ln_vec_tail,
    mut_ln_fp16_acc,
    mut_ln_one_pass,
    mut_ln_no_beta,
    mut_rms_no_eps,
    mut_gn_nhwc_axis,
    mut_softmax_no_max,
    mut_gelu_tanh_as_erf,
    mut_gelu_bf16_trunc,
    mut_gelu_f32_out,
    mut_quantize_int8_only,
    mut_quantize_half_away,
    mut_quantize_half_up,
    mut_quantize_last_axis,
    mut_softmax_last_axis,
    mut_dequantize_no_zp,
    mut_requantize_truncate,
    mut_quantize_wraps,
    mut_quantize_reciprocal,
    mut_rms_no_sqrt,
    mut_softmax_narrow_sum,
    mut_bias_gelu_bias_after,
    mut_gelu_tanh_coeff,
    mut_matmul_short_k,
    mut_conv_short_rc,
    mut_gelu_last_tile,
    mut_bias_gelu_wrong_axis,
    mut_matmul_drop_tail,
    mut_matmul_tile_edge,
    mut_conv_tile_edge,
    mut_winograd_short_c,
    mut_winograd_tile_edge,
    mut_matmul_packed_k,
    mut_winograd_packed_e,  # not run by the suite: see its rule
    mut_softmax_merge_short,
    mut_mean_columns_short,
    mut_reduce_rows_short,
    mut_qconv2d_zp_sign,
    mut_qconv2d_int16_acc,
    mut_qconv2d_short_k,
    mut_ln_overflow_zero,
    mut_matmul_epilogue_order,
    mut_conv_pad_edge,
    mut_conv_pack_short,
    mut_pool_window_short,
    mut_winograd_input_sign,
    mut_qdense_comp_short,
    mut_q4_scale_short,
    eq_ln_gamma_folded,
    eq_ln_div_sqrt,
    eq_softmax_divide,
    eq_gelu_distributed,
    eq_quantize_float_clamp,
]
