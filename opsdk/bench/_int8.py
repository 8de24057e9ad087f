"""Whole-model int8 benchmark: opsdk int8 (``opsdk.quant.quantize_model``) against opsdk
float, torch eager float, torch dynamic int8 (``quantize_dynamic`` of the Linear layers) and
onnxruntime static int8 (``quantize_static``, QDQ, per-channel weights, on the same
calibration data), interleaved in one process with the same thread count; plus each int8
model's agreement with the float model.

onnxruntime runs twice: with its default int8 activations (S8S8) and with uint8 activations
(U8S8). Which is faster depends on the model and the CPU: on MobileBERT (x86 with VNNI) the
S8S8 model left about half its MatMuls float, dequantizing their weights on every call, and
ran about 3x slower than U8S8, so either alone could flatter opsdk (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..quant import agreement
from ._model import _interleave, _ratio, _vm_timed
from ._timing import Timer, ort_session, py_step, setup_threads

__all__ = ["run_int8_bench"]


#: onnxruntime candidates: name -> the activation type of its ``quantize_static``.
ORT_INT8 = {"onnxruntime_static_int8": "QInt8", "onnxruntime_static_u8s8": "QUInt8"}


def _ort_static_int8(onnx_bytes: bytes, names: Sequence[str],
                     calibration: Sequence[Sequence[np.ndarray]],
                     activations: str = "QInt8") -> bytes:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )  # heavy: onnxruntime

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._it, None)
            return None if batch is None else dict(zip(names, batch))

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its advice to pre-process, logged on the root logger
    try:
        with tempfile.TemporaryDirectory() as d:
            src, dst = os.path.join(d, "float.onnx"), os.path.join(d, "int8.onnx")
            with open(src, "wb") as f:
                f.write(onnx_bytes)
            quantize_static(src, dst, _Reader(), quant_format=QuantFormat.QDQ,
                            per_channel=True, activation_type=QuantType[activations],
                            weight_type=QuantType.QInt8)
            with open(dst, "rb") as f:
                return f.read()
    finally:
        root.setLevel(level)


def run_int8_bench(
    loaded: Any,
    quantized: Any,
    calibration: Sequence[Sequence[np.ndarray]],
    *,
    target: str = "x86",
    threads: int | None = None,
    repeats: int = 11,
    budget_ms: float = 50.0,
) -> dict[str, Any]:
    """Time and compare the int8 model ``quantized`` (a :class:`opsdk.quant.QuantizedModel`
    of ``loaded.opsdk_mod``) against its peers on ``loaded.inputs``.

    Returns ``{"ms": {candidate: median ms}, "speedup": {candidate: x of opsdk_int8 over
    it}, "agreement": {int8 candidate: agreement with the float model}, "threads"}``.
    """
    import torch  # heavy: torch

    from ..model import compile_model  # heavy: TVM

    n = setup_threads(threads)
    inputs = list(loaded.inputs)
    timers: dict[str, Timer] = {}
    outs: dict[str, np.ndarray] = {}
    timers["opsdk_int8"], outs["opsdk_int8"] = _vm_timed(
        compile_model(quantized.mod, target).ex, inputs)
    timers["opsdk_float"], outs["opsdk_float"] = _vm_timed(
        compile_model(loaded.opsdk_mod, target).ex, inputs)
    notes: dict[str, str] = {}
    if loaded.torch_module is not None:
        model = loaded.torch_module.eval()
        targs = tuple(torch.from_numpy(a) for a in inputs)

        def first(o: Any) -> np.ndarray:
            # The first tensor, as opsdk's import returns it (a transformers ModelOutput is
            # a dataclass of tensors: its tuple).
            while isinstance(o, (tuple, list)) or hasattr(o, "to_tuple"):
                o = o.to_tuple()[0] if hasattr(o, "to_tuple") else o[0]
            return o.detach().numpy()

        with torch.no_grad():
            timers["torch_float"] = Timer(py_step(lambda: model(*targs)))
            with warnings.catch_warnings():  # its own deprecation notice, every call
                warnings.simplefilter("ignore")
                dyn = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                             dtype=torch.qint8)
            outs["torch_dynamic_int8"] = first(dyn(*targs))
            timers["torch_dynamic_int8"] = Timer(py_step(lambda: dyn(*targs)))
    for cand, act in ORT_INT8.items():
        if loaded.onnx is None:
            notes[cand] = loaded.onnx_error or "no ONNX export"
            continue
        try:
            sess_names = [i.name for i in ort_session(loaded.onnx, n).get_inputs()]
            q = _ort_static_int8(loaded.onnx, sess_names, calibration, act)
            sess = ort_session(q, n)
            feed = dict(zip(sess_names, inputs))
            outs[cand] = sess.run(None, feed)[0]
            timers[cand] = Timer(py_step(lambda sess=sess, feed=feed: sess.run(None, feed)))
        except Exception as e:  # an op quantize_static cannot handle: say so in the report
            notes[cand] = f"{type(e).__name__}: {str(e)[:200]}"
    with torch.no_grad():
        _interleave(timers, repeats, budget_ms / 1e3)
    ref = outs["opsdk_float"]
    return {
        "threads": n,
        "ms": {c: float(np.median(t.samples)) * 1e3 for c, t in timers.items()},
        "speedup": {c: _ratio(timers, c, "opsdk_int8") for c in timers if c != "opsdk_int8"},
        "agreement": {c: agreement(o, ref) for c, o in outs.items()
                      if c != "opsdk_float" and o.shape == ref.shape},
        "notes": notes,
    }
