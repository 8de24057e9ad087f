"""``gelu``: exact (erf) or tanh-approximated Gaussian error linear unit."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from tvm import te, tirx

from .._dtypes import FLOAT_DTYPES
from .._opdef import Tensor, op
from ..te_utils import acc, bind, erf_f32, exp_f32, narrow

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
