"""Shared pieces of the built-in ops' torch converters: reading an ``fx.Node``'s arguments as
TVM's ``from_exported_program`` importer holds them, and building TVM's own op where opsdk's
does not apply (see ``OpDef.torch``)."""

from __future__ import annotations

from typing import Any

from tvm import relax

from .._dtypes import FLOAT_DTYPES

__all__ = ["arg", "covered_dtype", "filled", "tensor"]


def arg(node: Any, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` of an fx node, or its keyword ``name``, or ``default``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def tensor(imp: Any, v: Any) -> relax.Expr | None:
    """The Relax value of an fx node argument, None for an absent optional tensor."""
    if v is None:
        return None
    return imp.env[v]


def covered_dtype(x: relax.Expr) -> bool:
    """Whether ``x`` has a dtype the float ops cover (float32 / float16 / bfloat16)."""
    ty = x.ty
    return isinstance(ty, relax.TensorType) and str(ty.dtype) in FLOAT_DTYPES


def filled(shape: list[Any], dtype: str, value: float) -> relax.Expr:
    """A tensor of ``shape`` filled with ``value``: an absent gamma / beta for TVM's ops."""
    return relax.op.full(relax.ShapeExpr(shape), relax.const(value, dtype), dtype)
