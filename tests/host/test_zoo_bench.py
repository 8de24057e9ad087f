"""``opsdk bench --zoo``: the registry names the architectures the benchmark promises, the
small set runs end to end with real numbers (table, JSON, chart), a peer that does not
import is skipped with one line, and bad names are usage errors."""

from __future__ import annotations

import json
import sys

import pytest

from opsdk.bench._zoo import SMALL, ZOO, select_zoo
from opsdk.cli import main

#: Architecture -> (zoo name, the optional packages it needs).
REQUIRED = {
    "MobileNetV2": ("mobilenet_v2", ("timm",)),
    "MobileNetV3-Large": ("mobilenet_v3_large", ("timm",)),
    "EfficientNet": ("efficientnet_b1", ("timm",)),
    "ResNet-50": ("resnet50", ("timm",)),
    "ConvNeXt-Tiny": ("convnext_tiny", ("timm",)),
    "DeiT-Small": ("deit_small", ("timm",)),
    "BERT encoder": ("bert_small", ("transformers",)),
    "MobileBERT encoder": ("mobilebert", ("transformers",)),
    "GPT-2 prefill": ("gpt2_prefill", ("transformers",)),
    "YOLOv8 detector": ("yolov8n", ()),
    "UNet": ("unet", ()),
}


def test_registry_lists_the_required_architectures_with_their_needs():
    for arch, (name, needs) in REQUIRED.items():
        assert name in ZOO, arch
        assert ZOO[name].needs == needs, arch
        assert ZOO[name].description, arch
    full = [z.name for z in select_zoo("all")]
    assert set(full) >= {n for n, _ in REQUIRED.values()}
    assert not set(SMALL) & set(full)  # the test models are not in the real-size run
    assert [z.name for z in select_zoo("small")] == list(SMALL)


def test_hand_written_detector_is_yolov8n_sized():
    import torch

    model, (x,) = ZOO["yolov8n"].build()
    assert tuple(x.shape) == (1, 3, 320, 320)
    # yolov8n: 3.16 M parameters; 80 classes + 4 box values over 40^2 + 20^2 + 10^2 cells.
    assert 3.0e6 < sum(p.numel() for p in model.parameters()) < 3.3e6
    with torch.no_grad():
        assert tuple(model(x).shape) == (1, 84, 2100)


