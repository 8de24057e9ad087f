"""``tvm_mean``: the kernel TVM lowers ``mean`` over the spatial axes to (global average
pooling, a squeeze-excite block's squeeze).

Relax legalizes ``relax.mean`` to ``topi.sum`` followed by a division by the reduced count;
this is that compute, over H and W of an NCHW or NHWC tensor, keeping the reduced dims. NCHW
reduces the innermost axes (``x86.rows`` / ``neon.rows``: vector partial sums along a row);
NHWC reduces outer axes with the channels innermost (``x86.columns`` / ``neon.columns``:
vectors of channels, the spatial loops outside them). Channels and spatial sizes static, the
batch may be symbolic.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, topi

from .._declare import op
from .._errmodel import error_model
from .._opdef import Tensor
from ._epilogue import gamma, static_int

__all__ = ["tvm_mean", "tvm_reduce"]


def _axes(layout: str) -> tuple[int, int]:
    return (2, 3) if layout == "NCHW" else (1, 2)


def _reference(x, *, layout="NCHW"):
    return x.mean(axis=_axes(layout), keepdims=True)


def _check(shapes, dtypes, attrs):
    s = [static_int(d) for d in shapes["x"]]
    for d, name in zip((s[1], s[2], s[3]), ("dim 1", "dim 2", "dim 3")):
        if d is None:
            raise ValueError(f"argument 'x' has a symbolic {name}; the mean kernel needs "
                             "static channels and spatial sizes (only the batch may be "
                             "symbolic)")


def _error(m) -> np.ndarray:
    """A sum of ``n = H * W`` terms in any order, then one division: gamma_{n+1} of the mean
    of |x| (the order the rule's vector partial sums take is one of those the bound covers)."""
    axes = _axes(m.attrs["layout"])
    x = m.inputs["x"]
    n = x.shape[axes[0]] * x.shape[axes[1]]
    return gamma(n + 1, m.u) * np.abs(x).mean(axis=axes, keepdims=True)


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    check=_check,
    layouts={"NCHW": {"layout": "NCHW"}, "NHWC": {"layout": "NHWC"}},
    domain={"x": (-4.0, 4.0)},
    kind="reduction",
    examples=[(2, 7, 7, 40)],
)
def tvm_mean(x: Tensor, *, layout: Literal["NCHW", "NHWC"] = "NCHW") -> te.Tensor:
    """The mean over the spatial axes, keeping them (``relax.mean``'s legalization)."""
    axes = list(_axes(layout))
    count = x.shape[axes[0]] * x.shape[axes[1]]
    return topi.divide(topi.sum(x, axes, True), count)


error_model(tvm_mean)(_error)


# ---------------------------------------------------------------------------- tvm_reduce
_REDUCE_AXIS = {"last": 2, "middle": 1}


def _reduce_reference(x, *, reduce="max", axis="last"):
    f = np.max if reduce == "max" else np.sum
    return f(x, axis=_REDUCE_AXIS[axis], keepdims=True)


def _reduce_check(shapes, dtypes, attrs):
    for i in (1, 2):
        if static_int(shapes["x"][i]) is None:
            raise ValueError(f"argument 'x' has a symbolic dim {i}; the reduce kernel needs "
                             "static trailing dims (only the batch may be symbolic)")


def _reduce_error(m) -> np.ndarray:
    """max: exact. sum of ``n`` terms in any order: gamma_n of the sum of |x|."""
    x, axis = m.inputs["x"], _REDUCE_AXIS[m.attrs["axis"]]
    if m.attrs["reduce"] == "max":
        return np.zeros_like(np.max(x, axis=axis, keepdims=True))
    return gamma(x.shape[axis], m.u) * np.abs(x).sum(axis=axis, keepdims=True)


@op(
    reference=_reduce_reference,
    dtypes=("float32",),
    ranks=(3, 3),
    check=_reduce_check,
    layouts={"last": {"axis": "last"}, "middle": {"axis": "middle"}},
    domain={"x": (-4.0, 4.0)},
    kind="reduction",
    examples=[(2, 7, 40)],
)
def tvm_reduce(x: Tensor, *, reduce: Literal["max", "sum"] = "max",
               axis: Literal["last", "middle"] = "last") -> te.Tensor:
    """A plain reduction, nothing after it (``relax.max`` / ``relax.sum`` keeping the axis,
    e.g. DeiT's and BERT's mask check): over the last axis (``x86.rows`` / ``neon.rows``) or
    the middle one, the last innermost (``x86.columns`` / ``neon.columns``)."""
    f = topi.max if reduce == "max" else topi.sum
    return f(x, _REDUCE_AXIS[axis], True)


error_model(tvm_reduce)(_reduce_error)
