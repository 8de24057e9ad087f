"""``rms_norm``: ``x / sqrt(mean(x^2) + epsilon) * gamma`` over the trailing axes."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax, te
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import ModelInput, error_model
from .._opdef import Axis, Tensor
from .._patterns import call_attr, float_tensor, trailing_begin
from ..te_utils import acc, prod, reduce_axes, rsqrt_finite
from ._convert import arg, covered_dtype, filled, tensor
from ._norm import NormChain, norm_error

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


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    return norm_error(m, centered=False)  # layer_norm's bound without the centring


# ---------------------------------------------------------------------------------------------
# torch: rms_norm


def _default_eps(dtype: str) -> float:
    """torch's rms_norm default: the machine epsilon of the input dtype."""
    import torch  # optional: only converters of torch programs get here

    return float(torch.finfo(getattr(torch, dtype)).eps)


def _tvm_from_torch(node: Any, imp: Any) -> relax.Expr:
    """TVM's own ``rms_norm`` for a node opsdk's op does not cover (float64), or when the op
    is not mapped: TVM 0.27's importer has no rms_norm converter at all."""
    x = imp.env[node.args[0]]
    dtype = str(x.ty.dtype)
    shape = [int(d) for d in arg(node, 1, "normalized_shape")]
    gamma = tensor(imp, arg(node, 2, "weight"))
    gamma = filled(shape, dtype, 1.0) if gamma is None else gamma
    eps = arg(node, 3, "eps")
    eps = _default_eps(dtype) if eps is None else eps
    axes = list(range(-len(shape), 0))
    return imp.block_builder.emit(relax.op.nn.rms_norm(x, gamma, axes, float(eps)))


def _from_torch(node: Any, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    if not covered_dtype(x):
        return _tvm_from_torch(node, imp)
    shape = arg(node, 1, "normalized_shape")
    gamma = tensor(imp, arg(node, 2, "weight"))
    eps = arg(node, 3, "eps")
    eps = _default_eps(str(x.ty.dtype)) if eps is None else eps
    call = rms_norm(x, gamma, begin_axis=-len(shape), epsilon=float(eps))
    return imp.block_builder.emit(call)


rms_norm.torch("rms_norm.default", convert=_from_torch, keep=("rms_norm",),
               unmapped=_tvm_from_torch)


# ---------------------------------------------------------------------------------------------
# TVM's R.nn.rms_norm (ONNX RMSNormalization): over trailing axes, float dtypes


@rms_norm.replaces("relax.nn.rms_norm", onnx="RMSNormalization", since=23)
def _tvm_rms_norm() -> tuple[DFPattern, Any]:
    pattern = is_op("relax.nn.rms_norm")(wildcard(), wildcard())

    def build(call: relax.Call, m: Any) -> relax.Expr | None:
        x, weight = call.args
        ty = float_tensor(x)
        if ty is None:
            return None
        begin = trailing_begin(call_attr(call, "axes"), ty.ndim)
        if begin is None:
            return None
        return rms_norm(x, weight, begin_axis=begin, epsilon=float(call_attr(call, "epsilon")))

    return pattern, build


@rms_norm.fusion()
def _decomposed() -> list[tuple[DFPattern, Any]]:
    # the decomposed RMSNorm (x * rsqrt(mean(x^2) + eps), optional gamma)
    return NormChain(center=False, op=rms_norm).patterns()
