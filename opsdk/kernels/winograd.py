"""``tvm_conv2d_winograd``: a 3x3, stride-1 conv2d as Winograd F(2x2, 3x3), and the choice of
that algorithm for TVM's ``conv2d`` in the model pipeline.

A direct 3x3 convolution spends 9 multiply-adds per output and input channel. Winograd's
minimal filtering algorithm F(2x2, 3x3) computes a 2x2 output tile from a 4x4 input tile with
16, a 2.25x cut (Lavin & Gray, 2016)::
    U = G g G^T                     (weights, 4x4 per (input, output) channel pair)
    V = B^T d B                     (each 4x4 input tile, per input channel)
    M[e] = V[e] @ U[e]              (16 independent GEMMs over the input channels)
    Y = A^T M A                     (each 2x2 output tile, per output channel)

``winograd_conv2d`` writes these four stages as TE blocks tagged ``opsdk.winograd`` (``weight``,
``input``, ``gemm``, ``output``); the ``kind:winograd`` rules schedule them as one kernel (the
weight transform is packed and folded at compile time when the weights are constants).
``legalize_conv2d`` is the pipeline's choice of it for ``relax.nn.conv2d``: NHWC / HWIO,
3x3, stride 1, no dilation, one group, float32, static channels and spatial size, and enough
channels for the GEMMs to pay (:data:`MIN_CHANNELS`); everything else keeps TVM's direct
convolution.

The transforms have coefficients 0, +-1/2 and +-1 only: every product with them is exact, so
the whole computation rounds like a sum of at most ``C + 21`` terms per output, and the error
model bounds it with the absolute values of the same four stages (:func:`winograd_abs`).
F(4x4, 3x3) (another 1.8x fewer multiplies) was measured and not adopted: with one-stage
transforms it was slower here (64 -> 64 channels at 56x56, 2 threads: 0.62 ms against 0.57
ms) and its coefficients (up to 8 and 1/24) made the error 7x the direct convolution's.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import tvm
from tvm import te, tirx

from .._declare import op
from .._errmodel import error_model
from .._opdef import Tensor
from ._epilogue import (
    ACTIVATIONS,
    Activation,
    epilogue_abs,
    epilogue_error,
    epilogue_np,
    epilogue_te,
    gamma,
    static_int,
)
from .conv2d import _conv_np, pads4

__all__ = [
    "MIN_CHANNELS",
    "TAG",
    "WINOGRAD_TAG",
    "legalize_conv2d",
    "tvm_conv2d_winograd",
    "winograd_abs",
    "winograd_conv2d",
    "winograd_eligible",
]

#: The block annotation naming each stage (``weight``, ``input``, ``gemm``, ``output``): how
#: the schedule rules (:func:`opsdk.schedules.classify`) recognize a Winograd conv.
WINOGRAD_TAG = TAG = "opsdk.winograd"

#: Output tile size ``m`` of F(m x m, 3 x 3) and the input tile ``alpha = m + 2``.
M, ALPHA = 2, 4
_H = Fraction(1, 2)
#: F(2x2, 3x3) (Lavin & Gray): input transform B^T, weight transform G, output transform A^T.
BT = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))
G = ((1, 0, 0), (_H, _H, _H), (_H, -_H, _H), (0, 0, 1))
AT = ((1, 1, 1, 0), (0, 1, -1, -1))

#: Fewest input and output channels for which the pipeline picks Winograd over the direct
#: conv: its 16 GEMMs reduce over the input channels. Measured (NHWC 56x56, 2 threads, the
#: direct conv at 170-220 GFLOPS): 16 -> 16 1.25x, 32 -> 64 1.47x, 64 -> 64 1.82x faster.
MIN_CHANNELS = 16

#: Rounding steps along one term of an output beyond the C products and adds of the GEMM:
#: 9 in the weight transform (one scaling, eight adds), 3 in the input transform, 8 in the
#: output transform and 1 for the accumulator's zero start.
EXTRA_ROUNDINGS = 21


def _linear(terms: list[tuple[Fraction | int, tirx.PrimExpr]], dtype: str) -> tirx.PrimExpr:
    """``sum coef * e`` over the non-zero coefficients (a +-1 coefficient is an add / sub)."""
    out = None
    for coef, e in terms:
        if coef == 0:
            continue
        term = e if coef in (1, -1) else e * tirx.const(float(coef), dtype)
        if out is None:
            out = -term if coef == -1 else term
        else:
            out = out - term if coef == -1 else out + term
    return out if out is not None else tirx.const(0.0, dtype)


def _table(index: tirx.PrimExpr, exprs: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """``exprs[index]`` as a chain of ``if_then_else``: once a rule unrolls the loop over
    ``index``, every condition is a constant and only the one expression is left.

    Not ``Select``: a vectorized loop inside the unrolled one turns a select's condition
    into a vector (``Broadcast(e == 3)``), which TIR's simplifier does not fold after the
    unroll, so every unrolled copy kept all sixteen cases through the late TIR passes (0.2-0.3 s
    more per kernel); ``if_then_else`` keeps its condition scalar, and it folds."""
    out = exprs[-1]
    for i in range(len(exprs) - 2, -1, -1):
        out = tirx.if_then_else(index == i, exprs[i], out)
    return out


def _pads(padding: Any) -> tuple[int, int, int, int]:
    p = [int(v) for v in (padding if isinstance(padding, (list, tuple)) else [padding])]
    if len(p) == 1:
        p = p * 4
    elif len(p) == 2:
        p = p * 2
    return p[0], p[1], p[2], p[3]  # top, left, bottom, right


def winograd_conv2d(x: te.Tensor, w: te.Tensor, padding: Any = 1) -> te.Tensor:
    """3x3, stride-1 convolution of NHWC ``x`` with HWIO ``w`` by Winograd F(2x2, 3x3).

    ``padding`` is one int, ``(top/bottom, left/right)`` or ``(top, left, bottom, right)``.
    The batch may be symbolic; the spatial size and channels must be static.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.kernels.winograd import winograd_conv2d
    >>> x, w = te.placeholder((1, 6, 6, 8), name="x"), te.placeholder((3, 3, 8, 4), name="w")
    >>> [int(d) for d in winograd_conv2d(x, w, 1).shape]
    [1, 6, 6, 4]
    """
    top, left, bottom, right = _pads(padding)
    n, h, wd, c = x.shape
    k = w.shape[3]
    hs, ws = int(h), int(wd)
    oh, ow = hs + top + bottom - 2, ws + left + right - 2
    th, tw = -(-oh // M), -(-ow // M)
    dt = x.dtype
    pairs = [(a, b) for a in range(ALPHA) for b in range(ALPHA)]

    def weight(e, ci, co):
        return _table(e, [_linear([(G[a][i] * G[b][j], w[i, j, ci, co])
                                   for i in range(3) for j in range(3)], dt) for a, b in pairs])

    u = te.compute((ALPHA * ALPHA, c, k), weight, name="wino_weight", attrs={TAG: "weight"})

    def tile(b, r, s, ci):
        # a zero outside the input: the padding, and the bottom / right rows of a last tile
        # that reaches past it
        return tirx.if_then_else(tirx.all(r >= 0, r < hs, s >= 0, s < ws), x[b, r, s, ci],
                                 tirx.const(0.0, dt))

    def transform_input(e, b, ty, tx, ci):
        r0, s0 = ty * M - top, tx * M - left
        return _table(e, [_linear([(BT[a][i] * BT[bb][j], tile(b, r0 + i, s0 + j, ci))
                                   for i in range(ALPHA) for j in range(ALPHA)], dt)
                          for a, bb in pairs])

    v = te.compute((ALPHA * ALPHA, n, th, tw, c), transform_input, name="wino_input",
                   attrs={TAG: "input"})
    rc = te.reduce_axis((0, c), name="rc")
    mm = te.compute((ALPHA * ALPHA, n, th, tw, k),
                    lambda e, b, ty, tx, co: te.sum(v[e, b, ty, tx, rc] * u[e, rc, co], axis=rc),
                    name="wino_gemm", attrs={TAG: "gemm"})

    def transform_output(b, r, s, co):
        ty, tx = r // M, s // M
        outs = [_linear([(AT[i][a] * AT[j][bb], mm[a * ALPHA + bb, b, ty, tx, co])
                         for a, bb in pairs], dt) for i in range(M) for j in range(M)]
        return _table((r % M) * M + s % M, outs)

    return te.compute((n, oh, ow, k), transform_output, name="wino_output",
                      attrs={TAG: "output"})


def winograd_abs(x: np.ndarray, w: np.ndarray, padding: Any = 1) -> np.ndarray:
    """``|A^T| (sum_c (|G| |g| |G^T|) * (|B^T| |d| |B|)) |A|`` per output, in float64: the
    magnitudes every rounding of :func:`winograd_conv2d` is relative to (NHWC / HWIO)."""
    top, left, bottom, right = _pads(padding)
    nb, hs, ws, _ = x.shape
    oh, ow = hs + top + bottom - 2, ws + left + right - 2
    th, tw = -(-oh // M), -(-ow // M)
    bt, g, at = (np.abs(np.array(mat, dtype=np.float64)) for mat in (BT, G, AT))
    xp = np.pad(np.abs(x), ((0, 0), (top, th * M + 2 - hs - top),
                            (left, tw * M + 2 - ws - left), (0, 0)))
    ii = (np.arange(th) * M)[:, None] + np.arange(ALPHA)  # (th, alpha) rows of each tile
    jj = (np.arange(tw) * M)[:, None] + np.arange(ALPHA)
    d = xp[:, ii[:, None, :, None], jj[None, :, None, :], :]  # n, th, tw, alpha, alpha, c
    v = np.einsum("ai,ntwijc,bj->ntwabc", bt, d, bt)
    u = np.einsum("ai,ijck,bj->abck", g, np.abs(w), g)
    m = np.einsum("ntwabc,abck->ntwabk", v, u)
    y = np.einsum("ra,ntwabk,sb->ntrwsk", at, m, at).reshape(nb, th * M, tw * M, -1)
    return y[:, :oh, :ow]


# ------------------------------------------------------------------ the kernel family
def _reference(x, w, bias=None, residual=None, *, channels=16, padding=1, pad_left=-1,
               pad_bottom=-1, pad_right=-1, activation="relu"):
    pads = pads4(padding, pad_left, pad_bottom, pad_right)
    y = np.moveaxis(_conv_np(np.moveaxis(x, -1, 1), np.transpose(w, (3, 2, 0, 1)), 1, pads,
                             1), 1, -1)
    return epilogue_np(y, bias, residual, activation, (1, 1, 1, -1))


def _pads_of(a) -> tuple[int, int, int, int]:
    return pads4(a["padding"], a.get("pad_left", -1), a.get("pad_bottom", -1),
                 a.get("pad_right", -1))


def _input_shapes(s, a):
    c, o = s[3], a["channels"]
    top, left, bottom, right = _pads_of(a)
    hs, ws = static_int(s[1]), static_int(s[2])
    oh, ow = ((hs + top + bottom - 2, ws + left + right - 2)
              if hs is not None and ws is not None else (s[1], s[2]))
    return {"w": (3, 3, c, o), "bias": (o,), "residual": (s[0], oh, ow, o)}


def _check(shapes, dtypes, attrs):
    _, h, w, c = (static_int(d) for d in shapes["x"])
    for name, d in (("channels", c), ("height", h), ("width", w)):
        if d is None:
            raise ValueError(f"argument 'x' has a symbolic {name}; the Winograd kernel needs "
                             "static channels and spatial sizes (only the batch may be symbolic)")
    if attrs["padding"] < 0 or attrs["channels"] < 1:
        raise ValueError("argument 'channels' must be >= 1 and 'padding' >= 0")
    if min(attrs["pad_left"], attrs["pad_bottom"], attrs["pad_right"]) < -1:
        raise ValueError("arguments 'pad_left', 'pad_bottom', 'pad_right' must be >= 0, or "
                         "-1 for 'padding'")
    top, left, bottom, right = _pads_of(attrs)
    if h + top + bottom < 3 or w + left + right < 3:
        raise ValueError(f"argument 'x' is {h}x{w}, smaller than the 3x3 window with padding "
                         f"{(top, left, bottom, right)}; pass a larger input or more padding")


def _error(m) -> np.ndarray:
    """Every output is a float32 sum of ``C`` products of transformed values, each transform a
    short sum with exact coefficients: ``gamma(C + 21)`` of the four stages in absolute value
    (:func:`winograd_abs`), then the bias and residual adds."""
    x, w = m.inputs["x"], m.inputs["w"]
    s = winograd_abs(x, w, _pads_of(m.attrs))
    k = x.shape[-1] + EXTRA_ROUNDINGS
    return epilogue_error(m, gamma(k + 2, m.u) * (s + epilogue_abs(m, (1, 1, 1, -1))))


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    input_shapes=_input_shapes,
    check=_check,
    layouts={"NHWC": {}},
    domain={"x": (-2.0, 2.0), "w": (-1.0, 1.0), "bias": (-1.0, 1.0), "residual": (-2.0, 2.0)},
    # Output channels around the vector widths and tile widths; padding 0 leaves odd output
    # sizes (a last tile half outside), 2 a tile that reads only padding; the sides apart
    # (top, left, bottom, right: relax's 4-value padding, uneven for TF-style SAME).
    attr_domain={
        "channels": [16, 24, 7, 33, 64, 1],
        "padding": [1, 0, 2],
        "pad_left": [-1, 0, 2],
        "pad_bottom": [-1, 0, 2],
        "pad_right": [-1, 0, 1],
        "activation": list(ACTIVATIONS),
    },
    kind="winograd",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "bias"),
    examples=[(2, 8, 8, 4)],
)
def tvm_conv2d_winograd(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    channels: int = 16,
    padding: int = 1,
    pad_left: int = -1,
    pad_bottom: int = -1,
    pad_right: int = -1,
    activation: Activation = "relu",
) -> te.Tensor:
    """``act(conv2d(x, w) + bias + residual)``, 3x3 stride 1 NHWC, by Winograd F(2x2, 3x3):
    what the model pipeline legalizes an eligible conv2d to, with FuseOps' epilogue. Padding
    ``(padding, pad_left, pad_bottom, pad_right)`` (top, left, bottom, right; -1 is
    ``padding``), as :func:`legalize_conv2d` passes relax's four values."""
    y = winograd_conv2d(x, w, list(pads4(padding, pad_left, pad_bottom, pad_right)))
    return epilogue_te(y, bias, residual, activation, lambda i: i[3])


