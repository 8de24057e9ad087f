"""opsdk.transform rewrites: ReplaceTVMOps and FuseIntoOps.

Every rule has a positive case, checked structurally (op counts) and numerically (the rewritten
module against the unfused one, both compiled for the host), and near misses that must come
out unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import opsdk
from opsdk.transform import FuseIntoOps, ReplaceTVMOps, op_counts, rewrite_sites

DEV = tvm.cpu()
RNG = np.random.default_rng(11)
R = relax.op


def _func(params: list[relax.Var], body) -> tvm.IRModule:
    """A module whose main emits what the generator ``body(*params)`` yields, in order; each
    yield gets the emitted var back, so later steps refer to bound values."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            gen = body(*params)
            last = None
            try:
                while True:
                    last = bb.emit(gen.send(last) if last is not None else next(gen))
            except StopIteration:
                pass
            out = bb.emit_output(last)
        bb.emit_func_output(out)
    return bb.get()


def _chain(*steps):
    """A body where each step is ``f(params..., previous values...) -> expr``."""

    def body(*params):
        env = list(params)
        for step in steps:
            env.append((yield step(*env)))

    return body


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _run(mod: tvm.IRModule, *arrays: np.ndarray) -> np.ndarray:
    ex = opsdk.compile(mod, "x86")
    out = relax.VirtualMachine(ex, DEV)["main"](*[tvm.runtime.tensor(a, DEV) for a in arrays])
    return out.numpy()


def _assert_same_numbers(before, after, *arrays, tol=2e-5):
    ref, got = _run(before, *arrays), _run(after, *arrays)
    assert got.shape == ref.shape
    err = np.max(np.abs(got.astype(np.float64) - ref))
    assert err <= tol * max(1.0, np.max(np.abs(ref))), err


def _unchanged(before: tvm.IRModule, after: tvm.IRModule) -> None:
    assert op_counts(after) == op_counts(before)
    assert not any(k.startswith("opsdk.") for k in op_counts(after))
    assert rewrite_sites(after) == []


def _c(v, dtype="float32"):
    return relax.const(np.asarray(v, dtype))


def _calls(mod: tvm.IRModule, op: str) -> list[relax.Call]:
    found: list[relax.Call] = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == op:
            found.append(e)

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


# ---------------------------------------------------------------------------------------------
# LayerNorm spelled out


def _ln_module(
    shape=(2, 5, 16),
    mean_axes=(-1,),
    var_axes=(-1,),
    square="power",
    norm="div",
    eps_after_sqrt=False,
    eps_param=False,
    exponent=2.0,
    gamma="vector",
    beta=True,
    commute=False,
):
    """Decomposed LayerNorm as exporters emit it, with knobs for the near misses."""
    x = _var("x", shape)
    feat = tuple(shape[a] for a in var_axes) if len(var_axes) > 1 else (shape[var_axes[0]],)
    params = [x]
    eps_v = _var("eps", ()) if eps_param else None
    if eps_v is not None:
        params.append(eps_v)
    g = _c(RNG.normal(size=feat))
    if gamma == "per_row":  # a scale per row, not per feature: not a LayerNorm gamma
        g = _c(RNG.normal(size=(*shape[:-1], 1)))
    b = _c(RNG.normal(size=feat))
    eps = eps_v if eps_v is not None else _c(1e-5)

    def body(x, *_):
        m = yield R.mean(x, axis=list(mean_axes), keepdims=True)
        d = yield R.subtract(x, m)
        sq = yield (R.power(d, _c(exponent)) if square == "power" else R.multiply(d, d))
        v = yield R.mean(sq, axis=list(var_axes), keepdims=True)
        if norm == "rsqrt":
            r = yield R.rsqrt((yield R.add(v, eps)))
            n = yield R.multiply(d, r)
        else:
            if eps_after_sqrt:
                s = yield R.add((yield R.sqrt(v)), eps)
            else:
                s = yield R.sqrt((yield (R.add(eps, v) if commute else R.add(v, eps))))
            n = yield R.divide(d, s)
        if gamma is not None:
            n = yield (R.multiply(g, n) if commute else R.multiply(n, g))
        if beta:
            yield (R.add(b, n) if commute else R.add(n, b))

    return _func(params, body)


