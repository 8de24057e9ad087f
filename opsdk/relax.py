"""Builders for Relax calls of registered opsdk ops: ``opsdk.relax.layer_norm(x, gamma, beta)``.

Attribute access looks the op up in the registry, so plugin ops get builders too.

Examples
--------
>>> import opsdk
>>> from tvm import relax
>>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
>>> call = opsdk.relax.gelu(x, approximate="tanh")
>>> call.op.name
'opsdk.gelu'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .registry import builder, get_op, registered_ops

__all__: list[str] = []  # builders are looked up dynamically


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return builder(get_op(name))
    except KeyError as e:
        raise AttributeError(str(e)) from None


def __dir__() -> list[str]:
    return sorted(d.name for d in registered_ops())
