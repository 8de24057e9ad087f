"""``layer_norm``: normalize over the trailing axes ``[begin_axis, ndim)``, then scale and shift.

Two-pass statistics (mean, then the mean of squared deviations) keep the variance accurate
for inputs with a large mean, where the one-pass ``E[x^2] - E[x]^2`` cancels catastrophically.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax, te
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import error_model
from .._opdef import Axis, Tensor
from .._patterns import ONES, ZEROS, affine_params, call_attr, float_tensor, trailing_begin
from ..te_utils import acc, prod, reduce_axes, rsqrt_finite
from ._convert import arg, covered_dtype, filled, tensor
from ._norm import NormChain, norm_error

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


# Error model, keyed by the reference: variants of the op (same math) share it.
error_model(_reference)(norm_error)


# ---------------------------------------------------------------------------------------------
# torch: layer_norm / native_layer_norm (``keep``: native_layer_norm is what torch's
# decomposition makes of layer_norm)


def _tvm_from_torch(node: Any, imp: Any) -> relax.Expr:
    """TVM's own ``layer_norm`` for a node opsdk's op does not cover (float64). Emitted here
    rather than through TVM's converter: in 0.27 it fails on absent weights
    (``elementwise_affine=False``)."""
    x = imp.env[node.args[0]]
    dtype = str(x.ty.dtype)
    shape = [int(d) for d in arg(node, 1, "normalized_shape")]
    gamma = tensor(imp, arg(node, 2, "weight"))
    gamma = filled(shape, dtype, 1.0) if gamma is None else gamma
    beta = tensor(imp, arg(node, 3, "bias"))
    beta = filled(shape, dtype, 0.0) if beta is None else beta
    eps = arg(node, 4, "eps", 1e-5)
    axes = list(range(-len(shape), 0))
    return imp.block_builder.emit(relax.op.nn.layer_norm(x, gamma, beta, axes, float(eps)))


def _from_torch(node: Any, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    if not covered_dtype(x):
        return _tvm_from_torch(node, imp)
    shape = arg(node, 1, "normalized_shape")
    gamma = tensor(imp, arg(node, 2, "weight"))
    beta = tensor(imp, arg(node, 3, "bias"))
    eps = arg(node, 4, "eps", 1e-5)
    call = layer_norm(x, gamma, beta, begin_axis=-len(shape), epsilon=float(eps))
    # native_layer_norm returns (out, mean, rstd); inference graphs read only [0], and TVM's
    # getitem passes a tensor through for an integer index, as TVM's own converter relies on.
    return imp.block_builder.emit(call)


layer_norm.torch("layer_norm.default", "native_layer_norm.default", convert=_from_torch,
                 keep=("layer_norm",))


# ---------------------------------------------------------------------------------------------
# TVM's R.nn.layer_norm (ONNX LayerNormalization): over trailing axes, float dtypes


@layer_norm.replaces("relax.nn.layer_norm", onnx="LayerNormalization", since=17)
def _tvm_layer_norm() -> tuple[DFPattern, Any]:
    pattern = is_op("relax.nn.layer_norm")(wildcard(), ONES | wildcard(), ZEROS | wildcard())

    def build(call: relax.Call, m: Any) -> relax.Expr | None:
        x = call.args[0]
        ty = float_tensor(x)
        if ty is None:
            return None
        begin = trailing_begin(call_attr(call, "axes"), ty.ndim)
        params = affine_params(call, m)
        if begin is None or params is None:
            return None
        return layer_norm(x, *params, begin_axis=begin,
                          epsilon=float(call_attr(call, "epsilon")))

    return pattern, build


# ---------------------------------------------------------------------------------------------
# Fusion: the decomposed chain as exporters spell it


@layer_norm.fusion()
def _decomposed() -> list[tuple[DFPattern, Any]]:
    # the decomposed LayerNorm as exporters spell it (x - mean, its mean square, + eps,
    # sqrt and divide or rsqrt and multiply, optional gamma / beta)
    return NormChain(center=True, op=layer_norm).patterns()
