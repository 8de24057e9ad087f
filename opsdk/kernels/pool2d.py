"""``tvm_pool2d``: the kernel TVM lowers ``max_pool2d`` / ``avg_pool2d`` to.

``topi.nn.pool2d`` as relax's legalization calls it (padding block, window reduction, and for
the average a division block), NCHW and NHWC, with ``ceil_mode`` and (average)
``count_include_pad`` as relax's attributes carry them. Spatial sizes and channels static, the batch
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


def _out_len(n: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """Output length along an axis of length ``n`` (torch's and TVM's rule): with
    ``ceil_mode`` the last window may start past the end of the padded input's last whole
    window, but not past the input and its leading padding."""
    span = n + 2 * padding - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= n + padding:
        out -= 1
    return out


def _windows(x, kernel, stride, padding, fill, ceil_mode=False):
    """(N, C, OH, OW, k*k) windows of an NCHW float64 array; outside the input (the padding,
    and with ``ceil_mode`` past the padding too) filled with ``fill``."""
    h, w = x.shape[2], x.shape[3]
    oh = _out_len(h, kernel, stride, padding, ceil_mode)
    ow = _out_len(w, kernel, stride, padding, ceil_mode)
    # pad past the bottom / right far enough for a ceil-mode window's tail
    eh = max(padding, (oh - 1) * stride + kernel - h - padding)
    ew = max(padding, (ow - 1) * stride + kernel - w - padding)
    xp = np.pad(x, ((0, 0), (0, 0), (padding, eh), (padding, ew)), constant_values=fill)
    taps = [xp[:, :, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
            for i in range(kernel) for j in range(kernel)]
    return np.stack(taps, axis=-1)


def _counts(h, w, kernel, stride, padding, ceil_mode, include_pad):
    """(OH, OW) divisors of the average: the window's input pixels, or with
    ``include_pad`` its pixels inside the padded input (a ceil-mode window's part past the
    padding does not count, as in torch)."""
    out = []
    for n in (h, w):
        o = _out_len(n, kernel, stride, padding, ceil_mode)
        start = np.arange(o) * stride - padding
        lo, hi = (-padding, n + padding) if include_pad else (0, n)
        out.append(np.minimum(start + kernel, hi) - np.maximum(start, lo))
    return np.outer(out[0], out[1]).astype(np.float64)


def _reference(x, *, layout="NCHW", pool="max", kernel=3, stride=2, padding=1,
               ceil_mode=False, count_include_pad=False):
    xc = x if layout == "NCHW" else np.moveaxis(x, -1, 1)
    if pool == "max":
        y = _windows(xc, kernel, stride, padding, -np.inf, ceil_mode).max(axis=-1)
    else:
        s = _windows(xc, kernel, stride, padding, 0.0, ceil_mode).sum(axis=-1)
        y = s / _counts(xc.shape[2], xc.shape[3], kernel, stride, padding, ceil_mode,
                        count_include_pad)
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
    mean_abs = _reference(np.abs(m.inputs["x"]), **{**a, "pool": "avg"})
    return gamma(a["kernel"] ** 2 + 1, m.u) * mean_abs


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    check=_check,
    layouts={
        # count_include_pad is the average's alone
        "NCHW_max": {"layout": "NCHW", "pool": "max", "count_include_pad": False},
        "NHWC_max": {"layout": "NHWC", "pool": "max", "count_include_pad": False},
        "NCHW_avg": {"layout": "NCHW", "pool": "avg"},
        "NHWC_avg": {"layout": "NHWC", "pool": "avg"},
    },
    domain={"x": (-4.0, 4.0)},
    attr_domain={"kernel": [3, 2, 7], "stride": [2, 1, 3], "padding": [1, 0, 3],
                 "ceil_mode": [False, True], "count_include_pad": [False, True]},
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
    ceil_mode: bool = False,
    count_include_pad: bool = False,
) -> te.Tensor:
    """Max / average pooling over ``kernel x kernel`` windows (``topi.nn.pool2d`` as relax's
    legalization calls it). ``ceil_mode``: the output length rounds up (a last window past
    the padded input, as torch's ``ceil_mode=True``); ``count_include_pad`` (average): the
    divisor counts the padding's pixels too (torch's default; ONNX's
    ``count_include_pad=1``)."""
    return topi.nn.pool2d(x, (kernel, kernel), (stride, stride), (1, 1),
                          (padding, padding, padding, padding), pool, ceil_mode, layout,
                          count_include_pad=count_include_pad)


error_model(tvm_pool2d)(_error)
