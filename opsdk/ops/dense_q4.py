"""``dense_q4``: float32 activations times ggml ``q4_0`` group-wise int4 weights.

Weights come in groups of 32 along K, each with its own scale ``d[n, g]`` (float16, as ggml
stores it, or float32). Within group ``g`` of row ``n``, byte ``j`` (0..15) of the group's 16
bytes in ``qs[n, 16 g : 16 g + 16]`` holds weight ``32 g + j`` in its low nibble and weight
``32 g + j + 16`` in its high nibble; a weight is ``d[n, g] * (nibble - 8)``. That is ggml's
``block_q4_0`` (an fp16 ``d`` followed by 16 bytes ``qs``) with the two fields split into two
arrays (:func:`q4_0_from_blocks` takes a GGUF tensor's bytes apart without changing one).

``y[m, n] = act(sum_g float32(d[n, g]) * (sum_{j<32} x[m, 32 g + j] * (q[n, 32 g + j] - 8))
+ bias[n])``

A dequantized weight ``d * (q - 8)`` is exact in float32 (an 11-bit fp16 significand times a
4-bit integer), so the kernel rounds only in its float32 sums, the group-scale multiply and
the bias add: a group's sum of 32 products, one multiply, the sum over the ``K / 32`` groups
and the bias add are ``K / 32 + 34 <= K + 2`` roundings deep, so the error model is the
dot-product bound ``gamma_(K+2) * (sum_k |x| |w_dequant| + |bias|)`` for any order of the
sums (the same bound holds for a kernel that dequantizes first and runs one float32 dot
product of length K), then the activation's (as :mod:`.dense_w8`).

``activations="q8_0"`` is llama.cpp's ``q4_0 x q8_0`` numerics: ``x`` quantized per row and
32-block to int8 with a float16-rounded scale ``dx16[m, g]``
(:func:`~opsdk.ops.dense_w8.quantize_q8_0`, bit for bit), the block sums exact in int32,
``isum[m, n, g] = sum_j xq * (nibble - 8)``, and
``y = act(sum_g isum[m, n, g] * (float32(d[n, g]) * dx16[m, g]) + bias[n])``. The reference
repeats the quantization's float32 / float16 steps exactly and sums the integers exactly; the
error model covers the float part only: per block the scale product and the term product
(one rounding each), the sum over the ``K / 32`` blocks and the bias add,
``gamma_(K/32 + 2) * (sum_g |isum| |d| dx16 + |bias|)``, then the activation's.

The compute below is the definition (and the generic lowering); the rules in
:mod:`opsdk.schedules._wgemm` rebuild it from the attributes the output block records under
:data:`ATTRS_KEY`.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._domains import log_uniform
from .._errmodel import ModelInput, error_model, gamma
from .._opdef import Tensor
from .dense_w8 import (
    ACTIVATIONS,
    WeightActivation,
    WeightActivations,
    activation_error,
    activation_reference,
    epilogue_fusions,
    q8_0_error,
    q8_0_te,
    quantize_q8_0,
)
from .dense_w8 import activation_te as _activation_te

__all__ = [
    "ATTRS_KEY",
    "GROUP",
    "dense_q4",
    "dequantize_q4_0",
    "q4_0_from_blocks",
    "q4_0_ints",
    "quantize_q4_0",
]

#: Annotation on the output block holding the attributes (``activation``, ``has_bias``).
ATTRS_KEY = "opsdk.dense_q4"
#: Weights per q4_0 group (ggml's QK4_0).
GROUP = 32


def _k_of(shape, opname: str = "dense_q4") -> int | None:
    """K of ``x``'s shape when static, after checking it is whole groups."""
    k = shape[1]
    if isinstance(k, tirx.IntImm):
        k = int(k.value)
    if not isinstance(k, int):
        return None  # symbolic: checked when the kernel runs on it (the rule needs it static)
    if k % GROUP:
        raise ValueError(
            f"op {opname!r}: argument 'x' has K = {k} (its last axis), not a multiple of "
            f"{GROUP}: q4_0 weights come in whole groups of {GROUP}; pad K (x with zeros, "
            "the weight rows with zero groups) to a multiple of 32, or use dense_w8"
        )
    return k


