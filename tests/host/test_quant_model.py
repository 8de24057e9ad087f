"""``opsdk.quant.quantize_model`` on imported models: which layers become int8, bit-exact
plumbing of one layer against the qdense reference, end-to-end agreement with float, the
sensitivity report, mixed precision, calibration methods, and the ``opsdk quantize`` CLI."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import opsdk
from opsdk.cli import main as cli
from opsdk.quant import QuantConfig, find_sites, quantize_dense, quantize_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))


def _run(mod, inputs, target="x86"):
    vm = relax.VirtualMachine(opsdk.compile(mod, target), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    while not isinstance(out, tvm.runtime.Tensor):
        out = out[0]
    return out.numpy()


@pytest.fixture(scope="module")
def block():
    import transformer_block as tb

    model, (x,) = tb.build_model(dim=64, heads=4, seq=16, batch=2)
    mod = opsdk.transform.FuseIntoOps()(opsdk.frontend.from_torch(
        torch.export.export(model, (x,))))
    rng = np.random.default_rng(1)
    calib = [rng.standard_normal(x.shape).astype("float32") for _ in range(8)]
    return mod, x.numpy(), calib


def test_sites_are_the_constant_weight_dense_layers(block):
    mod, _, _ = block
    sites = find_sites(mod)
    # qkv, proj, fc1 (+ bias_gelu), fc2; attention's Q K^T and P V multiply activations.
    assert [s.shape for s in sites] == [(64, 192), (64, 64), (64, 256), (256, 64)]
    assert [s.bias is not None for s in sites] == [True] * 4
    assert [s.gelu for s in sites] == [False, False, True, False]


def test_block_quantized_matches_float_within_two_percent(block):
    mod, x, calib = block
    qm = quantize_model(mod, iter(calib))  # a stream, read once
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    assert counts["opsdk.qdense"] == 4 and counts["opsdk.quantize"] == 4
    # Softmax and the layer norms stay float; the GELU after fc1 too.
    assert counts["opsdk.softmax"] == 1 and counts["opsdk.layer_norm"] == 2
    assert counts["opsdk.gelu"] == 1 and "opsdk.bias_gelu" not in counts
    ref, got = _run(mod, [x]), _run(qm.mod, [x])
    rel = np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref**2))
    assert 0 < rel < 0.02
    rows = qm.sensitivity()
    errors = [r["rel_rmse"] for r in rows]
    assert errors == sorted(errors, reverse=True) and len(rows) == 4  # worst first
    assert all(0 < r["rel_rmse"] < 0.05 and r["cosine"] > 0.999 for r in rows)
    report = opsdk.model.report(qm.mod, "x86", profile=False, asm=False)
    assert not report.problems, report.problems  # every kernel scheduled, none serial
    # constant weights packed once at compile time (their own folded function)
    if "avx512vnni" in opsdk.targets.target_features(opsdk.target("x86")):
        assert all(k.name.endswith("_prepacked") for k in report.kernels if "qdense" in k.name)


def test_one_layer_is_bit_exact_with_the_qdense_reference():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 32)).astype("float32")
    b = rng.standard_normal(32).astype("float32")
    x = relax.Var("x", relax.TensorType((3, 5, 48), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))
            y = bb.emit_output(relax.op.add(y, relax.const(b)))
        bb.emit_func_output(y)
    mod = bb.get()
    data = [rng.standard_normal((3, 5, 48)).astype("float32") for _ in range(3)]
    for cfg in (QuantConfig(), QuantConfig(weights="per_tensor", activations="symmetric")):
        qm = quantize_model(mod, data, cfg)
        (site,) = qm.sites
        dq = quantize_dense(w.T, b, site.act, per_channel=cfg.weights == "per_channel")
        want = dq.run(data[0].reshape(15, 48)).reshape(3, 5, 32)
        assert np.array_equal(_run(qm.mod, [data[0]]), want)
        assert (site.act.zero_point == 0) == (cfg.activations == "symmetric")



@pytest.mark.parametrize("fc2_bias", [False, True])
def test_dense_relu_dense_chain_is_bit_exact(fc2_bias):
    # A ReLU FFN (MobileBERT's): fc1 requantizes straight to fc2's input parameters (zero
    # point -128: saturation is the ReLU), so fc2 has no quantize of its own. With a bias
    # fc2's matmul is not its root (the add is): the float matmul of the now int8 input
    # must not be emitted (it failed to type).
    from opsdk.ops.qdense import _reference as qdense_ref

    rng = np.random.default_rng(0)
    w1, b1 = rng.standard_normal((24, 48)).astype("float32"), rng.standard_normal(48)
    w2 = rng.standard_normal((48, 16)).astype("float32")
    b2 = rng.standard_normal(16).astype("float32") if fc2_bias else None
    x = relax.Var("x", relax.TensorType((2, 5, 24), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w1)))
            y = bb.emit(relax.op.add(y, relax.const(b1.astype("float32"))))
            y = bb.emit(relax.op.nn.relu(y))
            y = bb.emit(relax.op.matmul(y, relax.const(w2)))
            if b2 is not None:
                y = bb.emit(relax.op.add(y, relax.const(b2)))
            y = bb.emit_output(y)
        bb.emit_func_output(y)
    data = [rng.standard_normal((2, 5, 24)).astype("float32") for _ in range(3)]
    qm = quantize_model(bb.get(), data)
    s1, s2 = qm.sites
    assert s2.act.zero_point == -128
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    assert counts["opsdk.qdense"] == 2 and counts["opsdk.quantize"] == 1
    q1 = quantize_dense(w1.T, b1.astype("float32"), s1.act)
    mid = q1.run(data[0].reshape(10, 24), out_dtype="int8", out=s2.act)
    q2 = quantize_dense(w2.T, b2, s2.act)
    want = qdense_ref(mid, q2.w_q, q2.w_scale, q2.bias_q, **q2.qdense_attrs())
    assert np.array_equal(_run(qm.mod, [data[0]]), want.reshape(2, 5, 16))


def _conv_model(w1, b1, w2=None):
    """conv(+bias) NCHW, and with ``w2`` a ReLU and a second conv after it."""
    x = relax.Var("x", relax.TensorType((2, w1.shape[1], 9, 11), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w1), padding=1))
            y = bb.emit(relax.op.add(y, relax.const(b1.reshape(1, -1, 1, 1))))
            if w2 is not None:
                y = bb.emit(relax.op.nn.relu(y))
                y = bb.emit(relax.op.nn.conv2d(y, relax.const(w2), strides=2))
            y = bb.emit_output(y)
        bb.emit_func_output(y)
    return bb.get()


def test_conv_layers_are_bit_exact_with_the_qconv2d_reference():
    from opsdk.ops.qconv2d import _reference as qconv_ref
    from opsdk.quant import quantize_conv2d

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 5, 3, 3)).astype("float32")
    b1 = rng.standard_normal(16).astype("float32")
    w2 = rng.standard_normal((8, 16, 1, 1)).astype("float32")
    data = [rng.standard_normal((2, 5, 9, 11)).astype("float32") for _ in range(3)]
    # One conv: quantize -> qconv2d (run in NHWC inside; the transposes are exact).
    qm = quantize_model(_conv_model(w1, b1), data)
    (site,) = qm.sites
    assert site.name == "conv0" and site.conv["layout"] == "NHWC"
    want = quantize_conv2d(w1, b1, site.act, padding=1).run(data[0])
    assert np.array_equal(_run(qm.mod, [data[0]]), want)
    # conv -> ReLU -> conv: the first requantizes straight to the second's input parameters
    # (a zero point at -128: saturation is the ReLU), so one quantize is left.
    qm = quantize_model(_conv_model(w1, b1, w2), data)
    s1, s2 = qm.sites
    assert s2.act.zero_point == -128
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    assert counts["opsdk.qconv2d"] == 2 and counts["opsdk.quantize"] == 1
    assert "relax.nn.relu" not in opsdk.transform.op_counts(qm.mod, "relax.nn.")
    q1 = quantize_conv2d(w1, b1, s1.act, padding=1)
    mid = q1.run(data[0], out_dtype="int8", out=s2.act)
    q2 = quantize_conv2d(w2, None, s2.act, stride=2)
    want = qconv_ref(mid, q2.w_q, q2.w_scale, q2.bias_q, **q2.qconv2d_attrs())
    assert np.array_equal(_run(qm.mod, [data[0]]), want)



def test_relu6_depthwise_chain_is_bit_exact():
    # MobileNet's expand -> ReLU6 -> depthwise -> ReLU6 -> project: all int8 between, the
    # clamps folded into saturation (the calibrated ranges lie within [0, 6]).
    from opsdk.ops.qconv2d import _reference as qconv_ref
    from opsdk.quant import quantize_conv2d

    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((12, 4, 1, 1)) * 0.5).astype("float32")
    wd = rng.standard_normal((12, 1, 3, 3)).astype("float32") * 0.3
    w3 = rng.standard_normal((6, 12, 1, 1)).astype("float32")
    x = relax.Var("x", relax.TensorType((1, 4, 9, 9), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w1)))
            y = bb.emit(relax.op.clip(y, 0.0, 6.0))
            y = bb.emit(relax.op.nn.conv2d(y, relax.const(wd), padding=1, groups=12))
            y = bb.emit(relax.op.clip(y, 0.0, 6.0))
            y = bb.emit_output(relax.op.nn.conv2d(y, relax.const(w3)))
        bb.emit_func_output(y)
    data = [rng.standard_normal((1, 4, 9, 9)).astype("float32") for _ in range(4)]
    qm = quantize_model(bb.get(), data)
    s1, s2, s3 = qm.sites
    assert s2.conv["depthwise"] and s2.act.zero_point == s3.act.zero_point == -128
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    assert counts["opsdk.qconv2d"] == 3 and counts["opsdk.quantize"] == 1
    q1 = quantize_conv2d(w1, None, s1.act)
    q2 = quantize_conv2d(wd, None, s2.act, padding=1, depthwise=True)
    q3 = quantize_conv2d(w3, None, s3.act)
    mid = q1.run(data[0], out_dtype="int8", out=s2.act)
    mid = qconv_ref(mid, q2.w_q, q2.w_scale, q2.bias_q, **q2.qconv2d_attrs("int8", s3.act))
    want = qconv_ref(mid, q3.w_q, q3.w_scale, q3.bias_q, **q3.qconv2d_attrs())
    assert np.array_equal(_run(qm.mod, [data[0]]), want)
    # Symmetric activations put the zero point at 0: the clamps' lower bound 0 cuts inside
    # the int8 range, saturation is not the clamp, so no chain (each conv quantizes its input).
    qm = quantize_model(bb.get(), data, QuantConfig(activations="symmetric"))
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    assert counts["opsdk.quantize"] == 3 and counts["opsdk.qconv2d"] == 3

def test_conv_net_quantized_matches_float_within_two_percent():
    import conv_net

    model, (x,) = conv_net.build_model()
    mod = opsdk.transform.FuseIntoOps()(opsdk.frontend.from_torch(
        torch.export.export(model, (x,))))
    rng = np.random.default_rng(1)
    calib = [rng.standard_normal(x.shape).astype("float32") for _ in range(8)]
    qm = quantize_model(mod, calib)
    assert qm.quantized == ["conv0", "conv1", "conv2", "dense0"]
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    # conv1 -> ReLU -> conv2 stays int8: 3 quantizes for 4 layers; GroupNorm stays float
    assert counts["opsdk.qconv2d"] == 3 and counts["opsdk.quantize"] == 3
    assert counts["opsdk.group_norm"] == 1
    ref, got = _run(mod, [x.numpy()]), _run(qm.mod, [x.numpy()])
    rel = np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref**2))
    assert 0 < rel < 0.02
    rows = qm.sensitivity()
    assert len(rows) == 4 and all(0 < r["rel_rmse"] < 0.05 for r in rows)
    report = opsdk.model.report(qm.mod, "x86", profile=False, asm=False)
    assert not report.problems, report.problems
    convs = [k for k in report.kernels if "qconv2d" in k.name]
    if "avx512vnni" in opsdk.targets.target_features(opsdk.target("x86")):
        assert [k.rule for k in convs] == ["x86.qconv2d_vnni"] * 3
        assert all(k.name.endswith("_prepacked") for k in convs)


def _dense_model(scale: float = 1.0):
    """dense0 -> ReLU -> dense1; a large ``scale`` makes dense1's input overflow."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            w = np.full((8, 8), scale, "float32")
            y = bb.emit(relax.op.nn.relu(relax.op.matmul(x, relax.const(w))))
            y = bb.emit_output(relax.op.matmul(y, relax.const(w)))
        bb.emit_func_output(y)
    return bb.get()


