"""``layer_norm``: normalize over the trailing axes ``[begin_axis, ndim)``, then scale and shift.

Two-pass statistics (mean, then the mean of squared deviations) keep the variance accurate
for inputs with a large mean, where the one-pass ``E[x^2] - E[x]^2`` cancels catastrophically.
"""

from __future__ import annotations

import numpy as np
from tvm import te

from .._dtypes import FLOAT_DTYPES
from .._opdef import Axis, Tensor, op
from ..te_utils import acc, prod, reduce_axes, rsqrt_finite

_F32_MAX = float(np.finfo(np.float32).max)


def _reference(x, gamma=None, beta=None, *, begin_axis=-1, epsilon=1e-5):
    axes = tuple(range(begin_axis, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    sq = ((x - mean) ** 2).sum(axis=axes, keepdims=True)
    var = sq / np.prod([x.shape[a] for a in axes])
    # The documented semantics: a row whose float32 sum of squares overflows is NaN.
    y = np.where(sq > _F32_MAX, np.nan, (x - mean) / np.sqrt(var + epsilon))
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def _input_shapes(x_shape, attrs):
    tail = tuple(x_shape[attrs["begin_axis"] :])
    return {"gamma": tail, "beta": tail}


def _check(shapes, dtypes, attrs):
    if attrs["epsilon"] < 0:
        raise ValueError(f"argument 'epsilon' is {attrs['epsilon']}; pass epsilon >= 0")


@op(
    reference=_reference,
    dtypes=FLOAT_DTYPES,
    ranks=(1, 6),
    input_shapes=_input_shapes,
    check=_check,
    layouts={"last": {"begin_axis": -1}, "last2": {"begin_axis": -2}},
    domain={"x": (-4.0, 4.0), "gamma": (-2.0, 2.0), "beta": (-2.0, 2.0)},
    attr_domain={"epsilon": [1e-5, 1e-6, 1e-3]},
    kind="norm",
    special_values=True,  # inf, NaN, huge inputs: docs/verification.md
    examples=[(2, 3, 8)],
)
def layer_norm(
    x: Tensor,
    gamma: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    begin_axis: Axis = -1,
    epsilon: float = 1e-5,
) -> te.Tensor:
    """Layer normalization over axes ``[begin_axis, ndim)`` with optional gamma and beta.

    float16/bfloat16 inputs are accumulated in float32; the output has the input dtype.
    """
    outer, inner = x.shape[:begin_axis], x.shape[begin_axis:]
    n = prod(inner)

    def red(prefix):
        return reduce_axes(inner, prefix)

    r1 = red("r")
    s = te.compute(outer, lambda *o: te.sum(acc(x(*o, *r1)), axis=r1), name="sum")
    mean = te.compute(outer, lambda *o: s(*o) / n, name="mean")
    r2 = red("k")

    def dev2(*o):
        d = acc(x(*o, *r2)) - mean(*o)
        return te.sum(d * d, axis=r2)

    sq = te.compute(outer, dev2, name="sqsum")
    rstd = te.compute(outer, lambda *o: rsqrt_finite(sq(*o), n, epsilon), name="rstd")
    b = len(outer)

    def out(*i):
        y = (acc(x(*i)) - mean(*i[:b])) * rstd(*i[:b])
        if gamma is not None:
            y = y * acc(gamma(*i[b:]))
        if beta is not None:
            y = y + acc(beta(*i[b:]))
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name="layer_norm")


@layer_norm.fusion()
def _decomposed():
    # the decomposed LayerNorm as exporters spell it (x - mean, its mean square, + eps,
    # sqrt and divide or rsqrt and multiply, optional gamma / beta)
    from ..transform._fuse import layer_norm_patterns

    return layer_norm_patterns()
