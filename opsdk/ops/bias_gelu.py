"""``bias_gelu``: ``gelu(x + bias)`` fused, bias broadcast over the last axis."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from tvm import relax, te
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import ModelInput, error_model
from .._opdef import Tensor
from .._patterns import call_attr, float_tensor, param_of, same_dims, shape_of
from ..te_utils import acc, narrow
from .gelu import gelu_error, gelu_expr, gelu_reference


def _reference(x, bias, *, approximate="none"):
    return gelu_reference(x + bias, approximate)


@op(
    reference=_reference,
    dtypes=FLOAT_DTYPES,
    ranks=(1, 6),
    input_shapes=lambda s, a: {"bias": (s[-1],)},
    layouts={"erf": {"approximate": "none"}, "tanh": {"approximate": "tanh"}},
    domain={"x": (-4.0, 4.0), "bias": (-2.0, 2.0)},
    kind="elementwise",
    special_values=True,  # inf, NaN, huge inputs: docs/verification.md
    examples=[(2, 3, 8)],
)
def bias_gelu(
    x: Tensor, bias: Tensor, *, approximate: Literal["none", "tanh"] = "none"
) -> te.Tensor:
    """GELU of ``x + bias`` (bias of shape ``(x.shape[-1],)``), the Linear + GELU epilogue.

    The add happens in float32 for float16/bfloat16 inputs, so the sum is not rounded twice.
    """
    return te.compute(
        x.shape,
        lambda *i: narrow(gelu_expr(acc(x(*i)) + acc(bias(i[-1])), approximate), x.dtype),
        name="bias_gelu",
    )


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    v = m.inputs["x"] + m.inputs["bias"]
    e, deriv = gelu_error(v, m.attrs["approximate"], m.u)
    return e + deriv * m.u * np.abs(v)  # fl(x + bias) rounds once


# The GELUs a bias add may feed: TVM's two (approximation fixed by the op) and opsdk's own.
_GELU_OPS = {"relax.nn.gelu": "none", "relax.nn.gelu_tanh": "tanh", "opsdk.gelu": None}


@bias_gelu.fusion()
def _decomposed() -> list[tuple[DFPattern, Any]]:
    # gelu(x + bias) with a per-feature bias, for relax.nn.gelu, gelu_tanh and
    # opsdk.gelu
    a, b = wildcard(), wildcard()
    add = is_op("relax.add")(a, b)
    out = []
    for op_name, approx in _GELU_OPS.items():

        def fused(orig: relax.Call, m: Any, approx: str | None = approx) -> relax.Expr | None:
            mode = approx if approx is not None else str(call_attr(orig, "approximate", "none"))
            shape = shape_of(orig)
            for x, bias in ((m[a], m[b]), (m[b], m[a])):
                xs = shape_of(x)
                if xs is None or shape is None or not same_dims(xs, shape):
                    continue
                if float_tensor(x) is None or str(bias.ty.dtype) != str(x.ty.dtype):
                    continue
                q = param_of(bias, (shape[-1],))
                if q is not None:
                    return bias_gelu(x, q, approximate=mode)
            return None  # e.g. a residual add: both operands are full tensors

        out.append((is_op(op_name)(add), fused))
    return out