def _no_layer_model():
    x = relax.Var("x", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, x))  # two activations: not a layer
        bb.emit_func_output(y)
    return bb.get()


_GOOD = np.ones((4, 8), "float32")
_NAN = _GOOD.copy()
_NAN[1, 2] = np.nan


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        (_dense_model, [], r"the calibration data is empty"),
        (_dense_model, [np.ones((4, 9), "float32")],
         r"calibration batch 0, input 'x': shape \(4, 9\); the model takes \(4, 8\)"),
        (_dense_model, [_GOOD, np.ones((4, 8), "float64")],
         r"calibration batch 1, input 'x': dtype float64; the model takes float32"),
        (_dense_model, [[_GOOD, _GOOD]], r"batch 0 has 2 array\(s\); the model takes 1 input"),
        (_dense_model, [_GOOD, _NAN], r"calibration batch 1, input 'x' has NaN or infinite"),
        (lambda: _dense_model(1e30), [_GOOD * 1e10],
         r"calibration batch 0: the input of layer dense1 has NaN or infinite values"),
        (_no_layer_model, [], r"no dense \(matmul\) or conv2d layer with a constant"),
    ],
    ids=["empty", "shape", "dtype", "count", "nan", "overflow", "no-layer"],
)
def test_bad_calibration_input_is_named(model, data, message):
    with pytest.raises(ValueError, match=message):
        quantize_model(model(), iter(data))


