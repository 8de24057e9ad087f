"""The model pipeline: constants folded and weights packed at compile time, epilogues fused
into their matmul / conv, every kernel of the examples scheduled by a rule (x86 and arm), the
model report and the model / GEMM benchmarks (fields only, never timed assertions)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx

import opsdk
from opsdk.model import LoadedModel, compile_model, load_model, report, within_tolerance

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
_EXAMPLES = ("transformer_block", "conv_net", "mobilenet_block")


def _kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def _dense_relu(n, k, m, rng):
    w = rng.standard_normal((k, m)).astype("float32")
    b = rng.standard_normal((m,)).astype("float32")
    x = relax.Var("x", relax.TensorType((n, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(relax.const(w.T.copy()))))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(b))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), w, b


def _run(ex, *arrays):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    while not isinstance(out, tvm.runtime.Tensor):  # a tuple of outputs: the first
        out = out[0]
    return out.numpy()


def test_epilogue_fused_and_weight_packed_at_compile_time():
    rng = np.random.default_rng(0)
    n = tirx.Var("n", "int64")
    mod, w, b = _dense_relu(n, 48, 40, rng)
    cm = compile_model(mod, "x86")
    ks = _kernels(cm.scheduled)
    # One kernel: the transpose folded, bias + ReLU fused, the packing evaluated.
    assert len(ks) == 1, list(ks)
    (name, f), = ks.items()
    assert "add" in name and "relu" in name
    assert f.attrs["opsdk.rule"] == "x86.matmul" and f.attrs["opsdk.kind"] == "matmul"
    assert not [k for k in ks if "weight_prepack" in k]  # folded into a packed constant
    for rows in (1, 7, 33):
        x = rng.standard_normal((rows, 48)).astype("float32")
        got = _run(cm.ex, x)
        want = np.maximum(x.astype(np.float64) @ w + b, 0)
        bound = 50 * 2.0**-24 * (np.abs(x) @ np.abs(w) + np.abs(b))
        assert np.all(np.abs(got - want) <= bound)


def test_opsdk_ops_keep_their_kernels_and_elementwise_ones_fuse():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 64)).astype("float32")
    x = relax.Var("x", relax.TensorType((16, 32), "float32"))
    gv = rng.standard_normal(32).astype("float32")
    g = relax.const(gv)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(opsdk.relax.layer_norm(x, g))
            y = bb.emit(relax.op.matmul(y, relax.const(w)))
            y = bb.emit_output(opsdk.relax.gelu(y))
        bb.emit_func_output(y)
    cm = compile_model(bb.get(), "x86")
    rules = {k: str(f.attrs["opsdk.rule"]) for k, f in _kernels(cm.scheduled).items()}
    ln = [k for k in rules if k.startswith("opsdk_layer_norm")]
    assert len(ln) == 1 and rules[ln[0]] == "x86.rows", rules
    fused = [k for k in rules if "matmul" in k and "gelu" in k]
    assert fused and rules[fused[0]] == "x86.matmul", rules
    xv = rng.standard_normal((16, 32)).astype("float32")
    ln = opsdk.get_op("layer_norm").reference(xv.astype(np.float64), gv.astype(np.float64),
                                              begin_axis=1)
    want = opsdk.get_op("gelu").reference(ln @ w)
    np.testing.assert_allclose(_run(cm.ex, xv), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", ["x86", "arm"])
@pytest.mark.parametrize("name", _EXAMPLES)
def test_every_kernel_of_the_examples_is_scheduled(name, target):
    # At the benchmark sizes (the files' DEFAULT_ARGS): the small ones keep some kernels
    # under the report's serial limit (conv_net's 3-channel NCHW -> NHWC transpose had no
    # vector instruction on arm at 56x56 and went unnoticed at 16x16).
    m = load_model(str(EXAMPLES / f"{name}.py"), baselines=False)
    rep = report(m, target, profile=False)
    assert rep.kernels
    assert not rep.problems, rep.format()
    for k in rep.kernels:
        assert k.rule != "generic", k
        if k.kind in ("matmul", "conv2d", "winograd"):  # heavy: register-tiled SIMD
            assert k.vectorized_loops and k.parallel_loops, k
            wide = ("neon",) if target == "arm" else ("zmm", "ymm")  # 8 channels: ymm
            assert sum(k.vector_ops.get(w, 0) for w in wide) > 0, k


def _conv_model(c, k, *, stride=1, kernel=3, groups=1, batch=None, rng):
    """NCHW ``relu(conv2d(x, w) + b)`` with constant weights (a conv + folded BN)."""
    n = batch if batch is not None else tirx.Var("n", "int64")
    w = rng.uniform(-1, 1, (k, c // groups, kernel, kernel)).astype("float32")
    b = rng.uniform(-1, 1, (k,)).astype("float32")
    x = relax.Var("x", relax.TensorType((n, c, 13, 11), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), strides=stride,
                                           padding=kernel // 2, groups=groups))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(b.reshape(1, k, 1, 1)))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), w, b


def test_3x3_convs_run_winograd_with_folded_weights_and_fused_epilogue():
    from opsdk.kernels.winograd import EXTRA_ROUNDINGS, winograd_abs
    from opsdk.kernels.winograd import _reference as direct

    rng = np.random.default_rng(3)
    mod, w, b = _conv_model(16, 24, rng=rng)
    cm = compile_model(mod, "x86")
    kinds = {k: str(f.attrs["opsdk.kind"]) for k, f in _kernels(cm.scheduled).items()}
    # One conv kernel, Winograd, with bias + ReLU fused into it and the weight transform
    # folded into a constant (no weight block left).
    (name,) = [k for k in kinds if "conv2d" in k]
    assert kinds[name] == "winograd" and "relu" in name, kinds
    f = _kernels(cm.scheduled)[name]
    assert f.attrs["opsdk.rule"] == "x86.winograd"
    assert 'T.sblock("wino_weight")' not in f.script()
    direct_cm = compile_model(mod, "x86", winograd=False)
    kinds = {str(f.attrs["opsdk.kind"]) for f in _kernels(direct_cm.scheduled).values()}
    assert "conv2d" in kinds and "winograd" not in kinds, kinds
    plain = opsdk.compile(mod, "x86", winograd=False)
    whc = np.transpose(w, (2, 3, 1, 0))
    for batch in (1, 3):  # one executable, symbolic batch
        x = rng.uniform(-2, 2, (batch, 16, 13, 11)).astype("float32")
        xh = np.transpose(x, (0, 2, 3, 1)).astype(np.float64)
        want = direct(xh, whc.astype(np.float64), b.astype(np.float64), activation="relu",
                      channels=24, padding=1)
        u = 2.0**-24
        n = 16 + EXTRA_ROUNDINGS + 2
        bound = n * u / (1 - n * u) * (winograd_abs(xh, whc, 1) + np.abs(b))
        for ex in (cm.ex, direct_cm.ex, plain):
            got = np.transpose(_run(ex, x), (0, 2, 3, 1))
            assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("case", [
    {"stride": 2}, {"kernel": 1}, {"groups": 16}, {"c": 8}, {"k": 8}])
def test_other_convs_stay_direct(case):
    rng = np.random.default_rng(4)
    kw = {"c": 16, "k": 16, **case}
    mod, _, _ = _conv_model(kw.pop("c"), kw.pop("k"), rng=rng, **kw)
    kinds = {f.attrs["opsdk.kind"] for f in _kernels(compile_model(mod, "x86").scheduled)
             .values()}
    assert "conv2d" in kinds and "winograd" not in kinds, kinds


def test_model_report_profile_and_json(tmp_path):
    m = load_model(str(EXAMPLES / "conv_net.py"), entry_args={})
    rep = report(m, "x86")
    timed = [k for k in rep.kernels if k.time_ms is not None]
    assert timed and rep.kernel_ms and rep.kernel_ms > 0
    assert sum(k.share for k in timed) == pytest.approx(1.0, abs=1e-6)
    # each kernel also timed in its place in a run, the sum the report's in-model figure
    assert all(k.model_ms and k.model_ms > 0 for k in timed)
    assert rep.model_kernel_ms == pytest.approx(sum(k.model_ms for k in timed))
    data = json.loads(rep.to_json())
    assert {k["name"] for k in data["kernels"]} == {k.name for k in rep.kernels}
    assert data["problems"] == []
    text = rep.format()
    for k in rep.kernels:
        assert k.name in text
    assert "problems: none" in text
    # Every timed kernel's rates and its share of this machine's roof, measured with
    # opsdk's own kernels (GEMM GFLOP/s, copy GB/s per working-set size).
    assert rep.roof is not None and rep.roof.gflops > 0 and rep.roof.threads == rep.threads
    for k in timed:
        assert k.bytes and k.gbps and k.gbps > 0 and k.roof_pct and k.roof_pct > 0, k
        per_call_s = k.time_ms / 1e3 / k.calls
        assert k.gbps == pytest.approx(k.bytes / per_call_s / 1e9)
    conv = next(k for k in timed if k.kind == "conv2d")
    assert conv.flops and conv.gflops == pytest.approx(conv.flops / conv.bytes * conv.gbps)
    assert data["roof"]["gflops"] == pytest.approx(rep.roof.gflops)
    assert "roof on" in text and "GF/s" in text and "in the model" in text


def test_model_bench_fields():
    from opsdk.bench import run_model_bench

    m = load_model(str(EXAMPLES / "transformer_block.py"), entry_args={})
    cands = ["opsdk", "tvm_default", "torch"]
    try:
        import onnxruntime  # noqa: F401

        cands.append("onnxruntime")
    except ImportError:
        pass
    (row,) = run_model_bench([m], repeats=1, budget_ms=1, candidates=cands)
    for c in cands:
        assert row[f"{c}_ms"] > 0, row
        assert row[f"check_{c}"]["ok"], row
    for c in cands[1:]:
        assert row[f"speedup_{c}"] > 0
    assert row["rules"] and "generic" not in row["rules"]


def test_gemm_bench_fields():
    from opsdk.bench import format_gemm_table, run_gemm_bench

    (row,) = run_gemm_bench([(40, 48, 24)], repeats=1, budget_ms=1)
    assert row["rule"] == "x86.matmul" and row["within_bound"]
    assert row["opsdk_gflops"] > 0 and row["torch_gflops"] > 0 and row["pct_torch"] > 0
    assert "40x48x24" in format_gemm_table([row])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opsdk", *args], capture_output=True,
                          text=True, timeout=600)


def test_explain_model_cli(tmp_path):
    out = tmp_path / "report.json"
    r = _cli("explain", "--model", str(EXAMPLES / "mobilenet_block.py"), "--model-arg",
             "size=16", "--model-arg", "cin=16", "--model-arg", "cout=16",
             "--no-profile", "--json", str(out), "--strict")
    assert r.returncode == 0, r.stderr
    assert "x86.conv2d" in r.stdout and "problems: none" in r.stdout
    assert json.loads(out.read_text())["kernels"]
    bad = _cli("explain", "--model", "no/such/model.py")
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_explain_op_cli_writes_json_and_takes_bench_style_shapes(tmp_path):
    out = tmp_path / "ln.json"
    r = _cli("explain", "layer_norm", "--target", "x86", "--shape", "64x768", "--no-asm",
             "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["op"] == "layer_norm" and data["rule"] == "x86.rows"
    assert "T.int64(64), T.int64(768)" in data["tir"]
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    bad = _cli("explain", "layer_norm", "--shape", "64xabc")
    assert bad.returncode == 2 and "4096x768" in bad.stderr


def test_bench_gemm_cli():
    r = _cli("bench", "--gemm", "32x48x16", "--repeats", "1", "--budget-ms", "1")
    assert r.returncode == 0, r.stderr
    assert "32x48x16" in r.stdout and "x86.matmul" in r.stdout
    bad = _cli("bench", "--gemm", "32x48")
    assert bad.returncode == 2 and "MxNxK" in bad.stderr


def test_loaded_model_from_an_irmodule_benchmarks_without_peers():
    from opsdk.bench import run_model_bench

    rng = np.random.default_rng(2)
    mod, _, _ = _dense_relu(8, 16, 24, rng)
    m = LoadedModel("dense", mod, mod, [rng.standard_normal((8, 16)).astype("float32")])
    (row,) = run_model_bench([m], repeats=1, budget_ms=1,
                             candidates=["opsdk", "tvm_default", "onnxruntime"])
    assert row["opsdk_ms"] > 0 and row["speedup_tvm_default"] > 0
    assert row["torch_ms"] is None and "onnxruntime" in row["errors"]


def test_avx2_target_gets_the_same_rules_with_256_bit_vectors():
    """The x86 rules take their vector width from the target: an AVX2-only CPU (haswell)
    gets 8-lane tiles, and the code runs on this host (which has AVX2) and matches torch."""
    host = opsdk.targets.target_features(opsdk.target("x86"))
    if "avx2" not in host:
        pytest.skip("host without AVX2")
    avx2 = {"kind": "llvm", "mcpu": "haswell"}
    m = load_model(str(EXAMPLES / "mobilenet_block.py"), entry_args={}, dynamic_batch=True)
    rep = report(m, avx2, profile=False)
    assert not rep.problems, rep.format()
    heavy = [k for k in rep.kernels if k.kind in ("conv2d", "matmul")]
    assert heavy and all(k.vector_ops.get("ymm", 0) and not k.vector_ops.get("zmm")
                         for k in heavy), rep.format()
    import torch

    cm = compile_model(m.opsdk_mod, avx2)
    got = _run(cm.ex, *m.inputs)
    with torch.no_grad():
        want = m.torch_module(*m.torch_args).numpy()
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))


class _SqueezeExcite(torch.nn.Module):
    """MobileNetV3's squeeze-excite: its second 1x1 conv fuses with hard-sigmoid and the
    product with the block's input, a conv epilogue the conv rule does not take (today)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Conv2d(c, 8, 1), torch.nn.Conv2d(8, c, 1)

    def forward(self, x):
        w = torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))
        return x * torch.nn.functional.hardsigmoid(self.fc2(w))


