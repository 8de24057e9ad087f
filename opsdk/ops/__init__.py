"""The built-in op library: an explicit list, registered by :func:`opsdk.register_builtin_ops`."""

from __future__ import annotations

from ._quant import QRANGE
from .attention import attention
from .bias_gelu import bias_gelu
from .dense_q4 import dense_q4
from .dense_w8 import dense_w8
from .dequantize import dequantize
from .gelu import gelu
from .group_norm import group_norm
from .layer_norm import layer_norm
from .qconv2d import qconv2d
from .qdense import qdense
from .quantize import quantize
from .requantize import requantize
from .rms_norm import rms_norm
from .softmax import softmax
from .take_q4 import take_q4
from .take_w8 import take_w8

__all__ = ["BUILTIN_OPS", "FLOAT_OPS", "INT8_OPS", "QRANGE", "WEIGHT_ONLY_OPS"]

#: The float ops (float32 / float16 / bfloat16, verified against error models).
FLOAT_OPS = (layer_norm, rms_norm, gelu, bias_gelu, softmax, group_norm, attention)
#: The INT8 ops (integer and float32 outputs verified bit-exactly).
INT8_OPS = (quantize, dequantize, requantize, qdense, qconv2d)
#: The weight-only quantized dense ops (float32 activations, int8 / ggml q4_0 weights,
#: verified against error models) and the row gathers from their tables (exact).
WEIGHT_ONLY_OPS = (dense_w8, dense_q4, take_q4, take_w8)
#: Every built-in op, in registration order. Adding an op means adding it here.
BUILTIN_OPS = (*FLOAT_OPS, *INT8_OPS, *WEIGHT_ONLY_OPS)
