"""``add_layer_norm``: a residual add fused with LayerNorm, returning both results.

A pre-LN transformer block computes ``h = x + r`` and ``LayerNorm(h)``, and keeps ``h`` for
the next residual add. One kernel reads ``x`` and ``r`` once and writes both outputs; its
fusion rule finds ``x + r`` followed by a LayerNorm over the last axis in an imported model
and makes later uses of ``x + r`` read the op's first output.

Load it with ``--module add_layer_norm`` (from this folder), or
``opsdk.load_plugins(["add_layer_norm"])``::

    opsdk verify add_layer_norm --module add_layer_norm --target x86
"""

from __future__ import annotations

import numpy as np
from tvm import te
from tvm.relax.dpl import is_op, wildcard

import opsdk
from opsdk.te_utils import acc, prod, reduce_axes, rsqrt_finite
from opsdk.verify import error_model, norm_model, per_output, rounding_model

__all__ = ["OPS", "add_layer_norm"]


def _reference(x, r, gamma, beta, *, epsilon=1e-5):
    h = x + r
    mean = h.mean(axis=-1, keepdims=True)
    var = ((h - mean) ** 2).mean(axis=-1, keepdims=True)
    return h, (h - mean) / np.sqrt(var + epsilon) * gamma + beta


def _input_shapes(shape, attrs):
    return {"r": tuple(shape), "gamma": tuple(shape[-1:]), "beta": tuple(shape[-1:])}


@opsdk.op(
    reference=_reference,
    ranks=(2, 4),
    input_shapes=_input_shapes,
    domain={"x": (-4.0, 4.0), "r": (-4.0, 4.0), "gamma": (-2.0, 2.0), "beta": (-2.0, 2.0)},
    attr_domain={"epsilon": [1e-5, 1e-6]},
    kind="norm",
    examples=[(2, 3, 8)],
)
def add_layer_norm(x: opsdk.Tensor, r: opsdk.Tensor, gamma: opsdk.Tensor, beta: opsdk.Tensor,
                   *, epsilon: float = 1e-5) -> tuple[te.Tensor, te.Tensor]:
    """``(x + r, LayerNorm(x + r) * gamma + beta)`` over the last axis.

    The sum is formed in float32 (once per use: it is recomputed, not stored and re-read) and
    both outputs have the input dtype.
    """
    outer, inner = x.shape[:-1], x.shape[-1:]
    n = prod(inner)
    b = len(outer)

    def h(*i):
        return acc(x(*i)) + acc(r(*i))

    k1 = reduce_axes(inner, "r")
    total = te.compute(outer, lambda *o: te.sum(h(*o, *k1), axis=k1), name="sum")
    mean = te.compute(outer, lambda *o: total(*o) / n, name="mean")
    k2 = reduce_axes(inner, "k")

    def dev2(*o):
        d = h(*o, *k2) - mean(*o)
        return te.sum(d * d, axis=k2)

    sq = te.compute(outer, dev2, name="sqsum")
    rstd = te.compute(outer, lambda *o: rsqrt_finite(sq(*o), n, epsilon), name="rstd")

    def normed(*i):
        y = (h(*i) - mean(*i[:b])) * rstd(*i[:b])
        return (y * acc(gamma(*i[b:])) + acc(beta(*i[b:]))).astype(x.dtype)

    residual = te.compute(x.shape, lambda *i: h(*i).astype(x.dtype), name="residual")
    return residual, te.compute(x.shape, normed, name="add_layer_norm")


# Output 0 is one float32 rounding of x + r; output 1 a LayerNorm of x + r, whose float32
# rounding the norm then carries (norm_model's residual=).
error_model(add_layer_norm)(per_output(
    rounding_model(1),
    norm_model(axes=-1, residual="r", gamma="gamma", beta="beta")))


@add_layer_norm.fusion()
def _add_then_layer_norm():
    # torch's LayerNorm arrives as opsdk.layer_norm (from_torch) or relax.nn.layer_norm.
    x, r, gamma, beta = wildcard(), wildcard(), wildcard(), wildcard()
    h = is_op("relax.add")(x, r)
    ln = is_op("opsdk.layer_norm")(h, gamma, beta) | is_op("relax.nn.layer_norm")(h, gamma, beta)

    def build(call, m):
        xt, rt = m[x].ty, m[r].ty
        if getattr(xt, "ndim", -1) < 2 or str(xt.shape) != str(rt.shape):
            return None  # a broadcasting add (a bias) is not a residual
        if str(call.op.name) == "opsdk.layer_norm":
            axis = int(call.attrs["begin_axis"])
            eps = float(call.attrs["epsilon"])
        else:
            axes = [int(a) for a in call.attrs.axes]
            axis = axes[0] if len(axes) == 1 else 0
            eps = float(call.attrs.epsilon)
        if axis not in (-1, xt.ndim - 1):
            return None  # normalizes over more than the last axis
        fused = opsdk.relax.add_layer_norm(m[x], m[r], m[gamma], m[beta], epsilon=eps)
        return fused, {call: 1, m[h]: 0}

    return ln, build


OPS = [add_layer_norm]
