"""``relax.sort``, ``relax.argsort`` and ``relax.topk`` as one sort kernel: TVM 0.27 registers
no legalization for them on CPUs (its own pipelines call ``tvm.contrib.sort``, which lives in
``libtvm_runtime_extra``, not in the runtime an artifact ships), so a detector's top-k
scores, a ``torch.sort`` or an ONNX ``TopK`` stopped the compile.

Each row along the sorted axis is copied into a scratch pair (integer sort keys, positions),
sorted by a bottom-up merge sort that ping-pongs between two such pairs, ``ceil(log2 n)``
passes of ``n`` steps (``n log n``: 8400 anchors take 14 passes), and its first ``k`` positions and
their values are written out; the rows run in parallel. For a top-k every run is cut to its
first ``k``, so a pass over runs longer than ``k`` moves ``k`` per pair (``n (log2 k + 2)``
steps in all). It is written as loops, like the recurrence kernels
(:mod:`opsdk.frontend._recurrent`), and runs through the ``extern`` rules as written, on
x86 and aarch64 alike.

Order as torch's: a NaN ranks above every number (last ascending, first descending, among
the top-k largest); the merge is stable, so equal values keep their positions' order
(torch documents ties only for ``stable=True``, which this matches).
"""

from __future__ import annotations

import functools
import math

from tvm import relax, tirx
from tvm.script import tirx as T

__all__ = ["SORT_LEGALIZATIONS"]


def _key(v, dtype: str):
    """An integer with the order torch sorts ``v`` (of ``dtype``) in: a float's bits with the
    negatives' magnitudes negated (``-0.0`` equal to ``0.0``), every NaN above infinity.
    Integers, so that no float comparison is left for TVM's simplifier, which takes
    ``not (a > b)`` for ``a <= b`` and ``x != x`` for false (NaNs sorted anywhere)."""
    if not dtype.startswith(("float", "bfloat")):
        return tirx.Cast(_key_dtype(dtype), v)
    wide = dtype == "float64"
    it, ft = ("int64", "float64") if wide else ("int32", "float32")
    bits = tirx.reinterpret(it, tirx.Cast(ft, v))
    mag = bits & tirx.const((1 << 63) - 1 if wide else (1 << 31) - 1, it)
    inf = tirx.const(0x7FF0000000000000 if wide else 0x7F800000, it)
    top = tirx.const((1 << 63) - 1 if wide else (1 << 31) - 1, it)
    return tirx.Select(mag > inf, top, tirx.Select(bits < tirx.const(0, it), -mag, mag))


def _key_dtype(dtype: str) -> str:
    if dtype in ("float64", "uint32"):  # uint32: its values in a signed type
        return "int64"
    return "int32" if dtype.startswith(("float", "bfloat")) else dtype