LN_VARIANTS = {
    "pow_div_affine": {},
    "mul_rsqrt": {"square": "mul", "norm": "rsqrt"},
    "commuted": {"commute": True},
    "no_affine": {"gamma": None, "beta": False},
    "gamma_only": {"beta": False},
    "last_two_axes": {"mean_axes": (1, 2), "var_axes": (-2, -1)},
}


@pytest.mark.parametrize("variant", LN_VARIANTS)
def test_layer_norm_chain_fuses_and_matches(variant):
    kw = LN_VARIANTS[variant]
    before = _ln_module(**kw)
    after = FuseIntoOps(["layer_norm"])(before)
    counts = op_counts(after)
    assert counts == {"opsdk.layer_norm": 1}, counts
    (site,) = rewrite_sites(after)
    assert (site.rule, site.op) == ("fuse.layer_norm", "opsdk.layer_norm")
    (call,) = _calls(after, "opsdk.layer_norm")
    assert int(call.attrs["begin_axis"]) == -len(kw.get("var_axes", (-1,)))
    assert float(call.attrs["epsilon"]) == 1e-5
    x = RNG.normal(3.0, 2.0, size=(2, 5, 16)).astype("float32")
    _assert_same_numbers(before, after, x)


def test_layer_norm_per_row_scale_fuses_only_the_core():
    before = _ln_module(gamma="per_row", beta=False)
    after = FuseIntoOps(["layer_norm"])(before)
    assert op_counts(after) == {"opsdk.layer_norm": 1, "relax.multiply": 1}
    _assert_same_numbers(before, after, RNG.normal(size=(2, 5, 16)).astype("float32"))


LN_NEAR_MISSES = {
    "eps_after_sqrt": {"eps_after_sqrt": True},
    "mean_axis_differs_from_variance_axis": {"mean_axes": (-2,), "var_axes": (-1,)},
    "variance_axis_not_trailing": {
        "mean_axes": (1,),
        "var_axes": (1,),
        "gamma": None,
        "beta": False,
    },
    "non_constant_eps": {"eps_param": True},
    "exponent_not_two": {"exponent": 3.0},
}


@pytest.mark.parametrize("variant", LN_NEAR_MISSES)
def test_layer_norm_near_misses_are_left_alone(variant):
    before = _ln_module(**LN_NEAR_MISSES[variant])
    _unchanged(before, FuseIntoOps()(before))


# ---------------------------------------------------------------------------------------------
# RMSNorm spelled out


def _rms_module(var_axes=(-1,), eps=1e-6, with_gamma=True, eps_after=False):
    x = _var("x", (3, 4, 32))
    g = _c(RNG.normal(size=32))

    def body(x):
        sq = yield R.multiply(x, x)
        v = yield R.mean(sq, axis=list(var_axes), keepdims=True)
        if eps_after:
            r = yield R.divide(_c(1.0), (yield R.sqrt(v)))
        else:
            r = yield R.rsqrt((yield R.add(v, _c(eps))))
        n = yield R.multiply(x, r)
        if with_gamma:
            yield R.multiply(n, g)

    return _func([x], body)


def test_rms_norm_chain_fuses_and_matches():
    before = _rms_module()
    after = FuseIntoOps(["rms_norm"])(before)
    assert op_counts(after) == {"opsdk.rms_norm": 1}
    _assert_same_numbers(before, after, RNG.normal(size=(3, 4, 32)).astype("float32"))


@pytest.mark.parametrize("kw", [{"var_axes": (1,)}, {"eps_after": True}], ids=["axis", "no_eps"])
def test_rms_norm_near_misses_are_left_alone(kw):
    before = _rms_module(**kw)
    _unchanged(before, FuseIntoOps()(before))


# ---------------------------------------------------------------------------------------------
# bias + GELU


