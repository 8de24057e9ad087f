"""torch.export's program imported as it is, without torch's second trace, where that trace
would change nothing the importer sees.

``torch.export.export`` returns the training IR: composite ops whole (``conv2d``,
``batch_norm``, ``silu``), in-place ops (``relu_``, ``add_``). :func:`opsdk.frontend.from_torch`
used to run ``ExportedProgram.run_decompositions`` first, which traces the whole program a
second time (fake tensors, functionalization, every op through the dispatcher): 0.5-5.4 s a
model on this 2-core machine, about 1 ms a node, more than TVM's own import of it (0.03-0.3
s). For most convolutional nets that trace only renames ops whose import is the same, so
here it is skipped when, and only when, every call in the program is one of:

- an op opsdk converts whole either way (``layer_norm``, ``linear``, a user's mapped op): the
  same converter sees the same node;
- a core ATen op the decomposition table leaves alone and that mutates nothing: the trace
  keeps it as it is;
- one of :data:`AS_IS` below, each imported here exactly as TVM imports what the
  decomposition makes of it (``conv2d`` is TVM's ``convolution``; ``silu`` is
  ``x * sigmoid(x)``; an eval ``batch_norm`` is ``_native_batch_norm_legit_no_training``),
  which ``tests/nocompile/test_frontend_asis.py`` checks op by op, structurally, against the
  decomposed import;
- an in-place op whose input nothing else reads (it was made for it alone and is no view of
  another tensor), so mutating it and computing a new value are the same;
- a piece of a ``split``, ``chunk`` or ``unbind`` (:data:`MULTI_OUTPUT`) of a tensor that
  no in-place op wrote (nor a view of one): the trace keeps each piece a reader takes, under
  the same index (of a written tensor it splits again for each piece);

and the program mutates no buffer or input, has no symbolic dim, no other multi-output op
and no ``flatten`` to the same shape (which the trace drops). Any other program takes the
second trace.
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Callable, Iterable
from typing import Any

from tvm import relax

__all__ = ["AS_IS", "MULTI_OUTPUT", "as_is_converters", "importable_as_is"]

Converter = Callable[[Any, Any], relax.Expr]


def _batch_norm(node: Any, imp: Any) -> relax.Expr:
    """``batch_norm(x, w, b, mean, var, training=False, momentum, eps, cudnn)`` as the
    decomposed ``_native_batch_norm_legit_no_training(x, w, b, mean, var, momentum, eps)``
    (TVM 0.27 reads the training IR's arguments at the latter's positions: epsilon became
    the momentum and training True)."""
    import torch  # heavy: torch

    a = node.args
    shim = types.SimpleNamespace(
        args=(a[0], a[1], a[2], a[3], a[4], a[6], a[7]), kwargs={},
        target=torch.ops.aten._native_batch_norm_legit_no_training.default)
    return imp._batch_norm(shim, training=False, return_tuple=False)


def _silu(node: Any, imp: Any) -> relax.Expr:
    """``x * sigmoid(x)``, torch's decomposition."""
    bb, x = imp.block_builder, imp.env[node.args[0]]
    return bb.emit(relax.op.multiply(x, bb.emit(relax.op.sigmoid(x))))


def _hard(node: Any, imp: Any, times_x: bool) -> relax.Expr:
    """``clamp(x + 3, 0, 6) / 6`` (hardsigmoid), ``x * clamp(x + 3, 0, 6) / 6``
    (hardswish): torch's decompositions, the clamp as ``clamp_min`` then ``clamp_max``."""
    bb, x = imp.block_builder, imp.env[node.args[0]]
    dt = x.ty.dtype
    y = bb.emit(relax.op.add(x, relax.const(3, dt)))
    y = bb.emit(relax.op.clip(y, 0, math.inf))
    y = bb.emit(relax.op.clip(y, -math.inf, 6))
    if times_x:
        y = bb.emit(relax.op.multiply(x, y))
    return bb.emit(relax.op.divide(y, relax.const(6, dt)))


