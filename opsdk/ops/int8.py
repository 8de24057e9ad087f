"""The INT8 ops (quantize, dequantize, requantize, qdense), loadable as a plugin module while
they mature: ``opsdk.load_plugins(["opsdk.ops.int8"])`` or ``--module opsdk.ops.int8``."""

from __future__ import annotations

from .dequantize import dequantize
from .qdense import qdense
from .quantize import quantize
from .requantize import requantize

__all__ = ["OPS"]

#: The INT8 ops; integer outputs are verified bit-exactly.
OPS = (quantize, dequantize, requantize, qdense)
