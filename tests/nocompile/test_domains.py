"""Log-uniform domains and the INT8 ops' test data: what verify draws, without compiling.

- ``opsdk.log_uniform``: definition-time checks, tensor data and attributes spread over the
  decades, a sensible first example / shrink target, reproducers that replay the exact value;
- the INT8 ops' domains: scales across >= 4 decades, zero points at the ends of the int8 and
  uint8 ranges, saturated outputs at both ends, K not a multiple of 4 (or 16), and every float32
  intermediate of the references a normal float (what keeps bit-exact comparison valid).
"""

from __future__ import annotations

import json
import math
import shlex
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from tvm import te

import opsdk
from opsdk import LogUniform, OpDefinitionError, Tensor, log_uniform
from opsdk.ops._quant import QRANGE
from opsdk.verify import Case
from opsdk.verify._report import reproducer_command
from opsdk.verify._strategies import (
    LogAttr,
    StrategyKnobs,
    _attr_choices,
    case_strategy,
    corner_cases,
    make_inputs,
)

X86_LANES_8BIT = 64  # vector_lanes(x86 znver4, 8 bits): what verify passes for int8 cells


def _ref_scale(x, *, scale=1.0):
    return x * np.float32(scale)


def _scale_op(name: str = "demo_scale", **kw: Any) -> opsdk.OpDef:
    def demo_scale(x: Tensor, s: Tensor, *, scale: float = 1.0, n: int = 1) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * s(*i) * scale, name="y")

    demo_scale.__name__ = name

    def ref(x, s, *, scale=1.0, n=1):
        return x * s * np.float32(scale)

    return opsdk.op(reference=ref, dtypes=("float32",), **kw)(demo_scale)


def _draw(d: opsdk.OpDef, dtype: str, layout: str, n: int = 150, p_common: int = 0,
          lanes: int = X86_LANES_8BIT) -> list[Case]:
    """``n`` cases as verify draws them (derandomized: the same every run)."""
    out: list[Case] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case_strategy(d, "x86", dtype, layout, lanes, StrategyKnobs(p_common=p_common)))
    def run(case: Case) -> None:
        out.append(case)

    run()
    return out


def _cases(name: str, dtype: str, layout: str, n: int = 150) -> list[Case]:
    d = opsdk.get_op(name)
    return corner_cases(d, "x86", dtype, layout, X86_LANES_8BIT) + _draw(d, dtype, layout, n)


def _decades(values) -> float:
    v = np.asarray(list(values), dtype=np.float64)
    return float(np.log10(v.max() / v.min()))


# ------------------------------------------------------------------------- log_uniform itself


def test_log_uniform_is_public_and_unpacks_like_a_range():
    assert {"log_uniform", "LogUniform"} <= set(opsdk.__all__)
    dom = log_uniform(1e-4, 100)
    assert isinstance(dom, LogUniform) and dom == LogUniform(1e-4, 100.0)
    lo, hi = dom  # code that only wants the bounds (e.g. benchmarks) keeps working
    assert (lo, hi) == (1e-4, 100.0) and dom.decades == pytest.approx(6)
    assert dom.typical == 0.1 and 0.1 in dom and 1e3 not in dom
    assert repr(dom) == "log_uniform(0.0001, 100.0)"
    assert dom.at(0) == 1e-4 and dom.at(1) == 100.0 and dom.at(0.5) == pytest.approx(0.1)
    with pytest.raises(AttributeError):
        dom.lo = 1.0  # frozen


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"domain": {"s": log_uniform(0.0, 1.0)}}, r"domain\['s'\].*lo must be > 0"),
        ({"domain": {"s": log_uniform(-1.0, 1.0)}}, r"domain\['s'\].*lo must be > 0"),
        ({"domain": {"s": log_uniform(2.0, 1.0)}}, r"domain\['s'\].*hi must be > lo"),
        ({"domain": {"s": log_uniform(1.0, 1.0)}}, r"domain\['s'\].*hi must be > lo"),
        ({"domain": {"s": log_uniform(1e-3, math.inf)}}, r"domain\['s'\].*finite"),
        ({"domain": {"s": log_uniform("a", 1.0)}}, r"domain\['s'\].*real numbers"),
        ({"domain": {"scale": log_uniform(1e-3, 1.0)}}, r"'scale' is not a tensor input"),
        ({"attr_domain": {"scale": log_uniform(0, 1.0)}}, r"attr_domain\['scale'\].*lo must"),
        ({"attr_domain": {"scale": log_uniform(3.0, 2.0)}}, r"attr_domain\['scale'\].*hi must"),
        ({"attr_domain": {"n": log_uniform(1.0, 8.0)}}, r"attr_domain\['n'\].*float attr.*int"),
        ({"attr_domain": {"s": log_uniform(1.0, 8.0)}}, r"'s' is not an attribute"),
        ({"attr_domain": {"scale": [log_uniform(1.0, 8.0)]}}, r"not inside a list"),
    ],
)
def test_bad_log_uniform_is_refused_at_definition_naming_op_and_argument(kw, match):
    with pytest.raises(OpDefinitionError, match=r"op 'demo_bad'.*" + match):
        _scale_op("demo_bad", **kw)


