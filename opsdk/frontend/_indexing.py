"""torch's indexing on import: ``select``, advanced indexing and ``index_put`` as torch
defines them.

TVM 0.27's converters of these ops give wrong answers without an error (measured with
torch 2.13, float32, every case below now in ``tests/host/test_frontend.py``):

- a negative index reads outside the tensor: ``x[:, -1]`` (``select.int``: a ``take`` in
  its fast mode, which does not wrap), ``x[:, [-1, 0]]`` and ``x[:, idx]`` with negative
  values (``index.Tensor``). An LSTM keyword spotter's ``y[:, -1]`` gave 1e31;
- two or more index tensors beside a sliced dimension (``x[:, i, j]``, ``x[i, :, j]``)
  index every combination of the indices instead of the pairs they zip to;
- ``index_put`` (``x[i] = v``, ``x[:, i, j] = v``) refused fewer index tensors than the
  tensor has dimensions, and with a sliced dimension between two index tensors wrote the
  wrong elements.

The converters here follow torch's rules: every index is wrapped by its dimension's
extent (folded into the constant when the index is one); the index tensors broadcast
together, and their shape takes the place of the first indexed dimension when the
indexed dimensions are adjacent, or goes first when a slice separates them. A boolean
mask (a data-dependent shape) is refused with its fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.sym import Analyzer  # tvm.arith before 0.27

__all__ = ["index", "index_put", "select"]

_INT64_MAX = 2**63 - 1


def _static(e: Any) -> int | None:
    """A shape entry as a Python int, None when it is symbolic."""
    if isinstance(e, int):
        return e
    return int(e.value) if isinstance(e, tvm.tirx.IntImm) else None


def _shape(x: relax.Expr) -> list[Any]:
    return list(x.ty.shape)


def _wrapped(imp: Any, idx: relax.Expr, extent: Any, what: str) -> relax.Expr:
    """``idx`` with each negative value ``v`` replaced by ``v + extent``, as torch reads it
    (a constant is folded; a computed index gets a ``where``)."""
    bb = imp.block_builder
    dt = str(idx.ty.dtype)
    if dt in ("bool", "uint8"):
        raise ValueError(
            f"{what}: a boolean mask as an index gives a shape that depends on the data, "
            "which a compiled model cannot have; compute with the mask instead "
            "(torch.where(mask, x, other) or x * mask)")
    if "int" not in dt:
        raise ValueError(f"{what}: an index tensor of dtype {dt}; indices are integers")
    n = _static(extent)
    if isinstance(idx, tvm.ir.expr.Constant):
        v = idx.value.numpy()
        if not (v < 0).any():
            return idx
        if n is not None:
            return relax.const(np.where(v < 0, v + n, v).astype(v.dtype))
    if n is not None:
        ext = relax.const(n, dt)
    else:
        ext = bb.emit(relax.op.astype(relax.op.shape_to_tensor(relax.ShapeExpr([extent])), dt))
    neg = bb.emit(relax.op.less(idx, relax.const(0, dt)))
    return bb.emit(relax.op.where(neg, relax.op.add(idx, ext), idx))


def select(node: Any, imp: Any) -> relax.Expr:
    """``select.int`` (``x[:, i]``): a negative ``i`` counts from the end."""
    x, dim, i = imp.env[node.args[0]], node.args[1], node.args[2]
    if not isinstance(i, int) or not isinstance(dim, int):
        return imp._select(node)
    shape = _shape(x)
    dim %= len(shape)
    bb = imp.block_builder
    if i < 0:
        n = _static(shape[dim])
        if n is None:  # a symbolic extent: a slice counts from the end itself
            end = i + 1 if i < -1 else _INT64_MAX
            piece = bb.emit(relax.op.strided_slice(x, axes=[dim], begin=[i], end=[end]))
            return bb.emit(relax.op.squeeze(piece, axis=[dim]))
        i += n
    return bb.emit(relax.op.take(x, relax.const(i, "int64"), dim))


def _indices(imp: Any, x: relax.Expr, raw: Any, what: str) -> list[relax.Expr | None]:
    """The index list padded with None to the tensor's rank, each index wrapped."""
    shape = _shape(x)
    if len(raw) > len(shape):
        raise ValueError(f"{what}: {len(raw)} indices for a tensor of {len(shape)} dimensions")
    out: list[relax.Expr | None] = []
    for d, a in enumerate([*raw, *[None] * (len(shape) - len(raw))]):
        out.append(None if a is None else _wrapped(imp, imp.env[a], shape[d], what))
    return out


def _broadcast(shapes: list[list[Any]]) -> list[Any]:
    """numpy's broadcast of equal-rank shapes; a symbolic extent stands for itself."""
    out = []
    for col in zip(*shapes):
        big = [e for e in col if _static(e) != 1]
        out.append(big[0] if big else col[0])
    return out


def _flat(bb: Any, e: relax.Expr, shape: list[Any]) -> relax.Expr:
    """``e`` broadcast to ``shape``, then one-dimensional."""
    return bb.emit(relax.op.reshape(bb.emit(relax.op.broadcast_to(e, shape)), [-1]))


