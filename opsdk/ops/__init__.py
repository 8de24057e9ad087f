"""The built-in op library: an explicit list, registered by :func:`opsdk.register_builtin_ops`."""

from __future__ import annotations

from .bias_gelu import bias_gelu
from .gelu import gelu
from .group_norm import group_norm
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .softmax import softmax

__all__ = ["BUILTIN_OPS"]

#: Every built-in op, in registration order. Adding an op means adding it here.
BUILTIN_OPS = (layer_norm, rms_norm, gelu, bias_gelu, softmax, group_norm)
