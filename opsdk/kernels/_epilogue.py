"""The elementwise epilogue FuseOps appends to a matmul or conv, in TE and in numpy."""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, tirx

Activation = Literal["none", "relu", "relu6"]


def epilogue_te(y: te.Tensor, bias, residual, activation: str, bias_index) -> te.Tensor:
    """``act(y + bias + residual)`` as separate blocks (as FuseTIR leaves them)."""
    if bias is not None:
        y = te.compute(y.shape, lambda *i: y(*i) + bias(bias_index(i)), name="T_add")
    if residual is not None:
        y = te.compute(y.shape, lambda *i: y(*i) + residual(*i), name="T_add_res")
    if activation == "relu":
        y = te.compute(y.shape, lambda *i: te.max(y(*i), tirx.const(0.0, y.dtype)), name="relu")
    elif activation == "relu6":  # ChannelsLast spells clip(0, 6) as min(max(x, 0), 6)
        lo = te.compute(y.shape, lambda *i: te.max(y(*i), tirx.const(0.0, y.dtype)),
                        name="T_maximum")
        y = te.compute(y.shape, lambda *i: te.min(lo(*i), tirx.const(6.0, y.dtype)),
                       name="T_minimum")
    return y


def epilogue_np(y: np.ndarray, bias, residual, activation: str, bias_shape) -> np.ndarray:
    if bias is not None:
        y = y + bias.reshape(bias_shape)
    if residual is not None:
        y = y + residual
    if activation == "relu":
        y = np.maximum(y, 0.0)
    elif activation == "relu6":
        y = np.minimum(np.maximum(y, 0.0), 6.0)
    return y


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