def _input_shapes(s, a):
    k = _k_of(s)
    kk = s[1] if k is None else k
    return {"qs": ("N", kk // 2), "d": ("N", kk // GROUP), "bias": ("N",)}


def dequantize_q4_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The float32 weights ``(N, K)`` of q4_0 ``qs`` ``(N, K / 2)`` uint8 and ``d``
    ``(N, K / 32)`` (float16 or float32): exact (no rounding).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.ops.dense_q4 import dequantize_q4_0
    >>> qs = np.array([[0x8F] + [0x88] * 15], "uint8")  # w0 = 15 - 8, w16 = 8 - 8
    >>> w = dequantize_q4_0(qs, np.array([[0.5]], "float16"))
    >>> w.shape, float(w[0, 0]), float(w[0, 16]), float(w[0, 1])
    ((1, 32), 3.5, 0.0, 0.0)
    """
    qs = np.asarray(qs, dtype=np.uint8)
    n, half = qs.shape
    g = half // 16
    b = qs.reshape(n, g, 16)
    q = np.concatenate([b & 15, b >> 4], axis=2).astype(np.int8) - np.int8(8)  # (n, g, 32)
    dd = np.asarray(d).astype(np.float32).reshape(n, g, 1)
    return (q.astype(np.float32) * dd).reshape(n, g * GROUP)


def quantize_q4_0(w_float: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q4_0_ref`` on each row of a ``(N, K)`` float weight (K a multiple
    of 32): returns ``(qs, d)`` for :func:`dense_q4`, ``qs`` ``(N, K / 2)`` uint8 and ``d``
    ``(N, K / 32)`` float16, byte for byte what ggml writes.

    Per group of 32: ``max`` is the value of largest magnitude (sign kept, the first one on a
    tie), ``d = max / -8``, ``id = 1 / d`` (0 when d is 0), ``q = min(15, int8(x * id + 8.5))``
    in float32 (truncation toward zero), ``d`` stored as float16.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.ops.dense_q4 import quantize_q4_0
    >>> w = np.zeros((1, 32), "float32"); w[0, 0] = -4.0; w[0, 1] = 2.0; w[0, 17] = 1.0
    >>> qs, d = quantize_q4_0(w)
    >>> float(d[0, 0]), hex(qs[0, 0]), hex(qs[0, 1]), hex(qs[0, 2])
    (0.5, '0x80', '0xac', '0x88')
    """
    w = np.asarray(w_float, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantize_q4_0: w_float has shape {w.shape}; pass a (N, K) matrix "
                         f"with K a multiple of {GROUP}")
    n, k = w.shape
    b = w.reshape(n, k // GROUP, GROUP)
    pick = np.argmax(np.abs(b), axis=2)  # the first of equal magnitudes, as ggml's '>'
    mx = np.take_along_axis(b, pick[..., None], axis=2)[..., 0]
    d = (mx / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)),
                       np.float32(0)).astype(np.float32)
    v = b * inv[..., None] + np.float32(8.5)  # float32 arithmetic, as the C code
    q = np.minimum(np.float32(15), np.trunc(v)).astype(np.uint8)  # (int8_t) truncates
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8).reshape(n, k // 2)
    return qs, d.astype(np.float16)


def q4_0_from_blocks(raw: np.ndarray | bytes, rows: int | None = None) -> tuple[np.ndarray,
                                                                                np.ndarray]:
    """``(qs, d)`` of a GGUF / ggml q4_0 tensor's raw bytes: ``rows x (K / 32)`` blocks of
    18 bytes (float16 ``d``, then 16 bytes ``qs``), as views of ``raw`` (no byte changes).

    ``raw`` is a uint8 array of shape ``(rows, K / 32 * 18)`` or ``(rows, K / 32, 18)`` (what
    the ``gguf`` package's reader gives), or flat bytes with ``rows`` given. ``d`` is returned
    as a float16 view ``(rows, K / 32)`` (little-endian, as GGUF stores it) and ``qs`` as
    ``(rows, K / 2)`` uint8; ``qs`` is a copy only where the blocks' layout makes a strided
    view impossible to reshape (the bytes are the same).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.ops.dense_q4 import q4_0_from_blocks, quantize_q4_0
    >>> w = np.linspace(-1, 1, 64, dtype="float32").reshape(1, 64)
    >>> qs, d = quantize_q4_0(w)
    >>> blocks = np.concatenate([d.reshape(1, 2, 1).view("uint8"), qs.reshape(1, 2, 16)], 2)
    >>> qs2, d2 = q4_0_from_blocks(blocks.reshape(1, 36))
    >>> bool((qs2 == qs).all() and (d2 == d).all())
    True
    """
    a = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) \
        else np.asarray(raw)
    if a.dtype != np.uint8:
        raise ValueError(f"q4_0_from_blocks: raw has dtype {a.dtype}; pass the tensor's bytes "
                         "as uint8")
    if rows is None:
        if a.ndim < 2:
            raise ValueError("q4_0_from_blocks: flat bytes need rows=")
        rows = a.shape[0]
    if a.size % (rows * 18):
        raise ValueError(f"q4_0_from_blocks: {a.size} bytes are not {rows} rows of whole "
                         "18-byte q4_0 blocks")
    blocks = a.reshape(rows, a.size // (rows * 18), 18)
    d = np.ascontiguousarray(blocks[:, :, :2]).view("<f2").reshape(rows, -1)
    qs = blocks[:, :, 2:].reshape(rows, -1)
    return qs, d


def q4_0_ints(qs: np.ndarray) -> np.ndarray:
    """The int4 weights ``nibble - 8`` ``(N, K)`` (int8) of q4_0 bytes ``qs`` ``(N, K / 2)``."""
    qs = np.asarray(qs, dtype=np.uint8)
    n, half = qs.shape
    b = qs.reshape(n, half // 16, 16)
    return (np.concatenate([b & 15, b >> 4], axis=2).astype(np.int8) - np.int8(8)).reshape(
        n, half * 2)


def _q8_0_terms(x, qs, d, absolute: bool = False) -> np.ndarray:
    """``sum_g isum * d * dx16`` in float64 (exact: int64 block sums; fp16 x fp16 scales are
    exact in float64, float32 ones nearly), or of ``|isum|`` with ``absolute``."""
    xq, d16 = quantize_q8_0(x)
    m, k = xq.shape
    g = k // GROUP
    xb = xq.astype(np.int64).reshape(m, g, GROUP)
    wb = q4_0_ints(qs).astype(np.int64).reshape(-1, g, GROUP)
    isum = np.einsum("mgj,ngj->mng", xb, wb).astype(np.float64)
    scale = np.asarray(d).astype(np.float64)[None, :, :] * d16.astype(np.float64)[:, None, :]
    if absolute:
        isum, scale = np.abs(isum), np.abs(scale)
    return (isum * scale).sum(axis=2)


def _reference(x, qs, d, bias=None, *, activation="none", activations="float32"):
    if activations == "q8_0":
        y = _q8_0_terms(x, qs, d)
    else:
        w = dequantize_q4_0(qs.astype(np.uint8), d).astype(np.float64)
        y = x @ w.T
    if bias is not None:
        y = y + bias
    return activation_reference(y, activation)


@error_model(_reference)  # keyed by the reference: variants (same math) share it
def _error(m: ModelInput) -> np.ndarray:
    """float32 sums over K exact dequantized weights (in groups or not), the group-scale
    multiply and the bias add: gamma_(K+2) of the sum of |x w| + |bias|."""
    x, qs, d, b = (m.inputs[k] for k in ("x", "qs", "d", "bias"))
    numerics = m.attrs.get("activations", "float32")
    if numerics == "q8_0":  # exact integer block sums: only the float sum over blocks rounds
        e = q8_0_error(_q8_0_terms(x, qs, d, absolute=True), b, x.shape[-1] // GROUP, m.u)
    else:
        w = dequantize_q4_0(qs.astype(np.uint8), d).astype(np.float64)
        mag = np.abs(x) @ np.abs(w).T
        if b is not None:
            mag = mag + np.abs(b)
        e = gamma(x.shape[-1] + 2, m.u) * mag
    act = m.attrs["activation"]
    if act in ("none", "relu"):
        return e
    pre = _reference(x, qs, d, b, activation="none", activations=numerics)
    return activation_error(pre, e, act, m.u)


def _check(shapes, dtypes, attrs):
    _k_of(shapes["x"])


@op(
    reference=_reference,
    dtypes={"x": ("float32",), "qs": ("uint8",), "d": ("float16", "float32"),
            "bias": ("float32",)},
    ranks=(2, 2),
    free_dims={"N": (1, 64)},
    input_shapes=_input_shapes,
    check=_check,
    dim_multiples={1: GROUP},
    # Nibbles over the whole byte range; group scales as quantize_q4_0 makes them for weights
    # of magnitude ~1e-3..1 (amax / 8).
    domain={
        "x": (-2.0, 2.0),
        "qs": (0, 255),
        "d": log_uniform(1e-4, 1e-1),
        "bias": (-1.0, 1.0),
    },
    attr_domain={"activation": list(ACTIVATIONS)},
    layouts={"float32": {"activations": "float32"}, "q8_0": {"activations": "q8_0"}},
    kind="dense",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("qs", "d", "bias"),
    examples=[(4, 64)],
)
def dense_q4(
    x: Tensor,
    qs: Tensor,
    d: Tensor,
    bias: Tensor | None = None,
    *,
    activation: WeightActivation = "none",
    activations: WeightActivations = "float32",
) -> te.Tensor:
    """ggml q4_0 weight-only dense ``act(x @ dequant(qs, d).T + bias)`` (x: ``(M, K)`` float32,
    K a multiple of 32; qs: ``(N, K / 2)`` uint8; d: ``(N, K / 32)`` float16 / float32).
    ``activations="q8_0"``: x quantized to int8 per 32-block first (ggml q8_0, nearbyint),
    integer block sums (see the module)."""
    m, k = x.shape
    n = qs.shape[0]
    rg = te.reduce_axis((0, k // GROUP), name="g")
    rj = te.reduce_axis((0, GROUP), name="j")

    def weight(j, kk, dtype="float32"):  # the int4 value (nibble - 8)
        g, e = kk // GROUP, kk % GROUP
        byte = qs[j, g * 16 + e % 16].astype("int32")
        nib = tirx.bitwise_and(tirx.shift_right(byte, ((e // 16) * 4).astype("int32")), 15)
        return (nib - 8).astype(dtype)

    if activations == "q8_0":
        xq, xd = q8_0_te(x)
        isum = te.compute(
            (m, n, k // GROUP),
            lambda i, j, g: te.sum(xq[i, g * GROUP + rj].astype("int32")
                                   * weight(j, g * GROUP + rj, "int32"), axis=rj),
            name="isum",
        )
        acc = te.compute(
            (m, n), lambda i, j: te.sum(
                isum[i, j, rg].astype("float32") * (d[j, rg].astype("float32") * xd[i, rg]),
                axis=rg),
            name="acc",
        )
    else:
        part = te.compute(
            (m, n, k // GROUP),
            lambda i, j, g: te.sum(x[i, g * GROUP + rj] * weight(j, g * GROUP + rj), axis=rj),
            name="part",
        )
        acc = te.compute(
            (m, n), lambda i, j: te.sum(part[i, j, rg] * d[j, rg].astype("float32"), axis=rg),
            name="acc",
        )

    def body(i, j):
        v = acc[i, j] if bias is None else acc[i, j] + bias[j]
        return _activation_te(v, activation)

    attrs = {"activation": activation, "has_bias": bias is not None, "activations": activations}
    return te.compute((m, n), body, name="dense_q4", attrs={ATTRS_KEY: attrs})


dense_q4.fusion()(epilogue_fusions(dense_q4))
