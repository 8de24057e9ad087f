"""A walk over Relax expressions that stays in Relax.

``relax.analysis.post_order_visit`` calls back into Python for every node, the ``IntImm``
dims inside each ``ShapeExpr`` and the shapes of every call's struct info included. After
VM shape lowering a weight-transform function of ResNet-50 has 96 000 such nodes for 814
bindings: each walk with a callback cost 0.03-0.1 s, and a model build walked its modules
some 80 times. :func:`relax_exprs` visits the Relax expressions only (a ``ShapeExpr`` is
one leaf), each occurrence once, in the same post order. And :func:`with_functions`, the
module passes' way to replace some functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tvm
from tvm import relax

__all__ = ["calls_of", "relax_exprs", "with_functions"]


def relax_exprs(root: Any) -> list[Any]:
    """Every Relax expression under ``root`` (an expression or a function), children before
    parents, an expression used twice listed twice: what ``post_order_visit`` calls back
    with, less the ``PrimExpr`` and struct-info parts (a binding's defined variable and a
    function's parameters are not uses, as there).

    Examples
    --------
    >>> from tvm import relax
    >>> from opsdk._walk import relax_exprs
    >>> x = relax.Var("x", relax.TensorType((4,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     y = bb.emit(relax.op.add(x, x))
    ...     _ = bb.emit_func_output(y)
    >>> [type(e).__name__ for e in relax_exprs(bb.get()["main"])]
    ['Op', 'Var', 'Var', 'Call', 'Var', 'SeqExpr', 'Function']
    """
    out: list[Any] = []
    _visit(root, out)
    return out


def _visit(e: Any, out: list[Any]) -> None:
    t = type(e)
    if t is relax.Call:
        if isinstance(e.op, tvm.ir.expr.Expr):
            _visit(e.op, out)
        for a in e.args:
            _visit(a, out)
    elif t is relax.Tuple:
        for f in e.fields:
            _visit(f, out)
    elif t is relax.TupleGetItem:
        _visit(e.tuple_value, out)
    elif t is relax.SeqExpr:
        for block in e.blocks:
            for b in block.bindings:
                _visit(b.value, out)
        _visit(e.body, out)
    elif t is relax.If:
        _visit(e.cond, out)
        _visit(e.true_branch, out)
        _visit(e.false_branch, out)
    elif t is relax.Function:
        _visit(e.body, out)
    out.append(e)


def calls_of(root: Any, *ops: str) -> Iterator[relax.Call]:
    """The calls under ``root`` of the ops named ``ops`` (every call of an op when none is
    named), in :func:`relax_exprs` order.

    Examples
    --------
    >>> from tvm import relax
    >>> from opsdk._walk import calls_of
    >>> x = relax.Var("x", relax.TensorType((4,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     y = bb.emit(relax.op.nn.relu(relax.op.add(x, x)))
    ...     _ = bb.emit_func_output(y)
    >>> [str(c.op.name) for c in calls_of(bb.get()["main"], "relax.nn.relu")]
    ['relax.nn.relu']
    """
    wanted = set(ops)
    for e in relax_exprs(root):
        if type(e) is relax.Call and isinstance(e.op, tvm.ir.Op) \
                and (not wanted or e.op.name in wanted):
            yield e


def with_functions(mod: tvm.IRModule, updates: dict[Any, Any]) -> tvm.IRModule:
    """``mod`` with the functions of ``updates`` (global var -> function) replaced, in a
    copy (item assignment mutates: the caller's module stays as it was); ``mod`` itself
    when there is nothing to replace.

    Examples
    --------
    >>> import tvm
    >>> from opsdk._walk import with_functions
    >>> mod = tvm.IRModule()
    >>> with_functions(mod, {}) is mod
    True
    """
    if not updates:
        return mod
    mod = mod.clone()
    for gv, f in updates.items():
        mod[gv] = f
    return mod
