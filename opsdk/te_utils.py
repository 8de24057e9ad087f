"""TE helpers for op computes: float32 accumulation, element counts, reduce axes, and
vectorizable float32 ``exp``/``erf`` (TVM's own lower to one libm call per vector lane)."""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx

from ._vecmath import erf_f32, exp_f32

__all__ = ["acc", "dtype_of", "erf_f32", "exp_f32", "prod", "reduce_axes", "rsqrt_finite"]


def acc(value: tirx.PrimExpr, dtype: str = "float32") -> tirx.PrimExpr:
    """Cast to the accumulation dtype (float32 for float16/bfloat16/float32 inputs)."""
    return value if dtype_of(value) == dtype else value.astype(dtype)


def dtype_of(value: tirx.PrimExpr) -> str:
    """Dtype string of a TIR expression (0.27 exposes it as ``.ty``)."""
    return str(value.ty)


def prod(dims: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
    """Product of dims as a float32 expression (the element count of a reduction)."""
    out = tirx.const(1.0, "float32")
    for d in dims:
        out = out * d.astype("float32") if hasattr(d, "astype") else out * float(d)
    return out


def reduce_axes(shape: Sequence[tirx.PrimExpr], prefix: str) -> list[tirx.IterVar]:
    """One reduce axis per dim in ``shape``."""
    return [te.reduce_axis((0, d), name=f"{prefix}{i}") for i, d in enumerate(shape)]


def rsqrt_finite(sum_sq: tirx.PrimExpr, count: tirx.PrimExpr, epsilon: float) -> tirx.PrimExpr:
    """``rsqrt(sum_sq / count + epsilon)`` of a norm's sum of squares, NaN when that sum
    overflowed float32 (``inf``: deviations beyond ~1.8e19 / sqrt(count)): plain ``rsqrt``
    would give 0 there and the row would silently come out as zeros.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.te_utils import rsqrt_finite
    >>> s = te.placeholder((4,), "float32", name="s")
    >>> r = te.compute((4,), lambda i: rsqrt_finite(s[i], 16, 1e-5), name="r")
    >>> str(r.dtype)
    'float32'
    """
    v = sum_sq / count + epsilon
    return tirx.Select(v < tirx.const(float("inf"), "float32"), tirx.rsqrt(v),
                       tirx.const(float("nan"), "float32"))

