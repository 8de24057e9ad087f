"""``tvm_pool2d``: the kernel TVM lowers ``max_pool2d`` / ``avg_pool2d`` to.

``topi.nn.pool2d`` as relax's legalization calls it (padding block, window reduction, and for
the average a division block), NCHW and NHWC. Spatial sizes and channels static, the batch
may be symbolic. Scheduled by the ``kind:pool`` rules (``x86.pool``, ``neon.pool``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, topi

from .._declare import op
from .._errmodel import error_model
from .._opdef import Tensor
from ._epilogue import gamma, static_int

__all__ = ["tvm_pool2d"]


def _windows(x, kernel, stride, padding, fill):
    """(N, C, OH, OW, k*k) windows of an NCHW float64 array, padding filled with ``fill``."""
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)),
                constant_values=fill)
    h, w = x.shape[2], x.shape[3]
    oh = (h + 2 * padding - kernel) // stride + 1
    ow = (w + 2 * padding - kernel) // stride + 1
    taps = [xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            for i in range(kernel) for j in range(kernel)]
    return np.stack(taps, axis=-1)


def _reference(x, *, layout="NCHW", pool="max", kernel=3, stride=2, padding=1):
    xc = x if layout == "NCHW" else np.moveaxis(x, -1, 1)
    if pool == "max":
        y = _windows(xc, kernel, stride, padding, -np.inf).max(axis=-1)
    else:  # count_include_pad=False, as torch's default exports
        s = _windows(xc, kernel, stride, padding, 0.0).sum(axis=-1)
        cnt = _windows(np.ones_like(xc), kernel, stride, padding, 0.0).sum(axis=-1)
        y = s / cnt
    return y if layout == "NCHW" else np.moveaxis(y, 1, -1)


def _hw(s, layout):
    return (s[2], s[3]) if layout == "NCHW" else (s[1], s[2])


def _check(shapes, dtypes, attrs):
    s = [static_int(d) for d in shapes["x"]]
    for d, name in zip((s[1], s[2], s[3]), ("dim 1", "dim 2", "dim 3")):
        if d is None:
            raise ValueError(f"argument 'x' has a symbolic {name}; pool kernels need static "
                             "channels and spatial sizes (only the batch may be symbolic)")
    h, w = _hw(s, attrs["layout"])
    k, p = attrs["kernel"], attrs["padding"]
    if p * 2 >= k + 1 or h + 2 * p < k or w + 2 * p < k:
        raise ValueError(f"argument 'x' is {h}x{w}: too small for a {k}x{k} window with "
                         f"padding {p} (padding must be at most half the window)")


def _error(m) -> np.ndarray:
    """max: exact. avg: a sum of at most k*k terms and one division (gamma_{k*k+1} of the
    mean of |x|)."""
    a = m.attrs
    if a["pool"] == "max":
        return np.zeros_like(m.ref)
    mean_abs = _reference(np.abs(m.inputs["x"]), layout=a["layout"], pool="avg",
                          kernel=a["kernel"], stride=a["stride"], padding=a["padding"])
    return gamma(a["kernel"] ** 2 + 1, m.u) * mean_abs


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    check=_check,
    layouts={
        "NCHW_max": {"layout": "NCHW", "pool": "max"},
        "NHWC_max": {"layout": "NHWC", "pool": "max"},
        "NCHW_avg": {"layout": "NCHW", "pool": "avg"},
        "NHWC_avg": {"layout": "NHWC", "pool": "avg"},
    },
    domain={"x": (-4.0, 4.0)},
    attr_domain={"kernel": [3, 2, 7], "stride": [2, 1, 3], "padding": [1, 0, 3]},
    kind="pool",
    examples=[(2, 4, 8, 8)],
)
def tvm_pool2d(
    x: Tensor,
    *,
    layout: Literal["NCHW", "NHWC"] = "NCHW",
    pool: Literal["max", "avg"] = "max",
    kernel: int = 3,
    stride: int = 2,
    padding: int = 1,
) -> te.Tensor:
    """Max / average pooling over ``kernel x kernel`` windows (``topi.nn.pool2d``)."""
    return topi.nn.pool2d(x, (kernel, kernel), (stride, stride), (1, 1),
                          (padding, padding, padding, padding), pool, False, layout,
                          count_include_pad=False)


error_model(tvm_pool2d)(_error)