@pytest.mark.parametrize(
    "gelu,approx",
    [(R.nn.gelu, "none"), (R.nn.gelu_tanh, "tanh"), (opsdk.relax.gelu, "none")],
    ids=["tvm_gelu", "tvm_gelu_tanh", "opsdk_gelu"],
)
@pytest.mark.parametrize("bias_shape", [(24,), (1, 1, 24)], ids=["vector", "broadcast"])
def test_bias_gelu_fuses_and_matches(gelu, approx, bias_shape):
    x, b = _var("x", (2, 3, 24)), _var("b", bias_shape)
    before = _func([x, b], _chain(lambda x, b: R.add(b, x), lambda x, b, s: gelu(s)))
    after = FuseIntoOps(["bias_gelu"])(before)
    counts = op_counts(after, "opsdk.")
    assert counts == {"opsdk.bias_gelu": 1}, op_counts(after)
    (call,) = _calls(after, "opsdk.bias_gelu")
    assert str(call.attrs["approximate"]) == approx
    xs = RNG.normal(size=(2, 3, 24)).astype("float32")
    _assert_same_numbers(before, after, xs, RNG.normal(size=bias_shape).astype("float32"))


@pytest.mark.parametrize(
    "other_shape", [(2, 3, 24), (2, 3, 1), (3, 24)], ids=["residual", "per_row", "matrix"]
)
def test_bias_gelu_near_misses_are_left_alone(other_shape):
    x, y = _var("x", (2, 3, 24)), _var("y", other_shape)
    before = _func([x, y], _chain(lambda x, y: R.add(x, y), lambda x, y, s: R.nn.gelu(s)))
    after = FuseIntoOps()(before)
    assert op_counts(after) == op_counts(before) and rewrite_sites(after) == []


# ---------------------------------------------------------------------------------------------
# conv2d + batch_norm (+ relu)


