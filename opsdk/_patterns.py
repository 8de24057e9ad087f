"""Building blocks of rewrite rules: the :class:`Rule` record and helpers that read Relax
expressions (types, shapes, constants, attributes) and match common pattern shapes.

Nothing here names an op: the op files (``opsdk/ops/*.py``) build their fusion and replace
rules from these, and ``opsdk.transform`` applies the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.sym import Analyzer

from ._dtypes import FLOAT_DTYPES, array_view

__all__ = [
    "ONES",
    "ZEROS",
    "Rule",
    "affine_params",
    "bn_scale_shift",
    "call_attr",
    "const_value",
    "either",
    "float_tensor",
    "param_of",
    "reduced_axes",
    "same_dims",
    "scalar_value",
    "shape_of",
    "static_shape",
    "tensor_type",
    "trailing_begin",
]


@dataclass(frozen=True)
class Rule:
    """A rewrite rule: when ``pattern`` matches, ``build(orig, matchings)`` returns the
    replacement, or None to leave the match alone (a near miss).

    A rule into a multi-output op returns ``(call, {expr: output_index})``: the op's call
    and, for the matched root ``orig`` and any other matched expression the op also
    computes (the ``x + r`` of a residual add + norm), which output replaces it. Uses of
    those expressions after the call then read the call's output, and their own
    computation goes away when nothing else needs it.
    """

    name: str
    pattern: DFPattern
    build: Callable[[relax.Call, Any], relax.Expr | None]


# ---------------------------------------------------------------------------------------------
# Reading Relax expressions


def tensor_type(e: relax.Expr) -> relax.TensorType | None:
    """The expression's tensor type when it has a known rank, else None."""
    ty = e.ty
    if isinstance(ty, relax.TensorType) and ty.ndim >= 0:
        return ty
    return None


def float_tensor(e: relax.Expr) -> relax.TensorType | None:
    """The tensor type of ``e`` if opsdk ops accept its dtype (float32/16, bfloat16)."""
    ty = tensor_type(e)
    return ty if ty is not None and str(ty.dtype) in FLOAT_DTYPES else None


def static_shape(e: relax.Expr) -> tuple[int, ...] | None:
    """The shape of ``e`` when every dim is a known integer."""
    ty = tensor_type(e)
    if ty is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return None
        dims.append(int(d.value))
    return tuple(dims)


