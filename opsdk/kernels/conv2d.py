"""``tvm_conv2d``: the kernel TVM lowers ``conv2d`` to (dense, grouped, depthwise).

``topi.nn.conv`` (what relax's conv2d legalization calls, with every attribute relax's
``conv2d`` carries: strides, 4-value padding, dilation, groups) followed by the epilogue
FuseOps appends: the bias of a folded BatchNorm, a residual add, an activation. Layouts:
``NCHW`` (weights OIHW) and ``NHWC`` (HWIO, what :class:`~opsdk.transform.ChannelsLast`
makes), each dense / grouped (``groups`` divides the input and output channels) and
depthwise (``groups`` = input channels, ``multiplier`` output channels per input channel).
Padding is ``(padding, pad_left, pad_bottom, pad_right)`` (top, left, bottom, right; -1 is
``padding``): relax hands the legalization four values, uneven for TF-style ``SAME``.

The channel count, the spatial size and the attributes are static (a model's are; each is a
separate compile); the batch may be symbolic. Scheduled by the ``kind:conv2d`` rules.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, topi

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

__all__ = ["pads4", "tvm_conv2d"]


def _nchw(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout.startswith("NCHW") else np.moveaxis(x, -1, 1)


def _oihw(w: np.ndarray, layout: str) -> np.ndarray:
    return w if layout.startswith("NCHW") else np.transpose(w, (3, 2, 0, 1))


def pads4(padding, pad_left: int = -1, pad_bottom: int = -1,
          pad_right: int = -1) -> tuple[int, int, int, int]:
    """``(top, left, bottom, right)`` of the families' padding attributes: each side that is
    -1 takes ``padding`` (a 4-tuple ``padding`` is returned as it is).

    Examples
    --------
    >>> from opsdk.kernels.conv2d import pads4
    >>> pads4(1), pads4(1, pad_bottom=2, pad_right=0), pads4((0, 1, 2, 3))
    ((1, 1, 1, 1), (1, 1, 2, 0), (0, 1, 2, 3))
    """
    if isinstance(padding, (tuple, list)):
        t, left, b, r = (int(v) for v in padding)
        return t, left, b, r
    p = int(padding)
    return (p, p if pad_left < 0 else pad_left, p if pad_bottom < 0 else pad_bottom,
            p if pad_right < 0 else pad_right)


def _conv_np(x, w, stride, padding, groups, dilation=1):
    """float64 direct convolution, NCHW x OIHW -> NCHW. ``padding`` is one int or
    ``(top, left, bottom, right)``; ``w`` has ``C / groups`` input channels and its output
    channels in ``groups`` consecutive blocks (a depthwise multiplier m: groups = C, m
    outputs per input channel)."""
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    top, left, bottom, right = pads4(padding)
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    oh = (h + top + bottom - dilation * (kh - 1) - 1) // stride + 1
    ow = (wd + left + right - dilation * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = w[g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dilation, j * dilation
                patch = xs[:, :, r0:r0 + stride * (oh - 1) + 1:stride,
                           c0:c0 + stride * (ow - 1) + 1:stride]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    return out


def _groups(layout: str, c: int, groups: int = 1) -> int:
    return c if layout.endswith("dw") else groups


def _reference(x, w, bias=None, residual=None, *, layout="NCHW", channels=16, kernel=3,
               kernel_h=-1, stride=1, padding=1, pad_left=-1, pad_bottom=-1, pad_right=-1,
               dilation=1, groups=1, multiplier=1, activation="none"):
    lay = layout
    xc = _nchw(x, lay)
    y = _conv_np(xc, _oihw(w, lay), stride, pads4(padding, pad_left, pad_bottom, pad_right),
                 _groups(lay, xc.shape[1], groups), dilation)
    if not lay.startswith("NCHW"):
        y = np.moveaxis(y, 1, -1)
    bshape = (1, -1, 1, 1) if lay.startswith("NCHW") else (1, 1, 1, -1)
    return epilogue_np(y, bias, residual, activation, bshape)


def _pads(a) -> tuple[int, int, int, int]:
    return pads4(a["padding"], a.get("pad_left", -1), a.get("pad_bottom", -1),
                 a.get("pad_right", -1))


def _dims(s, a):
    """(C, H, W) of the input and the output channel count."""
    if a["layout"].startswith("NCHW"):
        c, h, w = s[1], s[2], s[3]
    else:
        h, w, c = s[1], s[2], s[3]
    o = c * a.get("multiplier", 1) if a["layout"].endswith("dw") else a["channels"]
    return c, h, w, o


def _window(a) -> tuple[int, int]:
    """The window's rows and columns: ``kernel_h`` (-1: ``kernel``, a square) x ``kernel``."""
    kh = a.get("kernel_h", -1)
    return (a["kernel"] if kh < 0 else kh), a["kernel"]


