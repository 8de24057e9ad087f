"""Post-training int8 quantization: from one layer's parameters to a whole imported model.

- :func:`quantize_model` rewrites the dense and conv2d layers of an imported model
  (``opsdk.frontend``) into ``quantize -> qdense`` / ``quantize -> qconv2d`` after
  calibrating on a stream of inputs, with per-channel or per-tensor weights, symmetric or
  asymmetric activations and min/max, percentile or MSE ranges; :func:`sensitivity` reports
  each layer's own error, and ``mixed_precision=`` keeps the worst layers in float.
- :func:`calibrate`, :func:`choose_qparams`, :func:`quantize_weights`,
  :func:`quantize_dense` and :func:`quantize_conv2d` are the pieces, with exactly the
  integer semantics of the ``quantize`` / ``qdense`` / ``qconv2d`` ops, so their parameters
  plug into ``opsdk.relax.qdense(...)`` and ``opsdk.relax.qconv2d(...)``.

Examples
--------
>>> import numpy as np
>>> from opsdk.quant import calibrate, quantize_dense
>>> rng = np.random.default_rng(0)
>>> xs = [rng.normal(size=(16, 32)).astype("float32") for _ in range(4)]
>>> w = rng.normal(size=(8, 32)).astype("float32") * 0.1
>>> act = calibrate(xs, method="minmax")
>>> qd = quantize_dense(w, np.zeros(8, "float32"), act)
>>> qd.drift(xs)["rel_rmse"] < 0.05
True
"""

from __future__ import annotations

from ._calibrate import (
    ConvQuant,
    DenseQuant,
    QParams,
    calibrate,
    choose_qparams,
    quantize_conv2d,
    quantize_dense,
    quantize_weights,
)
from ._model import (
    QuantConfig,
    QuantizedModel,
    QuantSite,
    agreement,
    find_sites,
    quantize_model,
    sensitivity,
)

__all__ = [
    "ConvQuant",
    "DenseQuant",
    "QParams",
    "QuantConfig",
    "QuantSite",
    "QuantizedModel",
    "agreement",
    "calibrate",
    "choose_qparams",
    "find_sites",
    "quantize_conv2d",
    "quantize_dense",
    "quantize_model",
    "quantize_weights",
    "sensitivity",
]
