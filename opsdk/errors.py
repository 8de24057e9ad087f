"""Errors opsdk raises about a user's model that the CLI reports in one line (no traceback).

Kept free of heavy imports: the CLI catches them without loading TVM first.

Examples
--------
>>> from opsdk.errors import UnloweredOpError
>>> issubclass(UnloweredOpError, RuntimeError)
True
"""

from __future__ import annotations

__all__ = ["UnloweredOpError"]


class UnloweredOpError(RuntimeError):
    """A model operator that no legalization handles for the target reached code generation
    (TVM's VM codegen would fail with an internal error)."""