error_model(tvm_conv2d_winograd)(_error)


# ------------------------------------------------------------------ the pipeline's choice
def winograd_eligible(call: Any) -> bool:
    """Whether the pipeline computes this ``relax.nn.conv2d`` call by Winograd: NHWC data,
    HWIO weights, a 3x3 window, stride 1, dilation 1, one group, float32, static channels
    (at least :data:`MIN_CHANNELS` in and out) and spatial size."""
    a = call.attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout)) != (
            "NHWC", "HWIO", "NHWC"):
        return False
    if [int(s) for s in a.strides] != [1, 1] or [int(s) for s in a.dilation] != [1, 1]:
        return False
    if int(a.groups) != 1 or str(a.out_dtype or "float32") not in ("float32", ""):
        return False
    xt, wt = call.args[0].ty, call.args[1].ty
    if str(getattr(xt, "dtype", "")) != "float32" or str(getattr(wt, "dtype", "")) != "float32":
        return False
    xs, ws = getattr(xt, "shape", None), getattr(wt, "shape", None)
    if xs is None or ws is None or len(xs) != 4 or len(ws) != 4:
        return False
    dims = [static_int(d) for d in (*xs.values[1:], *ws.values)]
    if any(d is None for d in dims):
        return False
    _, _, c, kh, kw, ci, co = dims
    return (kh, kw) == (3, 3) and ci == c and min(c, co) >= MIN_CHANNELS


def legalize_conv2d(bb: Any, call: Any) -> Any:
    """``relax.nn.conv2d`` legalization for the model pipeline: Winograd where
    :func:`winograd_eligible`, TVM's own legalization (direct convolution) elsewhere."""

    if not winograd_eligible(call):
        return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
    return bb.call_te(winograd_conv2d, call.args[0], call.args[1],
                      padding=[int(p) for p in call.attrs.padding],
                      primfunc_name_hint="conv2d_winograd")
