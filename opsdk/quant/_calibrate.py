"""Calibration and quantization parameters: activation ranges, scales and zero points, dense
weights per channel, and the drift of one layer against float32.

The integer semantics are exactly those of the ``quantize`` / ``qdense`` ops, so parameters
produced here plug straight into ``opsdk.relax.qdense(...)``
(examples: :mod:`opsdk.quant`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..ops import QRANGE
from ..ops.qconv2d import conv2d_nchw, qconv2d
from ..ops.qdense import qdense

__all__ = [
    "ConvQuant",
    "DenseQuant",
    "QParams",
    "calibrate",
    "choose_qparams",
    "quantize_conv2d",
    "quantize_dense",
    "quantize_weights",
]

Method = Literal["minmax", "percentile", "mse"]


@dataclass(frozen=True)
class QParams:
    """Affine quantization parameters: ``real = (q - zero_point) * scale``."""

    scale: float
    zero_point: int
    dtype: str = "int8"
    lo: float = 0.0
    hi: float = 0.0

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Quantize like the ``quantize`` op (float32 division, ties to even, saturation)."""
        q = np.rint(x.astype(np.float32) / np.float32(self.scale)).astype(np.int64)
        lo, hi = QRANGE[self.dtype]
        return np.clip(q + self.zero_point, lo, hi).astype(self.dtype)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Back to float32, like the ``dequantize`` op."""
        return (q.astype(np.int64) - self.zero_point).astype(np.float32) * np.float32(self.scale)


def choose_qparams(lo: float, hi: float, dtype: str = "int8", symmetric: bool = False) -> QParams:
    """Scale and zero point that map ``[lo, hi]`` (widened to include 0) onto ``dtype``.

    Examples
    --------
    >>> from opsdk.quant import choose_qparams
    >>> p = choose_qparams(-1.0, 3.0)
    >>> p.zero_point, round(p.scale * 255, 6)
    (-64, 4.0)
    """
    qmin, qmax = QRANGE[dtype]
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if symmetric:
        m = max(-lo, hi)
        lo, hi = -m, m
    span = hi - lo
    if span <= 0:  # an all-zero tensor: any scale represents it exactly
        return QParams(1.0, 0, dtype, lo, hi)
    if symmetric:
        scale = max(-lo, hi) / ((qmax - qmin) / 2)
        zp = 0 if dtype == "int8" else (qmin + qmax + 1) // 2
    else:
        scale = span / (qmax - qmin)
        zp = int(np.clip(round(qmin - lo / scale), qmin, qmax))
    return QParams(float(np.float32(scale)), zp, dtype, lo, hi)


def _quant_error(x: np.ndarray, p: QParams) -> float:
    return float(np.mean((p.dequantize(p.quantize(x)) - x) ** 2))


def calibrate(
    batches: Iterable[np.ndarray],
    *,
    method: Method = "minmax",
    dtype: str = "int8",
    symmetric: bool = False,
    percentile: float = 99.99,
    mse_grid: int = 64,
) -> QParams:
    """Activation quantization parameters from sample batches.

    ``minmax`` covers every value seen; ``percentile`` clips the tails at ``percentile`` (and
    ``100 - percentile``); ``mse`` searches clipping ranges shrunk from the min/max for the one
    with the smallest mean squared quantization error on the data.
    """
    parts = [np.asarray(b, dtype=np.float64).ravel() for b in batches]
    data = np.concatenate(parts) if parts else np.zeros(0)
    if data.size == 0:
        raise ValueError("calibrate: no calibration data")
    lo, hi = float(data.min()), float(data.max())
    if method == "minmax":
        return choose_qparams(lo, hi, dtype, symmetric)
    if method == "percentile":
        a, b = np.percentile(data, [100.0 - percentile, percentile])
        return choose_qparams(float(a), float(b), dtype, symmetric)
    if method == "mse":
        sample = data if data.size <= 200_000 else np.random.default_rng(0).choice(data, 200_000)
        best = None
        for f in np.linspace(1.0, 0.2, mse_grid):
            p = choose_qparams(lo * f, hi * f, dtype, symmetric)
            err = _quant_error(sample, p)
            if best is None or err < best[0]:
                best = (err, p)
        assert best is not None
        return best[1]
    raise ValueError(f"calibrate: method must be minmax, percentile or mse, got {method!r}")


def quantize_weights(w: np.ndarray, *, per_channel: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights (rows = output channels) and their float32 scales.

    Returns ``(w_q, w_scale)`` with ``w_scale`` of shape ``(N,)`` or ``(1,)``; the range is
    ``[-127, 127]`` so that ``-w`` is representable.
    """
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1) if per_channel else np.array([np.abs(w).max()])
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    s = scale[:, None] if per_channel else scale[0]
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return q, scale