def same_dims(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shape tuples (ints or symbolic PrimExprs) are provably equal."""
    if len(a) != len(b):
        return False
    ana = Analyzer()
    return all(ana.can_prove_equal(x, y) for x, y in zip(a, b))


def shape_of(e: relax.Expr) -> tuple[Any, ...] | None:
    """The (possibly symbolic) shape of ``e``."""
    ty = tensor_type(e)
    if ty is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return tuple(ty.shape.values)


def const_value(e: relax.Expr) -> np.ndarray | None:
    """The value of a constant, or of reshape/expand_dims/squeeze/astype of a constant: a
    read-only view of the constant's memory where numpy can share it (no copy of a
    model's weights per look), else a copy."""
    if isinstance(e, relax.Var):
        return None
    if isinstance(e, tvm.ir.expr.Constant):
        return array_view(e.value)
    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
        name = str(e.op.name)
        if name in ("relax.reshape", "relax.expand_dims", "relax.squeeze"):
            inner = const_value(e.args[0])
            shape = static_shape(e)
            if inner is not None and shape is not None:
                return inner.reshape(shape)
        if name == "relax.astype":
            inner = const_value(e.args[0])
            ty = tensor_type(e)
            if inner is not None and ty is not None:
                return inner.astype(str(ty.dtype))
    return None


def scalar_value(e: relax.Expr) -> float | None:
    """A one-element constant as a Python float (shortest repr of its dtype), else None."""
    v = const_value(e)
    if v is None or v.size != 1:
        return None
    # float(str(np.float32(1e-5))) == 1e-05: keep the value the author wrote.
    return float(str(v.reshape(())[()]))


def call_attr(call: relax.Call, key: str, default: Any = None) -> Any:
    """An attribute of a TVM or opsdk op call, as plain Python."""
    attrs = call.attrs
    if attrs is None:
        return default
    try:
        v = attrs[key] if isinstance(attrs, tvm.ir.attrs.DictAttrs) else getattr(attrs, key)
    except (AttributeError, KeyError):
        return default
    return _py(v)


def _py(v: Any) -> Any:
    if isinstance(v, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return v.value
    if isinstance(v, (list, tuple)) or type(v).__name__ == "Array":
        return [_py(x) for x in v]
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return str(v) if type(v).__name__ == "String" else v


# ---------------------------------------------------------------------------------------------
# Pattern shapes and the checks a pattern cannot say


def either(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    """``op(a, b)`` or ``op(b, a)`` for a commutative op."""
    return is_op(op)(a, b) | is_op(op)(b, a)


def reduced_axes(call: relax.Call, ndim: int) -> list[int] | None:
    """Normalized axes of a keepdims mean, None when it does not keep dims or reduces all."""
    if not call_attr(call, "keepdims", False):
        return None
    axes = call_attr(call, "axis")
    if axes is None:
        return None
    return sorted(int(a) % ndim for a in axes)


def trailing_begin(axes: Sequence[int], ndim: int) -> int | None:
    """``-k`` if ``axes`` are exactly the last k axes (in any order, negative or not), else
    None."""
    norm = sorted(a % ndim for a in axes)
    if not norm or norm != list(range(ndim - len(norm), ndim)):
        return None
    return -len(norm)


def param_of(p: relax.Expr, tail: tuple[Any, ...]) -> relax.Expr | None:
    """``p`` as a tensor of shape ``tail`` (the normalized axes), or None.

    Accepts exactly ``tail`` or ``(1, ..., 1, *tail)`` (reshaped); anything else, such as
    a per-row scale, is not a per-feature parameter.
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


#: Gamma / beta of a TVM norm call spelled as constant ones / zeros (how ONNX
#: GroupNormalization-21 is imported): match ``ONES | wildcard()`` to see through them.
ONES = is_op("relax.ones_like")(wildcard()) | is_op("relax.ones")(wildcard()) | is_const()
ZEROS = is_op("relax.zeros_like")(wildcard()) | is_op("relax.zeros")(wildcard()) | is_const()


def _is_filled(m: Any, pat: Any, value: float) -> bool:
    if pat not in m:
        return False
    v = const_value(m[pat])
    return v is None or bool(np.all(v == value))  # None: a ones/zeros(_like) call


def bn_scale_shift(call: relax.Call, channels: int) -> tuple[np.ndarray, np.ndarray] | None:
    """An inference ``batch_norm`` call as ``(scale, shift)`` per channel, float64:
    ``gamma / sqrt(var + eps)`` and ``beta - mean * scale`` (``scale`` / ``center`` off: a
    gamma of ones / a beta of zeros). None for a training-mode BN or statistics that are no
    constants of ``channels`` values."""
    if call_attr(call, "training", True):
        return None  # training mode normalizes with batch statistics
    stats = [const_value(p) for p in call.args[1:5]]
    if any(s is None or s.size != channels for s in stats):
        return None
    gamma, beta, mean, var = (s.reshape(channels).astype(np.float64) for s in stats)
    if not call_attr(call, "scale", True):
        gamma = np.ones(channels)
    if not call_attr(call, "center", True):
        beta = np.zeros(channels)
    scale = gamma / np.sqrt(var + float(call_attr(call, "epsilon")))
    return scale, beta - mean * scale


def affine_params(call: relax.Call, m: Any) -> tuple[relax.Expr | None, relax.Expr | None] | None:
    """(gamma, beta) of a TVM norm call ``op(x, gamma, beta)`` with ``scale`` / ``center``
    flags, for an opsdk op; None when the flags make it ambiguous. ``m`` are the matchings
    of a pattern whose gamma / beta arguments are ``ONES | wildcard()`` / ``ZEROS |
    wildcard()``.

    TVM 0.27's legalization applies gamma and beta even when ``scale`` / ``center`` say not
    to, and opsdk honours the flags: so a flagged-off parameter is dropped only when it is
    ones / zeros anyway (both readings agree); otherwise the call stays TVM's.
    """
    gamma, beta = call.args[1], call.args[2]
    if not call_attr(call, "scale", True):
        if not _is_filled(m, ONES, 1.0):
            return None
        gamma = None
    if not call_attr(call, "center", True):
        if not _is_filled(m, ZEROS, 0.0):
            return None
        beta = None
    return gamma, beta
