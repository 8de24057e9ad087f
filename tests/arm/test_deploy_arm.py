"""``opsdk build --target arm`` artifacts under emulated aarch64: ``opsdk run --emulate``
checks them against the host build and torch, a ``+dotprod`` artifact is refused on a CPU
without it before anything runs, and the cross-compiled C++ example's output under
qemu-aarch64 equals Python's bit for bit."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

from opsdk.cli import main as cli
from opsdk.deploy import FeatureMismatch, build_artifact, read_manifest, run_artifact
from opsdk.deploy._artifact import read_weights

pytestmark = pytest.mark.arm

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)


@pytest.fixture(scope="module")
def transformer(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("deploy_arm") / "transformer"
    build_artifact(str(EXAMPLES / "transformer_block.py"), out, target="arm",
                   entry_args={"dim": 64, "heads": 4, "seq": 16, "batch": 2},
                   with_runtime=True, log=None)
    return out


def test_emulated_run_matches_host_build_and_torch(transformer, capsys):
    m = read_manifest(transformer)
    assert m["target"]["features"] == ["neon"]
    assert all(k["rule"].startswith("neon.") for k in m["kernels"])
    assert m["library"]["runtime_included"] == ["runtime/libtvm_runtime.so",
                                                "runtime/libtvm_ffi.so"]
    res = run_artifact(transformer, emulate=True, repeats=2, log=None)
    assert res["ok"] and res["emulated"] and "not performance" in res["warning"]
    (out,) = res["outputs"]
    assert out["vs_host"]["ok"] and out["vs_torch"]["ok"]
    assert "neon" in res["features"]["device"]
    # The weights travel as the model has them; main_transform_params ran on the device.
    assert m["weights"]["storage"] == "file" and res["latency"]["load_ms"] > 0
    assert cli(["run", str(transformer), "--emulate", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "emulated timings are not performance" in text


def test_dotprod_artifact_is_refused_on_a_cpu_without_it(tmp_path, capsys):
    out = tmp_path / "conv"
    build_artifact(str(EXAMPLES / "conv_net.py"), out, target="arm-dotprod",
                   entry_args={"channels": 8, "size": 16, "batch": 2}, log=None)
    assert read_manifest(out)["target"]["features"] == ["neon", "dotprod"]
    with pytest.raises(FeatureMismatch, match=r"lacks \+dotprod"):
        run_artifact(out, emulate=True, qemu_cpu="cortex-a72", log=None)
    assert cli(["run", str(out), "--emulate", "--qemu-cpu", "cortex-a72"]) == 2
    assert "illegal instruction" in capsys.readouterr().err
    res = run_artifact(out, emulate=True, repeats=1, log=None)  # cortex-a76 has it
    assert res["ok"] and {"neon", "dotprod"} <= set(res["features"]["device"])


def test_cpp_example_under_qemu_matches_python_bit_for_bit(transformer, tmp_path):
    from opsdk.runners import EmulatedRunner
    from opsdk.runners._provision import arm_env

    exe = tmp_path / "deploy_run-aarch64"
    subprocess.run(["make", "-s", "-C", str(EXAMPLES / "deploy"), "ARCH=aarch64",
                    f"TARGET={exe}", f"PYTHON={sys.executable}"],
                   check=True)
    outdir = tmp_path / "out"
    outdir.mkdir()
    env = arm_env()
    # On a board: LD_LIBRARY_PATH=out/runtime ./deploy_run-aarch64 out/ INPUTS OUTPUTS.
    run_env = {**os.environ, "QEMU_LD_PREFIX": str(env.sysroot)}
    proc = subprocess.run(
        [env.qemu, "-E", f"LD_LIBRARY_PATH={transformer / 'runtime'}", str(exe),
         str(transformer), str(transformer / "check" / "inputs"), str(outdir)],
        capture_output=True, text=True, check=False, env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shape = read_manifest(transformer)["outputs"][0]["example_shape"]
    x = np.fromfile(transformer / "check" / "inputs" / "x.bin", "float32").reshape(2, 16, 64)
    with EmulatedRunner() as r:
        (want,) = r.run(transformer / "model.so", [x], weights=read_weights(transformer))
    got = np.fromfile(outdir / "out0.bin", "float32").reshape(shape)
    assert np.array_equal(got, want)


def test_run_over_rpc_to_a_board_server(transformer, standalone_server, capsys):
    """The board path: a TVM RPC server (here the emulated one a board's rpc_server stands
    for) at HOST:PORT; the artifact is uploaded, feature-checked, run, checked and timed."""
    with standalone_server("cortex-a72") as (_, port):
        rc = cli(["run", str(transformer), "--rpc", f"127.0.0.1:{port}", "--repeats", "2"])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert f"device: rpc 127.0.0.1:{port}" in text and "vs torch:" in text
        assert "features: needs neon; device has them" in text
        # The op bench on the same board: opsdk vs TVM's lowering, timed there.
        rc = cli(["bench", "layer_norm", "--target", "arm", "--rpc", f"127.0.0.1:{port}",
                  "--shapes", "64x48", "--dtypes", "float32", "--repeats", "2"])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert f"device: rpc 127.0.0.1:{port}" in text and "neon.rows" in text
    # Nothing listening: one clear line, no hang.
    assert cli(["run", str(transformer), "--rpc", f"127.0.0.1:{port}"]) == 2
    assert "cannot connect" in capsys.readouterr().err


def test_rpc_runner_reconnects_after_the_board_server_restarts(transformer, standalone_server):
    """A board's rpc_server restarted between two runs (a reboot, a crash): the next run
    opens a new session instead of failing on the dead one."""
    from opsdk.runners import runner_for

    x = np.fromfile(transformer / "check" / "inputs" / "x.bin", "float32").reshape(2, 16, 64)
    lib = transformer / "model.so"
    with standalone_server("cortex-a72") as (_, port):
        runner = runner_for("arm", rpc=f"127.0.0.1:{port}")
        (first,) = runner.run(lib, [x], weights=read_weights(transformer))
    try:
        with standalone_server("cortex-a72", port=port):
            (again,) = runner.run(lib, [x], weights=read_weights(transformer))
    finally:
        runner.close()
    assert np.array_equal(first, again)


def test_decoder_artifact_under_qemu_matches_the_host(tmp_path):
    from opsdk.deploy import build_decoder_artifact
    from opsdk.llm import DecoderConfig, random_weights

    cfg = DecoderConfig(vocab=64, width=64, layers=1, heads=2, positions=32)
    out = tmp_path / "dec"
    m = build_decoder_artifact(random_weights(cfg, seed=5), out, weights="int4",
                               target="arm-dotprod", log=None, reference=False,
                               with_runtime=True)
    assert m["decoder"]["activations"] == "q8_0"  # the dotprod integer rule
    assert all(k["rule"].startswith("neon.") for k in m["kernels"])
    res = run_artifact(out, emulate=True, repeats=1, log=None)
    assert res["ok"] and res["emulated"], res["outputs"]

    # The C++ program on the board (qemu, a dotprod CPU): the check entry's logits are the
    # host's bit for bit, and greedy tokens are those of the same weights built for x86.
    from opsdk.deploy import load_decoder
    from opsdk.runners._provision import arm_env

    exe = tmp_path / "deploy_run-aarch64"
    subprocess.run(["make", "-s", "-C", str(EXAMPLES / "deploy"), "ARCH=aarch64",
                    f"TARGET={exe}", f"PYTHON={sys.executable}"], check=True)
    env = arm_env()
    qemu = [env.qemu, "-cpu", "cortex-a76", "-E", f"LD_LIBRARY_PATH={out / 'runtime'}",
            str(exe), str(out)]
    run_env = {**os.environ, "QEMU_LD_PREFIX": str(env.sysroot)}
    got_dir = tmp_path / "got"
    got_dir.mkdir()
    proc = subprocess.run([*qemu, str(out / "check" / "inputs"), str(got_dir)],
                          capture_output=True, text=True, check=False, env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.fromfile(got_dir / "out0.bin", "float32").reshape(m["outputs"][0]["example_shape"])
    with np.load(out / "check" / "expected.npz") as z:
        assert np.array_equal(got, z["host_0"])
    host = tmp_path / "dec_x86"
    build_decoder_artifact(random_weights(cfg, seed=5), host, weights="int4", target="x86",
                           log=None, reference=False)
    want, _ = load_decoder(host).generate([1, 2, 3], 6)
    proc = subprocess.run([*qemu, "--generate", "1,2,3", "6"], capture_output=True, text=True,
                          check=False, env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ",".join(map(str, want))


_KINDS_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    """A 3-D conv, a transposed one, a pool, a bidirectional LSTM and a GRU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(),
                                  nn.Conv3d(8, 8, 3, padding=1, groups=8), nn.SiLU(),
                                  nn.MaxPool3d((1, 2, 2)))
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.lstm = nn.LSTM(4 * 8 * 6, 20, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(40, 12)

    def forward(self, x):
        y = self.up(self.conv(x))                      # (1, 4, 8, 8, 6)
        seq = y.permute(0, 2, 1, 3, 4).flatten(2)      # (1, 8, 192)
        h, _ = self.lstm(seq)
        z, hn = self.gru(h.transpose(0, 1))
        return z, hn


def build_model():
    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():
        m.conv[1].running_var.uniform_(0.5, 2.0)
    return m, (torch.randn(1, 2, 4, 8, 6),)
'''


def test_recurrent_layers_and_3d_convs_under_qemu_match_the_host_and_torch(tmp_path):
    # the recurrence kernels (loop nests with their own vectors) and the 3-D convs on the
    # conv2d rules, cross-compiled: every heavy kernel on a NEON rule, outputs as on x86
    src = tmp_path / "kinds.py"
    src.write_text(_KINDS_MODEL)
    out = tmp_path / "kinds"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build_artifact(str(src), out, target="arm", with_runtime=True, log=None)
    # channels-last held (a relax.stack of the GRU's h_n once made ConvertLayout fail)
    assert not [w for w in seen if "model's layout" in str(w.message)]
    m = read_manifest(out)
    rules = {k["rule"] for k in m["kernels"]}
    assert all(r.startswith("neon.") for r in rules), rules
    assert "neon.fallback" not in rules and "neon.extern" in rules, rules
    res = run_artifact(out, emulate=True, repeats=1, log=None)
    assert res["ok"], res["outputs"]
    for o in res["outputs"]:
        assert o["vs_host"]["ok"] and o["vs_torch"]["ok"], o


def test_cross_compile_links_kernels_built_apart_and_runs_like_the_host(tmp_path, monkeypatch):
    # for another machine the kernels are compiled in chunks, in parallel, and linked with
    # the cross compiler at compile time: the model is a library (nothing kept in a cache)
    # that runs under qemu as the host build runs on x86 (the sort kernel's top-k exactly)
    from tvm import relax

    from opsdk._kernelcache import LinkedLibrary
    from opsdk.model import compile_model
    from opsdk.runners import EmulatedRunner, LocalRunner

    monkeypatch.setenv("OPSDK_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8, 3, 3)).astype("float32")
    d = rng.standard_normal((32, 16)).astype("float32")
    x = relax.Var("x", relax.TensorType((1, 8, 10, 10), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.silu(relax.op.nn.conv2d(x, relax.const(w), padding=1)))
            y = bb.emit(relax.op.mean(y, axis=[2, 3]))
            y = bb.emit_output(relax.op.nn.gelu(relax.op.matmul(y, relax.const(d.T.copy()))))
            top = bb.emit_output(relax.op.topk(x, 3, axis=1, dtype="int32"))  # the sort kernel
        bb.emit_func_output(relax.Tuple([y, top[0], top[1]]))
    cm = compile_model(bb.get(), "arm")
    assert isinstance(cm.ex, LinkedLibrary) and cm.library == cm.ex.path
    assert cm.ex.path.read_bytes()[18] == 183  # e_machine: EM_AARCH64
    assert cm.kernel_build.hits == [] and len(cm.kernel_build.misses) >= 3
    assert not (tmp_path / "cache" / ".kernels").exists()
    assert all(k["rule"].startswith("neon.") for k in cm.kernels)
    inp = rng.standard_normal((1, 8, 10, 10)).astype("float32")
    with EmulatedRunner(cpu="cortex-a72") as emu:
        got, values, indices = emu.run(cm.ex, [inp])
    with LocalRunner() as host:
        want, *top = host.run(compile_model(bb.get(), "x86").ex, [inp])
    order = np.argsort(-inp, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(indices, order.astype("int32"))
    np.testing.assert_array_equal(values, np.take_along_axis(inp, order, axis=1))
    np.testing.assert_array_equal(top[1], indices)
    # NEON and AVX-512 sum the 72 + 16 products in other orders: float32 rounding of
    # K = 88 terms, K * 2**-23 ~ 1e-5 of the values' scale (about 1 here)
    np.testing.assert_allclose(got, want, rtol=0, atol=88 * 2.0**-23 * np.abs(want).max())