def test_quantize_command_names_nan_calibration_data(tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((3, 1, 3, 56, 56)).astype("float32")
    x[1, 0, 0, 0, 0] = np.nan
    np.savez(tmp_path / "cal.npz", x=x)
    assert cli(["quantize", str(ROOT / "examples" / "conv_net.py"), "--calibration",
                str(tmp_path / "cal.npz")]) == 2
    err = capsys.readouterr().err
    assert "calibration batch 1, input 'x' has NaN or infinite values" in err
    assert "Traceback" not in err

def test_mixed_precision_keeps_the_worst_layers_float(block):
    mod, _, calib = block
    full = quantize_model(mod, calib)
    worst = full.sensitivity()[0]["site"]
    mp = quantize_model(mod, calib, mixed_precision=1)
    assert mp.config.keep_float == (worst,) and worst not in mp.quantized
    assert opsdk.transform.op_counts(mp.mod, "opsdk.")["opsdk.qdense"] == 3
    by_threshold = quantize_model(mod, calib, mixed_precision=1.0)  # nothing is that bad
    assert by_threshold.config.keep_float == ()
    with pytest.raises(ValueError, match=r"keep_float names no site: \['fc9'\]"):
        quantize_model(mod, calib, QuantConfig(keep_float=("fc9",)))
    with pytest.raises(ValueError, match="calibration data is empty"):
        quantize_model(mod, [])


def test_percentile_and_mse_clip_heavy_tails():
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((64, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(
                rng.standard_normal((16, 8)).astype("float32"))))
        bb.emit_func_output(y)
    mod = bb.get()
    data = [rng.standard_normal((64, 16)).astype("float32") for _ in range(4)]
    data[0][0, 0] = 50.0  # one outlier
    # 4096 values: a 0.1 % tail is 4 values, so percentile 99.9 drops the outlier.
    scales = {m: quantize_model(mod, data, QuantConfig(method=m, percentile=99.9)
                                ).sites[0].act.scale for m in ("minmax", "percentile", "mse")}
    assert scales["minmax"] > 5 * scales["percentile"] and scales["minmax"] > scales["mse"]


def test_quantize_command_writes_report_and_plot(tmp_path, capsys):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    model = str(ROOT / "examples" / "transformer_block.py")
    rc = cli(["quantize", model, "--model-arg", "dim=64", "--model-arg", "seq=16",
              "--model-arg", "batch=2", "--calibration", "4", "--mixed-precision", "1",
              "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "(kept float)" in text and "int8 layers: 3 of 4" in text
    rep = json.loads(out.read_text())
    assert len(rep["layers"]) == 4 and rep["end_to_end"]["rel_rmse"] < 0.02
    assert png.read_bytes()[:4] == b"\x89PNG"
    npz = tmp_path / "calib.npz"
    np.savez(npz, x=np.zeros((3, 2, 16, 32), "float32"))
    assert cli(["quantize", model, "--model-arg", "dim=64", "--model-arg", "seq=16",
                "--model-arg", "batch=2", "--calibration", str(npz)]) == 2
    assert "samples of 'x' are float32[2, 16, 32], the model takes float32[2, 16, 64]" in \
        capsys.readouterr().err
    assert cli(["quantize", model, "--mixed-precision", "-3"]) == 2


@pytest.mark.parametrize("scheme, act", [("w8", "float32"), ("w4", "float32"),
                                         ("w8", "q8_0"), ("w4", "q8_0")])
def test_weight_only_schemes(block, scheme, act):
    """Weight-only: every dense layer one dense_w8 / dense_q4 kernel (bias and GELU inside),
    the model against its own float64 layer references exactly up to float32 sums, and the
    quantization's effect reported per layer."""
    mod, x, calib = block
    qm = quantize_model(mod, iter(calib[:2]),
                        QuantConfig(scheme=scheme, weight_only_activations=act))
    op = {"w8": "opsdk.dense_w8", "w4": "opsdk.dense_q4"}[scheme]
    counts = opsdk.transform.op_counts(qm.mod, "opsdk.")
    assert counts[op] == 4 and "opsdk.qdense" not in counts and "opsdk.quantize" not in counts
    assert "opsdk.gelu" not in counts and "opsdk.bias_gelu" not in counts  # GELU in fc1
    ref, got = _run(mod, [x]), _run(qm.mod, [x])
    rel = np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref**2))
    # per-channel int8 errs ~0.4 % a layer, q4_0 ~6 %: both visible, both bounded
    assert 0 < rel < (0.02 if scheme == "w8" else 0.1)
    rows = qm.sensitivity()
    assert len(rows) == 4
    assert all(0 < r["rel_rmse"] < (0.02 if scheme == "w8" else 0.12) for r in rows)
    report = opsdk.model.report(qm.mod, "x86", profile=False, asm=False)
    assert not report.problems, report.problems
