"""``dequantize``: int8/uint8/int32 -> float32, ``(q - zero_point) * scale``.

``q - zero_point`` is exact in int32; its conversion to float32 is exact below 2**24 in
magnitude; the product is one float32 rounding, so the output is bit-exact.
"""

from __future__ import annotations

import numpy as np
from tvm import te

from .._declare import op
from .._domains import log_uniform
from .._errmodel import error_model
from .._opdef import Axis, Tensor
from ._quant import exact_model, param_shape, param_view, per_channel_index


def _reference(q, scale, zero_point, *, axis=-1, per_channel=False):
    s = param_view(scale, q.ndim, axis, per_channel, np.float32)
    zp = param_view(zero_point, q.ndim, axis, per_channel, np.int64)
    return (q.astype(np.int64) - zp).astype(np.float32) * s


@op(
    reference=_reference,
    dtypes={"q": ("int8", "uint8", "int32"), "scale": ("float32",), "zero_point": ("int32",)},
    ranks=(1, 6),
    input_shapes=lambda s, a: {"scale": param_shape(s, a), "zero_point": param_shape(s, a)},
    layouts={"per_tensor": {"per_channel": False}, "per_channel": {"per_channel": True}},
    # q over the whole int8 / uint8 range (an integer input's domain is cut to its dtype),
    # zero points over both ranges, scales over six decades: |q - zero_point| <= 383 is
    # exact in float32 and the product (1e-4 to 4e4, or 0) one rounding of a normal float,
    # the same in numpy and in any IEEE kernel, so the output is compared bit-exactly.
    domain={"q": (-128, 255), "scale": log_uniform(1e-4, 1e2), "zero_point": (-128, 255)},
    kind="elementwise",
    output_dtype="float32",
    examples=[(2, 3, 8)],
)
def dequantize(
    q: Tensor, scale: Tensor, zero_point: Tensor, *, axis: Axis = -1, per_channel: bool = False
) -> te.Tensor:
    """Affine dequantization to float32, per tensor or per channel along ``axis``."""
    a = {"axis": axis, "per_channel": per_channel}

    def body(*i):
        c = per_channel_index(i, a)
        return (q(*i).astype("int32") - zero_point(c)).astype("float32") * scale(c)

    return te.compute(q.shape, body, name="dequantize")


# Keyed by the reference: variants (same math) share it.
error_model(_reference)(exact_model)
