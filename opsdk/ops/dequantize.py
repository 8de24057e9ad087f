"""``dequantize``: int8/uint8/int32 -> float32, ``(q - zero_point) * scale``.

``q - zero_point`` is exact in int32; its conversion to float32 is exact below 2**24 in
magnitude; the product is one float32 rounding, so the output is bit-exact.
"""

from __future__ import annotations

import numpy as np
from tvm import te

from .._opdef import Axis, Tensor, op
from ._quant import param_shape, param_view, per_channel_index


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
    domain={"q": (-128, 127), "scale": (0.005, 0.1), "zero_point": (-20, 20)},
    kind="elementwise",
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