@functools.lru_cache(maxsize=64)
def _sort_kernel(pre: int, n: int, post: int, k: int, dtype: str, index_dtype: str,
                 descending: bool) -> tirx.PrimFunc:
    """``x`` of shape ``(pre, n, post)`` sorted along its middle axis: the first ``k`` values
    and their positions, as ``(pre, k, post)`` each. The passes move (key, position) pairs;
    the values are read back from ``x`` at the sorted positions."""
    rows = pre * post
    kt = _key_dtype(dtype)
    passes = max(1, (n - 1).bit_length())

    def first(left, right):
        # the left (earlier) run's head goes first unless the right one's strictly precedes
        return right <= left if descending else left <= right

    @T.macro
    def merge_pass(sk, si, dk, di, r, width, i, j):
        # Runs start every 2 * width; only a run's first k entries are kept (the top k of
        # two runs are among their top k each), so for a small k a pass moves k per block.
        for blk in range((n + 2 * width - 1) // (2 * width)):
            start = blk * 2 * width
            mid = start + width
            end_i = start + T.min(T.min(width, k), n - start)
            end_j = mid + T.max(T.min(T.min(width, k), n - mid), 0)
            i[0] = start
            j[0] = mid
            for t in range(T.min(end_i - start + end_j - mid, k)):
                # Branch-free (a sorted run's next element is a coin toss to a branch
                # predictor): both heads read, clamped inside the row (a spent run's head
                # is read, never taken), one taken by a select, its index advanced.
                left = sk[r, T.min(i[0], n - 1)]
                right = sk[r, T.min(j[0], n - 1)]
                take = T.Cast("int32", j[0] >= end_j or (i[0] < end_i and first(left, right)))
                dk[r, start + t] = T.Select(take == 1, left, right)
                di[r, start + t] = si[r, T.min(T.Select(take == 1, i[0], j[0]), n - 1)]
                i[0] = i[0] + take
                j[0] = j[0] + 1 - take

    @T.prim_func(private=True, check_well_formed=False)
    def sort_rows(x: T.Buffer((pre, n, post), dtype),
                  values: T.Buffer((pre, k, post), dtype),
                  indices: T.Buffer((pre, k, post), index_dtype)):
        T.func_attr({"tir.noalias": True})
        ak = T.decl_buffer((rows, n), kt)
        ai = T.decl_buffer((rows, n), "int32")
        bk = T.decl_buffer((rows, n), kt)
        bi = T.decl_buffer((rows, n), "int32")
        for r in T.parallel(rows):
            i = T.decl_buffer((1,), "int32", scope="local")  # the two runs' heads
            j = T.decl_buffer((1,), "int32", scope="local")
            for t in range(n):
                ak[r, t] = _key(x[r // post, t, r % post], dtype)
                ai[r, t] = t
            for level in range(passes):
                if level % 2 == 0:
                    merge_pass(ak, ai, bk, bi, r, T.shift_left(1, level), i, j)
                else:
                    merge_pass(bk, bi, ak, ai, r, T.shift_left(1, level), i, j)
            for t in range(k):
                if passes % 2 == 1:
                    values[r // post, t, r % post] = x[r // post, bi[r, t], r % post]
                    indices[r // post, t, r % post] = T.Cast(index_dtype, bi[r, t])
                else:
                    values[r // post, t, r % post] = x[r // post, ai[r, t], r % post]
                    indices[r // post, t, r % post] = T.Cast(index_dtype, ai[r, t])

    return sort_rows


def _static(shape) -> list[int] | None:
    dims = []
    for d in shape:
        if not isinstance(d, tirx.IntImm):
            return None
        dims.append(int(d))
    return dims


def _sorted_rows(bb: relax.BlockBuilder, x: relax.Expr, axis: int, k: int | None,
                 descending: bool, index_dtype: str) -> tuple[relax.Expr, relax.Expr] | None:
    """(values, indices) of the first ``k`` (None: all) of ``x`` sorted along ``axis``, or
    None when the shape is not static (the call is left for the pipeline to name)."""
    ty = x.ty
    dims = (_static(ty.shape.values) if isinstance(ty, relax.TensorType)
            and isinstance(ty.shape, relax.ShapeExpr) else None)
    if dims is None:
        return None
    axis = axis % len(dims)
    n = dims[axis]
    k = n if k is None or k < 0 else min(k, n)
    pre, post = math.prod(dims[:axis]), math.prod(dims[axis + 1:])
    kernel = _sort_kernel(pre, n, post, k, str(ty.dtype), index_dtype, bool(descending))
    gv = bb.add_func(kernel, "sort_rows")
    out = [*dims[:axis], k, *dims[axis + 1:]]
    flat = bb.emit(relax.op.reshape(x, (pre, n, post))) if (pre, n, post) != tuple(dims) \
        else x
    pair = bb.emit(relax.call_tir(gv, [flat], [
        relax.TensorType((pre, k, post), str(ty.dtype)),
        relax.TensorType((pre, k, post), index_dtype)]))
    values = bb.emit(relax.op.reshape(relax.TupleGetItem(pair, 0), out))
    indices = bb.emit(relax.op.reshape(relax.TupleGetItem(pair, 1), out))
    return values, indices


def _dtype(attrs, default: str = "int32") -> str:
    d = str(getattr(attrs, "dtype", "") or "")
    return d if d not in ("", "void") else default


def _legalize_sort(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    got = _sorted_rows(bb, call.args[0], int(call.attrs.axis), None,
                       bool(call.attrs.descending), "int32")
    return call if got is None else got[0]


def _legalize_argsort(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    got = _sorted_rows(bb, call.args[0], int(call.attrs.axis), None,
                       bool(call.attrs.descending), _dtype(call.attrs))
    return call if got is None else got[1]


def _legalize_topk(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a = call.attrs
    got = _sorted_rows(bb, call.args[0], int(a.axis), int(a.k), bool(a.largest), _dtype(a))
    if got is None:
        return call
    ret = str(a.ret_type)
    if ret == "values":
        return got[0]
    if ret == "indices":
        return got[1]
    return relax.Tuple(list(got))


#: Legalizations of the sort ops (:data:`opsdk.transform._lower.MISSING_LEGALIZATIONS`).
SORT_LEGALIZATIONS = {"relax.sort": _legalize_sort, "relax.argsort": _legalize_argsort,
                      "relax.topk": _legalize_topk}
