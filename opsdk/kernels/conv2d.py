"""``tvm_conv2d``: the kernel TVM lowers ``conv2d`` to (dense, grouped by channel, depthwise).

``topi.nn.conv`` (what relax's conv2d legalization calls: a padding block and one
multiply-accumulate block over a window) followed by the epilogue FuseOps appends: the bias
of a folded BatchNorm, a residual add, ReLU / ReLU6. Layouts: ``NCHW`` (weights OIHW) and
``NHWC`` (HWIO, what :class:`~opsdk.transform.ChannelsLast` makes), each dense and depthwise.

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

__all__ = ["tvm_conv2d"]


def _nchw(x: np.ndarray, layout: str) -> np.ndarray:
    return x if layout.startswith("NCHW") else np.moveaxis(x, -1, 1)


def _oihw(w: np.ndarray, layout: str) -> np.ndarray:
    return w if layout.startswith("NCHW") else np.transpose(w, (3, 2, 0, 1))


def _conv_np(x, w, stride, padding, groups):
    """float64 direct convolution, NCHW x OIHW -> NCHW."""
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    oh = (h + 2 * padding - kh) // stride + 1
    ow = (wd + 2 * padding - kw) // stride + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = w[g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    return out


def _groups(layout: str, c: int) -> int:
    return c if layout.endswith("dw") else 1


def _reference(x, w, bias=None, residual=None, *, layout="NCHW", channels=16, kernel=3,
               stride=1, padding=1, activation="none"):
    lay = layout
    xc = _nchw(x, lay)
    y = _conv_np(xc, _oihw(w, lay), stride, padding, _groups(lay, xc.shape[1]))
    if not lay.startswith("NCHW"):
        y = np.moveaxis(y, 1, -1)
    bshape = (1, -1, 1, 1) if lay.startswith("NCHW") else (1, 1, 1, -1)
    return epilogue_np(y, bias, residual, activation, bshape)


def _dims(s, a):
    """(C, H, W) of the input and the output channel count."""
    if a["layout"].startswith("NCHW"):
        c, h, w = s[1], s[2], s[3]
    else:
        h, w, c = s[1], s[2], s[3]
    o = c if a["layout"].endswith("dw") else a["channels"]
    return c, h, w, o


def _out_hw(h, w, a):
    k, st, p = a["kernel"], a["stride"], a["padding"]
    return (h + 2 * p - k) // st + 1, (w + 2 * p - k) // st + 1


def _input_shapes(s, a):
    c, h, w, o = _dims(s, a)
    k = a["kernel"]
    cg = 1 if a["layout"].endswith("dw") else c
    nchw = a["layout"].startswith("NCHW")
    wshape = (o, cg, k, k) if nchw else (k, k, cg, o)
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
    if k < 1 or st < 1 or p < 0 or attrs["channels"] < 1:
        raise ValueError("arguments 'kernel', 'stride', 'channels' must be >= 1 and "
                         "'padding' >= 0")
    if h + 2 * p < k or w + 2 * p < k:
        raise ValueError(f"argument 'x' is {h}x{w}, smaller than the {k}x{k} window with "
                         f"padding {p}; pass a larger input or more padding")


def _error(m) -> np.ndarray:
    """A float32 sum of K = C/groups * kh * kw products (gamma_K of the sum of |x w|), then
    the bias and residual adds: the same bound as a dense layer's."""
    a = m.attrs
    x, w = m.inputs["x"], m.inputs["w"]
    s = np.abs(_reference(np.abs(x), np.abs(w), layout=a["layout"], channels=a["channels"],
                          kernel=a["kernel"], stride=a["stride"], padding=a["padding"]))
    k = int(np.prod(w.shape)) // w.shape[0 if a["layout"].startswith("NCHW") else -1]
    bshape = (1, -1, 1, 1) if a["layout"].startswith("NCHW") else (1, 1, 1, -1)
    return epilogue_error(m, gamma(k + 2, m.u) * (s + epilogue_abs(m, bshape)))


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    input_shapes=_input_shapes,
    check=_check,
    layouts={
        "NCHW": {"layout": "NCHW"},
        "NHWC": {"layout": "NHWC"},
        "NCHW_dw": {"layout": "NCHW_dw"},
        "NHWC_dw": {"layout": "NHWC_dw"},
    },
    domain={"x": (-2.0, 2.0), "w": (-1.0, 1.0), "bias": (-1.0, 1.0), "residual": (-2.0, 2.0)},
    attr_domain={
        "channels": [16, 24, 7, 33, 64, 1, 96],
        "kernel": [3, 1, 7, 5],
        "stride": [1, 2],
        "padding": [1, 0, 3, 2],
        "activation": list(ACTIVATIONS),
    },
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
    stride: int = 1,
    padding: int = 1,
    activation: Activation = "relu",
) -> te.Tensor:
    """``act(conv2d(x, w) + bias + residual)``: ``topi.nn.conv`` plus a fused epilogue."""
    nchw = layout.startswith("NCHW")
    c = x.shape[1] if nchw else x.shape[3]
    groups = int(c) if layout.endswith("dw") else 1
    y = topi.nn.conv(x, w, stride, padding, 1, groups, "NCHW" if nchw else "NHWC",
                     "OIHW" if nchw else "HWIO")
    return epilogue_te(y, bias, residual, activation,
                       (lambda i: i[1]) if nchw else (lambda i: i[3]))


error_model(tvm_conv2d)(_error)