@dataclass
class DenseQuant:
    """A dense layer quantized for ``qdense``: weights, scales, bias and activation params."""

    w_q: np.ndarray
    w_scale: np.ndarray
    bias_q: np.ndarray
    act: QParams
    w_float: np.ndarray
    b_float: np.ndarray

    @property
    def per_channel(self) -> bool:
        return self.w_scale.shape[0] > 1

    def qdense_attrs(self, out_dtype: str = "float32", out: QParams | None = None) -> dict:
        """Attributes for ``opsdk.relax.qdense`` / the reference."""
        attrs = {"x_scale": self.act.scale, "x_zero_point": self.act.zero_point,
                 "out_dtype": out_dtype, "per_channel": self.per_channel}
        if out is not None:
            attrs.update(out_scale=out.scale, out_zero_point=out.zero_point)
        return attrs

    def run(self, x: np.ndarray, out_dtype: str = "float32", out: QParams | None = None):
        """Quantize ``x`` and evaluate the qdense reference (bit-exact with the kernels)."""

        xq = self.act.quantize(x)
        return qdense.reference(xq, self.w_q, self.w_scale, self.bias_q,
                          **self.qdense_attrs(out_dtype, out))

    def drift(self, batches: Sequence[np.ndarray]) -> dict[str, float]:
        """Max abs / relative error and relative RMSE of the float32-output qdense against the
        float32 layer ``x @ w.T + b`` on ``batches``."""
        errs, refs = [], []
        for x in batches:
            ref = x.astype(np.float64) @ self.w_float.astype(np.float64).T + self.b_float
            got = self.run(x).astype(np.float64)
            errs.append((got - ref).ravel())
            refs.append(ref.ravel())
        e, r = np.concatenate(errs), np.concatenate(refs)
        scale = float(np.abs(r).max()) or 1.0
        return {
            "max_abs": float(np.abs(e).max()),
            "max_rel": float(np.abs(e).max() / scale),
            "rel_rmse": float(np.sqrt(np.mean(e**2)) / (np.sqrt(np.mean(r**2)) or 1.0)),
        }


def quantize_dense(
    w: np.ndarray, b: np.ndarray | None, act: QParams, *, per_channel: bool = True
) -> DenseQuant:
    """Quantize a float dense layer ``y = x @ w.T + b`` for ``qdense``: int8 weights per channel
    (or per tensor), the bias as int32 in units of ``act.scale * w_scale``."""
    w = np.asarray(w, dtype=np.float32)
    b = np.zeros(w.shape[0], np.float32) if b is None else np.asarray(b, dtype=np.float32)
    w_q, w_scale = quantize_weights(w, per_channel=per_channel)
    bias_scale = np.float32(act.scale) * w_scale
    bias_q = np.clip(np.rint(b / bias_scale), -(2**31), 2**31 - 1).astype(np.int32)
    return DenseQuant(w_q, w_scale, bias_q, act, w, b)


@dataclass
class ConvQuant(DenseQuant):
    """A conv2d layer quantized for ``qconv2d``: OIHW int8 weights, scales, bias, activation
    params and the convolution's geometry."""

    stride: int = 1
    padding: int = 0
    layout: str = "NCHW"
    depthwise: bool = False

    def qconv2d_attrs(self, out_dtype: str = "float32", out: QParams | None = None) -> dict:
        """Attributes for ``opsdk.relax.qconv2d`` / the reference."""
        return {**self.qdense_attrs(out_dtype, out), "stride": self.stride,
                "padding": self.padding, "layout": self.layout, "depthwise": self.depthwise}

    def run(self, x: np.ndarray, out_dtype: str = "float32", out: QParams | None = None):
        """Quantize ``x`` and evaluate the qconv2d reference (bit-exact with the kernels)."""

        return qconv2d.reference(self.act.quantize(x), self.w_q, self.w_scale, self.bias_q,
                          **self.qconv2d_attrs(out_dtype, out))

    def float_layer(self, x: np.ndarray) -> np.ndarray:
        """The float64 layer ``conv(x, w) + b`` in the layer's layout."""

        xc = x if self.layout == "NCHW" else x.transpose(0, 3, 1, 2)
        y = conv2d_nchw(xc.astype(np.float64), self.w_float.astype(np.float64),
                        stride=self.stride, padding=self.padding, depthwise=self.depthwise)
        y = y + self.b_float.astype(np.float64)[None, :, None, None]
        return y if self.layout == "NCHW" else y.transpose(0, 2, 3, 1)


def quantize_conv2d(
    w: np.ndarray, b: np.ndarray | None, act: QParams, *, per_channel: bool = True,
    stride: int = 1, padding: int = 0, layout: str = "NCHW", depthwise: bool = False,
) -> ConvQuant:
    """Quantize a float conv2d layer (``w`` OIHW) for ``qconv2d``: int8 weights per output
    channel (or per tensor), the bias as int32 in units of ``act.scale * w_scale``."""
    w = np.asarray(w, dtype=np.float32)
    d = quantize_dense(w.reshape(w.shape[0], -1), b, act, per_channel=per_channel)
    return ConvQuant(d.w_q.reshape(w.shape), d.w_scale, d.bias_q, act, w, d.b_float,
                     stride, padding, layout, depthwise)