def _chunk(node: Any, imp: Any) -> relax.Expr:
    """``chunk(x, n, dim)`` as its decomposition: ``split_with_sizes`` into pieces of
    ``ceil(size / n)`` (the last one smaller, and fewer than ``n`` pieces where they run
    out), imported as cut positions. TVM's own converter asks for ``min(n, size)`` equal
    sections, torch's pieces only where ``n`` divides the size (6 in 4 chunks: three of 2)."""
    x = imp.env[node.args[0]]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    size = int(list(imp.shape_of(x))[dim])
    step = max(1, -(-size // node.args[1]))
    return imp.block_builder.emit(relax.op.split(x, list(range(step, size, step)), dim))


def _unbind(node: Any, imp: Any) -> relax.Expr:
    """``unbind(x, dim)`` as its decomposition: a one-wide ``slice`` per index, then a
    ``squeeze`` of each (TVM's converter splits instead)."""
    bb, x = imp.block_builder, imp.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    shape = list(imp.shape_of(x))
    axis = dim % len(shape)  # the decomposition's slices and squeezes name it non-negative
    pieces = [bb.emit(relax.op.strided_slice(x, (axis,), (i,), (i + 1,), (1,),
                                             assume_inbound=False))
              for i in range(int(shape[axis]))]
    return bb.emit(relax.Tuple([bb.emit(relax.op.squeeze(p, [axis])) for p in pieces]))


def _reshape(node: Any, imp: Any) -> relax.Expr:
    """``reshape`` as the trace makes it: of a contiguous tensor a ``view`` with the same
    arguments (TVM's converter then sees them as they are); of another, a ``view`` of the
    inferred shape (``-1`` resolved), which TVM imports as nothing when that is the shape
    the tensor has."""
    src = node.args[0].meta.get("val")
    if src is not None and not src.is_contiguous() and node.meta.get("val") is not None \
            and _same_shape(node):
        return imp.env[node.args[0]]
    return imp._reshape(node)


def _zeros(node: Any, imp: Any) -> relax.Expr:
    """``zeros(size)`` as its decomposition, ``full(size, 0)`` (TVM imports ``zeros`` as
    ``R.zeros``: the same tensor, another op)."""
    import torch  # heavy: torch

    shim = types.SimpleNamespace(args=(node.args[0], 0), kwargs=dict(node.kwargs),
                                 target=torch.ops.aten.full.default, meta=node.meta,
                                 name=node.name)
    return imp._full(shim)


def _adaptive_avg_pool2d(node: Any, imp: Any) -> relax.Expr:
    """ATen's ``adaptive_avg_pool2d``: to 1x1 a mean over the last two axes (and, for a
    channels-last input, an ``as_strided`` of the same shape, which TVM imports as a
    reshape); otherwise ``_adaptive_avg_pool2d``, imported by TVM's own converter."""
    import torch  # heavy: torch
    from torch._prims_common import suggest_memory_format  # heavy: torch

    x = imp.env[node.args[0]]
    size = list(node.args[1]) if isinstance(node.args[1], (list, tuple)) else [node.args[1]] * 2
    if size != [1, 1]:
        return imp._adaptive_avg_pool2d(node)
    bb = imp.block_builder
    y = bb.emit(relax.op.mean(x, axis=[-1, -2], keepdims=True))
    val = node.args[0].meta.get("val")
    if val is not None and val.dim() == 4 and \
            suggest_memory_format(val) == torch.channels_last:
        y = bb.emit(relax.op.reshape(y, y.ty.shape))
    return y


#: Ops of the training IR (by ``target.__name__``) that need torch's trace only for a new
#: name: each with the converter that imports it as TVM imports its decomposition (None:
#: TVM's converter of the op itself does already).
AS_IS: dict[str, Converter | None] = {
    "conv2d.default": None,
    "batch_norm.default": _batch_norm,
    "max_pool2d.default": None,
    "adaptive_avg_pool2d.default": _adaptive_avg_pool2d,
    "flatten.using_ints": None,
    "reshape.default": _reshape,
    "contiguous.default": None,
    "transpose.int": None,
    "dropout.default": None,
    "relu_.default": None,
    "add_.Tensor": None,
    "silu.default": _silu,
    "silu_.default": _silu,
    "hardswish.default": lambda n, imp: _hard(n, imp, True),
    "hardswish_.default": lambda n, imp: _hard(n, imp, True),
    "hardsigmoid.default": lambda n, imp: _hard(n, imp, False),
    "hardtanh_.default": None,
    "relu6.default": None,
    "relu6_.default": None,
    "leaky_relu_.default": None,
    "conv_transpose2d.input": None,
    "pad.default": None,
    "arange.default": None,
    "arange.start": None,
    "new_ones.default": None,
    "zeros.default": _zeros,
    "split.Tensor": None,
    "chunk.default": _chunk,
    "unbind.int": _unbind,
}

#: The multi-output ops whose pieces (``getitem``) a program taken as it is may read.
MULTI_OUTPUT = frozenset({"split.Tensor", "split_with_sizes.default", "chunk.default",
                          "unbind.int"})


def as_is_converters() -> dict[str, Converter]:
    """The converters :data:`AS_IS` names (for a program :func:`importable_as_is` took)."""
    return {k: fn for k, fn in AS_IS.items() if fn is not None}


def _inplace(name: str) -> bool:
    return name in AS_IS and name.split(".")[0].endswith("_")


def _fresh(node: Any) -> bool:
    """An in-place op's input is read by nothing else: a call's result (no placeholder, no
    view of another tensor) whose only user is this op, or such an op's own in-place result
    (``relu_(add_(bn, x))``: the one tensor, updated twice)."""
    src = node.args[0] if node.args else None
    while True:
        if getattr(src, "op", None) != "call_function" or len(src.users) != 1:
            return False
        schema = getattr(src.target, "_schema", None)
        if schema is None:
            return False
        if all(r.alias_info is None for r in schema.returns):
            return True
        if not _inplace(getattr(src.target, "__name__", "")):
            return False  # a view: another tensor shares its memory
        src = src.args[0]


def _written(node: Any) -> bool:
    """Whether ``node`` is, or is a view of, a tensor an in-place op wrote (functionalization
    then makes a view of it again at each use). Unknown ops count as written."""
    while getattr(node, "op", None) == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return True
        aliases = [r.alias_info for r in schema.returns]
        if all(a is None for a in aliases):
            return False  # a new tensor
        if any(a is not None and a.is_write for a in aliases):
            return True
        node = node.args[0]  # a view: its base decides
    return False  # an input or a parameter (mutated ones are refused before)


def _same_shape(node: Any) -> bool:
    out, src = node.meta.get("val"), node.args[0].meta.get("val")
    return out is None or src is None or tuple(out.shape) == tuple(src.shape)


def importable_as_is(ep: Any, table: Any, keep: Iterable[Any]) -> bool:
    """Whether ``ep`` imports the same with and without ``ep.run_decompositions(table)``
    (see the module's text); ``keep``: the aten overloads converted whole either way.

    Examples
    --------
    >>> import torch
    >>> from opsdk.frontend import decomposition_table
    >>> from opsdk.frontend._asis import importable_as_is
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
    ...                           torch.nn.ReLU(inplace=True)).eval()
    >>> ep = torch.export.export(net, (torch.randn(1, 3, 8, 8),))
    >>> importable_as_is(ep, decomposition_table(), keep=[])
    True
    >>> ep = torch.export.export(torch.nn.Mish(), (torch.randn(4),))  # mish: decomposed
    >>> importable_as_is(ep, decomposition_table(), keep=[])
    False
    """
    import torch  # heavy: torch

    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        return False
    kept = set(keep)
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if not all(isinstance(d, int) for d in getattr(val, "shape", ())):
                return False  # a symbolic dim: the trace's size arithmetic is its own
            continue
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            if getattr(n.args[0].target, "__name__", "") not in MULTI_OUTPUT:
                return False  # another op's outputs (max_pool2d's indices, a norm's stats)
            continue
        t = n.target
        if not isinstance(t, torch._ops.OpOverload):
            return False  # a higher-order op (autocast, a control-flow branch)
        if t in kept:
            continue
        name = t.__name__
        if name in AS_IS or name in MULTI_OUTPUT:
            if _inplace(name) and not _fresh(n):
                return False
            if name in MULTI_OUTPUT and _written(n.args[0]):
                return False  # of a written tensor: the trace splits again for each piece
            if name == "batch_norm.default" and (n.args[5] or n.args[3] is None
                                                 or n.args[4] is None):
                return False  # training, or no running statistics: batch statistics
            if name == "dropout.default" and (n.args[2] if len(n.args) > 2
                                              else n.kwargs.get("train")):
                return False
            if name == "flatten.using_ints" and _same_shape(n):
                return False  # the trace drops it (a reshape to its own shape stays a view)
            if name == "pad.default" and (n.args[2] if len(n.args) > 2 else
                                          n.kwargs.get("mode", "constant")) != "constant":
                return False  # reflect / replicate / circular: other ops in the trace
            continue
        if t in table or torch.Tag.core not in t.tags or t._schema.is_mutable:
            return False
    return True