def test_log_uniform_tensor_data_spreads_over_the_decades_and_stays_positive():
    d = _scale_op(domain={"x": (-1.0, 1.0), "s": log_uniform(1e-4, 1e2)})
    recipes = Counter()
    for recipe in ("domain", "normal", "constant", "rowconst", "ones", "mixed"):
        case = Case(d.name, "x86", "float32", "default", (100, 60), {}, (), {"s": recipe}, 5)
        s = make_inputs(d, case)["s"].astype(np.float64)
        assert (s > 0).all(), recipe
        if recipe in ("domain", "normal", "constant", "rowconst"):  # drawn in log space
            assert s.min() >= np.float32(1e-4) and s.max() <= np.float32(1e2), recipe
        recipes[recipe] = _decades(s)
    # uniform over the decades: each of the six gets about a sixth of 6000 elements
    case = Case(d.name, "x86", "float32", "default", (100, 60), {}, (), {"s": "domain"}, 1)
    s = make_inputs(d, case)["s"].astype(np.float64)
    hist, _ = np.histogram(np.log10(s), bins=6, range=(-4, 2))
    assert hist.min() > 800 and hist.max() < 1200, hist
    assert recipes["domain"] > 5.9 and recipes["normal"] > 3  # the bell is in log space too
    assert recipes["constant"] == 0 and recipes["ones"] == 0


def test_log_uniform_attribute_first_example_shrink_target_and_spread():
    d = _scale_op(attr_domain={"scale": log_uniform(1e-4, 1e2)})
    (choice,) = _attr_choices(d, "default", 2).values()
    assert isinstance(choice, LogAttr) and choice.first == 1.0  # the default, inside the range
    # hypothesis shrinks to the first value, and reaches both ends exactly
    assert find(choice.strategy(), lambda v: True) == 1.0
    assert find(choice.strategy(), lambda v: v < 1e-3) < 1e-3
    assert find(choice.strategy(), lambda v: v >= 1e2) == 1e2
    assert find(choice.strategy(), lambda v: v <= 1e-4) == 1e-4
    cases = _draw(d, "float32", "default", n=200)
    scales = [c.attrs["scale"] for c in cases]
    assert all(1e-4 <= v <= 1e2 for v in scales)
    assert _decades(scales) >= 5.5, sorted(scales)[:3]
    hist, _ = np.histogram(np.log10(scales), bins=6, range=(-4, 2))
    assert (hist > 0).all(), hist  # every decade
    # the common signature (what most examples use) takes the first value
    common = _draw(d, "float32", "default", n=20, p_common=100)
    assert {c.attrs["scale"] for c in common} == {1.0}

    # without a default in the range: the rounded geometric mean; for a required attribute too
    d2 = _scale_op("demo_scale2", attr_domain={"scale": log_uniform(0.005, 0.1)})
    assert _attr_choices(d2, "default", 2)["scale"].first == 0.02

    def demo_gain(x: Tensor, *, gain: float) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * gain, name="y")

    d3 = opsdk.op(reference=lambda x, *, gain: x * np.float32(gain), dtypes=("float32",),
                  attr_domain={"gain": log_uniform(1e-3, 1e3)})(demo_gain)
    assert d3.default_attrs() == {"gain": 1.0}
    assert {c.attrs["gain"] for c in _draw(d3, "float32", "default", n=10, p_common=100)} == {1.0}


