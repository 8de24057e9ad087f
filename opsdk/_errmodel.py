"""The error-model mechanism: what a model of an op's rounding error sees
(:class:`ModelInput`), the registry models join (:func:`error_model`), the accuracy assumed
of the float32 math library (:data:`MATH_ULPS`) and the first-order bounds models are built
from (recursive summation, normalized rows, softmax).

It sits below the ops, so an op file registers its own model next to its compute (and the
model kernels theirs); ``opsdk.verify`` applies the models (and re-exports this API). The
derivations are in ``docs/verification.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._opdef import OpDef

__all__ = [
    "EXP_FLUSH",
    "MATH_ULPS",
    "MODELS",
    "ErrorModel",
    "ModelInput",
    "error_model",
    "gamma",
    "norm_rows",
    "softmax_bound",
]

#: Accuracy assumed of the float32 math the built-in computes use, in units of u = 2**-24
#: (relative unless noted), each at least the measured maximum rounded up to a power of two.
#: Measured on 1e7 points over the whole argument range plus [-1e-3, 1e-3] (x86 znver4):
#: TVM's libm-based ``exp`` 1.0 and ``erf`` 1.27; ``opsdk._vecmath`` ``exp_f32`` 1.41 and
#: ``erf_f32`` 6.31 (at x ~ 3.98, where erf ~ 1); ``tanh`` 1.5 absolute; ``rsqrt`` (1/sqrt)
#: 1.5; ``log`` 1.30 (2026-12, Xeon, 2e6 points over [1e-38, 1e38] and [0.5, 2]).
#: (``exp_f32`` with its degree-4 polynomial, 2026-12, Xeon: 1.31 on 5e6 points.)
#: ``exp_f32`` returns 0 below 0.7 * 2**-126 and +inf above FLT_MAX (x > 88.7228).
#: ``sigmoid_f32`` 2.39 relative (TVM's own 2.34) over [-87, 30]; ``tanh_f32`` 1.39 absolute
#: (TVM's own 1.50) over [-10, 10] (2026-12, Zen 4): every scheduled kernel uses these.
#: ``tests/host/test_verify.py`` re-measures them, so a changed implementation shows up as a
#: broken model assumption rather than as a kernel failure.
MATH_ULPS: dict[str, float] = {"exp": 2.0, "erf": 8.0, "tanh_abs": 2.0, "rsqrt": 2.0, "log": 2.0,
                               "sigmoid": 4.0}

#: Absolute error of an exp whose result would be subnormal (flushed to zero).
EXP_FLUSH = 2.0**-126


@dataclass
class ModelInput:
    """What an error model sees for one example.

    ``inputs`` holds float64 copies of the (already rounded) inputs, None for absent
    optionals; ``attrs`` the normalized attributes; ``ref`` the float64 reference; ``u`` the
    unit roundoff of the accumulation dtype; ``dtype`` the primary input's dtype; ``output``
    the output ``ref`` belongs to (always 0 for a single-output op).
    """

    op: OpDef
    inputs: dict[str, np.ndarray | None]
    attrs: dict[str, Any]
    ref: np.ndarray
    u: float
    dtype: str = "float32"  # the primary input's dtype (the cell's)
    output: int = 0  # which output ``ref`` is (a multi-output op is checked output by output)

    def reference(self, inputs: Mapping[str, np.ndarray | None]) -> np.ndarray:
        """The op's float64 reference of this output on other inputs (e.g. perturbed)."""
        out = self.op.run_reference(inputs, self.attrs)
        return np.asarray(out if self.op.n_outputs == 1 else out[self.output])


ErrorModel = Callable[[ModelInput], np.ndarray]

#: The registered models, keyed by op name or reference function (see :func:`error_model`).
MODELS: dict[Any, ErrorModel] = {}


def error_model(op: OpDef | str | Callable[..., Any]) -> Callable[[ErrorModel], ErrorModel]:
    """Decorator registering the rounding-error model of an op.

    ``op`` is an :class:`~opsdk.OpDef`, an op name, or a reference function: a model keyed by
    a reference applies to every op that uses that reference (e.g. variants of a built-in).
    The model returns, per output element, a bound on the float32 computation error ``E``
    (output rounding is added by the engine).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.verify import error_model
    >>> @error_model("demo_double")
    ... def _double(m):
    ...     return m.u * np.abs(m.ref)  # one rounding: y = fl(2 x) is exact, bound anyway
    """

    def deco(fn: ErrorModel) -> ErrorModel:
        key = op.name if isinstance(op, OpDef) else op
        MODELS[key] = fn
        return fn

    return deco


