"""``softmax`` along any axis, numerically stable (the row maximum is subtracted first)."""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .._dtypes import FLOAT_DTYPES
from .._opdef import Axis, Tensor, op
from ..te_utils import acc, exp_f32


def _reference(x, *, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@op(
    reference=_reference,
    dtypes=FLOAT_DTYPES,
    ranks=(1, 6),
    layouts={"last": {"axis": -1}, "axis1": {"axis": 1}},
    domain={"x": (-8.0, 8.0)},
    kind="reduction",
    special_values=True,  # inf, NaN, huge inputs: docs/verification.md
    examples=[(2, 3, 8)],
)
def softmax(x: Tensor, *, axis: Axis = -1) -> te.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``, accumulated in float32."""
    nd = len(x.shape)

    def outer_idx(o, r):
        return (*o[:axis], r, *o[axis:])

    outer = [x.shape[i] for i in range(nd) if i != axis]
    rm = te.reduce_axis((0, x.shape[axis]), name="rm")
    mx = te.compute(outer, lambda *o: te.max(acc(x(*outer_idx(o, rm))), axis=rm), name="max")
    # exp is the expensive part (~16 vector ops): compute it once per element into ``e`` (a
    # row-sized buffer once the schedule computes it inside the row loop), then sum it and
    # scale it by one reciprocal per row (a division per element would be the slowest op).
    e = te.compute(
        x.shape,
        lambda *i: exp_f32(acc(x(*i)) - mx(*i[:axis], *i[axis + 1 :]), nonpositive=True),
        name="exp",
    )
    rs = te.reduce_axis((0, x.shape[axis]), name="rs")
    ex = te.compute(outer, lambda *o: te.sum(e(*outer_idx(o, rs)), axis=rs), name="expsum")
    rsum = te.compute(outer, lambda *o: tirx.const(1.0, "float32") / ex(*o), name="rsum")

    def out(*i):
        o = (*i[:axis], *i[axis + 1 :])
        return (e(*i) * rsum(*o)).astype(x.dtype)

    return te.compute(x.shape, out, name="softmax")
