"""Registration of opsdk ops as Relax ops (``opsdk.<name>``)."""

from __future__ import annotations

from ._relax import (
    builder,
    decode_call,
    get_op,
    is_registered,
    register,
    registered_ops,
    unregister,
)

__all__ = [
    "builder",
    "decode_call",
    "get_op",
    "is_registered",
    "register",
    "registered_ops",
    "unregister",
]
