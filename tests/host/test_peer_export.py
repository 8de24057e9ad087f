"""The onnxruntime peer gets an ONNX model where TorchScript's exporter gives up: the
torch.export-based exporter takes over (transformers' BERT and GPT-2 needed it)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from opsdk.model import _torch_to_onnx


class _Diff(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # aten::diff: no TorchScript symbolic
        return torch.diff(x, dim=-1) * 2.0


@pytest.mark.skipif(importlib.util.find_spec("onnxscript") is None
                    or importlib.util.find_spec("onnxruntime") is None,
                    reason="the bench extra (onnxscript, onnxruntime) is not installed")
def test_dynamo_exporter_takes_over_and_runs_in_onnxruntime():
    import onnxruntime as ort

    x = torch.randn(2, 9)
    data, why = _torch_to_onnx(_Diff(), (x,))
    assert data is not None and why == ""
    sess = ort.InferenceSession(data)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_array_equal(got, (torch.diff(x, dim=-1) * 2.0).numpy())


def test_a_model_neither_exporter_takes_says_both_reasons():
    class Eig(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.eigvals(x).real

    data, why = _torch_to_onnx(Eig(), (torch.randn(3, 3),))
    assert data is None
    assert why.startswith("torch.onnx.export failed:") and "eigvals" in why
    assert "\n" not in why and "\x1b" not in why
    if importlib.util.find_spec("onnxscript") is not None:
        assert "dynamo export:" in why
