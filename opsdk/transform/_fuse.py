"""``FuseIntoOps``: rewrite decomposed subgraphs, as exporters emit them, into fused ops.

The rules are the ops' own (``OpDef.fusion``, in the op files: for the built-ins the
decomposed LayerNorm / RMSNorm chains, bias add + GELU and GroupNorm in InstanceNorm form),
plus one that produces no opsdk op: a ``conv1d`` / ``conv2d`` / ``conv3d`` (+ bias) + inference
``batch_norm`` with constant weights and statistics  ->  the conv with the BN scale folded into
its weights,
plus a bias add. A ReLU after it stays and TVM's FuseOps fuses it into the convolution's
epilogue.

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
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, wildcard

from .. import ops as op_library  # the explicit op list, read when used
from .._patterns import Rule, bn_scale_shift, call_attr, const_value, either, float_tensor
from ..registry import registered_ops
from ._branches import MergeConvBranches
from ._rewrite import apply_rules

__all__ = ["FUSION_RULES", "FuseIntoOps"]


# ---------------------------------------------------------------------------------------------
# conv + batch_norm folding

#: The convs a BatchNorm folds into, by op name: their constructor and layout (data rank).
_CONVS = {"relax.nn.conv1d": (relax.op.nn.conv1d, "NCW"),
          "relax.nn.conv2d": (relax.op.nn.conv2d, "NCHW"),
          "relax.nn.conv3d": (relax.op.nn.conv3d, "NCDHW")}


def _conv_bn_rule() -> Rule:
    x, w = wildcard(), is_const()
    conv = (is_op("relax.nn.conv2d")(x, w) | is_op("relax.nn.conv1d")(x, w)
            | is_op("relax.nn.conv3d")(x, w))
    cbias = is_const() | is_op("relax.reshape")(is_const(), wildcard())
    cbias = cbias | is_op("relax.expand_dims")(is_const())
    conv_out = conv | either("relax.add", conv, cbias)
    g, b, mu, var = is_const(), is_const(), is_const(), is_const()
    bn = is_op("relax.nn.batch_norm")(conv_out, g, b, mu, var)
    root = is_tuple_get_item(bn, 0)

    def fused(orig: relax.Expr, m: Any) -> relax.Expr | None:
        bn_call, conv_call = m[bn], m[conv]
        make, plain = _CONVS[conv_call.op.name]
        ty = float_tensor(conv_call)
        wv = const_value(m[w])
        if ty is None or wv is None or ty.ndim != len(plain):
            return None
        out_layout = str(call_attr(conv_call, "out_layout") or call_attr(conv_call, "data_layout"))
        kernel_layout = str(call_attr(conv_call, "kernel_layout"))
        if sorted(out_layout) != sorted(plain) or "O" not in kernel_layout:
            return None
        caxis = out_layout.index("C")
        if call_attr(bn_call, "axis") % ty.ndim != caxis:
            return None
        channels = wv.shape[kernel_layout.index("O")]
        affine = bn_scale_shift(bn_call, channels)
        if affine is None:
            return None
        inv, shift = affine
        bias = np.zeros(channels)
        if cbias in m:
            bv = const_value(m[cbias])
            if bv is None or bv.size != channels:
                return None
            bias = bv.reshape(channels).astype(np.float64)
        new_w = _scaled(wv, inv, kernel_layout.index("O"))
        bshape = [1] * ty.ndim
        bshape[caxis] = channels
        new_b = (bias * inv + shift).reshape(bshape).astype(str(ty.dtype))
        attrs = conv_call.attrs
        out_dtype = call_attr(conv_call, "out_dtype")
        new_conv = make(
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


def _scaled(w: np.ndarray, scale: np.ndarray, axis: int) -> tvm.runtime.Tensor:
    """``w * scale`` along ``axis``, rounded once from float64, into a new tensor: a block of
    output channels at a time, so the float64 temporaries stay small (a model's weights in
    float64 at once cost more in fresh pages than in arithmetic)."""
    out = tvm.runtime.empty(w.shape, str(w.dtype))
    dst = np.from_dlpack(out)
    wm, dm = np.moveaxis(w, axis, 0), np.moveaxis(dst, axis, 0)
    bshape = (-1,) + (1,) * (w.ndim - 1)
    step = max(1, (1 << 17) // max(1, wm[0].size))
    for i in range(0, wm.shape[0], step):
        dm[i:i + step] = wm[i:i + step] * scale[i:i + step].reshape(bshape)
    return out


def _graph_rules() -> dict[str, list[Rule]]:
    """Rules that produce no opsdk op (so no op file owns them); ``conv_branches`` is a
    pass of its own (:func:`~._branches.MergeConvBranches`: a sum of any number of terms is
    no fixed pattern), run after the others."""
    return {"conv_bn": [_conv_bn_rule()], "conv_branches": []}


def op_fusion_rules() -> dict[str, list[Rule]]:
    """The fusion rules of the registered ops (``OpDef.fusion``), by rule name: the built-in
    ops' first (in :data:`FUSION_RULES` order), then the others' in op-name order."""

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
    first = [f"fuse.{n}" for n in _fusion_rule_names() if f"fuse.{n}" in out]
    return {n: out[n] for n in [*first, *(n for n in out if n not in first)]}


#: Names of the fusion rules, in the order :func:`FuseIntoOps` applies them: the graph rules,
#: then the built-in ops' (``OpDef.fusion``, in the op list's order), read when first asked
#: for (module ``__getattr__``).
FUSION_RULES: tuple[str, ...]


def _fusion_rule_names() -> tuple[str, ...]:

    ops = [n.removeprefix("fuse.") for d in op_library.BUILTIN_OPS for n, _ in d.fusions]
    return (*_graph_rules(), *ops)


def __getattr__(name: str) -> Any:
    if name == "FUSION_RULES":
        return _fusion_rule_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    - ``conv_bn``: inference ``batch_norm`` of a ``conv1d`` / ``conv2d`` / ``conv3d`` (+ bias)
      whose weights and BN parameters are constants  ->  the conv with folded weights plus a
      bias add;
    - ``conv_branches``: a sum of constant-weight convs (+ bias) of one input with the same
      stride and groups, and of an inference BN of that input or the input itself  ->  one
      ``conv2d`` whose kernel is their sum (:func:`MergeConvBranches`: RepVGG / MobileOne
      blocks as trained);
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
        mod = apply_rules(mod, selected)
        return MergeConvBranches()(mod) if "conv_branches" in names else mod

    return _pass
