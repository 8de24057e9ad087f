"""Registration of opsdk ops as Relax ops (``opsdk.<name>``)."""

from __future__ import annotations

from ._relax import (
    builder,
    decode_call,
    get_op,
    is_registered,
    load_builtin_ops,
    register,
    register_builtin_ops,
    register_kernels,
    registered_ops,
    unregister,
)

__all__ = [
    "builder",
    "decode_call",
    "get_op",
    "is_registered",
    "load_builtin_ops",
    "register",
    "register_builtin_ops",
    "register_kernels",
    "registered_ops",
    "unregister",
]
