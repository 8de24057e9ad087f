"""Shared pieces of the INT8 ops: integer ranges, per-tensor/per-channel parameter shapes and
float32-exact numpy helpers (integer outputs are compared bit-exactly, so the references
mirror the kernels' float32 rounding steps)."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import tirx

from .._domains import log_uniform

__all__ = [
    "QRANGE",
    "QUANT_ATTR_DOMAIN",
    "clamp_te",
    "exact_model",
    "param_shape",
    "param_view",
    "per_channel_index",
    "rint_f32",
    "round_to_te",
]

#: Where verify draws the quantization attributes qdense and qconv2d share: scales over
#: six decades, zero points at both ends of int8 and uint8 (255 is refused for an int8 input).
QUANT_ATTR_DOMAIN = {
    "x_scale": log_uniform(1e-4, 1e2),
    "x_zero_point": [0, -128, 127, 5, 255],
    "out_scale": log_uniform(1e-4, 1e2),
    "out_zero_point": [0, -128, 127, -3],
}

#: Saturation range of each quantized dtype.
QRANGE = {"int8": (-128, 127), "uint8": (0, 255), "int32": (-(2**31), 2**31 - 1)}


def param_shape(x_shape, attrs) -> tuple:
    """Shape of a scale / zero-point tensor: one per channel along ``axis``, or ``(1,)``."""
    return (x_shape[attrs["axis"]],) if attrs["per_channel"] else (1,)


def param_view(p: np.ndarray, ndim: int, axis: int, per_channel: bool, dtype) -> np.ndarray:
    """A scale / zero-point array shaped to broadcast against a rank-``ndim`` tensor."""
    shape = [1] * ndim
    if per_channel:
        shape[axis] = -1
    return p.astype(dtype).reshape(shape)


def per_channel_index(i, attrs):
    """Index into a parameter tensor for output index ``i``."""
    return i[attrs["axis"]] if attrs["per_channel"] else 0


def clamp_te(v: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """Saturate an integer expression to ``dtype``'s range and cast."""
    lo, hi = QRANGE[dtype]
    return tirx.max(tirx.min(v, hi), lo).astype(dtype)


def round_to_te(f: tirx.PrimExpr, zero_point, dtype: str) -> tirx.PrimExpr:
    """``sat(nearbyint(f) + zero_point)`` of a float32 expression, as ``dtype``.

    The rounded value is clamped to +-2**30 in float first: a value beyond the int32 range
    would make the float-to-int cast undefined (the clamp changes no saturated result).
    """
    r = tirx.max(tirx.min(tirx.nearbyint(f), 2.0**30), -(2.0**30))
    return clamp_te(r.astype("int32") + zero_point, dtype)


def rint_f32(v: np.ndarray) -> np.ndarray:
    """Round half to even in float32, like the kernels' ``nearbyint``."""
    return np.rint(np.asarray(v, dtype=np.float32))


def exact_model(m: Any) -> np.ndarray:
    """The error model of the INT8 ops' float32 outputs (dequantize, qdense / qconv2d with
    ``out_dtype="float32"``): their references repeat the kernel's float32 steps (a correctly
    rounded integer-to-float conversion, then single IEEE multiplications of normal floats,
    no additions to fuse), so a correct kernel matches bit for bit on every IEEE target."""
    return np.zeros(m.ref.shape)