def test_reproducer_replays_the_exact_attribute_value():
    d = _scale_op(attr_domain={"scale": log_uniform(1e-4, 1e2)})
    cases = [c for c in _draw(d, "float32", "default", n=60) if c.attrs["scale"] != 1.0]
    assert cases
    for case in cases[:10]:
        argv = shlex.split(reproducer_command(case))
        again = Case.from_json(argv[argv.index("--case") + 1])
        assert again == case
        assert again.attrs["scale"].hex() == case.attrs["scale"].hex()
        a, b = make_inputs(d, case), make_inputs(d, again)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # and the JSON float is the shortest repr that round-trips
    v = cases[0].attrs["scale"]
    assert json.loads(json.dumps(v)) == v


# ------------------------------------------------------------------------- the INT8 ops' data


def test_int8_scales_span_at_least_four_decades():
    spans = {}
    for name, dtype, layout, key in [
        ("quantize", "float32", "per_channel", "scale"),
        ("dequantize", "int8", "per_channel", "scale"),
        ("qdense", "int8", "int8_per_channel", "w_scale"),
    ]:
        d = opsdk.get_op(name)
        assert isinstance(d.domain[key], LogUniform) and d.domain[key].decades >= 5
        vals = np.concatenate([make_inputs(d, c)[key].ravel() for c in _cases(name, dtype, layout)])
        assert (vals > 0).all()
        spans[name] = _decades(vals)
    assert min(spans.values()) >= 4, spans
    qd = opsdk.get_op("qdense")
    for attr in ("x_scale", "out_scale"):
        assert isinstance(qd.attr_domain[attr], LogUniform)
        vals = [c.attrs[attr] for c in _cases("qdense", "uint8", "int8_per_tensor")]
        assert _decades(vals) >= 4, (attr, sorted(vals)[:3], sorted(vals)[-3:])


@pytest.mark.parametrize(("name", "dtype"), [
    ("quantize", "float32"), ("dequantize", "uint8"), ("dequantize", "int8"),
])
def test_tensor_zero_points_hit_both_ends_of_int8_and_uint8(name, dtype):
    d = opsdk.get_op(name)
    # per channel: drawn and corner cases put zero points at -128, 0, 127 and 255
    seen = Counter()
    for c in _cases(name, dtype, "per_channel"):
        seen.update(int(v) for v in make_inputs(d, c)["zero_point"].ravel())
    assert all(seen[v] > 0 for v in (-128, 0, 127, 255)), {v: seen[v] for v in (-128, 0, 127, 255)}
    # per tensor (one value): integer inputs get the "edges" recipe among the drawn ones and in
    # two corner cases; over seeds it takes each end
    drawn = _cases(name, dtype, "per_tensor")
    assert sum(c.data.get("zero_point") == "edges" for c in drawn) >= 10
    corners = corner_cases(d, "x86", dtype, "per_tensor", X86_LANES_8BIT)
    assert [c.seed for c in corners if c.data.get("zero_point") == "edges"] == [4, 8]
    ends = Counter()
    for seed in range(40):
        c = Case(name, "x86", dtype, "per_tensor", (2, 8), {}, (), {"zero_point": "edges"}, seed)
        ends.update(int(v) for v in make_inputs(d, c)["zero_point"].ravel())
    assert set(ends) == {-128, 0, 127, 255}, ends


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_qdense_zero_points_and_activations_cover_the_whole_range(dtype):
    d = opsdk.get_op("qdense")
    lo, hi = QRANGE[dtype]
    cases = _cases("qdense", dtype, "int8_per_tensor")
    zps = Counter(c.attrs["x_zero_point"] for c in cases)
    assert zps[lo] > 0 and zps[hi] > 0, zps
    assert set(zps) <= set(range(lo, hi + 1))  # the other type's ends are refused, not drawn
    # the corner with the largest attributes uses the top of this dtype's range
    big = [c for c in corner_cases(d, "x86", dtype, "int8_per_tensor", 64) if c.seed == 8]
    assert big and big[0].attrs["x_zero_point"] == hi and big[0].attrs["out_zero_point"] == 127
    xs = np.concatenate([make_inputs(d, c)["x"].ravel() for c in cases]).astype(int)
    assert xs.min() == lo and xs.max() == hi and ((xs > lo) & (xs < hi)).mean() > 0.3


