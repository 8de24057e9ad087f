"""Error bounds: how far a correct kernel may land from the float64 reference.

The contract every opsdk kernel is held to: compute in float32 (the accumulation dtype of
float32/float16/bfloat16 inputs) with any order of summation, then round once to the output
dtype. The bound of an output element is

    tol = E + u_o * (|y| + E) + eta_o        (output dtype narrower than float32)
    tol = E                                   (float32 output: its last rounding is in E)

where ``y`` is the float64 reference computed from the already-rounded inputs, ``u_o`` the
unit roundoff of the output dtype (half its machine epsilon), ``eta_o`` half its smallest
subnormal, and ``E`` a first-order rounding-error bound of a float32 evaluation of the op's
math, derived per op from its conditioning (an *error model*). Models are worst-case bounds
(recursive summation, ``gamma_k = k u / (1 - k u)``), never fitted to observed errors. The
derivations are in ``docs/verification.md``.

Ops without a model of their own get a kind-based fallback that is a heuristic (finite
difference sensitivities); register a model with :func:`error_model` for tight bounds. The
models (the built-ins' live in their op files) and their mechanism are in
:mod:`opsdk._errmodel`; this module applies them.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from .._dtypes import accum_dtype, eps, is_float, np_dtype
from .._errmodel import (  # the mechanism; re-exported here for opsdk.verify and _compose
    EXP_FLUSH,
    MATH_ULPS,
    ErrorModel,
    ModelInput,
    error_model,
    softmax_bound,
)
from .._errmodel import MODELS as _MODELS
from .._errmodel import gamma as _gamma  # noqa: F401  (for _compose)
from .._errmodel import norm_rows as _norm_rows  # noqa: F401  (for _compose)
from .._opdef import OpDef, as_outputs

__all__ = [
    "EXP_FLUSH",
    "MATH_ULPS",
    "ErrorModel",
    "ModelInput",
    "error_model",
    "model_for",
    "output_bound",
    "softmax_bound",
    "ulps",
]

_ETA_OPS = 8  # operations whose underflow may each add half a float32 subnormal


def model_for(d: OpDef) -> tuple[str, ErrorModel]:
    """(description, model) for ``d``: by name, then by reference function, then by kind.

    The built-in ops register their models in their op files, keyed by their reference
    functions (so variants of a built-in, with the same math, share its model)."""
    if d.name in _MODELS:
        fn = _MODELS[d.name]
        if d.module.startswith("opsdk."):
            return f"built-in {d.name}", fn
        structure = getattr(fn, "_opsdk_label", None)  # opsdk.verify.norm_model & co.
        return f"author's ({structure})" if structure else f"author's ({d.name})", fn
    if d.reference in _MODELS:
        module = getattr(d.reference, "__module__", "?")
        if module.startswith("opsdk."):  # a built-in op's reference (e.g. a mutant's)
            return f"built-in {module.rsplit('.', 1)[-1]}", _MODELS[d.reference]
        return f"author's (reference in {module})", _MODELS[d.reference]
    if d.kind == "elementwise":
        return "fallback:elementwise", _fallback_elementwise
    return f"fallback:{d.kind}", _fallback_reduction


def unit_roundoff(dtype: str) -> float:
    """Half the machine epsilon of ``dtype``."""
    return eps(dtype) / 2


def _eta(dtype: str) -> float:
    return float(ml_dtypes.finfo(np_dtype(dtype)).smallest_subnormal) / 2


def output_bound(d: OpDef, m: ModelInput, out_dtype: str) -> tuple[np.ndarray, str]:
    """Per-element tolerance of the kernel output against ``m.ref``, and the model used."""
    name, model = model_for(d)
    if not is_float(out_dtype):  # integer outputs: exact, unless the op's model says more
        if name.startswith("fallback"):
            return np.zeros(m.ref.shape), "exact (integer output)"
        with np.errstate(all="ignore"):
            e = np.asarray(model(m), dtype=np.float64)
        return np.broadcast_to(np.nan_to_num(e, nan=np.inf), m.ref.shape), name
    with np.errstate(all="ignore"):
        e = np.asarray(model(m), dtype=np.float64)
        e = np.broadcast_to(np.nan_to_num(e, nan=np.inf), m.ref.shape)
        e = e + _ETA_OPS * _eta(accum_dtype(out_dtype))
        if out_dtype == accum_dtype(out_dtype):
            return e, name
        uo = unit_roundoff(out_dtype)
        return e + uo * (np.abs(m.ref) + e) + _eta(out_dtype), name


def ulps(dtype: str, ref: np.ndarray, err: np.ndarray) -> np.ndarray:
    """``err`` in units of the spacing of ``dtype`` at ``|ref|`` (subnormal spacing near 0)."""
    if not is_float(dtype):
        return np.asarray(err, dtype=np.float64)
    info = ml_dtypes.finfo(np_dtype(dtype))
    with np.errstate(all="ignore"):
        mag = np.maximum(np.abs(ref), float(info.tiny))
        spacing = np.exp2(np.floor(np.log2(mag))) * float(info.eps)
        return err / spacing


# ---------------------------------------------------------------------------------------------
# Fallbacks for ops without a model (heuristic, documented as such).

_H = 2.0**-20  # relative finite-difference step: far above float64 noise, far below u32 effects


def _sensitivity(m: ModelInput, signs: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """sum over inputs of |y(x + h|x| s) - y(x)| / h: the elementwise |dy/dx| |x| when s = 1."""
    total = np.zeros_like(m.ref)
    for name, x in m.inputs.items():
        if x is None:
            continue
        s = 1.0 if signs is None else signs[name]
        step = _H * np.where(x == 0, 1.0, np.abs(x)) * s
        pert = dict(m.inputs)
        pert[name] = x + step
        yp = m.reference(pert)
        total = total + np.abs(yp - m.ref) / _H
    return total


def _fallback_elementwise(m: ModelInput) -> np.ndarray:
    scale = float(np.max(np.abs(m.ref), initial=0.0))
    return 16 * m.u * (np.abs(m.ref) + _sensitivity(m)) + 4 * m.u * scale


def _reduction_length(m: ModelInput) -> int:
    shapes = {k: v.shape for k, v in m.inputs.items() if v is not None}
    out = m.op.trace(shapes, m.op.dtypes_for(m.dtype, list(shapes)), m.attrs)
    best, stack, seen = 1, list(as_outputs(out)), []
    while stack:
        t = stack.pop()
        op = t.op
        if any(op.same_as(s) for s in seen):
            continue
        seen.append(op)
        axes = getattr(op, "reduce_axis", None) or []
        n = 1
        for a in axes:
            n *= int(a.dom.extent)
        best = max(best, n)
        stack.extend(getattr(op, "input_tensors", []))
    return best


def _fallback_reduction(m: ModelInput) -> np.ndarray:
    n = _reduction_length(m)
    rng = np.random.default_rng(0)
    probe = np.zeros_like(m.ref)
    for _ in range(4):
        signs = {k: rng.choice([-1.0, 1.0], v.shape) for k, v in m.inputs.items() if v is not None}
        probe = np.maximum(probe, _sensitivity(m, signs))
    scale = float(np.max(np.abs(m.ref), initial=0.0))
    return m.u * (n + 8) * (2 * np.abs(m.ref) + 4 * probe + scale)