def _span(a) -> tuple[int, int]:
    """The window's extent in input pixels, rows and columns: ``dilation * (k - 1) + 1``."""
    return tuple(a.get("dilation", 1) * (k - 1) + 1 for k in _window(a))


def _out_hw(h, w, a):
    top, left, bottom, right = _pads(a)
    (kh, kw), st = _span(a), a["stride"]
    return (h + top + bottom - kh) // st + 1, (w + left + right - kw) // st + 1


def _input_shapes(s, a):
    c, h, w, o = _dims(s, a)
    kh, k = _window(a)
    g = a.get("groups", 1)
    cg = 1 if a["layout"].endswith("dw") else (c // g if g > 1 else c)
    nchw = a["layout"].startswith("NCHW")
    wshape = (o, cg, kh, k) if nchw else (kh, k, cg, o)
    hs, ws = static_int(h), static_int(w)
    oh, ow = _out_hw(hs, ws, a) if hs is not None and ws is not None else (h, w)
    res = (s[0], o, oh, ow) if nchw else (s[0], oh, ow, o)
    return {"w": wshape, "bias": (o,), "residual": res}


def _check(shapes, dtypes, attrs):
    c, h, w, _ = (static_int(d) for d in _dims(shapes["x"], attrs))
    for name, d in (("channels", c), ("height", h), ("width", w)):
        if d is None:
            raise ValueError(f"argument 'x' has a symbolic {name}; conv kernels need static "
                             "channels and spatial sizes (only the batch may be symbolic)")
    k, st, p = attrs["kernel"], attrs["stride"], attrs["padding"]
    dil, g, m = attrs["dilation"], attrs["groups"], attrs["multiplier"]
    if min(k, st, dil, g, m, attrs["channels"]) < 1 or p < 0:
        raise ValueError("arguments 'kernel', 'stride', 'dilation', 'groups', 'multiplier', "
                         "'channels' must be >= 1 and 'padding' >= 0")
    if attrs["kernel_h"] == 0 or attrs["kernel_h"] < -1:
        raise ValueError("argument 'kernel_h' must be >= 1, or -1 for a square window of "
                         "'kernel'")
    if min(attrs["pad_left"], attrs["pad_bottom"], attrs["pad_right"]) < -1:
        raise ValueError("arguments 'pad_left', 'pad_bottom', 'pad_right' must be >= 0, or "
                         "-1 for 'padding'")
    if c % g or attrs["channels"] % g:
        raise ValueError(f"argument 'groups' is {g}, which does not divide the {c} input and "
                         f"{attrs['channels']} output channels; pick a common divisor")
    top, left, bottom, right = _pads(attrs)
    (span_h, span_w), (kh, kw) = _span(attrs), _window(attrs)
    if h + top + bottom < span_h or w + left + right < span_w:
        raise ValueError(f"argument 'x' is {h}x{w}, smaller than the {kh}x{kw} window "
                         f"(dilation {dil}) with padding {(top, left, bottom, right)}; pass a "
                         "larger input or more padding")


def _error(m) -> np.ndarray:
    """A float32 sum of K = C/groups * kh * kw products (gamma_K of the sum of |x w|; the
    padding's zeros and the dilation's gaps add no terms), then the bias and residual adds:
    the same bound as a dense layer's."""
    a = m.attrs
    x, w = m.inputs["x"], m.inputs["w"]
    s = np.abs(_reference(np.abs(x), np.abs(w), **{**a, "activation": "none"}))
    k = int(np.prod(w.shape)) // w.shape[0 if a["layout"].startswith("NCHW") else -1]
    bshape = (1, -1, 1, 1) if a["layout"].startswith("NCHW") else (1, 1, 1, -1)
    return epilogue_error(m, gamma(k + 2, m.u) * (s + epilogue_abs(m, bshape)))


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    input_shapes=_input_shapes,
    check=_check,
    # A dense layout has no depthwise multiplier; a depthwise one has groups = its input
    # channels and as many outputs as its multiplier says (``channels`` is not used).
    layouts={
        "NCHW": {"layout": "NCHW", "multiplier": 1},
        "NHWC": {"layout": "NHWC", "multiplier": 1},
        "NCHW_dw": {"layout": "NCHW_dw", "groups": 1, "channels": 16},
        "NHWC_dw": {"layout": "NHWC_dw", "groups": 1, "channels": 16},
    },
    domain={"x": (-2.0, 2.0), "w": (-1.0, 1.0), "bias": (-1.0, 1.0), "residual": (-2.0, 2.0)},
    attr_domain={
        "channels": [16, 24, 7, 33, 64, 1, 96],
        "kernel": [3, 1, 7, 5],
        # a one-row window: a conv1d runs as a conv2d over a one-row image (ChannelsLast)
        "kernel_h": [-1, 1],
        "stride": [1, 2],
        "padding": [1, 0, 3, 2],
        # with padding 0, a conv1d's equal left and right pads (1 or 2 a side)
        "pad_left": [-1, 0, 2, 1],
        "pad_bottom": [-1, 0, 2],
        "pad_right": [-1, 0, 1, 2],
        "dilation": [1, 2],
        "groups": [1, 2, 4],
        "multiplier": [1, 2, 3],
        "activation": list(ACTIVATIONS),
    },
    # groups must divide the input channels: a drawn channel count is rounded up to them
    dim_multiples={1: lambda a: a["groups"] if a["layout"] == "NCHW" else 1,
                   3: lambda a: a["groups"] if a["layout"] == "NHWC" else 1},
    kind="conv2d",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "bias"),
    examples=[(2, 4, 8, 8)],
)
def tvm_conv2d(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    layout: Literal["NCHW", "NHWC", "NCHW_dw", "NHWC_dw"] = "NCHW",
    channels: int = 16,
    kernel: int = 3,
    kernel_h: int = -1,
    stride: int = 1,
    padding: int = 1,
    pad_left: int = -1,
    pad_bottom: int = -1,
    pad_right: int = -1,
    dilation: int = 1,
    groups: int = 1,
    multiplier: int = 1,
    activation: Activation = "relu",
) -> te.Tensor:
    """``act(conv2d(x, w) + bias + residual)``: ``topi.nn.conv`` plus a fused epilogue, with
    relax's conv2d attributes as its legalization passes them (4-value padding); the window
    is ``kernel_h`` x ``kernel`` (``kernel_h`` -1: square)."""
    nchw = layout.startswith("NCHW")
    c = x.shape[1] if nchw else x.shape[3]
    g = int(c) if layout.endswith("dw") else groups
    pads = list(pads4(padding, pad_left, pad_bottom, pad_right))
    y = topi.nn.conv(x, w, stride, pads, dilation, g, "NCHW" if nchw else "NHWC",
                     "OIHW" if nchw else "HWIO")
    return epilogue_te(y, bias, residual, activation,
                       (lambda i: i[1]) if nchw else (lambda i: i[3]))


error_model(tvm_conv2d)(_error)
