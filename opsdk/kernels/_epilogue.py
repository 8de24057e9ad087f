"""The elementwise epilogue FuseOps appends to a matmul or conv, in TE and in numpy, and the
error it adds to the kernel's bound.

Activations are written block by block as TVM's legalization and FuseTIR leave them: SiLU as
a ``sigmoid`` block and a multiply that reads the pre-activation twice (a DAG, not a chain),
hardswish as torch.export decomposes it (``x * clip(x + 3, 0, 6) / 6``), sigmoid and tanh as
one call each. The rules fold any such epilogue into their write-back, and the scheduled
kernel evaluates ``exp`` / ``sigmoid`` / ``tanh`` with :mod:`opsdk._vecmath`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, tirx

from .._errmodel import MATH_ULPS

Activation = Literal["none", "relu", "relu6", "silu", "hardswish", "sigmoid", "tanh"]

#: Every activation kind, for the kernel families' attribute domains.
ACTIVATIONS: tuple[str, ...] = ("relu", "none", "relu6", "silu", "hardswish", "sigmoid", "tanh")


def epilogue_te(y: te.Tensor, bias, residual, activation: str, bias_index) -> te.Tensor:
    """``act(y + bias + residual)`` as separate blocks (as FuseTIR leaves them)."""
    if bias is not None:
        y = te.compute(y.shape, lambda *i: y(*i) + bias(bias_index(i)), name="T_add")
    if residual is not None:
        y = te.compute(y.shape, lambda *i: y(*i) + residual(*i), name="T_add_res")
    if activation == "relu":
        y = te.compute(y.shape, lambda *i: te.max(y(*i), tirx.const(0.0, y.dtype)), name="relu")
    elif activation == "relu6":  # ChannelsLast spells clip(0, 6) as min(max(x, 0), 6)
        y = _clip06(y, y)
    elif activation == "silu":  # relax's silu: x * sigmoid(x), y read by two blocks
        sig = te.compute(y.shape, lambda *i: te.sigmoid(y(*i)), name="compute")
        y = te.compute(y.shape, lambda *i: y(*i) * sig(*i), name="T_multiply")
    elif activation == "hardswish":  # torch.export: x * hardtanh(x + 3, 0, 6) / 6
        t = te.compute(y.shape, lambda *i: y(*i) + tirx.const(3.0, y.dtype), name="T_add_3")
        c = _clip06(t, y)
        m = te.compute(y.shape, lambda *i: y(*i) * c(*i), name="T_multiply")
        y = te.compute(y.shape, lambda *i: m(*i) / tirx.const(6.0, y.dtype), name="T_divide")
    elif activation == "sigmoid":
        y = te.compute(y.shape, lambda *i: te.sigmoid(y(*i)), name="compute")
    elif activation == "tanh":
        y = te.compute(y.shape, lambda *i: te.tanh(y(*i)), name="compute")
    return y


def _clip06(t: te.Tensor, like: te.Tensor) -> te.Tensor:
    lo = te.compute(t.shape, lambda *i: te.max(t(*i), tirx.const(0.0, like.dtype)),
                    name="T_maximum")
    return te.compute(t.shape, lambda *i: te.min(lo(*i), tirx.const(6.0, like.dtype)),
                      name="T_minimum")


def _sigmoid(y: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * y))  # no overflow warning for large |y|


def activation_np(y: np.ndarray, activation: str) -> np.ndarray:
    """The float64 activation of a pre-activation ``y``."""
    if activation == "relu":
        return np.maximum(y, 0.0)
    if activation == "relu6":
        return np.minimum(np.maximum(y, 0.0), 6.0)
    if activation == "silu":
        return y * _sigmoid(y)
    if activation == "hardswish":
        return y * np.clip(y + 3.0, 0.0, 6.0) / 6.0
    if activation == "sigmoid":
        return _sigmoid(y)
    if activation == "tanh":
        return np.tanh(y)
    return y


def epilogue_np(y: np.ndarray, bias, residual, activation: str, bias_shape) -> np.ndarray:
    if bias is not None:
        y = y + bias.reshape(bias_shape)
    if residual is not None:
        y = y + residual
    return activation_np(y, activation)


#: The largest slope of each activation (its Lipschitz constant): an error ``e`` in the
#: pre-activation moves the output by at most ``slope * e``. SiLU's is 1.0998 (at y ~ 2.4),
#: hardswish's 1.5 (at y = 3).
_SLOPE = {"none": 1.0, "relu": 1.0, "relu6": 1.0, "silu": 1.1, "hardswish": 1.5,
          "sigmoid": 0.25, "tanh": 1.0}


def activation_error(pre: np.ndarray, e: np.ndarray | float, activation: str,
                     u: float) -> np.ndarray:
    """The bound on the output's error, given the float64 pre-activation ``pre`` and the bound
    ``e`` on its computed value's error: the activation's slope times ``e``, plus the
    roundings of evaluating it at the computed value (``|y^| <= |pre| + e``), with the math
    library's accuracy from :data:`opsdk.verify.MATH_ULPS`. ReLU / ReLU6 add no rounding."""
    e = np.asarray(e, dtype=np.float64)
    grown = _SLOPE[activation] * e
    y = np.abs(pre) + e
    if activation == "silu":  # sigmoid, then one multiply: relative to |y sigmoid(y)| <= |y|
        own = (MATH_ULPS["sigmoid"] + 1) * u * y
    elif activation == "hardswish":  # the +3 moves the clip by u|y+3|; * and / round once each
        own = u * y * (y + 3.0) / 6.0 + 3 * u * y * np.minimum(y + 3.0, 6.0) / 6.0
    elif activation == "sigmoid":
        own = MATH_ULPS["sigmoid"] * u * np.ones_like(y)
    elif activation == "tanh":
        own = MATH_ULPS["tanh_abs"] * u * np.ones_like(y)
    else:
        own = np.zeros_like(y)
    return grown + own


def epilogue_error(m, e: np.ndarray) -> np.ndarray:
    """A kernel family's bound ``e`` on its pre-activation error (the dot products, bias and
    residual adds) carried through its activation (:func:`activation_error`)."""
    act = m.attrs.get("activation", "none")
    if act in ("none", "relu", "relu6"):
        return e
    pre = m.op.run_reference(m.inputs, {**m.attrs, "activation": "none"})
    return activation_error(np.asarray(pre, dtype=np.float64), e, act, m.u)


def epilogue_abs(m, bias_shape) -> np.ndarray | float:
    """``|bias| + |residual|`` of an error model's inputs (0 where absent): the magnitudes
    the epilogue's adds round."""
    extra = 0.0
    if m.inputs.get("bias") is not None:
        extra = extra + np.abs(m.inputs["bias"]).reshape(bias_shape)
    if m.inputs.get("residual") is not None:
        extra = extra + np.abs(m.inputs["residual"])
    return extra


def static_int(d) -> int | None:
    """A dim's value when it is static (a Python int or a TIR IntImm), else None."""
    if isinstance(d, int):
        return d
    if isinstance(d, tirx.IntImm):
        return int(d.value)
    return None


def gamma(k: float, u: float) -> float:
    """``k u / (1 - k u)``: the relative error bound of a k-term float sum."""
    return k * u / (1 - k * u)
