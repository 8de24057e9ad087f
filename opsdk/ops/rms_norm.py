"""``rms_norm``: ``x / sqrt(mean(x^2) + epsilon) * gamma`` over the trailing axes."""

from __future__ import annotations

import numpy as np
from tvm import te

from .._dtypes import FLOAT_DTYPES
from .._opdef import Axis, Tensor, op
from ..te_utils import acc, prod, reduce_axes, rsqrt_finite

_F32_MAX = float(np.finfo(np.float32).max)


def _reference(x, gamma=None, *, begin_axis=-1, epsilon=1e-6):
    axes = tuple(range(begin_axis, x.ndim))
    sq = (x * x).sum(axis=axes, keepdims=True)
    ms = sq / np.prod([x.shape[a] for a in axes])
    # The documented semantics: a row whose float32 sum of squares overflows is NaN.
    y = np.where(sq > _F32_MAX, np.nan, x / np.sqrt(ms + epsilon))
    return y if gamma is None else y * gamma


def _check(shapes, dtypes, attrs):
    if attrs["epsilon"] < 0:
        raise ValueError(f"argument 'epsilon' is {attrs['epsilon']}; pass epsilon >= 0")


@op(
    reference=_reference,
    dtypes=FLOAT_DTYPES,
    ranks=(1, 6),
    input_shapes=lambda s, a: {"gamma": tuple(s[a["begin_axis"] :])},
    check=_check,
    layouts={"last": {"begin_axis": -1}, "last2": {"begin_axis": -2}},
    domain={"x": (-4.0, 4.0), "gamma": (-2.0, 2.0)},
    attr_domain={"epsilon": [1e-6, 1e-5, 1e-3]},
    kind="norm",
    special_values=True,  # inf, NaN, huge inputs: docs/verification.md
    examples=[(2, 3, 8)],
)
def rms_norm(
    x: Tensor, gamma: Tensor | None = None, *, begin_axis: Axis = -1, epsilon: float = 1e-6
) -> te.Tensor:
    """Root-mean-square normalization over axes ``[begin_axis, ndim)``, optional gamma.

    float16/bfloat16 inputs are accumulated in float32; the output has the input dtype.
    """
    outer, inner = x.shape[:begin_axis], x.shape[begin_axis:]
    r = reduce_axes(inner, "r")

    def sq(*o):
        v = acc(x(*o, *r))
        return te.sum(v * v, axis=r)

    ss = te.compute(outer, sq, name="sqsum")
    n = prod(inner)
    scale = te.compute(outer, lambda *o: rsqrt_finite(ss(*o), n, epsilon), name="rrms")
    b = len(outer)

    def out(*i):
        y = acc(x(*i)) * scale(*i[:b])
        if gamma is not None:
            y = y * acc(gamma(*i[b:]))
        return y.astype(x.dtype)

    return te.compute(x.shape, out, name="rms_norm")


@rms_norm.fusion()
def _decomposed():
    # the decomposed RMSNorm (x * rsqrt(mean(x^2) + eps), optional gamma)
    from ..transform._fuse import rms_norm_patterns

    return rms_norm_patterns()
