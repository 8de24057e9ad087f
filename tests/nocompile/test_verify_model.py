"""The error models never cry wolf: float32 emulations of each built-in op stay within them.

Each op is evaluated the way a kernel may evaluate it (numpy float32 arithmetic, sequential
accumulation, which is the worst order for the bound; math functions perturbed by the
largest error ``MATH_ULPS`` allows, in the unfavourable direction) on the data verify
generates, and every element must lie within ``output_bound``. No TVM compilation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opsdk
from opsdk._dtypes import np_dtype
from opsdk.verify import MATH_ULPS, ModelInput, case_strategy, corner_cases, output_bound
from opsdk.verify._strategies import make_inputs

F = np.float32
U = 2.0**-24
_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def _perturb(v: np.ndarray, k: float, rng: np.random.Generator) -> np.ndarray:
    """A math function at its worst: the exact value ``v`` (float64) off by ``(k - 1) u``
    either way, then rounded to float32 (at most ``u`` more): ``k u`` in all."""
    s = rng.choice([-1.0, 1.0], np.shape(v))
    return (np.asarray(v, np.float64) * (1 + s * (k - 1) * U)).astype(F)


def _seq_sum(a: np.ndarray) -> np.ndarray:
    return np.add.accumulate(a.astype(F), axis=-1, dtype=F)[..., -1:]


def _norm_f32(x, g, b, eps, centered, rng):
    n = x.shape[-1]
    if centered:
        m = (_seq_sum(x) / F(n)).astype(F)
        d = (x - m).astype(F)
    else:
        d = x
    v = (_seq_sum(d * d) / F(n)).astype(F)
    r = _perturb(1 / np.sqrt((v + F(eps)).astype(F).astype(np.float64)), MATH_ULPS["rsqrt"], rng)
    y = (d * r).astype(F)
    if g is not None:
        y = (y * g).astype(F)
    if b is not None:
        y = (y + b).astype(F)
    return y


def _emulate(d, inputs, attrs, rng):
    x = inputs[d.primary].astype(F)
    if d.name in ("layer_norm", "rms_norm"):
        ba = attrs["begin_axis"]
        rows = int(np.prod(x.shape[:ba], dtype=np.int64))
        shape = x.shape

        def view(t):
            return None if t is None else np.broadcast_to(t.astype(F), shape).reshape(rows, -1)

        y = _norm_f32(x.reshape(rows, -1), view(inputs.get("gamma")), view(inputs.get("beta")),
                      attrs["epsilon"], d.name == "layer_norm", rng)
        return y.reshape(shape)
    if d.name == "group_norm":
        nhwc = attrs["layout"] == "NHWC"
        xx = x.transpose(0, 3, 1, 2) if nhwc else x
        N, C = xx.shape[:2]
        G = attrs["num_groups"]

        def chan(t):
            if t is None:
                return None
            return np.broadcast_to(t.astype(F).reshape(1, C, 1, 1), xx.shape).reshape(N * G, -1)

        y = _norm_f32(xx.reshape(N * G, -1), chan(inputs.get("gamma")), chan(inputs.get("beta")),
                      attrs["epsilon"], True, rng).reshape(xx.shape)
        return y.transpose(0, 2, 3, 1) if nhwc else y
    if d.name == "softmax":
        ax = attrs["axis"]
        xm = np.moveaxis(x, ax, -1)
        a = (xm - xm.max(axis=-1, keepdims=True)).astype(F)
        with np.errstate(under="ignore"):
            e = _perturb(np.exp(a.astype(np.float64)), MATH_ULPS["exp"], rng)
        e = np.where(a < F(-87.33654475), F(0), e)  # the vectorized exp flushes to zero
        y = (e / _seq_sum(e)).astype(F)
        return np.moveaxis(y, -1, ax)
    if d.name in ("gelu", "bias_gelu"):
        v = x if d.name == "gelu" else (x + inputs["bias"].astype(F)).astype(F)
        if attrs["approximate"] == "tanh":
            inner = (F(math.sqrt(2 / math.pi)) * (v + F(0.044715) * v * v * v)).astype(F)
            with np.errstate(over="ignore"):
                e = _perturb(np.exp(-2.0 * inner.astype(np.float64)), MATH_ULPS["exp"], rng)
            return (v / (F(1) + e)).astype(F)
        t = (v * F(1 / math.sqrt(2))).astype(F)
        f = _perturb(_erf64(t.astype(np.float64)), MATH_ULPS["erf"], rng)
        return (F(0.5) * v * (F(1) + f)).astype(F)
    raise AssertionError(d.name)


def _check(d, case):
    inputs = make_inputs(d, case)
    x64 = {p.name: (inputs[p.name].astype(np.float64) if p.name in inputs else None)
           for p in d.tensor_params}
    nattrs = d.normalize_attrs(d.bind_attrs(case.attrs), len(case.shape))
    with np.errstate(all="ignore"):
        ref = d.run_reference(x64, case.attrs)
        emul = _emulate(d, inputs, nattrs, np.random.default_rng(case.seed))
    out = emul.astype(np_dtype(case.dtype)).astype(np.float64)
    tol, _ = output_bound(d, ModelInput(d, x64, nattrs, ref, U), case.dtype)
    err = np.abs(out - ref)
    same = (np.isnan(out) & np.isnan(ref)) | (out == ref)
    bad = ~same & ~(err <= tol)
    assert not bad.any(), (
        f"{case.to_json()}: emulated float32 evaluation outside the model at "
        f"{np.argwhere(bad)[0]}: err {err[bad].max():.3g}, bound {tol[bad][0]:.3g}"
    )


# The float ops (the INT8 ops' models are exact: their references repeat the kernels' steps).
_BUILTINS = [d.name for d in opsdk.ops.FLOAT_OPS]


@pytest.mark.parametrize("name", _BUILTINS)
def test_model_covers_emulated_float32_on_corner_cases(name: str) -> None:
    d = opsdk.get_op(name)
    for dtype in d.dtypes:
        for layout in d.layouts:
            lanes = 16 if dtype == "float32" else 32
            for case in corner_cases(d, "x86", dtype, layout, lanes):
                _check(d, case)


@pytest.mark.parametrize("name", _BUILTINS)
def test_model_covers_emulated_float32_on_drawn_cases(name: str) -> None:
    d = opsdk.get_op(name)
    cells = [(dt, ly) for dt in d.dtypes for ly in d.layouts]

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        dtype, layout = data.draw(st.sampled_from(cells))
        lanes = 16 if dtype == "float32" else 32
        _check(d, data.draw(case_strategy(d, "x86", dtype, layout, lanes)))

    run()


def test_model_is_not_vacuous() -> None:
    # The bound of an ordinary float32 layer_norm (n = 17) stays within a few dozen ulps of
    # the output's scale: tight enough to see an epsilon misplaced or a variance off by
    # n/(n-1).
    d = opsdk.get_op("layer_norm")
    case = corner_cases(d, "x86", "float32", "last", 16)[0]
    inputs = make_inputs(d, case)
    x64 = {k: inputs[k].astype(np.float64) for k in inputs}
    nattrs = d.normalize_attrs(d.bind_attrs(case.attrs), 2)
    ref = d.run_reference(x64, case.attrs)
    tol, name = output_bound(d, ModelInput(d, x64, nattrs, ref, U), "float32")
    assert "layer_norm" in name
    assert float(tol.max()) < 64 * U * float(np.abs(ref).max())
