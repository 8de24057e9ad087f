"""``opsdk build`` / ``opsdk run`` on the host (x86): the artifact's files and manifest facts,
the run's checks, the C++ example's output bit for bit against Python's, and the folder and
input refusals."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import opsdk
from opsdk.cli import main as cli
from opsdk.deploy import ArtifactError, build_artifact, read_manifest, run_artifact
from opsdk.deploy._artifact import read_weights
from opsdk.runners import LocalRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = str(ROOT / "examples" / "conv_net.py")
SMALL_CONV = {"channels": 8, "size": 16, "batch": 2}


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("deploy") / "conv"
    build_artifact(CONV, out, target="x86", entry_args=SMALL_CONV, log=None)
    return out


def test_artifact_files_and_manifest_facts(art):
    m = read_manifest(art)
    assert sorted(p.name for p in art.iterdir()) == ["check", "io.txt", "manifest.json",
                                                     "model.so", "weights.params"]
    assert m["target"]["arch"] == "x86_64" and m["target"]["name"] == "x86"
    host_feats = opsdk.targets.target_features(opsdk.target("x86"))
    assert ("avx512f" in m["target"]["features"]) == ("avx512f" in host_feats)
    assert m["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, 3, 16, 16],
                            "example_shape": [2, 3, 16, 16]}]
    assert [o["example_shape"] for o in m["outputs"]] == [[2, 10]]
    # Every kernel is scheduled by a rule, and the rule is named.
    assert m["kernels"] and all(k["rule"] != "generic" for k in m["kernels"])
    mem = m["memory"]
    assert mem["planned_intermediates_bytes"] > 0 and mem["planned_blocks"] >= 1
    assert mem["outputs_bytes"] == 2 * 10 * 4
    assert mem["peak_bytes"] == mem["planned_intermediates_bytes"] + mem["outputs_bytes"]
    torch_params = sum(p.numel() * 4 for p in _conv_model().parameters())
    # BN folded into the conv weights and biases (not kept beside them): stored in no more
    # bytes than torch's parameters (the file's header aside); once loaded, the Winograd
    # convs' transformed weights take 16 values per 3x3 filter instead of 9 (here the
    # 16 -> 16 conv).
    w = m["weights"]
    assert w["storage"] == "file" and w["file"] == "weights.params"
    assert w["bytes"] == (art / "weights.params").stat().st_size
    assert 0 < w["tensor_bytes"] + w["bundled_bytes"] <= torch_params
    assert w["bytes"] <= 1.1 * w["tensor_bytes"]
    winograd_growth = (16 - 9) * 16 * 16 * 4
    assert w["tensor_bytes"] < w["transformed_bytes"] <= w["tensor_bytes"] + winograd_growth
    assert m["library"]["weights_bytes"] == w["loaded_bytes"]
    assert m["library"]["bytes"] == (art / "model.so").stat().st_size
    assert m["check"]["host_library"] == "model.so"  # the host build is the artifact itself
    assert m["versions"]["apache-tvm"] == "0.27.0.post1"
    io = [ln.split() for ln in (art / "io.txt").read_text().splitlines() if ln[:1] != "#"]
    assert io == [["input", "x", "float32", "2", "3", "16", "16"],
                  *[["weight", n, "float32", *map(str, a.shape)]
                    for n, a in zip(w["names"], read_weights(art))],
                  ["output", "out0", "float32", "2", "10"]]
    for p in art.rglob("*"):  # the modes a copy would have, not mkdtemp's 0700
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) == want & ~_umask(), p
    # No DWARF (a third of a library's bytes, read by nothing at run time); the symbol
    # table stays, so a profiler names the kernels.
    sections = _elf_sections(art / "model.so")
    assert ".text" in sections and ".symtab" in sections
    assert not [s for s in sections if s.startswith(".debug")], sections


def _elf_sections(path: pathlib.Path) -> list[str]:
    """Section names of a 64-bit little-endian ELF file."""
    import struct

    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, = struct.unpack_from("<I", data, shoff + i * shentsize)
        offset, size = struct.unpack_from("<QQ", data, shoff + i * shentsize + 0x18)
        return name, offset, size

    _, str_off, _ = header(shstrndx)
    names = []
    for i in range(shnum):
        name = header(i)[0]
        names.append(data[str_off + name:data.index(b"\0", str_off + name)].decode())
    return names


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def _conv_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_conv_for_test", CONV)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_model(**SMALL_CONV)[0]


def test_run_on_the_host_checks_host_build_and_torch(art):
    res = run_artifact(art, repeats=3, log=None)
    assert res["ok"] and not res["emulated"] and res["inputs"] == "stored"
    (out,) = res["outputs"]
    assert out["vs_host"]["bitexact"] and out["vs_torch"]["ok"]
    lat = res["latency"]
    assert len(lat["samples_ms"]) == 3 and lat["median_ms"] > 0 and lat["first_ms"] > 0
    assert res["features"]["missing"] == []
    rnd = run_artifact(art, random_inputs=True, seed=3, repeats=1, log=None)
    assert rnd["ok"] and rnd["inputs"] == "random" and "vs_torch" not in rnd["outputs"][0]


def test_given_inputs_are_checked_against_the_manifest(art, tmp_path):
    good = tmp_path / "in.npz"
    np.savez(good, x=np.ones((2, 3, 16, 16), "float32"))
    assert run_artifact(art, inputs=good, repeats=1, log=None)["ok"]
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((2, 3, 16, 16), "float64"))
    with pytest.raises(ArtifactError, match=r"input 'x': dtype float64, the model takes float32"):
        run_artifact(art, inputs=bad, log=None)
    with pytest.raises(ArtifactError, match=r"input 'x': shape \[2, 3, 16\], the model takes"):
        run_artifact(art, inputs={"x": np.ones((2, 3, 16), "float32")}, log=None)
    with pytest.raises(ArtifactError, match=r"no array named 'x'"):
        run_artifact(art, inputs={"y": np.ones((2, 3, 16, 16), "float32")}, log=None)


def test_cpp_example_matches_python_bit_for_bit(art, tmp_path):
    exe = tmp_path / "deploy_run"
    subprocess.run(["make", "-s", "-C", str(ROOT / "examples" / "deploy"), f"TARGET={exe}",
                    f"PYTHON={sys.executable}"], check=True)
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = subprocess.run([str(exe), str(art), str(art / "check" / "inputs"), str(outdir)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    m = read_manifest(art)
    x = np.fromfile(art / "check" / "inputs" / "x.bin", "float32").reshape(2, 3, 16, 16)
    with LocalRunner() as r:
        (want,) = r.run(art / "model.so", [x], weights=read_weights(art))
    got = np.fromfile(outdir / "out0.bin", "float32").reshape(m["outputs"][0]["example_shape"])
    assert np.array_equal(got, want)
    # A wrong input size is an error naming the file, not garbage.
    bad_in = tmp_path / "bad_in"
    bad_in.mkdir()
    np.ones(5, "float32").tofile(bad_in / "x.bin")
    proc = subprocess.run([str(exe), str(art), str(bad_in), str(outdir)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "x.bin: expected exactly 6144 bytes" in proc.stderr


def test_pt2_file_builds_and_runs(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ep = torch.export.export(model.eval(), (torch.randn(3, 16),))
    pt2 = tmp_path / "mlp.pt2"
    torch.export.save(ep, str(pt2))
    m = build_artifact(str(pt2), tmp_path / "art", target="x86", log=None)
    assert m["model"]["framework"] == "torch"
    assert any("bias_gelu" in k["name"] for k in m["kernels"])  # fused into the matmul
    res = run_artifact(tmp_path / "art", repeats=1, log=None)
    assert res["ok"] and res["outputs"][0]["vs_torch"]["ok"]


def test_no_winograd_build_keeps_every_conv_direct(art, tmp_path, capsys):
    rc = cli(["build", CONV, "--target", "x86", "-o", str(tmp_path / "direct"), "--no-winograd",
              *[f"--model-arg={k}={v}" for k, v in SMALL_CONV.items()]])
    assert rc == 0, capsys.readouterr().out
    direct = read_manifest(tmp_path / "direct")
    rules = {k["rule"] for k in direct["kernels"]}
    assert "x86.conv2d" in rules and "x86.winograd" not in rules, rules
    assert "x86.winograd" in {k["rule"] for k in read_manifest(art)["kernels"]}
    torch_params = sum(p.numel() * 4 for p in _conv_model().parameters())
    assert 0 < direct["library"]["weights_bytes"] <= torch_params
    assert run_artifact(tmp_path / "direct", repeats=1, log=None)["ok"]


def test_folders_are_never_overwritten_without_force(art, tmp_path, monkeypatch):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    for force in (False, True):  # not an artifact: refused even with --force
        with pytest.raises(ArtifactError, match=r"not empty|not an opsdk artifact"):
            build_artifact(CONV, user, target="x86", entry_args=SMALL_CONV, force=force,
                           log=None)
    assert (user / "notes.txt").read_text() == "keep me"
    copy = tmp_path / "copy"
    shutil.copytree(art, copy)
    with pytest.raises(ArtifactError, match="pass --force"):
        build_artifact(CONV, copy, target="x86", entry_args=SMALL_CONV, log=None)
    # A build that fails late leaves the earlier artifact whole and no temporary folder.
    from opsdk.deploy import _artifact

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_artifact, "_export", broken)
    before = read_manifest(copy)["library"]["sha256"]
    with pytest.raises(OSError, match="No space"):
        build_artifact(CONV, copy, target="x86", entry_args=SMALL_CONV, force=True, log=None)
    assert read_manifest(copy)["library"]["sha256"] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "mine"]


def test_damaged_artifact_and_wrong_device_are_clear_errors(art, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(art, copy)
    lib = copy / "model.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        read_manifest(copy)
    assert cli(["run", str(copy)]) == 2
    assert "rebuild the artifact" in capsys.readouterr().err
    assert cli(["run", str(tmp_path)]) == 2
    assert "not an opsdk artifact" in capsys.readouterr().err
    cut = tmp_path / "cut"
    shutil.copytree(art, cut)
    m = json.loads((cut / "manifest.json").read_text())
    del m["outputs"]
    (cut / "manifest.json").write_text(json.dumps(m))
    assert cli(["run", str(cut)]) == 2
    assert "is incomplete" in capsys.readouterr().err
    assert cli(["run", str(art), "--emulate"]) == 2
    assert "--emulate runs aarch64 artifacts" in capsys.readouterr().err
    m = json.loads((art / "manifest.json").read_text())
    m["target"]["arch"] = "aarch64"
    shutil.copytree(art, tmp_path / "armish")
    (tmp_path / "armish" / "manifest.json").write_text(json.dumps(m))
    assert cli(["run", str(tmp_path / "armish")]) == 2
    assert "pass --rpc HOST:PORT" in capsys.readouterr().err
    # (a missing file is neither a model nor a decoder: refused before anything is loaded)
    assert cli(["build", str(tmp_path / "nope.py"), "-o", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli(["build", CONV, "-o", str(tmp_path / "o"), "--target", "armv9"]) == 2
    assert "unknown target 'armv9'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _symbolic_mlp():
    from tvm import relax, tirx

    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    rng = np.random.default_rng(0)
    w1 = relax.const(rng.standard_normal((16, 64)).astype("float32"))
    w2 = relax.const(rng.standard_normal((64, 8)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w1)))
            y = bb.emit_output(relax.op.matmul(h, w2))
        bb.emit_func_output(y)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("tir_var_upper_bound", {"n": 1024})
    return mod


def test_symbolic_dims_memory_is_planned_for_their_bound(tmp_path):
    x = np.ones((2, 16), "float32")
    m = build_artifact(_symbolic_mlp(), tmp_path / "a", target="x86", inputs=[x], log=None)
    assert m["inputs"][0]["shape"] == ["n", 16] and m["outputs"][0]["shape"] == ["n", 8]
    mem = m["memory"]
    # The hidden (n, 64) float32 activation, planned for n = 1024; the output at n = 2.
    assert mem["planned_for"] == {"n": 1024}
    assert mem["planned_intermediates_bytes"] == 1024 * 64 * 4
    assert mem["outputs_bytes"] == 2 * 8 * 4 and mem["at"] == {"n": 2}
    small = build_artifact(_symbolic_mlp(), tmp_path / "b", target="x86", inputs=[x],
                           max_dims={"n": 4}, log=None)
    assert small["memory"]["planned_intermediates_bytes"] == 4 * 64 * 4
    assert run_artifact(tmp_path / "b", inputs=[np.ones((4, 16), "float32")], repeats=1,
                        log=None)["ok"]
    with pytest.raises(ArtifactError, match=r"n=5, but the artifact's memory is planned for "
                                            r"n <= 4; rebuild with --max-dim n=5"):
        run_artifact(tmp_path / "b", inputs=[np.ones((5, 16), "float32")], log=None)
    with pytest.raises(ArtifactError, match=r"no symbolic input dim 'batch'; its symbolic "
                                            r"dims are n"):
        build_artifact(_symbolic_mlp(), tmp_path / "c", target="x86", inputs=[x],
                       max_dims={"batch": 4}, log=None)
    with pytest.raises(ArtifactError, match=r"below the example input's n=2"):
        build_artifact(_symbolic_mlp(), tmp_path / "c", target="x86", inputs=[x],
                       max_dims={"n": 1}, log=None)
    assert not (tmp_path / "c").exists()


def test_int8_artifact_checks_the_device_against_its_int8_host_build(tmp_path, capsys):
    model = str(ROOT / "examples" / "transformer_block.py")
    rc = cli(["build", model, "--target", "x86", "--int8", "--calibration", "4", "-o",
              str(tmp_path / "q"), "--model-arg", "dim=64", "--model-arg", "seq=16",
              "--model-arg", "batch=2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "int8:     4 dense layers; output vs float: relative RMSE" in text
    q = read_manifest(tmp_path / "q")["quantization"]
    assert len(q["int8_layers"]) == 4 and q["vs_float"]["rel_rmse"] < 0.02
    res = run_artifact(tmp_path / "q", repeats=1, log=None)
    (out,) = res["outputs"]
    # Pass/fail is against the int8 host build; torch's float output is information.
    assert res["ok"] and out["vs_host"]["bitexact"]
    assert out["vs_torch"]["informational"] and out["vs_torch"]["rel_rmse"] < 0.02


def test_onnx_file_builds_and_is_checked_against_onnxruntime(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).eval()
    path = tmp_path / "mlp.onnx"
    torch.onnx.export(model, (torch.randn(3, 16),), str(path), dynamo=False)
    m = build_artifact(str(path), tmp_path / "art", target="x86", log=None)
    assert m["model"]["framework"] == "onnxruntime"
    res = run_artifact(tmp_path / "art", repeats=1, log=None)
    assert res["ok"] and res["outputs"][0]["vs_onnxruntime"]["ok"]


def test_a_rebuild_from_the_cache_does_not_reschedule(tmp_path, monkeypatch):
    # The manifest's facts of the scheduled module (memory plan, kernels, weight bytes) are
    # kept with the compile-cache entry: an unchanged model's second build reads them back.
    import opsdk._pipeline

    monkeypatch.setenv("OPSDK_NO_CACHE", "0")
    monkeypatch.setenv("OPSDK_CACHE_DIR", str(tmp_path / "cache"))
    first = build_artifact(CONV, tmp_path / "a", target="x86", entry_args=SMALL_CONV, log=None)

    def replanned(*args, **kwargs):
        raise AssertionError("the scheduled module was recomputed")

    monkeypatch.setattr(opsdk._pipeline, "_replan", replanned)
    second = build_artifact(CONV, tmp_path / "b", target="x86", entry_args=SMALL_CONV,
                            log=None)
    first.pop("build_seconds"), second.pop("build_seconds")
    assert second == first
    run = run_artifact(tmp_path / "b", repeats=1, log=None)
    assert run["ok"], run


_DICT_MODEL = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return {"out": self.b(y), "aux": (y.mean((2, 3)),)}


def build_model():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(1, 3, 8, 8),)
'''


def test_a_model_returning_a_dict_is_checked_output_by_output(tmp_path):
    # torchvision's segmentation models return {"out": ...}: torch's outputs are stored
    # in torch.export's order, one array each (not one object array run cannot read)
    f = tmp_path / "seg.py"
    f.write_text(_DICT_MODEL)
    build_artifact(str(f), tmp_path / "art", target="x86", log=None)
    with np.load(tmp_path / "art" / "check" / "expected.npz") as z:
        assert sorted(z.files) == ["host_0", "host_1", "torch_0", "torch_1"]
        assert z["torch_0"].shape == (1, 2, 8, 8) and z["torch_1"].shape == (1, 4)
    res = run_artifact(tmp_path / "art", repeats=1, log=None)
    assert res["ok"] and len(res["outputs"]) == 2
    assert all(o["vs_torch"]["ok"] for o in res["outputs"])
    # an artifact whose expected outputs cannot be read says so, without a traceback
    np.savez(tmp_path / "art" / "check" / "expected.npz",
             torch_0=np.array([{"out": 1}], dtype=object), host_0=np.zeros(1))
    with pytest.raises(ArtifactError, match=r"cannot read the expected outputs.*--force"):
        run_artifact(tmp_path / "art", repeats=1, log=None)
