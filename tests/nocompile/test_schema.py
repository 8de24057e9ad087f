"""Schema, type inference and registration: no code generation involved."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx

import opsdk
from opsdk import OpDefinitionError, Tensor

BUILTINS = {
    "layer_norm", "rms_norm", "gelu", "bias_gelu", "softmax", "group_norm", "attention",
    "quantize", "dequantize", "requantize", "qdense", "qconv2d", "dense_w8", "dense_q4", "take_q4",
    "take_w8",
}


def _infer(call: relax.Call) -> relax.TensorType:
    bb = relax.BlockBuilder()
    return bb.normalize(call).ty


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(list(shape), dtype))


def test_builtins_listed_and_registered_with_tvm():
    names = {d.name for d in opsdk.list_ops()}
    assert names >= BUILTINS
    assert {d.name for d in opsdk.ops.BUILTIN_OPS} == BUILTINS
    assert all(opsdk.get_op(n).source == "builtin" for n in BUILTINS)
    for name in BUILTINS:
        op = tvm.ir.Op.get(f"opsdk.{name}")
        assert op.name == f"opsdk.{name}"
        assert op.get_attr("FPurity")
        assert op.get_attr("TScriptPrinterName") == f"opsdk.{name}"


def test_int8_module_still_loads_as_a_plugin_and_changes_nothing():
    import opsdk.ops

    before = [(d.name, d.source) for d in opsdk.list_ops()]
    loaded = opsdk.load_plugins(["opsdk.ops.int8"])
    assert [d.name for d in loaded] == ["quantize", "dequantize", "requantize", "qdense", "qconv2d"]
    assert all(any(d is b for b in opsdk.ops.BUILTIN_OPS) for d in loaded)
    assert [(d.name, d.source) for d in opsdk.list_ops()] == before  # still "builtin"


def test_register_twice_is_noop_and_reimport_is_harmless():
    import importlib

    import opsdk.ops

    before = [d.name for d in opsdk.list_ops()]
    for d in opsdk.ops.BUILTIN_OPS:
        assert opsdk.register(d) is d
    opsdk.register_builtin_ops()
    importlib.import_module("opsdk")
    assert [d.name for d in opsdk.list_ops()] == before


@pytest.mark.parametrize(
    ("op", "shapes", "attrs", "out"),
    [
        ("layer_norm", {"x": (4, 3, 16), "gamma": (16,), "beta": (16,)}, {}, (4, 3, 16)),
        ("layer_norm", {"x": (4, 3, 16), "gamma": (3, 16)}, {"begin_axis": -2}, (4, 3, 16)),
        ("rms_norm", {"x": (7, 5)}, {}, (7, 5)),
        ("gelu", {"x": (2, 9)}, {"approximate": "tanh"}, (2, 9)),
        ("bias_gelu", {"x": (2, 9), "bias": (9,)}, {}, (2, 9)),
        ("softmax", {"x": (2, 5, 3)}, {"axis": 1}, (2, 5, 3)),
        ("group_norm", {"x": (2, 8, 4, 4), "gamma": (8,)}, {"num_groups": 4}, (2, 8, 4, 4)),
        ("group_norm", {"x": (2, 4, 4, 6)}, {"num_groups": 3, "layout": "NHWC"}, (2, 4, 4, 6)),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_static_type_inference(op, shapes, attrs, out, dtype):
    args = {k: _var(k, s, dtype) for k, s in shapes.items()}
    ty = _infer(getattr(opsdk.relax, op)(**args, **attrs))
    assert isinstance(ty, relax.TensorType)
    assert [int(v) for v in ty.shape.values] == list(out)
    assert ty.dtype == dtype


def test_symbolic_dims_are_kept():
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    x = _var("x", (n, m, 64))
    g = _var("g", (64,))
    for call in (
        opsdk.relax.layer_norm(x, g, g),
        opsdk.relax.softmax(x, axis=1),
        opsdk.relax.bias_gelu(x, g),
        opsdk.relax.rms_norm(x, g),
    ):
        ty = _infer(call)
        vals = ty.shape.values
        assert vals[0].same_as(n) and vals[1].same_as(m) and int(vals[2]) == 64
    xi = _var("xi", (n, 16, 7, 7), "float16")
    ty = _infer(opsdk.relax.group_norm(xi, num_groups=4))
    assert ty.shape.values[0].same_as(n) and ty.dtype == "float16"


def test_layer_norm_gamma_over_two_trailing_symbolic_axes():
    n = tirx.Var("n", "int64")
    x = _var("x", (n, 4, 8))
    ty = _infer(opsdk.relax.layer_norm(x, _var("g", (4, 8)), begin_axis=1))
    assert ty.shape.values[0].same_as(n)


def _err(call_fn, *needles):
    with pytest.raises(ValueError) as ei:
        _infer(call_fn())
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_error_wrong_rank():
    _err(
        lambda: opsdk.relax.group_norm(_var("x", (2, 8, 4)), num_groups=2),
        "opsdk.group_norm",
        "'x'",
        "rank 3",
        "rank 4",
    )


def test_error_wrong_dtype():
    _err(
        lambda: opsdk.relax.gelu(_var("x", (2, 8), "float64")),
        "opsdk.gelu",
        "'x'",
        "float64",
        "float32, float16, bfloat16",
    )
    _err(lambda: opsdk.relax.softmax(_var("x", (2, 8), "int8")), "opsdk.softmax", "int8")


def test_error_mixed_dtypes():
    _err(
        lambda: opsdk.relax.bias_gelu(_var("x", (2, 8)), _var("b", (8,), "float16")),
        "opsdk.bias_gelu",
        "'bias'",
        "float16",
        "cast",
    )


def test_error_axis_out_of_range():
    _err(
        lambda: opsdk.relax.softmax(_var("x", (2, 8)), axis=2), "opsdk.softmax", "'axis'", "[-2, 1]"
    )
    _err(
        lambda: opsdk.relax.layer_norm(_var("x", (2, 8)), begin_axis=-3),
        "opsdk.layer_norm",
        "'begin_axis'",
    )


def test_error_shape_mismatch():
    _err(
        lambda: opsdk.relax.layer_norm(_var("x", (2, 8)), _var("g", (7,))),
        "opsdk.layer_norm",
        "'gamma'",
        "(7,)",
        "(8,)",
    )
    _err(
        lambda: opsdk.relax.bias_gelu(_var("x", (2, 8)), _var("b", (2,))),
        "opsdk.bias_gelu",
        "'bias'",
    )


@pytest.mark.parametrize(("op", "build", "dim", "needle"), [
    ("layer_norm", lambda x, v: opsdk.relax.layer_norm(x, v, v), "m", "m and k are different"),
    ("bias_gelu", lambda x, v: opsdk.relax.bias_gelu(x, v), "m", "m and k are different"),
    ("quantize", lambda x, v: opsdk.relax.quantize(
        x, v, relax.Var("zp", relax.TensorType((tirx.Var("c", "int64"),), "int32")),
        axis=-1, per_channel=True), "m", "cannot be proven equal"),
    # a second tirx.Var("k") is another dim: "k and k are different" said nothing
    ("layer_norm", lambda x, v: opsdk.relax.layer_norm(x, v), "k",
     "two different tirx.Var objects with one name"),
])
def test_symbolic_dims_that_may_differ_are_refused(op, build, dim, needle):
    # x: (n, k), a parameter of shape (m,): equal only if k == m at run time; a kernel built
    # from such a call would read one with the other's extent (out of bounds when m < k).
    n, k = (tirx.Var(v, "int64") for v in "nk")
    x = relax.Var("x", relax.TensorType((n, k), "float32"))
    v = relax.Var("v", relax.TensorType((tirx.Var(dim, "int64"),), "float32"))
    _err(lambda: build(x, v), f"opsdk.{op}", "cannot be proven equal", "R.match_cast", needle)
    same = relax.Var("v", relax.TensorType((k,), "float32"))
    if op != "quantize":
        assert relax.BlockBuilder().normalize(build(x, same)).ty.shape is not None


@pytest.mark.parametrize(("layout", "q", "kv"), [
    ("BSHD", (1, 5, 8, 16), lambda h: (1, 7, h, 16)),
    ("BHSD", (1, 8, 5, 16), lambda h: (1, h, 7, 16)),
])
def test_attention_takes_grouped_kv_heads_that_divide_the_query_heads(layout, q, kv):
    for heads in (8, 2, 1):  # as many as q, grouped, one for all
        k = _var("k", kv(heads))
        ty = _infer(opsdk.relax.attention(_var("q", q), k, k, layout=layout))
        assert [int(d) for d in ty.shape.values] == list(q)
    k = _var("k", kv(3))
    _err(lambda: opsdk.relax.attention(_var("q", q), k, k, layout=layout),
         "opsdk.attention", "argument 'k' has 3 heads", "the 8 heads of 'q'", layout)
    _err(lambda: opsdk.relax.attention(_var("q", q), _var("k", kv(2)), _var("v", kv(4)),
                                       layout=layout), "opsdk.attention", "argument 'v'")


def test_error_attribute_value_and_type():
    with pytest.raises(
        ValueError, match=r"opsdk\.gelu: argument 'approximate' is 'fast'.*'none', 'tanh'"
    ):
        opsdk.relax.gelu(_var("x", (2, 8)), approximate="fast")
    with pytest.raises(ValueError, match=r"opsdk\.layer_norm: argument 'epsilon' must be float"):
        opsdk.relax.layer_norm(_var("x", (2, 8)), epsilon="1e-5")
    with pytest.raises(ValueError, match=r"opsdk\.group_norm: argument 'num_groups' is required"):
        opsdk.relax.group_norm(_var("x", (2, 8, 4, 4)))
    with pytest.raises(ValueError, match=r"argument 'eps' is not an attribute"):
        opsdk.relax.layer_norm(_var("x", (2, 8)), eps=1e-5)
    _err(
        lambda: opsdk.relax.group_norm(_var("x", (2, 8, 4, 4)), num_groups=3),
        "opsdk.group_norm",
        "'num_groups'",
        "divide",
    )
    _err(
        lambda: opsdk.relax.layer_norm(_var("x", (2, 8)), epsilon=-1.0),
        "opsdk.layer_norm",
        "'epsilon'",
    )
    _err(  # accepted once, then TVM refused the float32 literal deep in the build
        lambda: opsdk.relax.layer_norm(_var("x", (2, 8)), epsilon=1e300),
        "opsdk.layer_norm",
        "'epsilon'",
        "beyond float32's range",
    )
    _err(  # 1e-300 is 0 in float32: a constant row then gave NaN
        lambda: opsdk.relax.layer_norm(_var("x", (2, 8)), epsilon=1e-300),
        "opsdk.layer_norm",
        "'epsilon'",
        "which is 0 in float32",
    )


def test_error_non_tensor_argument():
    with pytest.raises(ValueError, match=r"opsdk\.gelu: argument 'x' is a ndarray"):
        opsdk.relax.gelu(np.zeros((2, 2), "float32"))


def _swish_ref(x):
    return x / (1.0 + np.exp(-x))


def test_definition_with_disagreeing_declared_type_raises_naming_the_op():
    def wrong_type(shapes, dtypes, attrs):
        return shapes["x"][:-1], dtypes["x"]  # claims the last axis is dropped

    with pytest.raises(OpDefinitionError, match=r"op 'bad_swish'.*declared type"):

        @opsdk.op(reference=_swish_ref, infer_type=wrong_type)
        def bad_swish(x: Tensor) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x(*i) * tirx.sigmoid(x(*i)), name="swish")

    assert not opsdk.is_registered("bad_swish")


def test_definition_whose_reference_disagrees_raises():
    with pytest.raises(OpDefinitionError, match=r"op 'bad_ref'.*reference returns shape"):

        @opsdk.op(reference=lambda x: x.sum(axis=-1))
        def bad_ref(x: Tensor) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x(*i), name="ident")


def test_definition_schema_errors():
    with pytest.raises(OpDefinitionError, match="keyword-only"):

        @opsdk.op(reference=lambda x, alpha: x)
        def bad_attr(x: Tensor, alpha: float) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x(*i), name="y")

    with pytest.raises(OpDefinitionError, match="reference parameters"):

        @opsdk.op(reference=lambda y: y)
        def bad_names(x: Tensor) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x(*i), name="y")

    with pytest.raises(OpDefinitionError, match="compute failed"):

        @opsdk.op(reference=lambda x: x)
        def bad_compute(x: Tensor) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x(*i, 0), name="y")


def test_weights_are_declared_by_name_in_the_ops_own_file():
    # The ops whose rules pack constant weights at compile time name them (verify's packed
    # cases bind those as a model does).
    assert opsdk.get_op("dense_q4").weights == ("qs", "d", "bias")
    assert opsdk.get_op("qdense").weights == ("w", "w_scale", "bias")
    assert opsdk.get_op("gelu").weights == ()
    for bad in ("w", ("x", "nope")):  # a string would be read letter by letter
        with pytest.raises(OpDefinitionError, match=r"op 'bad_weights': weights=.* tensor"):

            @opsdk.op(reference=lambda x: x, weights=bad)
            def bad_weights(x: Tensor) -> te.Tensor:
                return te.compute(x.shape, lambda *i: x(*i), name="y")


def test_consistent_declared_type_is_accepted_and_used():
    calls = []

    def declared(shapes, dtypes, attrs):
        calls.append(1)
        return shapes["x"], dtypes["x"]

    @opsdk.op(reference=_swish_ref, infer_type=declared)
    def ok_swish(x: Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * tirx.sigmoid(x(*i)), name="swish")

    opsdk.register(ok_swish)
    try:
        n = len(calls)
        ty = _infer(opsdk.relax.ok_swish(_var("x", (3, 5))))
        assert [int(v) for v in ty.shape.values] == [3, 5]
        assert len(calls) > n
    finally:
        opsdk.unregister(ok_swish)
    assert not opsdk.is_registered("ok_swish")
    with pytest.raises(AttributeError, match="no opsdk op named 'ok_swish'"):
        opsdk.relax.ok_swish  # noqa: B018


def test_same_name_different_definition_needs_replace():
    @opsdk.op(reference=_swish_ref, name="tmp_dup")
    def first(x: Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * tirx.sigmoid(x(*i)), name="s")

    @opsdk.op(reference=_swish_ref, name="tmp_dup")
    def second(x: Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * tirx.sigmoid(x(*i)), name="s")

    opsdk.register(first)
    try:
        opsdk.register(first)
        with pytest.raises(ValueError, match="already registered"):
            opsdk.register(second)
        opsdk.register(second, replace=True)
        assert opsdk.get_op("tmp_dup") is second
    finally:
        opsdk.unregister("tmp_dup")
    # Unregister then register again works (the TVM op object is reused).
    opsdk.register(first)
    opsdk.unregister(first)


def test_unregistered_op_in_a_module_fails_clearly():
    @opsdk.op(reference=_swish_ref, name="tmp_gone")
    def gone(x: Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i), name="s")

    opsdk.register(gone)
    call = opsdk.relax.tmp_gone(_var("x", (2, 2)))
    opsdk.unregister(gone)
    with pytest.raises(ValueError, match="tmp_gone is not registered"):
        _infer(call)


def test_targets_resolve():
    assert opsdk.target("arm").keys == ("arm_cpu", "cpu")
    assert "cpu" in opsdk.target("x86").keys
    assert opsdk.target("x86").attrs["mcpu"] != "native"
    from opsdk.targets import target_features

    assert "dotprod" in target_features(opsdk.target("arm-dotprod"))
    assert "dotprod" not in target_features(opsdk.target("arm"))
    assert "sve" in target_features(opsdk.target("arm-sve"))
    with pytest.raises(ValueError, match="unknown target 'armv9'"):
        opsdk.target("armv9")


@pytest.mark.parametrize(("spec", "needle", "plain"), [
    ({"kind": "llvm", "mtriple": "garbage"}, "no 'garbage' back end", True),
    ({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "nosuchcpu"}, "mcpu 'nosuchcpu'",
     False),  # plain tvm.compile only logs an unknown CPU, and so opsdk's rules let it be
    ({"kind": "nosuch"}, "not a valid TVM target", False),
])
def test_bad_target_dicts_are_refused_before_llvm_sees_them(spec, needle, plain):
    # an unknown triple used to crash the process in target_features (a segfault)
    with pytest.raises(ValueError, match=needle):
        opsdk.target(spec)
    with pytest.raises(ValueError, match=needle):  # compile resolves through opsdk.target
        opsdk.compile(tvm.IRModule(), spec)
    if plain:  # plain tvm.compile of an opsdk op reaches the rules' target_features unchecked
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((4, 8), "float32"))
        with bb.function("main", [x]):
            bb.emit_func_output(bb.emit(opsdk.relax.gelu(x)))
        with pytest.raises(ValueError, match=needle):
            tvm.compile(bb.get(), target=tvm.target.Target(spec))


def test_output_dtype_contract_is_declared_and_validated():
    # built-ins: same as the input by default, a fixed dtype, or an attribute
    assert opsdk.get_op("layer_norm").declared_dtype({"x": "bfloat16"}, {}) == "bfloat16"
    assert opsdk.get_op("dequantize").declared_dtype({"q": "int8"}, {}) == "float32"
    assert opsdk.get_op("qdense").output_dtype_rule() == "given by attribute 'out_dtype'"

    def ref(x):
        return x

    def body(x: Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i), name="y")

    with pytest.raises(OpDefinitionError, match="output_dtype='flaot32' is neither a dtype"):
        opsdk.op(reference=ref, output_dtype="flaot32", name="bad_out_dtype")(body)
    with pytest.raises(OpDefinitionError, match="output_dtype must be"):
        opsdk.op(reference=ref, output_dtype=3, name="bad_out_dtype")(body)
    d = opsdk.op(reference=ref, output_dtype=lambda dts, attrs: dts["x"], name="fn_out")(body)
    assert d.declared_dtype({"x": "float16"}, {}) == "float16"
    assert d.output_dtype_rule() == "<lambda>(dtypes, attrs)"


def _copy_compute(x: Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *i: x(*i), name="y")


def _sym_infer(shapes, dtypes, attrs):  # static 7 where the input has a symbolic dim
    return tuple(int(v) if isinstance(v, int) else 7 for v in shapes["x"]), dtypes["x"]


# Each definition mistake is an OpDefinitionError that names the op and the argument.
BAD_DEFINITIONS = [
    ({"domain": {"zz": (0, 1)}}, "domain= names 'zz', but 'zz' is not a tensor input"),
    ({"attr_domain": {"zz": [1]}}, "attr_domain= names 'zz', but 'zz' is not an attribute"),
    ({"kind": "elementwize"}, "did you mean 'elementwise'"),
    ({"domain": {"x": (1, 0)}}, "needs finite lo <= hi"),
    ({"domain": {"x": (float("nan"), 1)}}, "needs finite lo <= hi"),
    ({"ranks": (0, 0)}, "1 <= min <= max"),
    ({"ranks": (3, 1)}, "1 <= min <= max"),
    ({"ranks": (-1, 2)}, "1 <= min <= max"),
    ({"dtypes": ()}, "dtypes= must be a non-empty sequence"),
    ({"reference": None}, "reference= must be a function"),
    ({"input_shapes": lambda s, a: {"zz": s}}, "input_shapes returned 'zz'"),
    ({"input_shapes": lambda s, a: 1 / 0}, "input_shapes raised ZeroDivisionError"),
    ({"infer_type": lambda s, d, a: 1 / 0}, "infer_type raised ZeroDivisionError"),
    ({"reference": lambda x: 1 / 0}, "the reference raised ZeroDivisionError"),
    ({"ranks": (2, 2), "infer_type": _sym_infer}, "infer_type must follow symbolic dims"),
    ({"output_dtype": ("float32", "float16")}, "output_dtype gives 2 rules"),
    ({"domain": {"x": 5}}, "domain['x'] = 5: give (lo, hi), opsdk.log_uniform"),
    ({"dtypes": ("flaot32",)}, "dtypes= unsupported dtype 'flaot32'"),
    ({"examples": "abc"}, "examples='abc' must be shapes of the first input"),
    ({"examples": [(0, 3)]}, "tuples of positive ints"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_DEFINITIONS,
                         ids=[m[:40] for _, m in BAD_DEFINITIONS])
def test_definition_mistakes_name_the_op_and_argument(kwargs, message):
    args = {"reference": lambda x: x, **kwargs}
    with pytest.raises(OpDefinitionError, match="op 'bad_def'") as e:
        opsdk.op(**args, name="bad_def")(_copy_compute)
    assert message in str(e.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"target_key": "cpux"}, "target key 'cpux' is not a TVM target key"),
    ({"target_key": "cpu", "claims": ("vectorise",)}, "did you mean 'vectorize'"),
    ({"target_key": "cpu", "requires": ("AVX 512",)}, "is not a feature name"),
    # a typo of a feature, a kind or an arch: the rule would never have applied
    ({"target_key": "arm_cpu", "requires": ("neonn",)},
     "requires='neonn' is no LLVM feature of any 'arm_cpu' CPU (did you mean 'neon'?)"),
    ({"target_key": "cpu", "requires": ("avx512",)}, "(did you mean 'avx512f'?)"),
    ({"target_key": "cpu", "requires": ("kind:lvm",)}, "'lvm' is not a TVM target kind"),
    ({"target_key": "cpu", "requires": ("arch:aarch6",)}, "(did you mean 'aarch64'?)"),
    ({"target_key": "armcpu"}, "target key 'armcpu' is not a TVM target key"),
    ({"op_or_kinds": "kind:nrom", "target_key": "cpu"}, "'kind:nrom' names no op kind"),
    ({"target_key": "cpu", "priority": "high"}, "priority='high' must be a number"),
    ({"target_key": "cpu", "fn": 42}, "@rule decorates a function"),  # what it decorates
])
def test_rule_registration_mistakes_are_refused(kwargs, message):
    from opsdk.schedules import rule

    def my_rule(func, target):
        return None

    kwargs = dict(kwargs)
    fn = kwargs.pop("fn", my_rule)
    with pytest.raises((ValueError, TypeError), match="schedule rule") as e:
        rule(**{"op_or_kinds": "kind:norm", **kwargs})(fn)
    assert message in str(e.value)
    if fn is my_rule:  # the rule's name and what it is for: the definition to fix
        assert f"schedule rule {kwargs.get('target_key')}.my_rule for " in str(e.value)


def test_register_takes_an_op_definition():
    with pytest.raises(TypeError, match=r"opsdk\.get_op\('gelu'\)"):
        opsdk.register("gelu")


def test_a_rule_returning_nonsense_is_skipped_with_a_warning():
    from opsdk import schedules

    d = opsdk.get_op("gelu")
    x = te.placeholder((4, 8), "float32", name="x")
    func = te.create_prim_func([x, d.call_compute([x], d.default_attrs())])

    @schedules.rule("gelu", "cpu", name="test.returns_42", priority=10_000)
    def _bad(func, target):
        return 42

    try:
        with pytest.warns(UserWarning, match="returned a int"):
            ch = schedules.choose(d, func, opsdk.target("x86"))
    finally:
        schedules._RULES[:] = [r for r in schedules._RULES if r.name != "test.returns_42"]
    assert ch.rule != "test.returns_42"
    assert any("returned int, not a Schedule" in r for r in ch.reasons)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_gelu", "group_norm"])
def test_builtin_fusion_rules_are_rules_of_their_ops(op):
    # One op, one file: the decomposed-subgraph rule is registered by the op itself and
    # FuseIntoOps takes it from there, as it does an author's.
    from opsdk.transform._fuse import op_fusion_rules

    d = opsdk.get_op(op)
    assert [n for n, _ in d.fusions] == [f"fuse.{op}"]
    assert op_fusion_rules()[f"fuse.{op}"]  # at least one pattern
