"""Dtype helpers shared by op definitions, registration and verification, and a numpy view
of a TVM tensor."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "FLOAT_DTYPES",
    "accum_dtype",
    "array_view",
    "eps",
    "is_float",
    "np_dtype",
]

#: The float dtypes every built-in float op supports.
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

_NP = {
    "float64": np.dtype("float64"),
    "float32": np.dtype("float32"),
    "float16": np.dtype("float16"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int8": np.dtype("int8"),
    "uint8": np.dtype("uint8"),
    "int16": np.dtype("int16"),
    "int32": np.dtype("int32"),
    "int64": np.dtype("int64"),
    "bool": np.dtype("bool"),
}


def np_dtype(dtype: str) -> np.dtype:
    """Return the numpy dtype for a TVM dtype string (``bfloat16`` via ml_dtypes)."""
    try:
        return _NP[str(dtype)]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {sorted(_NP)}") from None


def is_float(dtype: str) -> bool:
    """Whether ``dtype`` is a floating-point TVM dtype."""
    return str(dtype) in ("float64", "float32", "float16", "bfloat16")


def accum_dtype(dtype: str) -> str:
    """Dtype to accumulate in: low-precision floats accumulate in float32."""
    return "float64" if str(dtype) == "float64" else "float32"


def eps(dtype: str) -> float:
    """Machine epsilon (distance from 1.0 to the next value) of a float dtype."""
    return float(ml_dtypes.finfo(np_dtype(dtype)).eps)


def array_view(tensor: Any) -> np.ndarray:
    """A read-only numpy view of a CPU TVM tensor's memory (no copy: a model's weights are
    looked at without being copied), or a copy where numpy's DLPack lacks its dtype.

    Examples
    --------
    >>> import numpy as np, tvm
    >>> from opsdk._dtypes import array_view
    >>> v = array_view(tvm.runtime.tensor(np.arange(3, dtype="float32")))
    >>> v.tolist(), v.flags.writeable
    ([0.0, 1.0, 2.0], False)
    """
    try:
        v = np.from_dlpack(tensor)
    except (BufferError, RuntimeError, TypeError, ValueError):  # bfloat16, ...
        return tensor.numpy()
    v.flags.writeable = False
    return v
