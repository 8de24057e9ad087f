"""The INT8 ops (quantize, dequantize, requantize, qdense, qconv2d) as a plugin module.

They are built-in ops now (:data:`opsdk.ops.BUILTIN_OPS`, registered when opsdk is imported);
this module stays so that ``opsdk.load_plugins(["opsdk.ops.int8"])`` and
``--module opsdk.ops.int8`` keep working (loading it registers nothing new)."""

from __future__ import annotations

from . import INT8_OPS
from .dequantize import dequantize
from .qconv2d import qconv2d
from .qdense import qdense
from .quantize import quantize
from .requantize import requantize

__all__ = ["OPS", "dequantize", "qconv2d", "qdense", "quantize", "requantize"]

#: The INT8 ops; integer outputs are verified bit-exactly.
OPS = INT8_OPS