def _offsets(bb: Any, flat: list[relax.Expr], shape: list[Any]) -> relax.Expr:
    """The row-major offsets of the elements that one flat index per dimension names."""
    out, stride = None, tvm.tirx.IntImm("int64", 1)
    for f, extent in zip(reversed(flat), reversed(shape)):
        n = _static(stride)
        if n == 1:
            term = f
        else:
            st = relax.const(n, "int64") if n is not None else bb.emit(relax.op.astype(
                relax.op.shape_to_tensor(relax.ShapeExpr([stride])), "int64"))
            term = bb.emit(relax.op.multiply(f, st))
        out = term if out is None else bb.emit(relax.op.add(out, term))
        stride = Analyzer().simplify(stride * extent)
    return out


def _layout(idx: list[relax.Expr | None]) -> tuple[list[int], int, int]:
    """The indexed dimensions, the rank of their broadcast shape, and where that shape
    goes in the result (the first indexed dimension if they are adjacent, else 0)."""
    dims = [d for d, e in enumerate(idx) if e is not None]
    rank = max(e.ty.ndim for e in idx if e is not None)
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    return dims, rank, dims[0] if adjacent else 0


def index(node: Any, imp: Any) -> relax.Expr:
    """``index.Tensor`` (``x[i]``, ``x[:, i, j]``, ``x[i, :, j]``) with torch's rules."""
    bb = imp.block_builder
    x = imp.env[node.args[0]]
    idx = _indices(imp, x, node.args[1], "aten.index")
    if all(e is None for e in idx):  # x[:, :]: the tensor itself
        return x
    dims, rank, at = _layout(idx)
    if len(dims) == 1:
        return bb.emit(relax.op.take(x, idx[dims[0]], axis=dims[0]))
    rest = [d for d in range(len(idx)) if d not in dims]
    if dims != list(range(len(dims))):  # index_tensor indexes the leading dimensions
        x = bb.emit(relax.op.permute_dims(x, dims + rest))
    y = bb.emit(relax.op.index_tensor(x, [idx[d] for d in dims]))
    if at:  # the broadcast dimensions go where the first indexed dimension was
        perm = [*range(rank, rank + at), *range(rank), *range(rank + at, rank + len(rest))]
        y = bb.emit(relax.op.permute_dims(y, perm))
    return y


def index_put(node: Any, imp: Any) -> relax.Expr:
    """``index_put`` / ``index_put_`` (``x[i] = v``, ``x[:, i] += v`` with accumulate)
    with torch's rules: every dimension gets a full index of the result's shape, flat, so
    the scatter sees one element per value."""
    bb = imp.block_builder
    args = imp.retrieve_args(node)
    x = args[0]
    raw = node.args[1] if len(node.args) > 1 else node.kwargs["indices"]
    values = args[2] if len(args) > 2 else node.kwargs["values"]
    accumulate = args[3] if len(args) > 3 else node.kwargs.get("accumulate", False)
    idx = _indices(imp, x, raw, "aten.index_put")
    shape = _shape(x)
    dims, rank, at = _layout(idx)
    rest = [d for d in range(len(shape)) if d not in dims]
    out_rank = rank + len(rest)
    # each sliced dimension's position in the result, and the broadcast shape of the indices
    pos = dict(zip(rest, [*range(at), *range(at + rank, out_rank)]))
    parts = []
    for d in range(len(shape)):
        e = idx[d]
        if e is None:
            e = bb.emit(relax.op.arange(relax.prim_value(0), shape[d], relax.prim_value(1),
                                        "int64"))
            new = [1] * out_rank
            new[pos[d]] = shape[d]
        else:
            new = [1] * at + [1] * (rank - e.ty.ndim) + list(e.ty.shape)
            new += [1] * (out_rank - len(new))
            if str(e.ty.dtype) != "int64":
                e = bb.emit(relax.op.astype(e, "int64"))
        parts.append(bb.emit(relax.op.reshape(e, new)))
    result_shape = _broadcast([_shape(p) for p in parts])
    flat = [_flat(bb, p, result_shape) for p in parts]
    if not isinstance(values, relax.Expr):
        values = relax.const(values, str(x.ty.dtype))
    if str(values.ty.dtype) != str(x.ty.dtype):
        values = bb.emit(relax.op.astype(values, str(x.ty.dtype)))
    vshape = _shape(values)
    while len(vshape) > out_rank and _static(vshape[0]) == 1:  # torch drops leading 1s
        vshape = vshape[1:]
        values = bb.emit(relax.op.reshape(values, vshape))
    values = _flat(bb, values, result_shape)
    if accumulate:
        # TOPI's index_put adds in a parallel loop, where two threads adding to one element
        # race; a scatter-add over the flattened tensor adds one value after another.
        xf = bb.emit(relax.op.reshape(x, [-1]))
        out = bb.emit(relax.op.scatter_elements(xf, _offsets(bb, flat, shape), values, 0,
                                                "add"))
        out = bb.emit(relax.op.reshape(out, shape))
    else:
        out = bb.emit(relax.op.index_put(x, relax.Tuple(flat), values, False))
    if getattr(node.target, "__name__", "").startswith("index_put_"):
        # in place: later reads of the tensor, through any node bound to it, see the write
        for n, e in list(imp.env.items()):
            if e is x:
                imp.env[n] = out
    return out
