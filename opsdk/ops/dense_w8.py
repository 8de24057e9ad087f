"""``dense_w8``: float32 activations times int8 weights with one float32 scale per output
channel (weight-only quantization, the memory-bound decode GEMV of an edge LLM).

``y[m, n] = act((sum_k x[m, k] * float32(w[n, k])) * w_scale[n] + bias[n])``

The int8 weight converts to float32 exactly, so the only roundings are the float32 dot
product of length K, the scale multiply and the bias add: the error model is the standard
``gamma_(K+2) * (sum_k |x| |w * w_scale| + |bias|)`` (any summation order, FMA or not), then
the activation's slope and own rounding. :func:`quantize_w8` makes the weights (symmetric,
per channel, ``scale = max|w_n| / 127``, round half to even).

``activations="q8_0"`` (llama.cpp's integer path) quantizes ``x`` per row and per block of 32
along K to int8 first (:func:`quantize_q8_0`: ``amax = max|x|``, ``dx = amax / 127``,
``xq = round_half_even(x / dx)``, the block's scale ``dx`` rounded to float16 as ggml stores
it), so the dot product is exact in int32 per block: ``isum[m, n, b] = sum_j xq * w``, and
``y = act(w_scale[n] * sum_b isum[m, n, b] * dx16[m, b] + bias[n])``. K must be whole blocks
then. Only the float32 sum over the ``K / 32`` blocks, the scale multiplies and the bias add
round: ``gamma_(K/32 + 2) * (sum_b |isum| dx16 |w_scale| + |bias|)``, with the reference
reproducing the quantization bit for bit (:func:`quantize_q8_0`).

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
    "QBLOCK",
    "WeightActivation",
    "WeightActivations",
    "activation_error",
    "activation_reference",
    "activation_te",
    "check_q8_0_k",
    "dense_w8",
    "epilogue_fusions",
    "q8_0_error",
    "q8_0_te",
    "quantize_q8_0",
    "quantize_w8",
]

#: Annotation on the output block holding the attributes (``activation``, ``has_bias``): the
#: rules rebuild the computation from it.
ATTRS_KEY = "opsdk.dense_w8"

WeightActivation = Literal["none", "relu", "gelu", "gelu_tanh", "silu"]
#: The numerics of the activations: float32 as given, or ggml q8_0 (int8 per 32-block).
WeightActivations = Literal["float32", "q8_0"]
#: Activations per q8_0 block along K (ggml's QK8_0).
QBLOCK = 32
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


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml q8_0 activations of a ``(M, K)`` float32 ``x`` (K a multiple of 32), bit for bit
    what the ``activations="q8_0"`` kernels compute: ``(xq, dx16)``, ``xq`` ``(M, K)`` int8
    and ``dx16`` ``(M, K / 32)`` float32 (each value a float16).

    Per block of 32: ``amax = max|x|``, ``dx = amax / 127`` (float32 division),
    ``id = 1 / dx`` (0 when dx is 0), ``xq = int8(nearbyint(float32(x * id)))`` (round half
    to even: ggml's ``roundf`` rounds ties away from zero, so the two differ on exact ties of
    ``x * id`` only), ``dx16 = float32(float16(dx))`` (ggml stores ``d`` as fp16).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.ops.dense_w8 import quantize_q8_0
    >>> x = np.zeros((1, 32), "float32"); x[0, :3] = [1.27, -0.5, 0.005]
    >>> xq, d = quantize_q8_0(x)
    >>> xq[0, :3].tolist(), float(d[0, 0]) == float(np.float16(np.float32(1.27) / 127))
    ([127, -50, 0], True)
    """
    x32 = np.asarray(x).astype(np.float32)
    m, k = x32.shape
    if k % QBLOCK:
        raise ValueError(f"quantize_q8_0: K = {k} is not a multiple of {QBLOCK}")
    b = x32.reshape(m, k // QBLOCK, QBLOCK)
    dx = (np.abs(b).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, np.float32(1)),
                       np.float32(0)).astype(np.float32)
    prod = (b * inv[..., None]).astype(np.float32)  # one float32 multiply, as the kernel
    xq = np.rint(prod).astype(np.int8).reshape(m, k)
    return xq, dx.astype(np.float16).astype(np.float32)


