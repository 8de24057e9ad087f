"""``softmax`` along any axis, numerically stable (the row maximum is subtracted first)."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import ModelInput, error_model, softmax_bound
from .._opdef import Axis, Tensor
from .._patterns import call_attr, float_tensor
from ..te_utils import acc, exp_f32
from ._convert import arg, covered_dtype


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


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    return softmax_bound(m.inputs[m.op.primary], m.attrs["axis"], m.u)


# ---------------------------------------------------------------------------------------------
# torch: softmax.int and the _softmax.default it decomposes to (``keep``: softmax.int)


def _from_torch(node: Any, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    dim = arg(node, 1, "dim", -1)
    if node.target.__name__ == "_softmax.default":
        to_float = bool(arg(node, 2, "half_to_float", False))
        dtype = "float32" if to_float else None
    else:
        dtype = arg(node, 2, "dtype")
        dtype = None if dtype is None else imp._convert_data_type(dtype)
    if dtype is not None and dtype != str(x.ty.dtype):
        x = imp.block_builder.emit(relax.op.astype(x, dtype))  # torch casts the input first
    if not covered_dtype(x):
        return imp.block_builder.emit(relax.op.nn.softmax(x, dim))
    return imp.block_builder.emit(softmax(x, axis=int(dim)))


softmax.torch("softmax.int", "_softmax.default", convert=_from_torch, keep=("softmax.int",))


# ---------------------------------------------------------------------------------------------
# TVM's R.nn.softmax (ONNX Softmax): float dtypes


@softmax.replaces("relax.nn.softmax", onnx="Softmax", since=13)
def _tvm_softmax() -> tuple[DFPattern, Any]:
    def build(call: relax.Call, m: Any) -> relax.Expr | None:
        x = call.args[0]
        if float_tensor(x) is None:
            return None
        return softmax(x, axis=int(call_attr(call, "axis")))

    return is_op("relax.nn.softmax")(wildcard()), build