def test_a_family_kernel_on_the_catch_all_rule_is_a_problem(monkeypatch):
    # `explain --model` said "problems: none" while MobileNetV3's convs ran on x86.fallback
    # (their hardsigmoid epilogue, since folded). A conv rule declining the convs stands in.
    from opsdk.model import FAMILY_KINDS

    monkeypatch.setattr("opsdk.schedules.cpu.x86.schedule_conv2d", lambda *a, **k: None)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), _SqueezeExcite(16)).eval()
    m = LoadedModel.from_torch("se", net, (torch.randn(1, 3, 16, 16),), baselines=False)
    rep = report(m, "x86", profile=False, asm=False, cache=False)
    on_catch_all = [k for k in rep.kernels if k.kind in FAMILY_KINDS
                    and k.rule == "x86.fallback"]
    assert on_catch_all, rep.format()  # the case this test is about still exists
    for k in rep.kernels:
        named = any("catch-all rule" in p for p in k.problems)
        assert named == (k in on_catch_all), k
    assert "problems: none" not in rep.format()


def test_a_rule_that_raised_on_a_kernel_is_a_problem_in_the_report():
    # quantize / explain showed only a warning at compile time, then "problems: none".
    from opsdk import schedules

    @schedules.rule("kind:matmul", "cpu", name="test.matmul_raises", priority=10_000)
    def _raises(func, target):
        raise RuntimeError("boom")

    x = relax.Var("x", relax.TensorType((8, 32), "float32"))
    w = relax.const(np.ones((32, 24), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(y)
    try:
        with pytest.warns(UserWarning, match="test.matmul_raises failed"):
            rep = report(bb.get(), "x86", profile=False, asm=False, cache=False)
    finally:
        schedules._RULES[:] = [r for r in schedules._RULES if r.name != "test.matmul_raises"]
    (k,) = [k for k in rep.kernels if k.kind == "matmul"]
    assert k.rule == "x86.matmul"  # the next rule took it
    assert k.problems == ["schedule rule failed: test.matmul_raises: RuntimeError: boom"]
    assert "test.matmul_raises" in rep.format()


@pytest.mark.parametrize(("kernel", "stride", "pad", "out_pad", "bias"), [
    (2, 2, 0, 0, True),     # UNet / FPN upsampling: a 1x1 conv and a depth-to-space
    (2, 3, 0, 2, False),    # kernel under the stride: the third phase has no tap
    (3, 2, 1, 1, True),     # taps overlap; the kernel zero-padded to 4, the output cropped
    ((4, 3), 2, (1, 0), 0, True),  # per-axis kernel and padding
    (3, 1, 1, 0, True),     # stride 1: a conv with the kernel reversed
], ids=["k2s2", "k2s3op2_nobias", "k3s2p1op1", "k4x3s2p1x0", "k3s1p1"])
def test_a_transposed_conv_among_channels_last_convs_is_lowered_and_right(
        kernel, stride, pad, out_pad, bias):
    # A UNet's ConvTranspose2d between convs took the convs' NHWC from ConvertLayout; TVM
    # legalizes only NCHW transposed convs, so it reached VM codegen unlowered. Now each runs
    # as a conv (the sub-pixel form: no multiplies by the zeros of a dilated input) on the
    # conv rules; H != W catches a swapped axis of the depth-to-space.
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(16, 8, kernel, stride=stride, padding=pad,
                                 output_padding=out_pad, bias=bias), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, padding=1)).eval()
    x = torch.randn(1, 3, 10, 6)
    m = LoadedModel.from_torch("up", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    rules = cm.rule_counts()
    assert "x86.fallback" not in rules and "generic" not in rules, rules
    names = [k["name"] for k in cm.kernels]
    assert not any("conv2d_transpose" in n for n in names), names
    with torch.no_grad():
        ref = net(x).numpy()
    got = _run(cm.ex, x.numpy())
    assert got.shape == ref.shape
    assert within_tolerance(got, ref)["ok"], within_tolerance(got, ref)


class _Conv1dNet(torch.nn.Module):
    def __init__(self, kernel, stride, pad, dilation, groups, bias):
        super().__init__()
        self.a = torch.nn.Conv1d(8, 32, kernel, stride, pad, dilation, groups, bias=bias)
        self.b = torch.nn.Conv1d(32, 16, 3, padding=1)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize(("kernel", "stride", "pad", "dilation", "groups", "bias"), [
    (10, 5, 0, 1, 1, False),  # wav2vec2's first feature conv
    (3, 2, 0, 1, 1, True),    # its later ones, and Whisper's second
    (3, 1, 1, 2, 1, True),    # dilated (a TCN)
    (16, 1, 8, 1, 4, True),   # wav2vec2's positional conv: grouped, an even kernel
    (5, 1, 2, 1, 8, True),    # depthwise
], ids=["k10s5", "k3s2", "k3d2", "k16g4", "dw5"])
def test_a_conv1d_runs_as_a_one_row_conv2d_on_the_conv_rules(
        kernel, stride, pad, dilation, groups, bias):
    # TVM's conv1d (NCW) had no opsdk rule: wav2vec2's feature encoder ran on the catch-all
    # rule at 21 GFLOP/s (324 ms of kernels). It is now a conv2d over a 1-row image,
    # channels-last on the conv rules like any other.
    torch.manual_seed(0)
    net = _Conv1dNet(kernel, stride, pad, dilation, groups, bias).eval()
    x = torch.randn(1, 8, 53)
    m = LoadedModel.from_torch("conv1d", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    rules = cm.rule_counts()
    assert "x86.fallback" not in rules and "generic" not in rules, rules
    assert rules.get("x86.conv2d", 0) >= 2, rules
    names = [k["name"] for k in cm.kernels]
    assert not any("conv1d" in n for n in names), names
    # the bias and GELU in the first conv's epilogue (not after its squeeze), and the two
    # convs channels-last between them: a transpose in and one out at most
    assert not any(n.startswith("fused_squeeze") for n in names), names
    assert sum("transpose" in n for n in names) <= 2, names
    with torch.no_grad():
        ref = net(x).numpy()
    got = _run(cm.ex, x.numpy())
    assert got.shape == ref.shape
    assert within_tolerance(got, ref)["ok"], within_tolerance(got, ref)


class _Conv3dNet(torch.nn.Module):
    def __init__(self, kernel, stride, pad, dilation, groups, bias):
        super().__init__()
        self.a = torch.nn.Conv3d(8, 16, kernel, stride, pad, dilation, groups, bias=bias)
        self.bn = torch.nn.BatchNorm3d(16)
        self.b = torch.nn.Conv3d(16, 8, 3, padding=1)

    def forward(self, x):
        return self.b(torch.nn.functional.silu(self.bn(self.a(x)))).mean((2, 3, 4))


@pytest.mark.parametrize(("kernel", "stride", "pad", "dilation", "groups", "bias", "batch"), [
    (3, 1, 1, 1, 1, True, 1),                      # C3D / a 3-D UNet's conv
    ((3, 3, 3), (2, 2, 2), 1, 1, 1, False, 2),     # strided, a batch of two clips
    ((1, 3, 3), (1, 2, 2), (0, 1, 1), 1, 1, True, 1),  # (2+1)D's spatial conv
    ((3, 1, 1), 1, (1, 0, 0), 1, 1, True, 1),      # its temporal conv
    (3, 1, 2, 2, 2, True, 1),                      # dilated, grouped
    (3, 1, 1, 1, 8, False, 1),                     # depthwise (X3D): 2 channels a group out
], ids=["k3", "k3s2b2", "k133s122", "k311", "k3d2g2", "dw3"])
def test_a_conv3d_runs_as_a_conv2d_over_depth_windows(
        kernel, stride, pad, dilation, groups, bias, batch):
    # TVM legalizes conv3d as an NCDHW loop nest that no rule took: a small video net's convs
    # ran on the catch-all rule at 12-50 GFLOP/s (0.32x onnxruntime). It is now an NHWC
    # conv2d over its depth windows, on the conv rules; its BatchNorm folds into it.
    torch.manual_seed(0)
    net = _Conv3dNet(kernel, stride, pad, dilation, groups, bias).eval()
    with torch.no_grad():
        net.bn.running_mean.normal_(0, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(batch, 8, 9, 14, 13)
    m = LoadedModel.from_torch("conv3d", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    rules = cm.rule_counts()
    assert "x86.fallback" not in rules and "generic" not in rules, rules
    assert rules.get("x86.conv2d", 0) + rules.get("x86.winograd", 0) >= 2, rules
    names = [k["name"] for k in cm.kernels]
    assert not any("conv3d" in n or "batch_norm" in n for n in names), names
    # the bias / BN shift and the SiLU run in the conv's epilogue, not after its reshape
    assert not any(n.startswith("fused_reshape") for n in names), names
    with torch.no_grad():
        ref = net(x).numpy()
    got = _run(cm.ex, x.numpy())
    assert got.shape == ref.shape
    assert within_tolerance(got, ref)["ok"], within_tolerance(got, ref)


@pytest.mark.parametrize(("kernel", "stride", "pad", "out_pad", "bias"), [
    (2, 2, 0, 0, True),                   # a 3-D UNet's upsampling: a 1x1x1 conv
    (3, 2, 1, 1, False),                  # odd kernel, output padding
    ((4, 4, 4), 2, 1, 0, True),           # k = 2s
    ((1, 2, 2), (1, 2, 2), 0, 0, True),   # spatial only (a video decoder)
], ids=["k2s2", "k3s2op1", "k4s2p1", "k122"])
def test_a_conv_transpose3d_imports_and_runs_as_a_conv2d(kernel, stride, pad, out_pad, bias):
    # TVM 0.27's importer refused it ("Unsupported transposed convolution dimensionality: 5");
    # now Relax's conv3d_transpose, in its sub-pixel form: a conv3d, so a conv2d.
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv3d(4, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.ConvTranspose3d(8, 6, kernel, stride=stride, padding=pad,
                                 output_padding=out_pad, bias=bias),
        torch.nn.Conv3d(6, 4, 3, padding=1)).eval()
    x = torch.randn(1, 4, 5, 7, 6)
    m = LoadedModel.from_torch("up3d", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    rules = cm.rule_counts()
    assert "x86.fallback" not in rules and "generic" not in rules, rules
    names = [k["name"] for k in cm.kernels]
    assert not any("conv3d" in n for n in names), names
    with torch.no_grad():
        ref = net(x).numpy()
    got = _run(cm.ex, x.numpy())
    assert got.shape == ref.shape
    assert within_tolerance(got, ref)["ok"], within_tolerance(got, ref)


@pytest.mark.parametrize(("kernel", "stride", "pad"), [(16, 8, 4), (4, 2, 1), (3, 1, 1)],
                         ids=["k16s8", "k4s2", "k3s1"])
def test_a_conv_transpose1d_runs_on_the_conv_rules(kernel, stride, pad):
    # a vocoder's (HiFi-GAN's) upsampling: TVM's conv1d_transpose was on the catch-all rule
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(8, 16, 7, padding=3), torch.nn.LeakyReLU(0.1),
        torch.nn.ConvTranspose1d(16, 8, kernel, stride=stride, padding=pad)).eval()
    x = torch.randn(1, 8, 33)
    m = LoadedModel.from_torch("up1d", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    rules = cm.rule_counts()
    assert "x86.fallback" not in rules and "generic" not in rules, rules
    with torch.no_grad():
        ref = net(x).numpy()
    got = _run(cm.ex, x.numpy())
    assert got.shape == ref.shape
    assert within_tolerance(got, ref)["ok"], within_tolerance(got, ref)


def test_an_op_no_lowering_takes_is_named_not_an_internal_error():
    # TVM leaves a call its legalization does not take (a channels-last transposed conv) in
    # place; VM codegen then failed with "InternalError: CodeGenVM cannot emit this Relax
    # operator" (a UNet's ConvTranspose2d did, before ChannelsLast kept it NCHW).
    from opsdk.errors import UnloweredOpError

    x = relax.Var("x", relax.TensorType((1, 4, 8, 8, 4), "float32"))
    w = relax.const(np.ones((4, 2, 2, 2, 2), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.conv3d_transpose(
                x, w, strides=2, data_layout="NDHWC", kernel_layout="IODHW"))
        bb.emit_func_output(y)
    with pytest.raises(UnloweredOpError, match=r"relax\.nn\.conv3d_transpose\(.*NDHWC"):
        compile_model(bb.get(), "x86", cache=False)


class _ConvPad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.Conv2d(16, 8, 2)

    def forward(self, x):
        return self.b(torch.nn.functional.pad(torch.relu(self.a(x)), (0, 1, 0, 1)))


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_pad_after_a_conv_is_not_its_epilogue(channels_last):
    # TVM calls a constant pad elementwise (each output reads x at its own index), so
    # FuseOps made it the conv's epilogue, and the conv rule never wrote the padded border
    # (uninitialized values, up to 1e30); a kernel whose shape changes is injective now.
    torch.manual_seed(0)
    net, x = _ConvPad().eval(), torch.randn(1, 3, 32, 32)
    mod = opsdk.frontend.from_torch(torch.export.export(net, (x,)))
    from opsdk._pipeline import schedule_passes

    tgt = opsdk.target("x86")
    passes = schedule_passes(tgt, channels_last=channels_last)
    cut = [p.info.name for p in passes].index("opsdk.ScheduleKernels")
    with tgt:
        fused = tvm.transform.Sequential(passes[:cut])(mod)
    names = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert not any("conv2d" in n and "pad" in n for n in names), names
    ex = tvm.compile(opsdk.pipeline(tgt, channels_last=channels_last)(mod), target=tgt)
    got = _run(ex, x.numpy())
    want = net(x).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()