def test_small_zoo_end_to_end_with_a_peer_that_does_not_import(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now fails
    out_json, chart = tmp_path / "zoo.json", tmp_path / "zoo.png"
    rc = main(["bench", "--zoo", "small", "--repeats", "2",
               "--peers", "onnxruntime,openvino,torch",
               "--json", str(out_json), "--chart", str(chart)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    skip_lines = [ln for ln in cap.err.splitlines() if "openvino" in ln]
    assert len(skip_lines) == 1 and "skipped openvino" in skip_lines[0], cap.err
    assert "Traceback" not in cap.err
    data = json.loads(out_json.read_text())
    assert data["peers"] == ["onnxruntime", "torch"] and "openvino" in data["skipped"]
    rows = data["zoo"]
    assert [r["model"] for r in rows] == list(SMALL)
    for r in rows:
        assert "failed" not in r, r["failed"]
        assert r["check_opsdk"]["ok"] and r["check_onnxruntime"]["ok"]
        assert r["compile_s"] > 0 and r["artifact_mb"] > 0 and r["peak_rss_mb"] > 0
        assert r["opsdk_ms"] > 0 and r["opsdk_p99_ms"] > 0
        for p in ("onnxruntime", "torch"):
            assert r[f"speedup_{p}"] > 0 and r[f"{p}_ms"] > 0
        assert r["speedup_openvino"] is None
    g = data["geomean"]["onnxruntime"]
    assert g["models"] == len(rows) and g["geomean"] > 0
    table = cap.out
    assert "geomean" in table and "x ort" in table and "x ov" not in table
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_that_fails_is_a_row_and_the_run_goes_on():
    from opsdk.bench._model import run_model_bench
    from opsdk.bench._zooreport import format_zoo_table

    class Broken:
        name = "broken"

        def build(self):
            raise RuntimeError("layer conv3 is not supported\nsecond line")

    rows = run_model_bench([Broken(), Broken()], candidates=["opsdk"], details=True,
                           keep_going=True, repeats=1, budget_ms=1)
    assert [r["failed"] for r in rows] == ["import: RuntimeError: layer conv3 is not "
                                           "supported"] * 2
    assert "broken               FAILED import: RuntimeError" in format_zoo_table(rows, [])
    with pytest.raises(RuntimeError):  # without keep_going, as --model: the error surfaces
        run_model_bench([Broken()], candidates=["opsdk"], repeats=1, budget_ms=1)


@pytest.mark.parametrize(("argv", "message"), [
    (["--zoo", "resnet50,nosuchnet"], "unknown zoo model 'nosuchnet'; choose from all, small,"),
    (["--zoo", "small", "--peers", "tflite"], "unknown peer 'tflite'"),
    (["--zoo", "small", "--model", "x.py"], "--zoo runs on its own"),
])
def test_zoo_usage_errors(capsys, argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("def build_model():\n    pass\n")
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if "unknown zoo model" in message:
        assert all(n in err for n in ZOO)


def test_model_bench_takes_its_peers_from_peers(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now fails
    model = tmp_path / "tiny.py"
    model.write_text("import torch\n\n\ndef build_model():\n    torch.manual_seed(0)\n"
                     "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU())\n"
                     "    return m.eval(), (torch.randn(4, 16),)\n")
    out_json = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(model), "--repeats", "2", "--budget-ms", "1",
               "--peers", "onnxruntime,openvino", "--json", str(out_json)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    skip_lines = [ln for ln in cap.err.splitlines() if "openvino" in ln]
    assert len(skip_lines) == 1 and "skipped openvino" in skip_lines[0], cap.err
    (row,) = json.loads(out_json.read_text())["models"]
    assert row["check_opsdk"]["ok"] and row["check_onnxruntime"]["ok"]
    assert row["opsdk_ms"] > 0 and row["onnxruntime_ms"] > 0 and row["speedup_onnxruntime"] > 0
    # TVM's default pipeline and torch were not asked for: neither was timed
    assert row["tvm_default_ms"] is None and row["torch_ms"] is None
    head = cap.out.splitlines()[0].split()
    assert head == ["model", "opsdk", "ort", "x", "ort", "checks"]


def test_model_bench_refuses_an_unknown_peer(tmp_path, capsys):
    (tmp_path / "x.py").write_text("def build_model():\n    pass\n")
    assert main(["bench", "--model", str(tmp_path / "x.py"), "--peers", "tflite"]) == 2
    err = capsys.readouterr().err
    assert "unknown peer 'tflite'" in err and "Traceback" not in err


def test_model_bench_checks_every_output_of_every_runtime(tmp_path, monkeypatch):
    """A second output (a segmentation net's ``aux``, a detector's second head) is compared
    too, for opsdk and each peer; one that differs fails its check and names the output."""
    from opsdk.bench import _model

    model = tmp_path / "two_heads.py"
    model.write_text(
        "import torch\n\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.a = torch.nn.Linear(16, 8)\n"
        "        self.b = torch.nn.Linear(16, 4)\n\n    def forward(self, x):\n"
        "        return {'out': self.a(x), 'aux': torch.tanh(self.b(x))}\n\n\n"
        "def build_model():\n    torch.manual_seed(0)\n"
        "    return Net().eval(), (torch.randn(2, 16),)\n")
    kw = {"candidates": ["opsdk", "onnxruntime", "torch"], "repeats": 1, "budget_ms": 1}
    (row,) = _model.run_model_bench([str(model)], **kw)
    for c in ("opsdk", "onnxruntime", "torch"):
        assert row[f"check_{c}"]["ok"] and row[f"check_{c}"]["outputs"] == 2, row

    timed = _model._vm_timed

    def second_off(*a, **k):  # opsdk's second output planted wrong
        t, outs = timed(*a, **k)
        return t, [outs[0], outs[1] + 0.01]

    monkeypatch.setattr(_model, "_vm_timed", second_off)
    (row,) = _model.run_model_bench([str(model)], **kw)
    chk = row["check_opsdk"]
    assert not chk["ok"] and chk["output"] == 1 and chk["max_abs"] > 5e-3, chk
    assert row["check_onnxruntime"]["ok"]
    table = _model.format_model_table([row], ["onnxruntime", "torch"])
    assert "opsdk:FAIL" in table and "opsdk differs from torch: output 1 of 2" in table
