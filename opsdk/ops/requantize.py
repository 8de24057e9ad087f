"""``requantize``: int32 accumulators -> int8/uint8 with a fixed-point multiplier and shift.

``y = sat(((x - in_zp) * M + 2**(n-1)) >> n) + out_zp)`` with ``n = 31 + shift``, computed in
int64: the real scale ``M * 2**-n`` is represented by an int32 ``multiplier`` M (normally in
``[2**30, 2**31)``, see :func:`quantize_multiplier`) and ``shift`` in ``[-30, 31]``. Rounding is
half toward +infinity (add half, arithmetic shift right); the result is saturated.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._opdef import Axis, Tensor
from ._quant import QRANGE, clamp_te, param_shape, param_view, per_channel_index

__all__ = ["quantize_multiplier", "requantize"]


def quantize_multiplier(real_scale: float) -> tuple[int, int]:
    """Split a positive real scale into (multiplier, shift) with
    ``real_scale ~= multiplier * 2**-(31 + shift)`` and multiplier in ``[2**30, 2**31)``.

    Examples
    --------
    >>> from opsdk.ops.requantize import quantize_multiplier
    >>> m, s = quantize_multiplier(0.25)
    >>> m * 2.0 ** -(31 + s)
    0.25
    """
    if not real_scale > 0:
        raise ValueError(f"requantize scale must be > 0, got {real_scale}")
    mant, exp = math.frexp(real_scale)  # real = mant * 2**exp, mant in [0.5, 1)
    m = round(mant * 2**31)
    if m == 2**31:
        m, exp = m // 2, exp + 1
    return int(m), int(-exp)


def _check(shapes, dtypes, attrs):
    lo, hi = QRANGE[attrs["out_dtype"]]
    if not lo <= attrs["output_zero_point"] <= hi:
        raise ValueError(
            f"argument 'output_zero_point' is {attrs['output_zero_point']}; it must lie in the "
            f"range of out_dtype {attrs['out_dtype']} [{lo}, {hi}]"
        )


def _reference(
    x, multiplier, shift, *, axis=-1, per_channel=False, input_zero_point=0,
    output_zero_point=0, out_dtype="int8",
):
    m = param_view(multiplier, x.ndim, axis, per_channel, np.int64)
    n = 31 + param_view(shift, x.ndim, axis, per_channel, np.int64)
    v = (x.astype(np.int64) - input_zero_point) * m
    y = ((v + (np.int64(1) << (n - 1))) >> n) + output_zero_point
    lo, hi = QRANGE[out_dtype]
    return np.clip(y, lo, hi).astype(out_dtype)


@op(
    reference=_reference,
    dtypes={"x": ("int32",), "multiplier": ("int32",), "shift": ("int32",)},
    ranks=(1, 6),
    input_shapes=lambda s, a: {"multiplier": param_shape(s, a), "shift": param_shape(s, a)},
    layouts={"per_tensor": {"per_channel": False}, "per_channel": {"per_channel": True}},
    check=_check,
    # The real scale M * 2**-(31 + shift) is in [0.5, 1) * 2**-shift: a uniform shift in
    # [-7, 13] spreads it evenly over the decades, ~6e-5 to ~128 (int64 stays exact:
    # |x - in_zp| * M < 2**48 and n = 31 + shift >= 24). Output zero points at both ends of
    # int8 and of uint8 (each refused for the other dtype; the largest valid one is a corner).
    domain={"x": (-100000, 100000), "multiplier": (2**30, 2**31 - 1), "shift": (-7, 13)},
    attr_domain={"input_zero_point": [0, 3, -7], "output_zero_point": [0, -5, 9, -128, 127, 255]},
    kind="elementwise",
    output_dtype="out_dtype",
    examples=[(2, 3, 8)],
)
def requantize(
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
    """Fixed-point requantization of int32 values, per tensor or per channel along ``axis``;
    ``output_zero_point`` must lie in the range of ``out_dtype``."""
    a = {"axis": axis, "per_channel": per_channel}
    one = tirx.const(1, "int64")

    def body(*i):
        c = per_channel_index(i, a)
        n = shift(c).astype("int64") + 31
        v = (x(*i).astype("int64") - input_zero_point) * multiplier(c).astype("int64")
        y = tirx.shift_right(v + tirx.shift_left(one, n - 1), n)
        # Add the zero point and saturate in int64: y can exceed the int32 range.
        return clamp_te(y + output_zero_point, out_dtype)

    return te.compute(x.shape, body, name="requantize")
