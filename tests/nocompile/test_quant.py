"""Post-training quantization helpers: parameters, calibration methods, weight quantization
and the drift report (numpy only, bit-exact with the qdense reference)."""

from __future__ import annotations

import numpy as np
import pytest

from opsdk.quant import calibrate, choose_qparams, quantize_dense, quantize_weights


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize(("lo", "hi"), [(-1.0, 3.0), (0.5, 2.0), (-7.0, -0.1), (-1e-3, 1e-3)])
def test_choose_qparams_covers_range_and_zero(lo, hi, dtype):
    p = choose_qparams(lo, hi, dtype)
    xs = np.linspace(min(lo, 0), max(hi, 0), 101).astype(np.float32)
    back = p.dequantize(p.quantize(xs))
    # half a step, plus the float32 roundings of x / scale and (q - zp) * scale
    tol = p.scale / 2 + 2 * np.finfo(np.float32).eps * np.abs(xs).max()
    assert np.max(np.abs(back - xs)) <= tol
    assert p.dequantize(p.quantize(np.zeros(1, np.float32)))[0] == 0.0  # zero is exact


def test_symmetric_int8_has_zero_point_zero():
    p = choose_qparams(-2.0, 5.0, "int8", symmetric=True)
    assert p.zero_point == 0 and p.scale == pytest.approx(5.0 / 127.5, rel=1e-6)


def test_calibration_methods():
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(64, 32)).astype(np.float32) for _ in range(4)]
    batches[0][0, 0] = 40.0  # one outlier
    mm = calibrate(batches, method="minmax")
    pc = calibrate(batches, method="percentile", percentile=99.9)
    ms = calibrate(batches, method="mse")
    assert mm.hi >= 40.0 and pc.hi < 10.0  # percentile clips the outlier
    data = np.concatenate([b.ravel() for b in batches])

    def mse(p):
        return float(np.mean((p.dequantize(p.quantize(data)) - data) ** 2))

    assert ms.scale <= mm.scale
    assert mse(ms) <= mse(mm)
    with pytest.raises(ValueError, match="method"):
        calibrate(batches, method="kl")
    with pytest.raises(ValueError, match="no calibration data"):
        calibrate([])


def test_quantize_weights_per_channel_and_per_tensor():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 16)).astype(np.float32) * np.logspace(-2, 1, 8)[:, None]
    q, s = quantize_weights(w, per_channel=True)
    assert q.dtype == np.int8 and s.shape == (8,) and q.min() >= -127
    assert np.all(np.abs(q * s[:, None] - w) <= s[:, None] / 2 * (1 + 1e-5))
    qt, st = quantize_weights(w, per_channel=False)
    assert st.shape == (1,)
    # per-channel scales follow each row's range: far smaller error on the small rows
    err_pc = np.abs(q * s[:, None] - w)[0].max()
    err_pt = np.abs(qt * st[0] - w)[0].max()
    assert err_pc < err_pt


def test_quantize_dense_drift_and_bit_exact_reference():
    rng = np.random.default_rng(2)
    xs = [rng.normal(size=(32, 64)).astype(np.float32) for _ in range(3)]
    w = (rng.normal(size=(16, 64)) * 0.1).astype(np.float32)
    b = rng.normal(size=16).astype(np.float32)
    act = calibrate(xs, method="mse")
    qd = quantize_dense(w, b, act)
    drift = qd.drift(xs)
    assert drift["rel_rmse"] < 0.02 and drift["max_rel"] < 0.05
    out = qd.run(xs[0], out_dtype="int8", out=choose_qparams(-8, 8))
    assert out.dtype == np.int8 and out.shape == (32, 16)
    # the same as the qdense op's reference on the quantized inputs (what kernels must match)
    from opsdk.ops.qdense import _reference

    again = _reference(act.quantize(xs[0]), qd.w_q, qd.w_scale, qd.bias_q,
                       **qd.qdense_attrs("int8", choose_qparams(-8, 8)))
    assert np.array_equal(out, again)
