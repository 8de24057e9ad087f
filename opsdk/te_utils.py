"""TE helpers for op computes: float32 accumulation, element counts, reduce axes, and
vectorizable float32 ``exp``/``erf`` (TVM's own lower to one libm call per vector lane)."""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx

from ._vecmath import bind, dtype_of, erf_f32, exp_f32, narrow, widen_bf16

__all__ = [
    "acc", "bind", "dtype_of", "erf_f32", "exp_f32", "narrow", "prod", "reduce_axes",
    "rsqrt_finite", "widen_bf16",
]


def acc(value: tirx.PrimExpr, dtype: str = "float32") -> tirx.PrimExpr:
    """Cast to the accumulation dtype (float32 for float16/bfloat16/float32 inputs).

    bfloat16 widens by its bits (``bits << 16``, exact): TVM's bfloat16 storage pass does not
    rewrite a cast inside a ``Let`` value (:func:`bind`), which would convert the raw
    integer instead.
    """
    if hasattr(value, "asobject"):
        value = value.asobject()
    if dtype_of(value) == dtype:
        return value
    if dtype_of(value) == "bfloat16" and dtype == "float32":
        return widen_bf16(value)
    return value.astype(dtype)


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

