"""``dense_w8``: float32 activations times int8 weights with one float32 scale per output
channel (weight-only quantization, the memory-bound decode GEMV of an edge LLM).

``y[m, n] = act((sum_k x[m, k] * float32(w[n, k])) * w_scale[n] + bias[n])``

The int8 weight converts to float32 exactly, so the only roundings are the float32 dot
product of length K, the scale multiply and the bias add: the error model is the standard
``gamma_(K+2) * (sum_k |x| |w * w_scale| + |bias|)`` (any summation order, FMA or not), then
the activation's slope and own rounding. :func:`quantize_w8` makes the weights (symmetric,
per channel, ``scale = max|w_n| / 127``, round half to even).

``activation`` exists because the model pipeline does not fuse an elementwise op into an
opsdk op's kernel (opsdk ops other than elementwise ones lower as opaque kernels, so
FuseOps leaves them whole): bias and activation are computed in the kernel's write-back
instead, with opsdk's vectorizable float32 math (:mod:`opsdk._vecmath`).

The compute below is the definition (and the generic lowering). The rules in
:mod:`opsdk.schedules._wgemm` rebuild it from the attributes the output block records under
:data:`ATTRS_KEY`: weights packed as ``(N / lanes, K, lanes)`` (folded at compile time for a
constant weight), a vector GEMV over output channels for a few rows, a dequantized panel
and a register-tiled float32 GEMM for many.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .._declare import op
from .._domains import log_uniform
from .._errmodel import MATH_ULPS, ModelInput, error_model, gamma
from .._opdef import OpDef, Tensor
from .._patterns import call_attr, param_of, shape_of
from .._vecmath import sigmoid_f32
from .gelu import gelu_error, gelu_expr, gelu_reference

__all__ = [
    "ACTIVATIONS",
    "ATTRS_KEY",
    "WeightActivation",
    "activation_error",
    "activation_reference",
    "activation_te",
    "dense_w8",
    "epilogue_fusions",
    "quantize_w8",
]

#: Annotation on the output block holding the attributes (``activation``, ``has_bias``): the
#: rules rebuild the computation from it.
ATTRS_KEY = "opsdk.dense_w8"

WeightActivation = Literal["none", "relu", "gelu", "gelu_tanh", "silu"]
#: The activations the weight-only dense ops fuse into their write-back.
ACTIVATIONS: tuple[str, ...] = ("none", "relu", "gelu", "gelu_tanh", "silu")
# The largest slope of each (GELU erf 1.129, tanh 1.130, SiLU 1.0998).
_SLOPE = {"none": 1.0, "relu": 1.0, "gelu": 1.13, "gelu_tanh": 1.131, "silu": 1.1}


def activation_te(v: tirx.PrimExpr, activation: str) -> tirx.PrimExpr:
    """The activation of a float32 expression, in vectorizable float32 arithmetic."""
    if activation == "relu":
        return tirx.max(v, tirx.const(0.0, "float32"))
    if activation in ("gelu", "gelu_tanh"):
        return gelu_expr(v, "tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return v * sigmoid_f32(v)
    return v


def activation_reference(y: np.ndarray, activation: str) -> np.ndarray:
    """The float64 activation."""
    if activation == "relu":
        return np.maximum(y, 0.0)
    if activation in ("gelu", "gelu_tanh"):
        return gelu_reference(y, "tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return y * (0.5 * (1.0 + np.tanh(0.5 * y)))
    return y


def activation_error(pre: np.ndarray, e: np.ndarray, activation: str, u: float) -> np.ndarray:
    """The output's error bound from the bound ``e`` on the computed pre-activation (float64
    ``pre``): the activation's largest slope times ``e``, plus its own float32 evaluation error
    at the computed value (GELU: :func:`~opsdk.ops.gelu.gelu_error`; SiLU: the sigmoid's
    accuracy and one multiply)."""
    if activation in ("none", "relu"):
        return e
    grown = _SLOPE[activation] * e
    if activation == "silu":
        return grown + (MATH_ULPS["sigmoid"] + 1) * u * (np.abs(pre) + e)
    # gelu_error at the exact pre-activation; the computed one is within e of it, where the
    # evaluation error is bounded alike (its terms grow with |v| at most linearly: + slope e u).
    own, _ = gelu_error(pre, "tanh" if activation == "gelu_tanh" else "none", u)
    return grown + own + 2 * u * e


def _reference(x, w, w_scale, bias=None, *, activation="none"):
    y = (x @ w.astype(np.float64).T) * w_scale
    if bias is not None:
        y = y + bias
    return activation_reference(y, activation)


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    """float32 dot product of length K (exact int8 -> float32 weights), then the scale
    multiply and the bias add: gamma_(K+2) of the sum of |x w s| + |bias|."""
    x, w, s, b = (m.inputs[k] for k in ("x", "w", "w_scale", "bias"))
    mag = np.abs(x) @ (np.abs(w) * np.abs(s)[:, None]).T
    if b is not None:
        mag = mag + np.abs(b)
    e = gamma(x.shape[-1] + 2, m.u) * mag
    act = m.attrs["activation"]
    if act in ("none", "relu"):
        return e
    pre = _reference(x, w, s, b, activation="none")
    return activation_error(pre, e, act, m.u)


@op(
    reference=_reference,
    dtypes={"x": ("float32",), "w": ("int8",), "w_scale": ("float32",), "bias": ("float32",)},
    ranks=(2, 2),
    free_dims={"N": (1, 64)},
    input_shapes=lambda s, a: {"w": ("N", s[1]), "w_scale": ("N",), "bias": ("N",)},
    # Activations of order 1, weights over the whole symmetric int8 range, scales as
    # quantize_w8 makes them for weights of magnitude ~1e-3..1 (max|w| / 127).
    domain={
        "x": (-2.0, 2.0),
        "w": (-127, 127),
        "w_scale": log_uniform(1e-5, 1e-2),
        "bias": (-1.0, 1.0),
    },
    attr_domain={"activation": list(ACTIVATIONS)},
    kind="dense",
    examples=[(4, 20)],
)
def dense_w8(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    activation: WeightActivation = "none",
) -> te.Tensor:
    """Weight-only int8 dense ``act(x @ (w * w_scale[:, None]).T + bias)`` (x: ``(M, K)``
    float32, w: ``(N, K)`` int8, w_scale: ``(N,)`` float32 per output channel)."""
    m, k = x.shape
    n = w.shape[0]
    rk = te.reduce_axis((0, k), name="k")
    acc = te.compute(
        (m, n), lambda i, j: te.sum(x[i, rk] * w[j, rk].astype("float32"), axis=rk), name="acc"
    )

    def body(i, j):
        v = acc[i, j] * w_scale[j]
        if bias is not None:
            v = v + bias[j]
        return activation_te(v, activation)

    attrs = {"activation": activation, "has_bias": bias is not None}
    return te.compute((m, n), body, name="dense_w8", attrs={ATTRS_KEY: attrs})


def quantize_w8(w_float: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8 quantization of a ``(N, K)`` float weight.

    ``scale[n] = max_k |w[n, k]| / 127`` (float32), ``q = round_half_even(w / scale)``
    clipped to [-127, 127]; a zero row gets scale 1 and zeros. Returns ``(w_int8, w_scale)``,
    the arguments of :func:`dense_w8`.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.ops.dense_w8 import quantize_w8
    >>> q, s = quantize_w8(np.array([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], "float32"))
    >>> q.tolist(), s.tolist()
    ([[64, -127, 32], [0, 0, 0]], [0.007874015718698502, 1.0])
    """
    w = np.asarray(w_float, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_w8: w_float has shape {w.shape}; pass a (N, K) matrix")
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


# The activations a model spells after a dense layer, and the `activation` each becomes
# (None: opsdk.gelu, whose `approximate` attribute decides).
_ACT_OPS = {"relax.nn.gelu": "gelu", "relax.nn.gelu_tanh": "gelu_tanh", "relax.nn.silu": "silu",
            "relax.nn.relu": "relu", "opsdk.gelu": None}


def epilogue_fusions(d: OpDef) -> Callable[[], list[tuple[DFPattern, Any]]]:
    """The fusion rules of a weight-only dense op ``d`` (``x, w, scale`` and no bias, no
    activation): ``+ bias`` (a per-feature constant or tensor), an activation after it or
    alone, and ``opsdk.bias_gelu`` of its output, all become ``d``'s own ``bias`` and
    ``activation``, so they run in its kernel's write-back. (The pipeline's kernel fusion
    does not fuse elementwise ops into an opsdk op's kernel: it lowers as an opaque kernel.)"""

    def rules() -> list[tuple[DFPattern, Any]]:
        x, w, s, b = wildcard(), wildcard(), wildcard(), wildcard()
        dense = is_op(f"opsdk.{d.name}")(x, w, s)
        add = is_op("relax.add")(dense, b) | is_op("relax.add")(b, dense)

        def build(m: Any, bias_pat: Any, act: str) -> relax.Expr | None:
            call = m[dense]
            if str(call_attr(call, "activation", "none")) != "none":
                return None
            bias = None
            if bias_pat is not None:
                shp = shape_of(call)
                if shp is None:
                    return None
                bias = param_of(m[bias_pat], (shp[-1],))
                if bias is None or str(bias.ty.dtype) != "float32":
                    return None
            return d(m[x], m[w], m[s], bias, activation=act)

        # Longest first: each pair is a rewrite of its own, run in this order.
        out: list[tuple[DFPattern, Any]] = []
        acts = []
        for op_name, act in _ACT_OPS.items():

            def mode(orig: relax.Call, act: str | None = act) -> str:
                if act is not None:
                    return act
                tanh = str(call_attr(orig, "approximate", "none")) == "tanh"
                return "gelu_tanh" if tanh else "gelu"

            acts.append((op_name, mode))
        for op_name, mode in acts:
            out.append((is_op(op_name)(add), lambda orig, m, mode=mode: build(m, b, mode(orig))))
        out.append((is_op("opsdk.bias_gelu")(dense, b),
                    lambda orig, m: build(m, b, acts[-1][1](orig))))
        for op_name, mode in acts:
            out.append((is_op(op_name)(dense),
                        lambda orig, m, mode=mode: build(m, None, mode(orig))))
        out.append((add, lambda orig, m: build(m, b, "none")))
        return out

    return rules


dense_w8.fusion()(epilogue_fusions(dense_w8))
