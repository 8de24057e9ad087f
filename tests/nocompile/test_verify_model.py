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
from tvm import te, tirx

import opsdk
from opsdk._dtypes import np_dtype
from opsdk.te_utils import acc, reduce_axes
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
    if d.name == "attention":
        return _attention_f32(inputs, attrs, rng)
    raise AssertionError(d.name)


def _attention_f32(inputs, attrs, rng):
    """The kernel's float32 steps: sequential dot products over the head dim and over the
    keys, the scale, the mask's add, the max subtraction, exp at its worst, one reciprocal
    per row."""
    bhsd = attrs["layout"] == "BHSD"
    q, k, v = (inputs[n].astype(F) if bhsd else inputs[n].astype(F).transpose(0, 2, 1, 3)
               for n in "qkv")
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    n, m, dim = q.shape[2], k.shape[2], q.shape[3]
    f = F(attrs["scale"] or 1 / math.sqrt(dim))
    s = _seq_sum(q[:, :, :, None, :] * k[:, :, None, :, :])[..., 0]  # (B, H, n, m)
    s = (s * f).astype(F)
    if inputs.get("mask") is not None:
        s = (s + inputs["mask"].astype(F)).astype(F)
    seen = np.ones((n, m), bool)
    if attrs["causal"]:
        seen = np.arange(m)[None, :] <= (m - n + np.arange(n))[:, None]
    seen = seen & np.isfinite(s)
    mx = np.where(seen, s, -np.inf).max(-1, keepdims=True)
    a = (s - np.where(np.isfinite(mx), mx, F(0))).astype(F)
    with np.errstate(under="ignore"):
        e = _perturb(np.exp(a.astype(np.float64)), MATH_ULPS["exp"], rng)
    e = np.where(seen & (a >= F(-87.33654475)), e, F(0))
    tot = _seq_sum(e)
    pv = _seq_sum(np.moveaxis(e[..., None] * v[:, :, None, :, :], -2, -1))[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(tot > 0, (pv * (F(1) / tot)).astype(F), F(0))
    return y if bhsd else y.transpose(0, 2, 1, 3)


def _case_data(d, case):
    """(inputs as drawn, float64 inputs with None for absent ones, normalized attributes)."""
    inputs = make_inputs(d, case)
    x64 = {p.name: (inputs[p.name].astype(np.float64) if p.name in inputs else None)
           for p in d.tensor_params}
    return inputs, x64, d.normalize_attrs(d.bind_attrs(case.attrs), len(case.shape))


def _check(d, case):
    if case.data.get(d.primary) == "special":
        return  # inf / NaN / overflow: documented semantics, compared exactly, not a model
    inputs, x64, nattrs = _case_data(d, case)
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


# ------------------------------------------------------------------ composed models


def test_composed_norm_model_is_the_built_in_norms_model() -> None:
    # norm_model states a norm's structure; for the built-in norms it must give their bound.
    from opsdk.verify import norm_model
    from opsdk.verify._tolerance import model_for

    composed = {
        "layer_norm": norm_model(gamma="gamma", beta="beta"),
        "rms_norm": norm_model(center=False, gamma="gamma"),
        "group_norm": None,  # per layout below
    }
    for name, model in composed.items():
        d = opsdk.get_op(name)
        for layout in d.layouts:
            if name == "group_norm":
                spatial = (2, 3) if layout == "NCHW" else (1, 2)
                model = norm_model(axes=spatial, groups="num_groups", gamma="gamma",
                                   beta="beta", channel_axis=1 if layout == "NCHW" else 3)
            for case in corner_cases(d, "x86", "float32", layout, 16)[:6]:
                _, x64, nattrs = _case_data(d, case)
                with np.errstate(all="ignore"):
                    m = ModelInput(d, x64, nattrs, d.run_reference(x64, case.attrs), U)
                    want = model_for(d)[1](m)
                    got = model(m)
                np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"{name} {case}")


def _l2_norm_ref(x, gamma=None, *, begin_axis=-1, epsilon=1e-6):
    axes = tuple(range(begin_axis, x.ndim))
    y = x / np.sqrt((x * x).sum(axis=axes, keepdims=True) + epsilon)
    return y if gamma is None else y * gamma


