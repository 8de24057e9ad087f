"""``gelu``: exact (erf) or tanh-approximated Gaussian error linear unit."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import EXP_FLUSH, MATH_ULPS, ModelInput, error_model
from .._opdef import Tensor
from .._patterns import float_tensor
from ..te_utils import acc, bind, erf_f32, exp_f32, narrow
from ._convert import arg, covered_dtype

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_expr(v: tirx.PrimExpr, approximate: str) -> tirx.PrimExpr:
    """GELU of a float32 expression; shared with ``bias_gelu``.

    ``exp``/``erf`` come from :mod:`opsdk._vecmath` (TVM's own lower to per-lane libm
    calls). The tanh form uses the identity ``0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u))``: one
    exp and one division, and no cancellation in ``1 + tanh(u)`` for large negative inputs.
    """
    return bind(v, "gelu_x", lambda v: _gelu(v, approximate))


def _gelu(v: tirx.PrimExpr, approximate: str) -> tirx.PrimExpr:
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)
        return v / (1.0 + exp_f32(-2.0 * inner))
    return 0.5 * v * (1.0 + erf_f32(v * (1.0 / math.sqrt(2.0))))


def gelu_reference(x: np.ndarray, approximate: str) -> np.ndarray:
    """float64 GELU; shared with ``bias_gelu``."""
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _reference(x, *, approximate="none"):
    return gelu_reference(x, approximate)


@op(
    reference=_reference,
    dtypes=FLOAT_DTYPES,
    ranks=(1, 6),
    layouts={"erf": {"approximate": "none"}, "tanh": {"approximate": "tanh"}},
    domain={"x": (-6.0, 6.0)},
    kind="elementwise",
    special_values=True,  # inf, NaN, huge inputs: docs/verification.md
    examples=[(2, 3, 8)],
)
def gelu(x: Tensor, *, approximate: Literal["none", "tanh"] = "none") -> te.Tensor:
    """GELU, ``x * Phi(x)``; ``approximate="tanh"`` uses the tanh formula (as in torch).

    Computed in float32 for float16/bfloat16 inputs; the output has the input dtype.
    """
    return te.compute(
        x.shape, lambda *i: narrow(gelu_expr(acc(x(*i)), approximate), x.dtype), name="gelu"
    )


# ---------------------------------------------------------------------------------------------
# Error model (shared with bias_gelu)

_SQRT1_2 = 1 / math.sqrt(2)
_K0 = math.sqrt(2 / math.pi)
_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def gelu_error(v: np.ndarray, approximate: str, u: float) -> tuple[np.ndarray, np.ndarray]:
    """(bound on the error of gelu evaluated in float32 at an exact v, |dgelu/dv|).

    erf form ``0.5 v (1 + erf(v / sqrt 2))``: the cancellation in ``1 + erf`` for negative v
    makes the error absolute in erf (about ``0.5 |v| k u``) while ``y`` itself is tiny.
    tanh form: the contract admits both evaluations, ``0.5 v (1 + tanh(s))`` (cancellation
    as above) and the cancellation-free ``v / (1 + exp(-2 s))``; the bound is the larger one.
    """
    if approximate == "tanh":
        p = 0.044715 * v**3
        q = v + p
        s = _K0 * q
        dp = 4 * u * np.abs(p)  # constant + three products
        dq = dp + u * (np.abs(q) + dp)
        ds = _K0 * dq * (1 + 2 * u) + 2 * u * np.abs(s)
        # (1) 0.5 v (1 + tanh(s))
        t = np.tanh(s)
        w = 1 + t
        dt = MATH_ULPS["tanh_abs"] * u + u * np.abs(t) + (1 - t * t) * ds
        dw = dt + u * (np.abs(w) + dt)
        y = 0.5 * v * w
        e1 = 0.5 * np.abs(v) * dw
        e1 = e1 + u * (np.abs(y) + e1)
        # (2) v / (1 + exp(-2 s)): exp's relative error plus 2 ds from its argument; an exp
        # beyond float32's range gives y = 0 where |y| < |v| 2**-126.
        with np.errstate(over="ignore"):
            ex = np.exp(-2 * s)
        den = 1 + ex
        rho_e = np.expm1(2 * ds) + MATH_ULPS["exp"] * u
        dden = ex * rho_e + u * den
        with np.errstate(invalid="ignore"):
            rel = np.where(np.isinf(den), 0.0, dden / den)
        e2 = np.abs(y) * ((1 + rel) * (1 + u) - 1) + EXP_FLUSH * (1 + np.abs(v))
        deriv = 0.5 * w + 0.5 * v * (1 - t * t) * _K0 * (1 + 3 * 0.044715 * v * v)
        return np.maximum(e1, e2), np.abs(deriv)
    z = v * _SQRT1_2
    f = _erf64(z)
    w = 1 + f
    df = 2 / math.sqrt(math.pi) * np.exp(-z * z)
    dt = MATH_ULPS["erf"] * u * np.abs(f) + df * 2 * u * np.abs(z)  # erf, fl(v * c)
    deriv = 0.5 * w + 0.5 * v * df * _SQRT1_2
    dw = dt + u * (np.abs(w) + dt)
    y = 0.5 * v * w
    e = 0.5 * np.abs(v) * dw
    return e + u * (np.abs(y) + e), np.abs(deriv)


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    e, _ = gelu_error(m.inputs["x"], m.attrs["approximate"], m.u)
    return e


# ---------------------------------------------------------------------------------------------
# torch: gelu (nothing kept from the decomposition: torch's leaves gelu whole)


def _from_torch(node: Any, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    approximate = arg(node, 1, "approximate", "none")
    if not covered_dtype(x) or approximate not in ("none", "tanh"):
        # TVM's own op for what opsdk's does not cover (float64)
        tvm_op = relax.op.nn.gelu_tanh if approximate == "tanh" else relax.op.nn.gelu
        return imp.block_builder.emit(tvm_op(x))
    return imp.block_builder.emit(gelu(x, approximate=approximate))


gelu.torch("gelu.default", convert=_from_torch, keep=())


# ---------------------------------------------------------------------------------------------
# TVM's R.nn.gelu and R.nn.gelu_tanh (ONNX Gelu): float dtypes


def _replace(tvm_op: str, approximate: str) -> tuple[DFPattern, Any]:
    def build(call: relax.Call, m: Any) -> relax.Expr | None:
        x = call.args[0]
        return gelu(x, approximate=approximate) if float_tensor(x) is not None else None

    return is_op(tvm_op)(wildcard()), build


@gelu.replaces("relax.nn.gelu", onnx="Gelu", since=20)
def _tvm_gelu() -> tuple[DFPattern, Any]:
    return _replace("relax.nn.gelu", "none")


@gelu.replaces("relax.nn.gelu_tanh", onnx="Gelu", since=20)
def _tvm_gelu_tanh() -> tuple[DFPattern, Any]:
    return _replace("relax.nn.gelu_tanh", "tanh")