def q8_0_te(x: te.Tensor) -> tuple[te.Tensor, te.Tensor]:
    """The TE stages of :func:`quantize_q8_0` (``xq`` ``(M, K)`` int8, ``xd`` ``(M, K / 32)``
    float32): ``xamax`` the block maxima, ``xid`` the inverse scales, then the two results;
    the same float32 operations, so the same bits."""
    m, k = x.shape
    f32 = "float32"
    rj = te.reduce_axis((0, QBLOCK), name="jq")
    amax = te.compute((m, k // QBLOCK),
                      lambda i, b: te.max(tirx.abs(x[i, b * QBLOCK + rj]), axis=rj), name="xamax")

    def inv(i, b):
        dx = amax[i, b] / tirx.const(127.0, f32)
        return tirx.if_then_else(dx != tirx.const(0.0, f32), tirx.const(1.0, f32) / dx,
                                 tirx.const(0.0, f32))

    xid = te.compute((m, k // QBLOCK), inv, name="xid")
    xq = te.compute((m, k), lambda i, kk: tirx.round(x[i, kk] * xid[i, kk // QBLOCK])
                    .astype("int8"), name="xq")
    xd = te.compute((m, k // QBLOCK),
                    lambda i, b: (amax[i, b] / tirx.const(127.0, f32)).astype("float16")
                    .astype(f32), name="xd")
    return xq, xd


def check_q8_0_k(shape, opname: str) -> None:
    """Refuse a static K that is not whole q8_0 blocks (``activations="q8_0"``)."""
    k = shape[1]
    if isinstance(k, tirx.IntImm):
        k = int(k.value)
    if isinstance(k, int) and k % QBLOCK:
        raise ValueError(
            f"op {opname!r}: argument 'x' has K = {k} (its last axis), not a multiple of "
            f"{QBLOCK}: activations='q8_0' quantizes x in blocks of {QBLOCK} along K; pad K "
            "(x and the weight with zeros) to a multiple of 32, or use activations='float32'")


def q8_0_error(terms: np.ndarray, bias: np.ndarray | None, blocks: int, u: float) -> np.ndarray:
    """Bound on a q8_0 kernel's float error, from ``terms`` = ``sum_b |isum_b * scale_b|``
    (exact, float64) over ``blocks`` blocks: each term is the exact int32 block sum times a
    product of two scales (one rounding) converted exactly and multiplied (one rounding); the
    ``blocks`` terms are summed in float32 in any order (``blocks - 1`` roundings deep), and
    the bias add is one more: ``gamma_(blocks + 2) * (terms + |bias|)``. (dense_w8 scales by
    ``w_scale`` after the sum instead: the same count.)"""
    mag = terms if bias is None else terms + np.abs(bias)
    return gamma(blocks + 2, u) * mag


def _check(shapes, attrs, opname: str) -> None:
    if attrs.get("activations") == "q8_0":
        check_q8_0_k(shapes["x"], opname)


def _reference(x, w, w_scale, bias=None, *, activation="none", activations="float32"):
    if activations == "q8_0":
        y = _q8_0_sums(x, w) * w_scale
    else:
        y = (x @ w.astype(np.float64).T) * w_scale
    if bias is not None:
        y = y + bias
    return activation_reference(y, activation)


def _q8_0_blocks(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact int64 block sums ``isum`` ``(M, N, K / 32)`` and the scales ``dx16`` (float64)."""
    xq, d16 = quantize_q8_0(x)
    m, k = xq.shape
    xb = xq.astype(np.int64).reshape(m, k // QBLOCK, QBLOCK)
    wb = np.asarray(w).astype(np.int64).reshape(-1, k // QBLOCK, QBLOCK)
    isum = np.einsum("mgj,ngj->mng", xb, wb)
    return isum, d16.astype(np.float64)


def _q8_0_sums(x: np.ndarray, w: np.ndarray, absolute: bool = False) -> np.ndarray:
    isum, d16 = _q8_0_blocks(x, w)
    if absolute:
        isum = np.abs(isum)
    return np.einsum("mng,mg->mn", isum.astype(np.float64), d16)


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    """float32 dot product of length K (exact int8 -> float32 weights), then the scale
    multiply and the bias add: gamma_(K+2) of the sum of |x w s| + |bias|."""
    x, w, s, b = (m.inputs[k] for k in ("x", "w", "w_scale", "bias"))
    q8 = m.attrs.get("activations", "float32") == "q8_0"
    if q8:  # the integer block sums are exact: only the float sum over blocks rounds
        e = q8_0_error(_q8_0_sums(x, w, absolute=True) * np.abs(s), b,
                       x.shape[-1] // QBLOCK, m.u)
    else:
        mag = np.abs(x) @ (np.abs(w) * np.abs(s)[:, None]).T
        if b is not None:
            mag = mag + np.abs(b)
        e = gamma(x.shape[-1] + 2, m.u) * mag
    act = m.attrs["activation"]
    if act in ("none", "relu"):
        return e
    pre = _reference(x, w, s, b, activation="none", activations=m.attrs.get("activations",
                                                                             "float32"))
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
    layouts={"float32": {"activations": "float32"}, "q8_0": {"activations": "q8_0"}},
    check=lambda shapes, dtypes, attrs: _check(shapes, attrs, "dense_w8"),
    dim_multiples={1: lambda attrs: QBLOCK if attrs.get("activations") == "q8_0" else 1},
    kind="dense",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "w_scale", "bias"),
    examples=[(4, 64)],
)
def dense_w8(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    activation: WeightActivation = "none",
    activations: WeightActivations = "float32",
) -> te.Tensor:
    """Weight-only int8 dense ``act(x @ (w * w_scale[:, None]).T + bias)`` (x: ``(M, K)``
    float32, w: ``(N, K)`` int8, w_scale: ``(N,)`` float32 per output channel).
    ``activations="q8_0"``: x quantized to int8 per 32-block first, integer block sums (K a
    multiple of 32; see the module)."""
    m, k = x.shape
    n = w.shape[0]
    if activations == "q8_0":
        check_q8_0_k(x.shape, "dense_w8")
        xq, xd = q8_0_te(x)
        rj = te.reduce_axis((0, QBLOCK), name="j")
        isum = te.compute(
            (m, n, k // QBLOCK),
            lambda i, j, b: te.sum(xq[i, b * QBLOCK + rj].astype("int32")
                                   * w[j, b * QBLOCK + rj].astype("int32"), axis=rj),
            name="isum")
        rb = te.reduce_axis((0, k // QBLOCK), name="b")
        acc = te.compute(
            (m, n), lambda i, j: te.sum(isum[i, j, rb].astype("float32") * xd[i, rb], axis=rb),
            name="acc")
    else:
        rk = te.reduce_axis((0, k), name="k")
        acc = te.compute(
            (m, n), lambda i, j: te.sum(x[i, rk] * w[j, rk].astype("float32"), axis=rk),
            name="acc"
        )

    def body(i, j):
        v = acc[i, j] * w_scale[j]
        if bias is not None:
            v = v + bias[j]
        return activation_te(v, activation)

    attrs = {"activation": activation, "has_bias": bias is not None, "activations": activations}
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
                # (1, N) reads as a per-feature (N,) through a reshape (not yet typed): the
                # dtype is the matched operand's
                bias = param_of(m[bias_pat], (shp[-1],))
                if bias is None or str(m[bias_pat].ty.dtype) != "float32":
                    return None
            numerics = str(call_attr(call, "activations", "float32"))
            return d(m[x], m[w], m[s], bias, activation=act, activations=numerics)

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
