"""``opsdk build`` of an unchanged model into the folder it was built into does nothing (the
artifact is up to date); a changed weight, data file, option or artifact file builds again."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from opsdk.deploy import build_artifact, read_manifest
from opsdk.model import record_timings

NET = """\
import json, os
import torch

def build_model():
    torch.manual_seed(int(os.environ.get("NET_SEED", "0")))
    width = json.load(open(os.path.join(os.path.dirname(__file__), "cfg.json")))["width"]
    m = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU())
    return m.eval(), (torch.randn(4, 8),)
"""


@pytest.fixture
def net(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.delenv("OPSDK_NO_CACHE", raising=False)
    monkeypatch.setenv("OPSDK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cfg.json").write_text('{"width": 16}')
    (tmp_path / "net.py").write_text(NET)
    return tmp_path / "net.py"


def _build(net: pathlib.Path, out: pathlib.Path, **kw) -> tuple[dict, dict]:
    with record_timings() as t:
        m = build_artifact(str(net), out, target="x86", force=True, log=None, **kw)
    return m, dict(t.seconds)


def _expected(out: pathlib.Path) -> np.ndarray:
    with np.load(out / "check" / "expected.npz") as z:
        return z["host_0"]


def test_an_unchanged_model_is_up_to_date_and_any_change_builds_again(net, monkeypatch):
    out = net.parent / "art"
    first, _ = _build(net, out)
    assert "up_to_date" not in first
    again, phases = _build(net, out)
    # nothing compiled: only the check ran, and the folder is the first build's
    assert again["up_to_date"] is True and list(phases) == ["up-to-date check"]
    assert again == read_manifest(out) | {"up_to_date": True}
    assert again["library"]["sha256"] == first["library"]["sha256"]

    # a weight: another seed, no file changed (only the tensors say it)
    before = _expected(out)
    monkeypatch.setenv("NET_SEED", "1")
    seeded, _ = _build(net, out)
    assert "up_to_date" not in seeded and not np.array_equal(_expected(out), before)
    assert _build(net, out)[0].get("up_to_date")

    # a data file the entry reads through Python: a 24-wide layer
    (net.parent / "cfg.json").write_text('{"width": 24}')
    wider, _ = _build(net, out)
    assert "up_to_date" not in wider and wider["outputs"][0]["example_shape"] == [4, 24]

    # an option, and the artifact damaged: both build again
    assert "up_to_date" not in _build(net, out, winograd=False)[0]
    assert _build(net, out, winograd=False)[0].get("up_to_date")
    (out / "io.txt").write_text("edited\n")
    assert "up_to_date" not in _build(net, out, winograd=False)[0]

    # another folder has its own record: both stay up to date
    other = net.parent / "other"
    _build(net, other, winograd=False)
    assert _build(net, other, winograd=False)[0].get("up_to_date")
    assert _build(net, out, winograd=False)[0].get("up_to_date")


def test_the_command_says_up_to_date_without_importing_tvm(net):
    env_py = (
        "import sys, runpy\n"
        "sys.argv = ['opsdk', 'build', sys.argv[1], '--target', 'x86', '-o', sys.argv[2], "
        "'--force', '--timings']\n"
        "from opsdk.cli import main\n"
        "rc = main()\n"
        "print('TVM IMPORTED' if 'tvm' in sys.modules else 'no tvm')\n"
        "sys.exit(rc)\n")
    out = net.parent / "art"

    def build() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", env_py, str(net), str(out)],
                              capture_output=True, text=True, timeout=300, cwd=net.parent)

    first = build()
    assert first.returncode == 0, first.stderr
    assert "TVM IMPORTED" in first.stdout and "up to date" not in first.stderr
    second = build()
    assert second.returncode == 0, second.stderr
    assert "is up to date" in second.stderr and "no tvm" in second.stdout
    assert "up-to-date check" in second.stdout  # --timings: the check is the whole run


def test_a_pt2_file_is_up_to_date_until_its_bytes_change(net):
    import torch

    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    pt2 = net.parent / "m.pt2"
    torch.export.save(torch.export.export(m, (torch.randn(2, 8),)), str(pt2))
    out = net.parent / "art"
    assert "up_to_date" not in _build(pt2, out)[0]
    assert _build(pt2, out)[0].get("up_to_date")
    with torch.no_grad():
        m[0].weight[0, 0] += 1
    torch.export.save(torch.export.export(m, (torch.randn(2, 8),)), str(pt2))
    assert "up_to_date" not in _build(pt2, out)[0]


def test_with_the_record_on_bad_input_is_still_one_clear_line(net, capsys):
    from opsdk.cli import main as cli

    out = net.parent / "art"
    # an unknown target: refused (after the model's import), nothing written
    assert cli(["build", str(net), "-o", str(out), "--target", "armv9"]) == 2
    assert "unknown target 'armv9'" in capsys.readouterr().err and not out.exists()
    # an entry that raises: named at the user's line, no traceback, no record left
    net.write_text(NET.replace("    return m.eval()", "    1 / 0\n    return m.eval()"))
    assert cli(["build", str(net), "-o", str(out), "--target", "x86"]) == 2
    err = capsys.readouterr().err
    assert "net.py:8: ZeroDivisionError" in err and "Traceback" not in err, err
    assert not out.exists() and not list((net.parent / "cache").glob("records/*.json"))


def test_a_decoder_is_up_to_date_until_its_checkpoint_or_an_option_changes(net):
    import torch

    from opsdk._modelimports import prepare_model_imports
    from opsdk.deploy import build_decoder_artifact

    prepare_model_imports()  # transformers' models beside the CPU torch
    from transformers import GPT2Config, GPT2LMHeadModel

    ckpt = net.parent / "ckpt"
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2,
                                    n_positions=32)).eval()
    hf.save_pretrained(ckpt)
    out = net.parent / "dec"

    def build(model=ckpt, **kw) -> dict:
        return build_decoder_artifact(str(model), out, weights="int4", target="x86",
                                      force=True, log=None, reference=False, **kw)

    assert "up_to_date" not in build()
    assert build()["up_to_date"] is True
    assert "up_to_date" not in build(check_steps=3)  # an option
    assert build(check_steps=3)["up_to_date"] is True
    with torch.no_grad():  # one weight of the checkpoint, nothing else
        hf.transformer.h[0].mlp.c_fc.weight[0, 0] += 1
    hf.save_pretrained(ckpt)
    assert "up_to_date" not in build(check_steps=3)
    # a built-in name: its random weights come from opsdk's code and the seed
    assert "up_to_date" not in build("gpt2-tiny")
    assert build("gpt2-tiny")["up_to_date"] is True
    assert "up_to_date" not in build("gpt2-tiny", seed=1)


def test_an_up_to_date_artifact_needs_no_force_and_a_changed_one_does(net, monkeypatch):
    from opsdk.deploy import ArtifactError

    out = net.parent / "art"
    built, _ = _build(net, out)
    # Building the same model again (no --force) keeps the artifact: nothing is replaced.
    again = build_artifact(str(net), out, target="x86", log=None)
    assert again["up_to_date"] is True
    assert again["library"]["sha256"] == built["library"]["sha256"]
    # An edit would replace it: refused without --force, the artifact left whole.
    monkeypatch.setenv("NET_SEED", "1")
    with pytest.raises(ArtifactError, match="earlier artifact that this build would replace"):
        build_artifact(str(net), out, target="x86", log=None)
    assert read_manifest(out)["library"]["sha256"] == built["library"]["sha256"]
    assert "up_to_date" not in build_artifact(str(net), out, target="x86", force=True, log=None)
