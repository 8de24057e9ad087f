"""An artifact stores each weight once, as the model has it, and transforms it once at load:
sizes, outputs bit for bit against the in-process compile and the bundled (format 1) build,
one transform per load, and clear errors for a damaged or missing weights file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from opsdk._files import sha256_file
from opsdk.cli import main as cli
from opsdk.deploy import ArtifactError, build_artifact, load_artifact, read_manifest, run_artifact
from opsdk.deploy._artifact import read_weights

# A ResNet-like net: a stem conv, one residual block of two 3x3 convs (Winograd: 16+
# channels), BatchNorms (folded into the convs), global pooling and a linear head.
_NET = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class Net(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.block, self.head = Block(c), nn.Linear(c, 10)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean(dim=(2, 3)))


def build_model():
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.normal_(1.0, 0.3)
                m.running_mean.normal_(0.0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(1, 3, 12, 12),)
'''


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from opsdk.model import load_model

    root = tmp_path_factory.mktemp("weights")
    (root / "net.py").write_text(_NET)
    loaded = load_model(str(root / "net.py"), baselines=False)
    mod, inputs = loaded.opsdk_mod, loaded.inputs
    lifted = root / "lifted"
    bundled = root / "bundled"
    build_artifact(mod, lifted, target="x86", inputs=inputs, log=None)
    build_artifact(mod, bundled, target="x86", inputs=inputs, lift_weights=False, log=None)
    # The bundled build's host outputs: the model compiled in this process with its weights
    # as constants (today's compile_model), run by build_artifact.
    with np.load(bundled / "check" / "expected.npz") as z:
        want = z["host_0"]
    weight_bytes = sum(p.numel() * 4 for p in loaded.torch_module.parameters())
    return lifted, bundled, inputs, want, weight_bytes


def test_weights_are_stored_once_and_transformed_at_load(built):
    lifted, bundled, _, _, weight_bytes = built
    m, old = read_manifest(lifted), read_manifest(bundled)
    w = m["weights"]
    # Stored: the weights as the model has them (BN folded in), once.
    assert w["bytes"] + w["bundled_bytes"] <= 1.1 * weight_bytes
    # Loaded: the Winograd convs' 16 values per 3x3 filter, computed at load; the bundled
    # build stores those in model.so instead.
    assert w["transformed_bytes"] > w["tensor_bytes"]
    assert old["weights"]["storage"] == "bundled" and old["weights"]["file"] is None
    assert old["library"]["weights_bytes"] >= w["transformed_bytes"]
    assert not (bundled / "weights.params").exists()
    assert "x86.winograd" in {k["rule"] for k in m["kernels"]}
    # Per inference the same kernels as the bundled build; the rest run once at load.
    per_call = {k["name"] for k in m["kernels"] if not k.get("at_load")}
    assert per_call == {k["name"] for k in old["kernels"]}
    assert any(k.get("at_load") for k in m["kernels"])


def test_outputs_are_bit_identical_to_the_in_process_compile(built):
    lifted, bundled, inputs, want, _ = built
    model = load_artifact(lifted)
    assert model.transform_runs == 1 and model.load_seconds > 0
    assert len(model.weights) == len(read_manifest(lifted)["weights"]["names"])
    for _ in range(2):  # later calls reuse the transformed weights
        (got,) = model(*inputs)
        assert np.array_equal(got, want)
    assert model.transform_runs == 1
    (old,) = load_artifact(bundled)(*inputs)
    assert np.array_equal(old, want) and load_artifact(bundled).transform_runs == 0
    res = run_artifact(lifted, repeats=2, log=None)
    assert res["ok"] and res["outputs"][0]["vs_host"]["bitexact"]
    assert res["latency"]["load_ms"] > 0


def test_runner_transforms_once_per_loaded_library(built):
    from opsdk.runners import LocalRunner

    lifted, _, inputs, want, _ = built
    weights = read_weights(lifted)
    with LocalRunner() as r:
        ex = lifted / "model.so"
        (a,) = r.run(ex, inputs, weights=weights)
        _, first = r.run_timed(ex, inputs, weights=weights, repeats=1)
        assert "load_ms" not in first  # no second transform on the same library
    assert np.array_equal(a, want)


def test_damaged_or_missing_weights_are_clear_errors(built, tmp_path, capsys):
    lifted = built[0]
    flipped = tmp_path / "flipped"
    shutil.copytree(lifted, flipped)
    data = bytearray((flipped / "weights.params").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (flipped / "weights.params").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"weights\.params does not match its manifest"):
        read_manifest(flipped)
    assert cli(["run", str(flipped)]) == 2
    assert "rebuild the artifact" in capsys.readouterr().err
    gone = tmp_path / "gone"
    shutil.copytree(lifted, gone)
    (gone / "weights.params").unlink()
    with pytest.raises(ArtifactError, match=r"weights.params is missing \(the artifact's "
                                            "weights\\); copy the whole artifact folder"):
        load_artifact(gone)
    cut = tmp_path / "cut"  # cut short, with a manifest that agrees: TVM's reader refuses
    shutil.copytree(lifted, cut)
    (cut / "weights.params").write_bytes(data[:40])
    m = json.loads((cut / "manifest.json").read_text())
    m["weights"]["sha256"] = sha256_file(cut / "weights.params")
    (cut / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="cannot be read as weights"):
        read_weights(cut)


def test_an_artifact_from_before_weights_files_still_runs(built, tmp_path):
    bundled = built[1]
    old = tmp_path / "old"
    shutil.copytree(bundled, old)
    m = json.loads((old / "manifest.json").read_text())
    m["format"] = "opsdk-artifact/1"
    del m["weights"]
    (old / "manifest.json").write_text(json.dumps(m))
    assert read_weights(old) is None
    assert run_artifact(old, repeats=1, log=None)["ok"]
    m["format"] = "opsdk-artifact/0"
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="rebuild the artifact with this opsdk"):
        read_manifest(old)


def test_a_rebuild_takes_over_the_weights_file_only_while_it_is_intact(built, tmp_path):
    """A build replacing an artifact with the same weights (a layer's code edited, ``--force``,
    ``--watch``) links the earlier weights file instead of writing 100 MB again; one whose
    bytes no longer match its manifest is written afresh."""
    from opsdk.model import load_model

    lifted = built[0]
    loaded = load_model(str(lifted.parent / "net.py"), baselines=False)
    out = tmp_path / "art"

    def build() -> tuple[dict, int]:
        m = build_artifact(loaded.opsdk_mod, out, target="x86", inputs=loaded.inputs,
                           force=True, log=None)
        return m, (out / "weights.params").stat().st_ino

    first, ino = build()
    again, ino_again = build()
    assert ino_again == ino  # the same file, linked into the new artifact
    assert again["weights"] == first["weights"]
    assert again["weights"]["sha256"] == sha256_file(out / "weights.params")
    data = bytearray((out / "weights.params").read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged in place: same size, same inode
    (out / "weights.params").write_bytes(bytes(data))
    fixed, ino_fixed = build()
    assert ino_fixed != ino
    assert fixed["weights"] == first["weights"]
    assert sha256_file(out / "weights.params") == first["weights"]["sha256"]
    assert run_artifact(out, repeats=1, log=None)["ok"]
