"""``FuseIntoOps``: rewrite decomposed subgraphs, as exporters emit them, into fused ops.

- LayerNorm spelled out: ``d = x - mean(x); v = mean(d**2 | d*d); d / sqrt(v + eps)``
  (or ``d * rsqrt(v + eps)``), optionally ``* gamma`` and ``+ beta``  ->  ``opsdk.layer_norm``;
- RMSNorm spelled out: ``x * rsqrt(mean(x**2 | x*x) + eps)`` (or ``x / sqrt(...)``),
  optionally ``* gamma``  ->  ``opsdk.rms_norm``;
- bias add + GELU (TVM's ``gelu`` / ``gelu_tanh`` or ``opsdk.gelu``)  ->  ``opsdk.bias_gelu``;
- ``conv2d`` (+ bias) + inference ``batch_norm`` with constant weights and statistics  ->
  ``conv2d`` with the BN scale folded into its weights, plus a bias add. A ReLU after it
  stays and TVM's FuseOps fuses it into the convolution's epilogue.

Matching is structural (relax.dpl); every rule then checks the facts the pattern cannot say
(equal reduction axes, trailing axes, constant scalar epsilon, exponent 2, parameter shapes)
and leaves a near miss untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, is_tuple_get_item, wildcard

from .. import relax as _ops
from ._rewrite import (
    Rule,
    apply_rules,
    call_attr,
    const_value,
    float_tensor,
    same_dims,
    scalar_value,
    shape_of,
)

__all__ = ["FUSION_RULES", "FuseIntoOps"]


def _either(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    """``op(a, b)`` or ``op(b, a)`` for a commutative op."""
    return is_op(op)(a, b) | is_op(op)(b, a)


def _reduced_axes(call: relax.Call, ndim: int) -> list[int] | None:
    """Normalized axes of a keepdims mean, None when it does not keep dims or reduces all."""
    if not call_attr(call, "keepdims", False):
        return None
    axes = call_attr(call, "axis")
    if axes is None:
        return None
    return sorted(int(a) % ndim for a in axes)


def _trailing(axes: list[int], ndim: int) -> int | None:
    return -len(axes) if axes and axes == list(range(ndim - len(axes), ndim)) else None


def _param(p: relax.Expr, tail: tuple[Any, ...]) -> relax.Expr | None:
    """``p`` as a tensor of shape ``tail`` (the normalized axes), or None.

    Accepts exactly ``tail`` or ``(1, ..., 1, *tail)`` (reshaped); anything else, such as
    a per-row scale, is not a LayerNorm parameter.
    """
    shp = shape_of(p)
    if shp is None:
        return None
    k = len(tail)
    if len(shp) < k or not same_dims(shp[len(shp) - k :], tail):
        return None
    if any(not (isinstance(d, tvm.tirx.IntImm) and d.value == 1) for d in shp[: len(shp) - k]):
        return None
    return p if len(shp) == k else relax.op.reshape(p, list(tail))


# ---------------------------------------------------------------------------------------------
# LayerNorm and RMSNorm chains


class _NormChain:
    """Patterns for the decomposed LayerNorm (``center=True``) or RMSNorm chain."""

    def __init__(self, center: bool) -> None:
        self.center = center
        if center:
            self.x = wildcard()
        else:
            # RMSNorm of a centred value, x - mean(x), is a LayerNorm chain: if it reached this
            # rule, the LayerNorm rule turned it down as a near miss, so leave it too.
            y = wildcard()
            self.x = ~is_op("relax.subtract")(y, is_op("relax.mean")(y))
        self.mean1 = is_op("relax.mean")(self.x)
        self.d = is_op("relax.subtract")(self.x, self.mean1) if center else self.x
        self.two = is_const()
        self.pow = is_op("relax.power")(self.d, self.two)
        self.var = is_op("relax.mean")(self.pow | is_op("relax.multiply")(self.d, self.d))
        self.eps = is_const()
        ve = _either("relax.add", self.var, self.eps)
        self.norm = is_op("relax.divide")(self.d, is_op("relax.sqrt")(ve)) | _either(
            "relax.multiply", self.d, is_op("relax.rsqrt")(ve)
        )
        self.gamma = wildcard()
        self.beta = wildcard()
        self.scaled = _either("relax.multiply", self.norm, self.gamma)
        self.shifted = _either("relax.add", self.scaled, self.beta)

    def check(self, m: Any) -> tuple[relax.Expr, int, float] | None:
        """(x, begin_axis, epsilon) when the chain is a real norm over the trailing axes."""
        x = m[self.x]
        ty = float_tensor(x)
        if ty is None:
            return None
        var_axes = _reduced_axes(m[self.var], ty.ndim)
        if var_axes is None:
            return None
        if self.center and _reduced_axes(m[self.mean1], ty.ndim) != var_axes:
            return None  # centred with a mean over other axes than the variance
        begin = _trailing(var_axes, ty.ndim)
        if begin is None:
            return None
        if self.pow in m and scalar_value(m[self.two]) != 2.0:
            return None
        eps = scalar_value(m[self.eps])
        if eps is None or eps < 0:
            return None
        return x, begin, eps

    def rules(self) -> list[Rule]:
        name = "fuse.layer_norm" if self.center else "fuse.rms_norm"
        build = _ops.layer_norm if self.center else _ops.rms_norm

        def make(root: DFPattern, with_gamma: bool, with_beta: bool) -> Rule:
            def fused(orig: relax.Call, m: Any) -> relax.Expr | None:
                found = self.check(m)
                if found is None:
                    return None
                x, begin, eps = found
                tail = tuple(shape_of(x)[begin:])
                params = []
                for p, wanted in ((self.gamma, with_gamma), (self.beta, with_beta)):
                    if wanted:
                        q = _param(m[p], tail)
                        if q is None or float_tensor(m[p]) is None:
                            return None  # not a per-feature parameter: fuse less
                        if str(m[p].ty.dtype) != str(x.ty.dtype):
                            return None
                        params.append(q)
                return build(x, *params, begin_axis=begin, epsilon=eps)

            return Rule(name, root, fused)

        rules = [make(self.scaled, True, False), make(self.norm, False, False)]
        if self.center:  # RMSNorm has no shift
            rules.insert(0, make(self.shifted, True, True))
        return rules


# ---------------------------------------------------------------------------------------------
# bias + GELU

_GELU_OPS = {"relax.nn.gelu": "none", "relax.nn.gelu_tanh": "tanh", "opsdk.gelu": None}


def _bias_gelu_rules() -> list[Rule]:
    a, b = wildcard(), wildcard()
    add = is_op("relax.add")(a, b)
    rules = []
    for op, approx in _GELU_OPS.items():

        def fused(orig: relax.Call, m: Any, approx: str | None = approx) -> relax.Expr | None:
            mode = approx if approx is not None else str(call_attr(orig, "approximate", "none"))
            out = shape_of(orig)
            for x, bias in ((m[a], m[b]), (m[b], m[a])):
                xs = shape_of(x)
                if xs is None or out is None or not same_dims(xs, out):
                    continue
                if float_tensor(x) is None or str(bias.ty.dtype) != str(x.ty.dtype):
                    continue
                q = _param(bias, (out[-1],))
                if q is not None:
                    return _ops.bias_gelu(x, q, approximate=mode)
            return None  # e.g. a residual add: both operands are full tensors

        rules.append(Rule("fuse.bias_gelu", is_op(op)(add), fused))
    return rules


# ---------------------------------------------------------------------------------------------
# GroupNorm as exporters decompose it


def _group_norm_rules() -> list[Rule]:
    return [_group_norm_rule(affine=True), _group_norm_rule(affine=False)]


def _group_norm_rule(affine: bool) -> Rule:
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
                                 is_op("relax.sqrt")(_either("relax.add", var, eps)))
    ones = is_const() | is_op("relax.reshape")(is_const(), wildcard())
    zeros = is_const() | is_op("relax.reshape")(is_const(), wildcard())
    inorm = _either("relax.add", _either("relax.multiply", norm, ones), zeros) | norm
    restored = is_op("relax.reshape")(inorm, back)
    gamma, beta = wildcard(), wildcard()
    root = _either("relax.add", _either("relax.multiply", restored, gamma), beta) if affine \
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
            if _reduced_axes(m[ax], 3) != [2]:
                return None
        if call_attr(m[var], "unbiased", False):
            return None  # a sample variance is not GroupNorm's
        if not isinstance(rs[1], tvm.tirx.IntImm) or not isinstance(xs[1], tvm.tirx.IntImm):
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
            dims = [int(d.value) if isinstance(d, tvm.tirx.IntImm) else -1 for d in ps]
            if dims[-3:] != [channels, 1, 1] or any(d != 1 for d in dims[:-3]):
                return None  # per channel (C, 1, 1) only
            params.append(relax.op.reshape(m[p], [channels]))
        return _ops.group_norm(xv, *params, num_groups=groups, epsilon=e, layout="NCHW")

    return Rule("fuse.group_norm", root, fused)


# ---------------------------------------------------------------------------------------------
# conv2d + batch_norm folding


def _conv_bn_rule() -> Rule:
    x, w = wildcard(), is_const()
    conv = is_op("relax.nn.conv2d")(x, w)
    cbias = is_const() | is_op("relax.reshape")(is_const(), wildcard())
    cbias = cbias | is_op("relax.expand_dims")(is_const())
    conv_out = conv | _either("relax.add", conv, cbias)
    g, b, mu, var = is_const(), is_const(), is_const(), is_const()
    bn = is_op("relax.nn.batch_norm")(conv_out, g, b, mu, var)
    root = is_tuple_get_item(bn, 0)

    def fused(orig: relax.Expr, m: Any) -> relax.Expr | None:
        bn_call, conv_call = m[bn], m[conv]
        if call_attr(bn_call, "training", True):
            return None  # training-mode BN normalizes with batch statistics
        ty = float_tensor(conv_call)
        wv = const_value(m[w])
        if ty is None or wv is None or ty.ndim != 4:
            return None
        out_layout = str(call_attr(conv_call, "out_layout") or call_attr(conv_call, "data_layout"))
        kernel_layout = str(call_attr(conv_call, "kernel_layout"))
        if sorted(out_layout) != sorted("NCHW") or "O" not in kernel_layout:
            return None
        caxis = out_layout.index("C")
        if call_attr(bn_call, "axis") % 4 != caxis:
            return None
        channels = wv.shape[kernel_layout.index("O")]
        stats = [const_value(m[p]) for p in (g, b, mu, var)]
        if any(s is None or s.size != channels for s in stats):
            return None
        gamma, beta, mean, variance = (s.reshape(channels).astype(np.float64) for s in stats)
        if not call_attr(bn_call, "scale", True):
            gamma = np.ones(channels)
        if not call_attr(bn_call, "center", True):
            beta = np.zeros(channels)
        bias = np.zeros(channels)
        if cbias in m:
            bv = const_value(m[cbias])
            if bv is None or bv.size != channels:
                return None
            bias = bv.reshape(channels).astype(np.float64)
        inv = gamma / np.sqrt(variance + float(call_attr(bn_call, "epsilon")))
        wshape = [1] * wv.ndim
        wshape[kernel_layout.index("O")] = channels
        new_w = (wv.astype(np.float64) * inv.reshape(wshape)).astype(wv.dtype)
        bshape = [1] * 4
        bshape[caxis] = channels
        new_b = ((bias - mean) * inv + beta).reshape(bshape).astype(str(ty.dtype))
        attrs = conv_call.attrs
        out_dtype = call_attr(conv_call, "out_dtype")
        new_conv = relax.op.nn.conv2d(
            conv_call.args[0],
            relax.const(new_w),
            strides=list(attrs.strides),
            padding=list(attrs.padding),
            dilation=list(attrs.dilation),
            groups=int(attrs.groups),
            data_layout=str(attrs.data_layout),
            kernel_layout=kernel_layout,
            out_layout=str(attrs.out_layout),
            out_dtype=str(out_dtype) if out_dtype not in (None, "") else None,
        )
        return relax.op.add(new_conv, relax.const(new_b))

    return Rule("fuse.conv_bn", root, fused)


# The matchers of the built-in ops' fusion rules: each op registers its own in its file
# (``@layer_norm.fusion()`` in ``opsdk/ops/layer_norm.py``), calling these.


def layer_norm_patterns() -> list[tuple[DFPattern, Any]]:
    """The decomposed LayerNorm chain (with gamma and beta, gamma only, neither)."""
    return [(r.pattern, r.build) for r in _NormChain(center=True).rules()]


def rms_norm_patterns() -> list[tuple[DFPattern, Any]]:
    """The decomposed RMSNorm chain (with gamma, without)."""
    return [(r.pattern, r.build) for r in _NormChain(center=False).rules()]


def bias_gelu_patterns() -> list[tuple[DFPattern, Any]]:
    """``gelu(x + bias)`` for TVM's two GELUs and opsdk.gelu."""
    return [(r.pattern, r.build) for r in _bias_gelu_rules()]


