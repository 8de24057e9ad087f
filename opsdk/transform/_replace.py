"""``ReplaceTVMOps``: swap TVM's own norm/activation ops for the opsdk ops.

Each rule checks what the opsdk op can express (trailing normalization axes, float dtypes,
4-D NCHW/NHWC group norm with a static channel count) and leaves any other call alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .. import relax as _ops
from ._rewrite import Rule, apply_rules, call_attr, const_value, float_tensor, static_shape

__all__ = ["REPLACEABLE_OPS", "ReplaceTVMOps"]


def _trailing_begin(axes: Sequence[int], ndim: int) -> int | None:
    """``-k`` if ``axes`` are exactly the last k axes, else None."""
    norm = sorted(a % ndim for a in axes)
    if not norm or norm != list(range(ndim - len(norm), ndim)):
        return None
    return -len(norm)


# Gamma / beta spelled as constant ones / zeros (how ONNX GroupNormalization-21 is imported).
_ONES = is_op("relax.ones_like")(wildcard()) | is_op("relax.ones")(wildcard()) | is_const()
_ZEROS = is_op("relax.zeros_like")(wildcard()) | is_op("relax.zeros")(wildcard()) | is_const()


def _is_filled(m: Any, pat: Any, value: float) -> bool:
    if pat not in m:
        return False
    v = const_value(m[pat])
    return v is None or bool(np.all(v == value))  # None: a ones/zeros(_like) call


def _affine(call: relax.Call, m: Any) -> tuple[relax.Expr | None, relax.Expr | None] | None:
    """(gamma, beta) for the opsdk op, or None when the call's flags make it ambiguous.

    TVM 0.27's legalization applies gamma and beta even when ``scale`` / ``center`` say not
    to, and opsdk honours the flags: so a flagged-off parameter is dropped only when it is
    ones / zeros anyway (both readings agree); otherwise the call stays TVM's.
    """
    gamma, beta = call.args[1], call.args[2]
    if not call_attr(call, "scale", True):
        if not _is_filled(m, _ONES, 1.0):
            return None
        gamma = None
    if not call_attr(call, "center", True):
        if not _is_filled(m, _ZEROS, 0.0):
            return None
        beta = None
    return gamma, beta


def _layer_norm(call: relax.Call, m: Any) -> relax.Expr | None:
    x = call.args[0]
    ty = float_tensor(x)
    if ty is None:
        return None
    begin = _trailing_begin(call_attr(call, "axes"), ty.ndim)
    params = _affine(call, m)
    if begin is None or params is None:
        return None
    return _ops.layer_norm(x, *params, begin_axis=begin, epsilon=float(call_attr(call, "epsilon")))


def _rms_norm(call: relax.Call, m: Any) -> relax.Expr | None:
    x, weight = call.args
    ty = float_tensor(x)
    if ty is None:
        return None
    begin = _trailing_begin(call_attr(call, "axes"), ty.ndim)
    if begin is None:
        return None
    return _ops.rms_norm(x, weight, begin_axis=begin, epsilon=float(call_attr(call, "epsilon")))


def _group_norm(call: relax.Call, m: Any) -> relax.Expr | None:
    x = call.args[0]
    ty = float_tensor(x)
    if ty is None or ty.ndim != 4:
        return None
    caxis = call_attr(call, "channel_axis") % 4
    axes = sorted(a % 4 for a in call_attr(call, "axes"))
    layout = {(1, (2, 3)): "NCHW", (3, (1, 2)): "NHWC"}.get((caxis, tuple(axes)))
    shape = static_shape(x)
    params = _affine(call, m)
    if layout is None or shape is None or params is None:  # opsdk: static channel count
        return None
    return _ops.group_norm(
        x,
        *params,
        num_groups=int(call_attr(call, "num_groups")),
        epsilon=float(call_attr(call, "epsilon")),
        layout=layout,
    )


def _gelu(approximate: str):
    def build(call: relax.Call, m: Any) -> relax.Expr | None:
        x = call.args[0]
        return _ops.gelu(x, approximate=approximate) if float_tensor(x) is not None else None

    return build


def _softmax(call: relax.Call, m: Any) -> relax.Expr | None:
    x = call.args[0]
    if float_tensor(x) is None:
        return None
    return _ops.softmax(x, axis=int(call_attr(call, "axis")))


def _rule(op: str, nargs: int, build, affine: bool = False) -> Rule:
    args = [wildcard() for _ in range(nargs)]
    if affine:  # see through gamma / beta, to tell ones / zeros apart
        args[1:3] = [_ONES | wildcard(), _ZEROS | wildcard()]
    return Rule(f"replace.{op.removeprefix('relax.nn.')}", is_op(op)(*args), build)


_RULES: dict[str, Rule] = {
    r.name.removeprefix("replace."): r
    for r in (
        _rule("relax.nn.layer_norm", 3, _layer_norm, affine=True),
        _rule("relax.nn.rms_norm", 2, _rms_norm),
        _rule("relax.nn.group_norm", 3, _group_norm, affine=True),
        _rule("relax.nn.gelu", 1, _gelu("none")),
        _rule("relax.nn.gelu_tanh", 1, _gelu("tanh")),
        _rule("relax.nn.softmax", 1, _softmax),
    )
}

#: TVM op names (without ``relax.nn.``) that :func:`ReplaceTVMOps` can replace.
REPLACEABLE_OPS: tuple[str, ...] = tuple(_RULES)


def ReplaceTVMOps(ops: Sequence[str] | None = None) -> tvm.transform.Pass:
    """Replace TVM's ``R.nn.layer_norm``, ``rms_norm``, ``group_norm``, ``gelu``,
    ``gelu_tanh`` and ``softmax`` with the opsdk ops.

    A call is replaced only when the opsdk op computes the same thing: normalization over the
    trailing axes (layer/rms norm), a 4-D NCHW or NHWC input with a static channel count
    (group norm), and a float32/float16/bfloat16 input. ``center=False`` / ``scale=False``
    are honoured only where beta / gamma are zeros / ones (TVM's own lowering ignores the
    flags, so anything else would change the numbers). Other calls stay as they are. The
    rewritten bindings are recorded (:func:`opsdk.transform.rewrite_sites`).

    Parameters
    ----------
    ops : sequence of str, optional
        Which TVM ops to replace (names from :data:`REPLACEABLE_OPS`, e.g. ``"layer_norm"``);
        all by default.

    Returns
    -------
    tvm.transform.Pass

    Examples
    --------
    >>> import opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.gelu_tanh(relax.op.nn.softmax(x)))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.ReplaceTVMOps()(bb.get())
    >>> opsdk.transform.op_counts(mod)
    {'opsdk.gelu': 1, 'opsdk.softmax': 1}
    """
    names = list(_RULES) if ops is None else [o.removeprefix("relax.nn.") for o in ops]
    unknown = [n for n in names if n not in _RULES]
    if unknown:
        raise ValueError(f"ReplaceTVMOps: unknown ops {unknown}; choose from {list(_RULES)}")
    rules = [_RULES[n] for n in names]

    @tvm.transform.module_pass(opt_level=0, name="opsdk.ReplaceTVMOps")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return apply_rules(mod, rules)

    return _pass