def test_requantize_output_zero_point_ends_and_range_check():
    d = opsdk.get_op("requantize")
    for out_dtype in ("int8", "uint8"):
        lo, hi = QRANGE[out_dtype]
        zps = {c.attrs["output_zero_point"] for c in _cases("requantize", "int32", "per_tensor")
               if c.attrs["out_dtype"] == out_dtype}
        assert {lo, hi} <= zps <= set(range(lo, hi + 1)), (out_dtype, zps)
    shapes = {"x": (2, 8), "multiplier": (1,), "shift": (1,)}
    dts = {"x": "int32", "multiplier": "int32", "shift": "int32"}
    d.validate(shapes, dts, {"output_zero_point": 255, "out_dtype": "uint8"})
    with pytest.raises(ValueError, match=r"opsdk.requantize: argument 'output_zero_point' is 255"):
        d.validate(shapes, dts, {"output_zero_point": 255, "out_dtype": "int8"})


@pytest.mark.parametrize(("name", "dtype", "layout"), [
    ("quantize", "float32", "per_tensor"),
    ("quantize", "float32", "per_channel"),
    ("requantize", "int32", "per_tensor"),
    ("requantize", "int32", "per_channel"),
    ("qdense", "int8", "int8_per_channel"),
    ("qdense", "uint8", "int8_per_tensor"),
])
def test_int8_outputs_saturate_at_both_ends(name, dtype, layout):
    d = opsdk.get_op(name)
    ends = Counter()
    for c in _cases(name, dtype, layout):
        ref = d.run_reference(make_inputs(d, c), c.attrs)
        if ref.dtype != np.int8:
            continue
        ends["-128"] += int((ref == -128).any())
        ends["127"] += int((ref == 127).any())
        ends["inside"] += int(((ref > -128) & (ref < 127)).any())
    assert ends["-128"] >= 5 and ends["127"] >= 5 and ends["inside"] >= 20, ends


def test_qdense_k_not_a_multiple_of_4_or_16():
    d = opsdk.get_op("qdense")
    for dtype in ("int8", "uint8"):
        cases = _cases("qdense", dtype, "int8_per_channel")
        ks = [c.shape[1] for c in cases]
        assert sum(k % 4 != 0 for k in ks) >= 20 and sum(k % 16 != 0 for k in ks) >= 30, ks
        assert any(k % 4 == 0 and k % 16 != 0 for k in ks) and any(k % 16 == 0 for k in ks)
        assert any(k > 1000 for k in ks)  # a long reduction
    # The static corner is the build that the dot-product rules (VNNI / sdot) compile in every
    # profile: in every cell but the op's first (round extents, the fast path), K has a tail
    # of the 4-byte groups, and N whole 16-channel blocks and a tail.
    cells = [(dt, ly) for dt in d.dtypes for ly in d.layouts]
    for lanes in (64, 16):  # x86 AVX-512, aarch64 NEON
        shapes = []
        for dt, ly in cells:
            # The many-row static corner, then the decode one (a dense op's GEMV: 1 x 3072).
            static, decode = [c for c in corner_cases(d, "x86", dt, ly, lanes) if c.static]
            assert decode.shape == (1, 3072) and decode.free == static.free
            shapes.append((static.shape[1], static.free["N"]))
        (k0, _), rest = shapes[0], shapes[1:]
        assert k0 % 16 == 0, shapes
        assert all(k % 4 != 0 and n > 16 and n % 16 != 0 for k, n in rest), shapes
        assert len({k % 16 for k, _ in rest}) >= 4, shapes  # several residues across cells