def group_norm_patterns() -> list[tuple[DFPattern, Any]]:
    """GroupNorm in ONNX's InstanceNormalization form (affine and not)."""
    return [(r.pattern, r.build) for r in _group_norm_rules()]


def _graph_rules() -> dict[str, list[Rule]]:
    """Rules that produce no opsdk op (so no op file owns them)."""
    return {"conv_bn": [_conv_bn_rule()]}


def op_fusion_rules() -> dict[str, list[Rule]]:
    """The fusion rules of the registered ops (``OpDef.fusion``), by rule name: the built-in
    ops' first (in :data:`FUSION_RULES` order), then the others' in op-name order."""
    from ..registry import registered_ops

    out: dict[str, list[Rule]] = {}
    for d in registered_ops():
        for name, factory in d.fusions:
            try:
                made = factory()
                pairs = made if isinstance(made, list) else [made]
                out[name] = [Rule(name, pattern, build) for pattern, build in pairs]
            except Exception as e:  # the author's factory: name it, not a traceback
                raise ValueError(f"opsdk.{d.name}: fusion rule {name!r} failed to build its "
                                 f"pattern: {type(e).__name__}: {e}") from e
    first = [f"fuse.{n}" for n in FUSION_RULES if f"fuse.{n}" in out]
    return {n: out[n] for n in [*first, *(n for n in out if n not in first)]}