def _conv_bn_module(
    conv_bias=True, relu=True, training=False, const_params=True, groups=1, nhwc=False
):
    cin, cout = 4, 6
    x = _var("x", (2, 7, 7, cin) if nhwc else (2, cin, 7, 7))
    w = RNG.normal(size=(cout, cin // groups, 3, 3)).astype("float32")
    if nhwc:
        w = w.transpose(2, 3, 1, 0).copy()  # HWIO
    layout = {"data_layout": "NHWC", "kernel_layout": "HWIO"} if nhwc else {}
    bshape = [1, 1, 1, cout] if nhwc else [1, cout, 1, 1]
    stats = {
        "gamma": RNG.normal(size=cout),
        "beta": RNG.normal(size=cout),
        "mean": RNG.normal(size=cout),
        "var": RNG.uniform(0.5, 2.0, size=cout),
    }
    params = [x]
    if const_params:
        bn_args = [_c(stats[k]) for k in ("gamma", "beta", "mean", "var")]
    else:
        bn_args = [_var(k, (cout,)) for k in ("gamma", "beta", "mean", "var")]
        params += bn_args
    cb = _c(RNG.normal(size=cout))

    def body(x, *_):
        c = yield R.nn.conv2d(x, _c(w), padding=[1, 1], groups=groups, **layout)
        if conv_bias:
            c = yield R.add(c, (yield R.reshape(cb, bshape)))
        axis = 3 if nhwc else 1
        bn = yield R.nn.batch_norm(c, *bn_args, axis=axis, epsilon=1e-5, training=training)
        y = yield relax.TupleGetItem(bn, 0)
        if relu:
            yield R.nn.relu(y)

    return _func(params, body), stats


@pytest.mark.parametrize(
    "kw",
    [{}, {"conv_bias": False, "relu": False}, {"groups": 2}, {"nhwc": True}],
    ids=["bias_relu", "bare", "grouped", "nhwc"],
)
def test_conv_bn_folds_into_conv_weights(kw):
    before, _ = _conv_bn_module(**kw)
    after = FuseIntoOps(["conv_bn"])(before)
    counts = op_counts(after)
    assert "relax.nn.batch_norm" not in counts
    assert counts["relax.nn.conv2d"] == 1 and counts["relax.add"] == 1
    assert counts.get("relax.nn.relu", 0) == (0 if kw.get("relu") is False else 1)
    assert [s.rule for s in rewrite_sites(after)] == ["fuse.conv_bn"]
    shape = (2, 7, 7, 4) if kw.get("nhwc") else (2, 4, 7, 7)
    _assert_same_numbers(before, after, RNG.normal(size=shape).astype("float32"))


def test_conv_bn_with_bound_params_folds():
    before, stats = _conv_bn_module(const_params=False)
    _unchanged(before, FuseIntoOps()(before))  # BN statistics are inputs: nothing to fold
    arrays = {k: v.astype("float32") for k, v in stats.items()}
    after = FuseIntoOps(params=arrays)(before)
    assert "relax.nn.batch_norm" not in op_counts(after)
    assert [p.name for p in after["main"].params] == ["x"]
    x = RNG.normal(size=(2, 4, 7, 7)).astype("float32")
    ref, got = _run(before, x, *arrays.values()), _run(after, x)
    assert np.max(np.abs(got - ref)) <= 2e-5 * np.max(np.abs(ref))


def test_conv_bn_training_mode_is_left_alone():
    before, _ = _conv_bn_module(training=True)
    _unchanged(before, FuseIntoOps()(before))


# ---------------------------------------------------------------------------------------------
# parallel conv branches of one input (MobileOne / RepVGG / FastViT blocks as trained)

_U32 = 2.0 ** -24  # float32 unit roundoff


def _branch_params(c, groups, convs, affine):
    """Random weights: ``convs`` as (kernel, padding, stride) with a bias each, ``affine``
    inference BNs of the input (mean 0, so ``|gamma|, |beta|`` bound their terms)."""
    rng = np.random.default_rng(5)
    p = {f"w{k}": rng.normal(size=(c, c // groups, kk, kk)) for k, (kk, _, _) in enumerate(convs)}
    p.update({f"b{k}": rng.normal(size=(1, c, 1, 1)) for k in range(len(convs))})
    for k in range(affine):
        p[f"g{k}"], p[f"beta{k}"] = rng.normal(size=c), rng.normal(size=c)
        p[f"var{k}"] = rng.uniform(0.5, 2.0, size=c)
    return p


def _branches_module(p, x_shape, groups, convs, affine, identity, scale=None):
    """``sum(conv_k(x) + b_k) + sum(bn_k(x)) [+ x]``, times ``scale`` per channel and plus
    ``x`` when ``scale`` is given (FastViT's layer-scaled residual), then a ReLU."""
    c = x_shape[1]

    def body(x):
        total = None
        for k, (_, pad, stride) in enumerate(convs):
            y = yield R.nn.conv2d(x, _c(p[f"w{k}"]), strides=stride, padding=pad, groups=groups)
            y = yield R.add(y, _c(p[f"b{k}"]))
            total = y if total is None else (yield R.add(total, y))
        for k in range(affine):
            bn = yield R.nn.batch_norm(x, _c(p[f"g{k}"]), _c(p[f"beta{k}"]), _c(np.zeros(c)),
                                       _c(p[f"var{k}"]), axis=1, training=False)
            total = yield R.add(total, (yield relax.TupleGetItem(bn, 0)))
        if identity:
            total = yield R.add(total, x)
        if scale is not None:
            total = yield R.add(x, (yield R.multiply(total, _c(scale))))
        yield R.nn.relu(total)

    return _func([_var("x", x_shape)], body)


def _assert_within_summation_bound(before, after, p, x, groups, convs, affine, identity,
                                   scale=None):
    """Both modules round a sum of ``n`` products per output, each within ``n u`` of
    ``sum |term|``: they differ by at most twice that (``|term|`` from the module with every
    weight made positive, on ``|x|``)."""
    n = sum(kk * kk * x.shape[1] // groups + 1 for kk, _, _ in convs) + 2 * affine + identity + 2
    ref, got = _run(before, x), _run(after, x)
    pos = {k: np.abs(v) for k, v in p.items()}
    mag = _run(_branches_module(pos, x.shape, groups, convs, affine, identity,
                                None if scale is None else np.abs(scale)), np.abs(x))
    gamma = n * _U32 / (1 - n * _U32)
    assert got.shape == ref.shape
    assert np.all(np.abs(got.astype(np.float64) - ref) <= 2 * gamma * (mag + 1e-30)), \
        np.max(np.abs(got - ref))


@pytest.mark.parametrize("groups,convs,affine,identity", [
    (1, [(3, 1, 1), (3, 1, 1), (1, 0, 1)], 1, True),  # RepVGG / MobileOne, dense
    (8, [(3, 1, 1)] * 3 + [(1, 0, 1)], 1, False),  # MobileOne depthwise, k = 3
    (2, [(3, 1, 2), (1, 0, 2)], 0, False),  # stride 2: the 1x1 is the 3x3's centre tap
    (1, [(3, [1, 1, 1, 1], 1), (3, [0, 0, 2, 2], 1)], 0, False),  # shifted: a 4x4 kernel
], ids=["dense", "depthwise", "stride2", "shifted"])
def test_conv_branches_of_one_input_merge_into_one_conv(groups, convs, affine, identity):
    shape = (1, 8, 10, 10)
    p = {k: v.astype("float32") for k, v in _branch_params(8, groups, convs, affine).items()}
    before = _branches_module(p, shape, groups, convs, affine, identity)
    after = FuseIntoOps(["conv_branches"])(before)
    counts = op_counts(after)
    assert counts["relax.nn.conv2d"] == 1 and "relax.nn.batch_norm" not in counts, counts
    assert counts["relax.add"] == 1, counts  # the merged bias
    assert [s.rule for s in rewrite_sites(after)] == ["fuse.conv_branches"]
    x = RNG.normal(size=shape).astype("float32")
    _assert_within_summation_bound(before, after, p, x, groups, convs, affine, identity)


def test_a_layer_scaled_residual_of_branches_merges_with_its_scale():
    # FastViT's RepMixer: x + scale * (dwconv(x) + b + bn(x) - ...): the scale multiplies
    # the merged kernel and bias; the residual x is the identity tap.
    shape, convs = (1, 8, 9, 9), [(3, 1, 1)]
    p = {k: v.astype("float32") for k, v in _branch_params(8, 8, convs, 1).items()}
    scale = RNG.uniform(0.5, 1.5, size=(8, 1, 1)).astype("float32")
    before = _branches_module(p, shape, 8, convs, 1, False, scale)
    after = FuseIntoOps(["conv_branches"])(before)
    counts = op_counts(after)
    assert counts["relax.nn.conv2d"] == 1 and "relax.multiply" not in counts, counts
    x = RNG.normal(size=shape).astype("float32")
    _assert_within_summation_bound(before, after, p, x, 8, convs, 1, True, scale)


def test_conv_branches_that_do_not_line_up_are_left_alone():
    shape = (1, 8, 10, 10)
    # different groups (a dense 1x1 beside a depthwise 3x3): two convs stay
    p = _branch_params(8, 1, [(1, 0, 1)], 0)
    p["w1"] = RNG.normal(size=(8, 1, 3, 3))
    p["b1"] = RNG.normal(size=(1, 8, 1, 1))

    def mixed(x):
        a = yield R.nn.conv2d(x, _c(p["w0"]))
        b = yield R.nn.conv2d(x, _c(p["w1"]), padding=1, groups=8)
        yield R.add(a, b)

    before = _func([_var("x", shape)], mixed)
    _unchanged(before, FuseIntoOps(["conv_branches"])(before))

    # a branch also read elsewhere: merging would not remove its conv
    def shared(x):
        a = yield R.nn.conv2d(x, _c(p["w0"]))
        b = yield R.nn.conv2d(x, _c(p["w0"] + 1.0))
        s = yield R.add(a, b)
        yield R.multiply(s, a)

    before = _func([_var("x", shape)], shared)
    _unchanged(before, FuseIntoOps(["conv_branches"])(before))


# ---------------------------------------------------------------------------------------------
# ReplaceTVMOps


def _replace_case(name):
    x = _var("x", (2, 6, 5, 8))
    c8, c6 = _c(RNG.normal(size=8)), _c(RNG.normal(size=6))
    calls = {
        "layer_norm": lambda x: R.nn.layer_norm(x, c8, c8, axes=[-1], epsilon=1e-5),
        "layer_norm_flags_off_with_identity_params": lambda x: R.nn.layer_norm(
            x, _c(np.ones(8)), R.zeros_like(c8), axes=[-1], center=False, scale=False
        ),
        "layer_norm_2axes": lambda x: R.nn.layer_norm(
            x, _c(RNG.normal(size=(5, 8))), _c(RNG.normal(size=(5, 8))), axes=[2, 3]
        ),
        "rms_norm": lambda x: R.nn.rms_norm(x, c8, axes=[-1], epsilon=1e-6),
        "group_norm": lambda x: R.nn.group_norm(x, c6, c6, 3, 1, [2, 3], epsilon=1e-5),
        "group_norm_nhwc": lambda x: R.nn.group_norm(x, c8, c8, 4, 3, [1, 2]),
        "gelu": R.nn.gelu,
        "gelu_tanh": R.nn.gelu_tanh,
        "softmax": lambda x: R.nn.softmax(x, axis=1),
    }
    return _func([x], _chain(calls[name]))


REPLACED = {
    "layer_norm": "opsdk.layer_norm",
    "layer_norm_flags_off_with_identity_params": "opsdk.layer_norm",
    "layer_norm_2axes": "opsdk.layer_norm",
    "rms_norm": "opsdk.rms_norm",
    "group_norm": "opsdk.group_norm",
    "group_norm_nhwc": "opsdk.group_norm",
    "gelu": "opsdk.gelu",
    "gelu_tanh": "opsdk.gelu",
    "softmax": "opsdk.softmax",
}


@pytest.mark.parametrize("case", REPLACED)
def test_replace_tvm_ops(case):
    before = _replace_case(case)
    after = ReplaceTVMOps()(before)
    assert op_counts(after) == {REPLACED[case]: 1}
    assert [s.op for s in rewrite_sites(after)] == [REPLACED[case]]
    _assert_same_numbers(before, after, RNG.normal(size=(2, 6, 5, 8)).astype("float32"))


def test_replace_keeps_what_opsdk_cannot_express():
    x, x3 = _var("x", (2, 6, 5, 8)), _var("x3", (2, 6, 5))
    x64 = _var("x64", (4, 8), "float64")
    n = tirx.Var("n", "int64")
    xc = _var("xc", (2, n, 5, 8))  # symbolic channel count
    c8, c6 = _c(RNG.normal(size=8)), _c(RNG.normal(size=6))

    def body(x, x3, x64, xc):
        yield R.nn.layer_norm(x, c6, c6, axes=[1])  # not a trailing axis
        yield R.nn.rms_norm(x, _c(RNG.normal(size=(6, 8))), axes=[1, 3])  # not contiguous
        yield R.nn.group_norm(x3, c6, c6, 3, 1, [2])  # 3-D group norm
        yield R.nn.group_norm(xc, c8, c8, 4, 3, [1, 2])  # channels not static
        yield R.nn.gelu(x64)  # float64
        # TVM's legalization ignores center=False / scale=False; opsdk would not
        yield R.nn.layer_norm(x, c8, c8, axes=[-1], center=False)
        yield R.nn.group_norm(x, c6, c6, 3, 1, [2, 3], scale=False)

    before = _func([x, x3, x64, xc], body)
    _unchanged(before, ReplaceTVMOps()(before))


def test_replace_selected_ops_only_and_unknown_names_raise():
    before = _func([_var("x", (4, 8))], _chain(R.nn.gelu, lambda x, g: R.nn.softmax(g)))
    assert op_counts(ReplaceTVMOps(["softmax"])(before)) == {
        "opsdk.softmax": 1,
        "relax.nn.gelu": 1,
    }
    with pytest.raises(ValueError, match="unknown ops"):
        ReplaceTVMOps(["conv2d"])
    with pytest.raises(ValueError, match="unknown rules"):
        FuseIntoOps(["attention"])


def test_sites_accumulate_over_passes_and_survive_compile():
    x, b = _var("x", (4, 16)), _var("b", (16,))
    before = _func([x, b], _chain(lambda x, b: R.add(x, b), lambda x, b, s: R.nn.gelu(s)))
    after = FuseIntoOps()(ReplaceTVMOps()(before))
    # gelu -> opsdk.gelu -> opsdk.bias_gelu: one site, the last rule wins.
    assert [(s.rule, s.op) for s in rewrite_sites(after)] == [("fuse.bias_gelu", "opsdk.bias_gelu")]
    assert opsdk.compile(after, "x86") is not None