def test_int8_reference_float32_steps_stay_normal():
    """The comment on qdense's domains, checked on what verify draws: the float32 factors and
    products the references round are zero or normal floats, far from overflow, so numpy and a
    kernel round them identically (no subnormal flushing, no int64 overflow)."""
    tiny, big = float(np.finfo(np.float32).tiny), 1e30
    d = opsdk.get_op("qdense")
    for dtype, layout in [("int8", "int8_per_channel"), ("uint8", "int8_per_tensor"),
                          ("int8", "float32")]:
        for c in _cases("qdense", dtype, layout, n=100):
            ins = make_inputs(d, c)
            acc = d.run_reference(ins, {**c.attrs, "out_dtype": "int32"}).astype(np.float32)
            s = np.float32(c.attrs["x_scale"]) * ins["w_scale"].astype(np.float32)
            r = s / np.float32(c.attrs["out_scale"])
            for v in (s, r, acc * s, acc * r):
                a = np.abs(v[v != 0].astype(np.float64))
                assert a.size == 0 or (a.min() >= tiny and a.max() <= big), c.to_json()
    q = opsdk.get_op("quantize")
    for c in _cases("quantize", "float32", "per_channel", n=100):
        ins = make_inputs(q, c)
        x, scale = np.abs(ins["x"].astype(np.float64)), ins["scale"].astype(np.float64)
        assert x.max() / scale.min() < 1e8, c.to_json()  # |x / scale|: far from overflow
        if (x > 0).any():
            assert x[x > 0].min() / scale.max() >= tiny, c.to_json()


def test_a_bounded_input_stays_inside_its_range_for_every_recipe():
    from opsdk.verify import Case
    from opsdk.verify._strategies import AUX_RECIPES, RECIPES, make_inputs

    def ref(x, table):
        return x * table

    @opsdk.op(reference=ref, domain={"table": opsdk.bounded(-1, 1)}, name="bounded_demo")
    def bounded_demo(x: opsdk.Tensor, table: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * table(*i), name="y")

    for recipe in {*RECIPES, *AUX_RECIPES}:
        for dtype in ("float32", "float16"):
            c = Case("bounded_demo", "x86", dtype, "default", (4, 33), {}, (),
                     {"x": "large", "table": recipe}, 1)
            t = make_inputs(bounded_demo, c)["table"].astype(np.float64)
            assert np.all(np.abs(t) <= 1.0), (recipe, dtype, np.abs(t).max())
    with pytest.raises(opsdk.OpDefinitionError, match="hi must be > lo"):
        opsdk.op(reference=ref, domain={"table": opsdk.bounded(1, -1)}, name="bad_bounded")(
            bounded_demo.compute
        )


@pytest.mark.parametrize(("name", "layout"), [("gelu", "tanh"), ("layer_norm", "last"),
                                              ("softmax", "last")])
def test_special_data_in_float16_is_drawn_without_warnings(name, layout):
    # +-1e37 and 3e38 are +-inf in float16 on purpose; the cast must not print a numpy
    # "overflow encountered in cast" RuntimeWarning in the middle of every verify run.
    import warnings

    d = opsdk.get_op(name)
    c = Case(name, "x86", "float16", layout, (6, 8), {}, (), {"x": "special"}, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = make_inputs(d, c)["x"]
    assert np.isinf(x).any()


def test_reproducer_keeps_the_plugin_modules_a_kernel_case_ran_with():
    # A module of plug-in rules (they register at import, no op of their own): a kernel
    # family's failure under them replays only with the module loaded again; another run's
    # modules (an earlier test's) do not leak into this one's reproducers.
    from opsdk.verify._report import run_modules

    case = _draw(_scale_op(), "float32", "default", n=1)[0]
    with run_modules(["my_conv_rules", "opsdk.ops"]):
        argv = shlex.split(reproducer_command(case, kernels=True))
    assert argv[argv.index("--module") + 1] == "my_conv_rules"
    assert argv.count("--module") == 1
    assert "--module" not in reproducer_command(case, kernels=True)
