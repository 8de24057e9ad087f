"""``bias_gelu``: ``gelu(x + bias)`` fused, bias broadcast over the last axis."""

from __future__ import annotations

from typing import Literal

from tvm import te

from .._dtypes import FLOAT_DTYPES
from .._opdef import Tensor, op
from ..te_utils import acc, narrow
from .gelu import gelu_expr, gelu_reference


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


@bias_gelu.fusion()
def _decomposed():
    # gelu(x + bias) with a per-feature bias, for relax.nn.gelu, gelu_tanh and
    # opsdk.gelu
    from ..transform._fuse import bias_gelu_patterns

    return bias_gelu_patterns()
