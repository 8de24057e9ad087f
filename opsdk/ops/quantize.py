"""``quantize``: float32 -> int8/uint8, ``clamp(round(x / scale) + zero_point)``.

Rounding: the quotient ``x / scale`` is rounded to float32 (an IEEE division, as the kernel
computes it), then to the nearest integer with ties to even (``nearbyint``), then the zero
point is added and the result saturated to the output range.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te

from .._declare import op
from .._domains import log_uniform
from .._opdef import Axis, Tensor
from ._quant import QRANGE, param_shape, param_view, per_channel_index, rint_f32, round_to_te


def _reference(x, scale, zero_point, *, axis=-1, per_channel=False, out_dtype="int8"):
    s = param_view(scale, x.ndim, axis, per_channel, np.float32)
    zp = param_view(zero_point, x.ndim, axis, per_channel, np.int64)
    q = rint_f32(x.astype(np.float32) / s).astype(np.int64) + zp
    lo, hi = QRANGE[out_dtype]
    return np.clip(q, lo, hi).astype(out_dtype)


@op(
    reference=_reference,
    dtypes={"x": ("float32",), "scale": ("float32",), "zero_point": ("int32",)},
    ranks=(1, 6),
    input_shapes=lambda s, a: {"scale": param_shape(s, a), "zero_point": param_shape(s, a)},
    layouts={"per_tensor": {"per_channel": False}, "per_channel": {"per_channel": True}},
    # Scales over six decades: from saturating nearly every x (1e-4) to rounding all of
    # [-4, 4] to the zero point (1e2). Bit-exact comparison stays valid over the whole
    # range: |x / scale| <= 1e3 / 1e-4 = 1e7 (the largest data recipe over the smallest
    # scale) is far from float32 overflow, scales are normal floats, and a quotient below
    # the normal range (|x| < 1e-36) rounds to 0 however a kernel treats subnormals. Zero
    # points over the int8 and uint8 ranges; the "edges" recipe puts them exactly at -128,
    # 0, 127 and 255 (one outside the output's range shifts the output into saturation).
    domain={"x": (-4.0, 4.0), "scale": log_uniform(1e-4, 1e2), "zero_point": (-128, 255)},
    kind="elementwise",
    output_dtype="out_dtype",
    examples=[(2, 3, 8)],
)
def quantize(
    x: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    *,
    axis: Axis = -1,
    per_channel: bool = False,
    out_dtype: Literal["int8", "uint8"] = "int8",
) -> te.Tensor:
    """Affine quantization of float32 ``x`` with per-tensor (``scale`` of shape ``(1,)``) or
    per-channel (``scale`` of shape ``(x.shape[axis],)``) scales and zero points."""
    a = {"axis": axis, "per_channel": per_channel}

    def body(*i):
        c = per_channel_index(i, a)
        return round_to_te(x(*i) / scale(c), zero_point(c), out_dtype)

    return te.compute(x.shape, body, name="quantize")