def gamma(k: float, u: float) -> float:
    """``gamma_k = k u / (1 - k u)``: the relative error bound of ``k`` roundings."""
    return k * u / (1 - k * u)


def norm_rows(X: np.ndarray, G: np.ndarray | None, B: np.ndarray | None, epsilon: float,
              centered: bool, u: float, mean_square: bool = True) -> np.ndarray:
    """Bound for ``y = (x - m) * rsqrt(v + eps) * g + b`` over rows of ``X`` (R, n).

    Two-pass statistics: ``m`` = sum/n, ``v`` = sum((x - m)^2)/n (``centered``), or
    ``m = 0, v = sum(x^2)/n`` (RMS); ``mean_square=False`` takes the sum of squares instead
    of their mean (``x / sqrt(sum(x^2) + eps)``, an L2 normalization). Recursive summation
    of n terms errs by at most ``gamma_{n-1} * sum|terms|``; the mean's error shifts every
    deviation (``dm``) and feeds into the variance only quadratically, because
    ``sum(x - m) = 0``: ``sum((x - m - dm)^2) = sum((x - m)^2) + n dm^2``.
    """
    n = X.shape[1]
    d = n if mean_square else 1  # the divisor of the sum of squares
    a1 = np.abs(X).mean(axis=1, keepdims=True)
    if centered:
        m = X.mean(axis=1, keepdims=True)
        D = X - m
        v = (D * D).sum(axis=1, keepdims=True) / d
        dm = gamma(n + 1, u) * a1
        shift = (n / d) * dm * dm
        dv = shift + gamma(n + 3, u) * (v + shift)
    else:
        D = X
        v = (X * X).sum(axis=1, keepdims=True) / d
        dm = np.zeros_like(a1)
        dv = gamma(n + 1, u) * v
    s = v + epsilon
    # rsqrt(fl(v_hat + eps)): an interval, because v_hat may be far from v (constant rows).
    lo = (s - dv) * (1 - u)
    hi = (s + dv) * (1 + u)
    safe_lo = np.where(lo > 0, lo, 1.0)
    dev = np.maximum(np.where(lo > 0, np.sqrt(s / safe_lo) - 1, np.inf), 1 - np.sqrt(s / hi))
    rho_r = (1 + dev) * (1 + MATH_ULPS["rsqrt"] * u) - 1
    r = 1 / np.sqrt(s)
    Z = D * r
    dt = dm + u * (np.abs(D) + dm)  # fl(x - m_hat)
    E = r * dt * (1 + rho_r) + np.abs(Z) * ((1 + rho_r) * (1 + u) - 1)
    Y = Z
    if G is not None:
        E = np.abs(G) * E + u * (np.abs(Z * G) + np.abs(G) * E)
        Y = Z * G
    if B is not None:
        Y = Y + B
        E = E + u * (np.abs(Y) + E)
    return E


def softmax_bound(x: np.ndarray, axis: int | tuple[int, ...], u: float) -> np.ndarray:
    """``exp(x - max) / sum`` over ``axis``: the max is exact; ``x - max`` rounds (relative
    u), which exp turns into a relative error ``u |x - max|``; the sum of positive terms adds
    ``gamma_{n-1}``; the output recomputes exp and divides (one more rounding). An exp
    whose result is subnormal may flush to zero (absolute ``2**-126``; the sum is >= 1)."""
    axes = (axis,) if isinstance(axis, int) else axis
    n = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    a = x - x.max(axis=axis, keepdims=True)
    e = np.exp(a)
    s = e.sum(axis=axis, keepdims=True)
    rho_e = np.expm1(u * np.abs(a)) * (1 + MATH_ULPS["exp"] * u) + MATH_ULPS["exp"] * u
    rho_s = (e * rho_e).sum(axis=axis, keepdims=True) / s + gamma(n - 1, u)
    rel = (1 + rho_e) * (1 + u) / (1 - rho_s) - 1
    return (e / s) * rel + EXP_FLUSH * (1 + rho_s)