def _logsumexp_ref(x, *, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _user_ops():
    """A user L2 norm and logsumexp (the ``opsdk new-op`` norm and reduction scaffolds)."""
    @opsdk.op(reference=_l2_norm_ref, ranks=(1, 4), kind="norm",
              input_shapes=lambda s, a: {"gamma": tuple(s[a["begin_axis"]:])},
              layouts={"last": {"begin_axis": -1}, "last2": {"begin_axis": -2}},
              domain={"x": (-4.0, 4.0), "gamma": (-2.0, 2.0)},
              attr_domain={"epsilon": [1e-6, 1e-3]})
    def user_l2norm(x: opsdk.Tensor, gamma: opsdk.Tensor | None = None, *,
                    begin_axis: opsdk.Axis = -1, epsilon: float = 1e-6) -> te.Tensor:
        outer, r = x.shape[:begin_axis], reduce_axes(x.shape[begin_axis:], "r")
        ss = te.compute(outer, lambda *o: te.sum(acc(x(*o, *r)) * acc(x(*o, *r)), axis=r))
        b = len(outer)

        def body(*i):
            y = acc(x(*i)) * tirx.rsqrt(ss(*i[:b]) + epsilon)
            return (y if gamma is None else y * acc(gamma(*i[b:]))).astype(x.dtype)

        return te.compute(x.shape, body)

    @opsdk.op(reference=_logsumexp_ref, ranks=(1, 4), kind="reduction",
              layouts={"last": {"axis": -1}, "first": {"axis": 0}}, domain={"x": (-8.0, 8.0)})
    def user_logsumexp(x: opsdk.Tensor, *, axis: opsdk.Axis = -1) -> te.Tensor:
        keep = [d for i, d in enumerate(x.shape) if i != axis]
        r = te.reduce_axis((0, x.shape[axis]))
        mx = te.compute(keep, lambda *o: te.max(acc(x(*o[:axis], r, *o[axis:])), axis=r))
        return te.compute(keep, lambda *o: mx(*o).astype(x.dtype))  # (its math: verify's job)

    return user_l2norm, user_logsumexp


def _emulate_user(name, inputs, attrs, rng):
    x = inputs["x"].astype(F)
    if name == "user_l2norm":
        b = attrs["begin_axis"]
        rows = int(np.prod(x.shape[:b], dtype=np.int64))
        xr = x.reshape(rows, -1)
        ss = _seq_sum(xr * xr)
        r = _perturb(1 / np.sqrt((ss + F(attrs["epsilon"])).astype(F).astype(np.float64)),
                     MATH_ULPS["rsqrt"], rng)
        y = (xr * r).astype(F).reshape(x.shape)
        g = inputs.get("gamma")
        return y if g is None else (y * g.astype(F)).astype(F)
    ax = attrs["axis"]
    xt = np.moveaxis(x, ax, -1)
    mx = xt.max(axis=-1, keepdims=True)
    e = _perturb(np.exp((xt - mx).astype(F).astype(np.float64)), MATH_ULPS["exp"], rng)
    s = _seq_sum(e)
    ls = _perturb(np.log(s.astype(np.float64)), MATH_ULPS["log"], rng)
    return (mx + ls).astype(F)[..., 0]


@pytest.mark.parametrize("which", [0, 1])
def test_composed_models_cover_emulated_user_ops(which: int) -> None:
    # The scaffolds' structures (norm_model / reduction_model): float32 emulations of a user
    # L2 norm and logsumexp stay within the composed bound, on corners and drawn cases.
    from opsdk.verify import error_model, norm_model, reduction_model
    from opsdk.verify._tolerance import _MODELS

    d = _user_ops()[which]
    model = (norm_model(center=False, mean_square=False, gamma="gamma") if which == 0
             else reduction_model(op="logsumexp"))
    error_model(d)(model)
    try:
        def check(case):
            inputs, x64, nattrs = _case_data(d, case)
            with np.errstate(all="ignore"):
                ref = d.run_reference(x64, case.attrs)
                emul = _emulate_user(d.name, inputs, nattrs, np.random.default_rng(case.seed))
            tol, label = output_bound(d, ModelInput(d, x64, nattrs, ref, U), "float32")
            assert label.startswith("author's (composed"), label
            err = np.abs(emul.astype(np.float64) - ref)
            assert (err <= tol).all(), f"{case.to_json()}: {err.max():.3g} > {tol.min():.3g}"
            return float((err / tol).max())

        worst = max(check(c) for layout in d.layouts
                    for c in corner_cases(d, "x86", "float32", layout, 16))

        @settings(max_examples=40, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data):
            check(data.draw(case_strategy(d, "x86", "float32",
                                          data.draw(st.sampled_from(list(d.layouts))), 16)))

        run()
        assert worst > 0.01  # not vacuous: the emulation's error is a visible part of the bound
    finally:
        _MODELS.pop(d.name, None)


def test_composed_model_names_a_wrong_attribute() -> None:
    from opsdk.verify import norm_model, reduction_model

    d = _user_ops()[0]
    case = corner_cases(d, "x86", "float32", "last", 16)[0]
    _, x64, nattrs = _case_data(d, case)
    m = ModelInput(d, x64, nattrs, x64["x"], U)
    with pytest.raises(ValueError, match=r"user_l2norm.*'eps' names no attribute.*epsilon"):
        norm_model(epsilon="eps")(m)
    with pytest.raises(ValueError, match=r"'scale' is not an input.*x, gamma"):
        norm_model(gamma="scale")(m)
    with pytest.raises(ValueError, match="op='median' is not one of sum, mean"):
        reduction_model(op="median")
