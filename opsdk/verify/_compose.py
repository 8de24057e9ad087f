"""Error models composed from the derived ones: the author states the structure of a norm or a
reduction (which axes, centred or not, mean or sum of squares, which inputs scale and shift),
and gets the same first-order bound the built-in norms and softmax are held to, instead of
the kind-based heuristic fallback or a hand-written bound."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._tolerance import (
    EXP_FLUSH,
    MATH_ULPS,
    ErrorModel,
    ModelInput,
    _gamma,
    _norm_rows,
    softmax_bound,
)

__all__ = ["norm_model", "per_output", "reduction_model", "rounding_model"]

REDUCTIONS = ("sum", "mean", "max", "min", "logsumexp", "softmax")

AxisSpec = str | int | Sequence[int] | None


def _value(m: ModelInput, spec: Any, what: str) -> Any:
    """An attribute (by name) or a literal."""
    if isinstance(spec, str):
        if spec not in m.attrs:
            raise ValueError(
                f"error model of op {m.op.name!r}: {what}={spec!r} names no attribute of the op "
                f"(attributes: {', '.join(sorted(m.attrs)) or 'none'}); pass an attribute name "
                f"or a value")
        return m.attrs[spec]
    return spec


def _input(m: ModelInput, name: str | None, what: str) -> np.ndarray | None:
    if name is None:
        return None
    if name not in m.inputs:
        raise ValueError(
            f"error model of op {m.op.name!r}: {what}={name!r} is not an input of the op "
            f"(inputs: {', '.join(m.inputs)}); pass the input's parameter name")
    return m.inputs[name]


def _axes(m: ModelInput, spec: AxisSpec, ndim: int, trailing: bool) -> tuple[int, ...]:
    """Normalized axes. An int from ``trailing`` specs means "from this axis to the last"."""
    v = _value(m, spec, "axes")
    if v is None:
        return tuple(range(ndim))
    if isinstance(v, int | np.integer):
        v = int(v) % ndim
        return tuple(range(v, ndim)) if trailing else (v,)
    return tuple(sorted(int(a) % ndim for a in v))


def _rows(t: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """``t`` as (rows, n) with ``axes`` last, and the permutation that did it."""
    perm = tuple(i for i in range(t.ndim) if i not in axes) + axes
    n = int(np.prod([t.shape[a] for a in axes], dtype=np.int64))
    return t.transpose(perm).reshape(-1, n), perm


def norm_model(
    x: str = "x", *, axes: AxisSpec = "begin_axis", center: bool = True,
    mean_square: bool = True, epsilon: str | float = "epsilon", gamma: str | None = None,
    beta: str | None = None, groups: str | int | None = None, channel_axis: int = 1,
    residual: str | None = None,
) -> ErrorModel:
    """Error model of ``y = (x - mean) / sqrt(var + epsilon) * gamma + beta`` over ``axes``.

    The statistics are two-pass and accumulate in float32, as in the built-in norms; the
    bound is theirs (``docs/verification.md``, Normalizations), so a user norm is held to a
    derived model rather than the heuristic ``fallback:norm``.

    Parameters
    ----------
    x : str
        The normalized input.
    axes : str, int, sequence of int or None
        The reduced axes: an attribute name or a value. An int means the trailing axes from
        it (``begin_axis``); a sequence lists them; None reduces all.
    center : bool
        Subtract the mean (layer norm); False for RMS / L2 norms.
    mean_square : bool
        ``var`` is the mean of the squares (layer / RMS norm); False for their sum
        (``x / sqrt(sum(x^2) + epsilon)``).
    epsilon : str or float
        The attribute holding epsilon, or its value.
    gamma, beta : str, optional
        Inputs that scale and shift the result; they broadcast against ``x`` (per channel of
        ``channel_axis`` when ``groups`` is given).
    groups : str or int, optional
        Group normalization: ``channel_axis`` splits into this many groups, each normalized
        over its channels and ``axes``.
    channel_axis : int
        The channel axis of a group norm.
    residual : str, optional
        An input added to ``x`` first (a fused residual add + norm): the norm is of
        ``x + residual``, summed in float32, and the bound adds that sum's rounding carried
        through the norm (first order: ``|gamma| rstd (d_i + mean(d) + |y_i| mean(|y| d))``
        with ``d = u |x + residual|``). Not with ``groups``.

    Examples
    --------
    >>> from opsdk.verify import error_model, norm_model
    >>> _ = error_model("demo_l2norm")(
    ...     norm_model(axes="begin_axis", center=False, mean_square=False, gamma="gamma"))
    """

    def model(m: ModelInput) -> np.ndarray:
        X = _input(m, x, "x")
        assert X is not None
        R = _input(m, residual, "residual")
        if R is not None:
            X = X + R
        eps = float(_value(m, epsilon, "epsilon"))
        G, B = _input(m, gamma, "gamma"), _input(m, beta, "beta")
        shape = X.shape
        if groups is not None and R is not None:
            raise ValueError(f"error model of op {m.op.name!r}: residual= with groups= is "
                             "not supported; write the model by hand")
        if groups is not None:
            g = int(_value(m, groups, "groups"))
            c = channel_axis % X.ndim
            C = shape[c]

            def per_channel(t: np.ndarray | None) -> np.ndarray | None:
                if t is None:
                    return None
                view = [1] * X.ndim
                view[c] = C
                return np.broadcast_to(t.reshape(view), shape)

            G, B = per_channel(G), per_channel(B)
            split = (*shape[:c], g, C // g, *shape[c + 1:])
            rest = _axes(m, axes, X.ndim, trailing=True)  # axes of x; c splits in two
            red = tuple(sorted({c + 1, *(a + 1 if a > c else a for a in rest if a != c)}))
            X, G, B = (None if t is None else t.reshape(split) for t in (X, G, B))
        else:
            red = _axes(m, axes, X.ndim, trailing=True)
            G, B = (None if t is None else np.broadcast_to(t, shape) for t in (G, B))
        Xr, perm = _rows(X, red)
        Gr, Br = (None if t is None else _rows(t, red)[0] for t in (G, B))
        E = _norm_rows(Xr, Gr, Br, eps, center, m.u, mean_square)
        if R is not None:
            E = E + _rounded_input_rows(Xr, Gr, eps, center, m.u, mean_square)
        E = E.reshape([X.shape[p] for p in perm]).transpose(np.argsort(perm))
        return E.reshape(shape)

    model._opsdk_label = "composed norm"  # type: ignore[attr-defined]
    return model


def _rounded_input_rows(S: np.ndarray, G: np.ndarray | None, eps: float, center: bool,
                        u: float, mean_square: bool) -> np.ndarray:
    """First-order error of a norm over the rows of ``S`` when ``S`` itself was rounded
    (relative ``u`` per element) before the norm."""
    d = u * np.abs(S)
    agg = np.mean if mean_square else np.sum
    dev = S - S.mean(axis=1, keepdims=True) if center else S
    rstd = 1.0 / np.sqrt(agg(dev * dev, axis=1, keepdims=True) + eps)
    yh = np.abs(dev * rstd)
    t = d + (d.mean(axis=1, keepdims=True) if center else 0.0)
    t = t + yh * agg(yh * d, axis=1, keepdims=True)
    E = t * rstd
    return E if G is None else E * np.abs(G)


def rounding_model(k: int = 1) -> ErrorModel:
    """``k`` roundings of the accumulation dtype relative to the result: the model of an
    output that is a few float32 operations of exact inputs (a residual sum, a scaled copy).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.verify import rounding_model
    >>> callable(rounding_model(1))
    True
    """
    def model(m: ModelInput) -> np.ndarray:
        return k * m.u * np.abs(m.ref)

    model._opsdk_label = f"composed rounding x{k}"  # type: ignore[attr-defined]
    return model


def per_output(*models: ErrorModel) -> ErrorModel:
    """The error model of a multi-output op: one model per output, in the compute's order.

    Examples
    --------
    >>> from opsdk.verify import error_model, norm_model, per_output, rounding_model
    >>> _ = error_model("demo_add_norm")(per_output(
    ...     rounding_model(1), norm_model(residual="r", gamma="gamma", beta="beta")))
    """
    def model(m: ModelInput) -> np.ndarray:
        if m.output >= len(models):
            raise ValueError(f"error model of op {m.op.name!r}: per_output has "
                             f"{len(models)} models, output {m.output} has none")
        return models[m.output](m)

    labels = [getattr(f, "_opsdk_label", "model") for f in models]
    model._opsdk_label = "per output: " + ", ".join(labels)  # type: ignore[attr-defined]
    return model


def reduction_model(x: str = "x", *, op: str = "sum", axis: AxisSpec = "axis") -> ErrorModel:
    """Error model of a reduction of ``x`` over ``axis``: ``sum``, ``mean``, ``max``, ``min``,
    ``logsumexp`` (``max + log(sum(exp(x - max)))``) or ``softmax``, accumulated in float32.

    The output may keep or drop the reduced axes. ``max`` / ``min`` are exact; a sum of ``n``
    terms errs by ``gamma_{n-1} sum |x|``; ``logsumexp`` carries the relative error of the sum
    of exponentials (the softmax model's) through the log, whose own error is
    ``MATH_ULPS["log"]`` relative.

    Examples
    --------
    >>> from opsdk.verify import error_model, reduction_model
    >>> _ = error_model("demo_logsumexp")(reduction_model(op="logsumexp", axis="axis"))
    """
    if op not in REDUCTIONS:
        raise ValueError(f"reduction_model: op={op!r} is not one of {', '.join(REDUCTIONS)}")

    def model(m: ModelInput) -> np.ndarray:
        X = _input(m, x, "x")
        assert X is not None
        red = _axes(m, axis, X.ndim, trailing=False)
        u = m.u
        n = int(np.prod([X.shape[a] for a in red], dtype=np.int64))
        if op == "softmax":
            return softmax_bound(X, red, u).reshape(m.ref.shape)
        if op in ("max", "min"):
            return np.zeros(m.ref.shape)
        if op in ("sum", "mean"):
            s1 = np.abs(X).sum(axis=red)
            E = _gamma(n - 1, u) * s1 if op == "sum" else _gamma(n + 1, u) * s1 / n
            return E.reshape(m.ref.shape)
        # logsumexp = mx + log(S), S = sum(exp(x - mx)) >= 1: S errs by rho_s relative.
        mx = X.max(axis=red, keepdims=True)
        a = X - mx
        e = np.exp(a)
        s = e.sum(axis=red, keepdims=True)
        rho_e = np.expm1(u * np.abs(a)) * (1 + MATH_ULPS["exp"] * u) + MATH_ULPS["exp"] * u
        rho_s = (e * rho_e).sum(axis=red, keepdims=True) / s + _gamma(n - 1, u) + n * EXP_FLUSH
        log_s = np.log(s)
        shift = -np.log1p(-rho_s)  # |log(S (1 +- rho_s)) - log S| <= -log(1 - rho_s)
        d_log = shift + MATH_ULPS["log"] * u * (np.abs(log_s) + shift)
        E = d_log + u * (np.abs(mx + log_s) + d_log)  # fl(mx + log S)
        return E.reshape(m.ref.shape)

    model._opsdk_label = f"composed {op}"  # type: ignore[attr-defined]
    return model