#: Names of the fusion rules, in the order :func:`FuseIntoOps` applies them.
FUSION_RULES: tuple[str, ...] = ("conv_bn", "layer_norm", "rms_norm", "bias_gelu", "group_norm")


def FuseIntoOps(
    rules: Sequence[str] | None = None,
    params: Mapping[str, Any] | None = None,
    func_name: str = "main",
) -> tvm.transform.Pass:
    """Rewrite decomposed subgraphs into fused ops.

    Rules (see :data:`FUSION_RULES`), then those of the registered ops (``OpDef.fusion``,
    named ``fuse.<op>`` unless they say otherwise):

    - ``layer_norm``: ``x - mean(x)``, its square (``power(d, 2)`` or ``d * d``) averaged over
      the same trailing axes, ``+ eps`` (a constant scalar), ``sqrt`` and divide (or ``rsqrt``
      and multiply), then optional ``* gamma`` and ``+ beta``  ->  ``opsdk.layer_norm``;
    - ``rms_norm``: the same without the centring  ->  ``opsdk.rms_norm``;
    - ``bias_gelu``: ``gelu(x + bias)`` with ``bias`` of shape ``(C,)`` (or ``(1, .., C)``)
      ->  ``opsdk.bias_gelu``;
    - ``conv_bn``: inference ``batch_norm`` of a ``conv2d`` (+ bias) whose weights and BN
      parameters are constants  ->  ``conv2d`` with folded weights plus a bias add;
    - ``group_norm``: a 4-D NCHW ``x`` reshaped to ``(N, G, -1)``, normalized over the last
      axis with ``variance`` (ONNX InstanceNormalization as TVM imports it, its scale and
      bias all ones and zeros), reshaped back, optionally ``* gamma + beta`` of shape
      ``(C, 1, 1)``  ->  ``opsdk.group_norm`` (torch.onnx's GroupNorm below opset 18).

    Near misses are left alone: epsilon added after the square root, a centring mean over
    other axes than the variance, a variance over non-trailing axes, a non-constant epsilon
    or exponent other than 2, a residual add in front of GELU, training-mode BN or BN
    parameters that are not constants. Bind parameters first (``params``) to fold those.

    Parameters
    ----------
    rules : sequence of str, optional
        Which rules to run; all by default.
    params : mapping of str to array, optional
        Values for parameters of ``func_name`` to bind as constants first
        (``relax.transform.BindParams``), e.g. BN statistics kept as inputs.
    func_name : str
        The function ``params`` belong to.

    Returns
    -------
    tvm.transform.Pass

    Examples
    --------
    >>> import opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    >>> b = relax.Var("b", relax.TensorType((16,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x, b]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.gelu(relax.op.add(x, b)))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.FuseIntoOps()(bb.get())
    >>> opsdk.transform.op_counts(mod)
    {'opsdk.bias_gelu': 1}
    """
    graph = _graph_rules()
    ops = op_fusion_rules()

    def full(n: str) -> str:  # "layer_norm" names the built-in op's rule "fuse.layer_norm"
        return n if n in graph or n in ops else f"fuse.{n}"

    names = [*graph, *ops] if rules is None else [full(n) for n in rules]
    unknown = [n for n in names if n not in graph and n not in ops]
    if unknown:
        raise ValueError(f"FuseIntoOps: unknown rules {unknown}; choose from "
                         f"{[*graph, *ops]} (an op's rules come with its OpDef.fusion)")
    selected = [r for n in graph if n in names for r in graph[n]]
    selected += [r for n in ops if n in names for r in ops[n]]

    @tvm.transform.module_pass(opt_level=0, name="opsdk.FuseIntoOps")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        attrs = mod.attrs
        if params:
            mod = relax.transform.BindParams(func_name, dict(params))(mod)
        # Exporters repeat subexpressions (torch.export emits ``x - mean`` once per use):
        # one value per expression, so a pattern sees the chain as the math writes it.
        mod = relax.transform.EliminateCommonSubexpr()(mod)
        if attrs is not None and mod.attrs is None:
            mod = mod.with_attrs(attrs)
        return apply_rules(mod, selected)

    return _pass
