"""Every registered op inside Relax functions with a symbolic batch: compiled for the host and
run against the float64 reference; cross-compiled for aarch64 and checked for NEON code."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx

import opsdk
from opsdk._asm import asm_of, asm_vector_stats
from opsdk._dtypes import eps, np_dtype
from opsdk._explain import build_single_op

DEV = tvm.cpu()
OPS = [d.name for d in opsdk.list_ops() if d.source == "builtin"]
# The float ops, checked here against a float error bound (the INT8 ops are compared exactly
# in tests/host/test_int8_schedules.py and by verify).
FLOAT_OPS = [d.name for d in opsdk.ops.FLOAT_OPS]
# Each float op with each float dtype it declares (attention is float32 only).
FLOAT_CELLS = [(d.name, dt) for d in opsdk.ops.FLOAT_OPS
               for dt in ("float32", "float16", "bfloat16") if dt in d.dtypes]


def _bound(ref: np.ndarray, dtype: str, k: int) -> np.ndarray:
    """Rounding of the output dtype (eps * |ref|) plus the float32 forward-error bound of a
    length-k recursive sum feeding a normalization (k * eps32 per unit of output, x8 for
    the mean/variance/rsqrt chain)."""
    return eps(dtype) * np.abs(ref) + (eps(dtype) + 8 * k * eps("float32")) * (1 + np.abs(ref))


def _inputs(d, shapes, dtype, rng):
    out = {}
    for name, shp in shapes.items():
        lo, hi = d.domain.get(name, (-2.0, 2.0))
        out[name] = rng.uniform(lo, hi, size=shp).astype(np_dtype(dtype))
    return out


def _reduction_len(d, shape, attrs) -> int:
    if d.kind == "elementwise":
        return 1
    return int(np.prod(shape)) // shape[0]


@pytest.mark.parametrize("op, dtype", FLOAT_CELLS)
def test_each_op_symbolic_batch_matches_reference(op, dtype):
    d = opsdk.get_op(op)
    rng = np.random.default_rng(7)
    for layout, lattrs in d.layouts.items():
        attrs = {**d.default_attrs(), **lattrs}
        base = d.examples[0]
        n = tirx.Var("n", "int64")
        shapes = d.example_shapes((n, *base[1:]), attrs)
        ex = tvm.compile(build_single_op(op, shapes, dtype, attrs), target=opsdk.target("x86"))
        vm = relax.VirtualMachine(ex, DEV)
        for batch in (1, 5):
            concrete = d.example_shapes((batch, *base[1:]), attrs)
            ins = _inputs(d, concrete, dtype, rng)
            out = vm["main"](*[tvm.runtime.tensor(a, DEV) for a in ins.values()]).numpy()
            ref = d.run_reference(ins, attrs)
            assert out.shape == ref.shape and str(out.dtype) == dtype
            err = np.abs(out.astype(np.float64) - ref)
            bound = _bound(ref, dtype, _reduction_len(d, concrete[d.primary], attrs))
            assert np.all(err <= bound), (
                f"{op} {dtype} layout={layout} batch={batch}: max err {err.max():.3g}, "
                f"worst err/bound {(err / bound).max():.3g}"
            )


def _all_ops_module(dtype: str) -> tvm.IRModule:
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 4, 24), dtype))
    g = relax.Var("g", relax.TensorType((24,), dtype))
    b = relax.Var("b", relax.TensorType((24,), dtype))
    xi = relax.Var("xi", relax.TensorType((n, 8, 5, 6), dtype))
    gi = relax.Var("gi", relax.TensorType((8,), dtype))
    r = opsdk.relax
    with bb.function("main", [x, g, b, xi, gi]):
        with bb.dataflow():
            outs = [
                bb.emit(r.layer_norm(x, g, b, epsilon=1e-5)),
                bb.emit(r.rms_norm(x, g)),
                bb.emit(r.gelu(x)),
                bb.emit(r.bias_gelu(x, b, approximate="tanh")),
                bb.emit(r.softmax(x, axis=1)),
                bb.emit(r.group_norm(xi, gi, gi, num_groups=4)),
            ]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def test_all_six_ops_in_one_function_x86():
    mod = _all_ops_module("float32")
    ex = tvm.compile(mod, target=opsdk.target("x86"))
    vm = relax.VirtualMachine(ex, DEV)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        X = rng.normal(size=(batch, 4, 24)).astype("float32")
        G, B = rng.normal(size=24).astype("float32"), rng.normal(size=24).astype("float32")
        XI, GI = (
            rng.normal(size=(batch, 8, 5, 6)).astype("float32"),
            rng.normal(size=8).astype("float32"),
        )
        outs = vm["main"](*[tvm.runtime.tensor(a, DEV) for a in (X, G, B, XI, GI)])
        refs = [
            ("layer_norm", {"x": X, "gamma": G, "beta": B}, {}),
            ("rms_norm", {"x": X, "gamma": G}, {}),
            ("gelu", {"x": X}, {}),
            ("bias_gelu", {"x": X, "bias": B}, {"approximate": "tanh"}),
            ("softmax", {"x": X}, {"axis": 1}),
            ("group_norm", {"x": XI, "gamma": GI, "beta": GI}, {"num_groups": 4}),
        ]
        for o, (name, ins, attrs) in zip(outs, refs):
            ref = opsdk.get_op(name).run_reference(ins, attrs)
            err = np.abs(o.numpy().astype(np.float64) - ref)
            assert np.all(err <= _bound(ref, "float32", 120)), (name, err.max())


def test_all_six_ops_compile_for_arm_with_neon():
    ex = tvm.compile(_all_ops_module("float32"), target=opsdk.target("arm"))
    stats = asm_vector_stats(asm_of(ex), "aarch64")
    assert stats["neon"] > 50, stats


@pytest.mark.parametrize("op", OPS)
def test_each_op_arm_asm_has_neon_and_rule_is_neon(op):
    e = opsdk.explain(op, "arm")
    assert e.rule.startswith("neon."), e.reasons
    assert e.asm_stats["neon"] > 0, e.asm_stats
    assert e.asm_stats["sve"] == 0


def test_explain_names_different_rules_per_target():
    arm = opsdk.explain("layer_norm", "arm", asm=False)
    x86 = opsdk.explain("layer_norm", "x86", asm=False)
    assert arm.rule == "neon.rows" and x86.rule == "x86.rows"
    assert any("skipped" in r and "arm_cpu" in r for r in x86.reasons)
    assert "T.parallel" in x86.tir and "T.vectorized" in x86.tir


def test_generic_fallback_without_matching_rule():
    e = opsdk.explain("layer_norm", "c", asm=False)
    assert e.rule == "generic"
    assert "T.parallel" not in e.tir


def test_lower_ops_pass_and_pipeline():
    mod = _all_ops_module("float32")
    lowered = opsdk.transform.LowerOps("x86")(mod)
    rules = {
        str(f.attrs["opsdk.op"]): str(f.attrs["opsdk.rule"])
        for f in lowered.functions.values()
        if isinstance(f, tirx.PrimFunc)
    }
    assert rules["gelu"] == "x86.elementwise" and rules["layer_norm"] == "x86.rows"
    ex = opsdk.compile(mod, "x86")
    assert ex is not None


def _children(stmt) -> list:
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, s_tir.SBlockRealize):
        return [stmt.block.body]
    if isinstance(stmt, tirx.IfThenElse):
        return [s for s in (stmt.then_case, stmt.else_case) if s is not None]
    body = getattr(stmt, "body", None)
    return [body] if body is not None else []


def _blocks(stmt) -> set[str]:
    own = {stmt.block.name_hint} if isinstance(stmt, s_tir.SBlockRealize) else set()
    return own.union(*(_blocks(c) for c in _children(stmt)))


def _shares_a_loop(func: tirx.PrimFunc, a: str, b: str, out: str) -> bool:
    """A loop below the output's (row) loop holds both blocks: one pass computes ``a`` and
    reduces it into ``b``."""

    def visit(stmt) -> bool:
        if isinstance(stmt, tirx.For):
            inside = _blocks(stmt)
            if a in inside and b in inside and out not in inside:
                return True
        return any(visit(c) for c in _children(stmt))

    return visit(func.body)


@pytest.mark.parametrize("target", ["x86", "arm"])
def test_softmax_float32_keeps_exp_in_the_output_buffer(target):
    # float32: the exp scratch lives in the output (no per-row workspace call); float16 keeps
    # a float32 scratch, which cannot alias a float16 output.
    def lowered(dtype):
        mod = build_single_op("softmax", {"x": (64, 768)}, dtype, {"axis": -1})
        return opsdk.transform.LowerOps(opsdk.target(target))(mod)

    def scratch_allocs(mod):
        f = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
        return [b.name for b in f.body.block.alloc_buffers if b.name == "exp"]

    assert scratch_allocs(lowered("float32")) == []
    assert scratch_allocs(lowered("float16")) == ["exp"]
    # the exp chunks are summed in the loop that computes them (no separate sum pass)
    f = next(f for f in lowered("float32").functions.values() if isinstance(f, tirx.PrimFunc))
    assert _shares_a_loop(f, "exp", "expsum_rf_update", "softmax")
    ex = tvm.compile(lowered("float32"), target=opsdk.target(target))
    assert "TVMBackendAllocWorkspace" not in asm_of(ex)
    if target == "x86":
        x = np.random.default_rng(3).uniform(-8, 8, size=(64, 768)).astype("float32")
        out = relax.VirtualMachine(ex, DEV)["main"](tvm.runtime.tensor(x, DEV)).numpy()
        ref = opsdk.get_op("softmax").run_reference({"x": x}, {"axis": -1})
        assert np.all(np.abs(out - ref) <= _bound(ref, "float32", 768))


@pytest.mark.parametrize("shape", [(7, 8, 8, 8), (8, 16, 5, 7)])
@pytest.mark.parametrize("target", ["x86", "arm"])
def test_softmax_middle_axis_keeps_the_rows_rule(target, shape):
    # (7, 8, 8, 8): C == H == W, equal extents must not make (n, c) look like row axes of
    # rsum[n, h, w]. (8, 16, 5, 7): the partitioned output tail makes the exp-in-output
    # rewrite fail TVM's re-check; the rule keeps the scratch instead of failing.
    e = opsdk.explain("softmax", target, shape=shape, attrs={"axis": 1}, asm=False)
    assert e.rule.endswith(".rows"), e.reasons
    if target == "x86":
        mod = build_single_op("softmax", {"x": shape}, "float32", {"axis": 1})
        ex = tvm.compile(mod, target=opsdk.target(target))
        x = np.random.default_rng(5).uniform(-8, 8, size=shape).astype("float32")
        out = relax.VirtualMachine(ex, DEV)["main"](tvm.runtime.tensor(x, DEV)).numpy()
        ref = opsdk.get_op("softmax").run_reference({"x": x}, {"axis": 1})
        assert np.all(np.abs(out - ref) <= _bound(ref, "float32", shape[1]))


def test_a_reshaping_transpose_runs_through_an_l1_tile():
    """Two channels-last scales flattened, transposed to (C, positions) and concatenated along
    the positions (a detector head): each output vector along the positions would gather
    with div / mod per lane; the rule fills a local tile along the channels instead and
    copies it out along the positions. Structure (a local tile) and every element."""
    from tvm import te

    a = te.placeholder((1, 10, 10, 32), name="a")
    b = te.placeholder((1, 5, 5, 32), name="b")
    n = 125

    def body(z, c, p):
        return tirx.if_then_else(p < 100, a[z, p // 10, p % 10, c],
                                 b[z, (p - 100) // 5, (p - 100) % 5, c])

    out = te.compute((1, 32, n), body, name="head")
    f = te.create_prim_func([a, b, out])
    tgt = opsdk.target("x86")
    sched = opsdk.schedules.apply_schedule(opsdk.schedules.kernel_for("k", f), f, tgt)
    assert sched.attrs["opsdk.rule"] == "x86.elementwise"
    allocs = [buf for buf in sched.body.block.alloc_buffers]
    assert any(str(buf.scope()) == "local" for buf in allocs), allocs
    fn = tvm.compile(tvm.IRModule({"main": sched.with_attr("global_symbol", "main")}), target=tgt)
    rng = np.random.default_rng(9)
    av = rng.standard_normal((1, 10, 10, 32)).astype("float32")
    bv = rng.standard_normal((1, 5, 5, 32)).astype("float32")
    y = tvm.runtime.empty((1, 32, n), "float32")
    fn(tvm.runtime.tensor(av), tvm.runtime.tensor(bv), y)
    want = np.concatenate([av.reshape(1, 100, 32), bv.reshape(1, 25, 32)], axis=1)
    np.testing.assert_array_equal(y.numpy(), want.transpose(0, 2, 1))


@pytest.mark.parametrize("shape,perm,dtype", [
    ((1, 48, 64, 64), (0, 2, 3, 1), "float32"),  # NCHW -> NHWC
    ((1, 64, 32, 48), (0, 3, 1, 2), "float32"),  # NHWC -> NCHW
    ((32, 80), (1, 0), "float32"),
    ((2, 64, 128), (0, 2, 1), "uint8"),  # 64-lane vectors
])
def test_a_transpose_runs_in_tiles_through_a_local_buffer(shape, perm, dtype):
    """A transpose whose input is contiguous along another output axis than the output's
    innermost: lanes x lanes tiles read in vectors along the input's rows into a local
    buffer, written out in vectors along the output's. Structure (the local tile, both
    loops vectorized, the rule's name) and every element."""
    from tvm import te

    a = te.placeholder(shape, name="a", dtype=dtype)
    out_shape = tuple(shape[p] for p in perm)
    out = te.compute(out_shape, lambda *i: a[tuple(i[perm.index(k)] for k in range(len(shape)))],
                     name="T_transpose")
    f = te.create_prim_func([a, out])
    tgt = opsdk.target("x86")
    sched = opsdk.schedules.apply_schedule(opsdk.schedules.kernel_for("k", f), f, tgt)
    assert sched.attrs["opsdk.rule"] == "x86.elementwise"
    assert [str(b.scope()) for b in sched.body.block.alloc_buffers] == ["local"]
    vec = [lp for lp in _loops(sched.body) if lp.kind == tirx.ForKind.VECTORIZED]
    lanes = opsdk.schedules.vector_lanes(tgt, np.dtype(dtype).itemsize * 8)
    assert [int(lp.extent) for lp in vec] == [lanes, lanes]
    fn = tvm.compile(tvm.IRModule({"main": sched.with_attr("global_symbol", "main")}), target=tgt)
    x = np.random.default_rng(4).integers(0, 250, size=shape).astype(dtype)
    y = tvm.runtime.empty(out_shape, dtype)
    fn(tvm.runtime.tensor(x), y)
    np.testing.assert_array_equal(y.numpy(), x.transpose(perm))


def _loops(stmt) -> list:
    """Every For loop under ``stmt`` (a scheduled function whose partitioned tails' block
    copies share iter vars, which a new Schedule would reject)."""
    if isinstance(stmt, tirx.For):
        return [stmt, *_loops(stmt.body)]
    if isinstance(stmt, tirx.SeqStmt):
        return [lp for s in stmt.seq for lp in _loops(s)]
    if isinstance(stmt, s_tir.SBlockRealize):
        return _loops(stmt.block)
    if isinstance(stmt, s_tir.SBlock):
        return _loops(stmt.body) + (_loops(stmt.init) if stmt.init is not None else [])
    return _loops(stmt.body) if hasattr(stmt, "body") else []


@pytest.mark.parametrize("shape", [(1, 16, 4, 600), (1, 16, 4, 2100), (1, 7, 9, 40)])
def test_softmax_middle_axis_runs_column_tiles_on_every_core(shape):
    """One image, softmax over its channels (YOLOv8's DFL head: (1, 16, 4, 2100)): the
    columns after the channel axis are the parallel rows, the innermost in tiles of at most
    256 that divide it (600: 3 x 200; 2100: 10 x 210; 40: one), not one task of the batch."""
    mod = build_single_op("softmax", {"x": shape}, "float32", {"axis": 1})
    lowered = opsdk.transform.LowerOps(opsdk.target("x86"))(mod)
    (f,) = [f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert f.attrs["opsdk.rule"] == "x86.rows"
    (par,) = [lp for lp in _loops(f.body) if lp.kind == tirx.ForKind.PARALLEL]
    w = shape[-1]
    tiles = w // max(d for d in range(16, 257) if w % d == 0) if w > 256 else 1
    assert int(par.extent) == shape[0] * shape[2] * tiles
    ex = tvm.compile(lowered, target=opsdk.target("x86"))
    x = np.random.default_rng(7).uniform(-8, 8, size=shape).astype("float32")
    out = relax.VirtualMachine(ex, DEV)["main"](tvm.runtime.tensor(x, DEV)).numpy()
    ref = opsdk.get_op("softmax").run_reference({"x": x}, {"axis": 1})
    assert np.all(np.abs(out - ref) <= _bound(ref, "float32", shape[1]))


@pytest.mark.parametrize(
    "op,shape,attrs",
    [
        ("layer_norm", (6, 8), {"begin_axis": -2}),
        ("rms_norm", (33, 65), {"begin_axis": -2}),  # 2145: no dividing width, scalar sum
        ("layer_norm", (37,), {"begin_axis": -1}),
        ("softmax", (1000,), {"axis": -1}),
    ],
)
@pytest.mark.parametrize("target", ["x86", "arm"])
def test_whole_tensor_norms_get_the_vector_rule(target, op, shape, attrs):
    # No row axis: the whole-tensor rule (one core, vector reductions), not the generic one.
    e = opsdk.explain(op, target, shape=shape, attrs=attrs)
    assert e.rule == ("x86.whole" if target == "x86" else "neon.whole"), e.reasons
    vec = e.asm_stats["zmm"] + e.asm_stats["ymm"] if target == "x86" else e.asm_stats["neon"]
    assert vec > 0, e.asm_stats
    if target == "x86":
        d = opsdk.get_op(op)
        full = {**d.default_attrs(), **attrs}
        shapes = d.example_shapes(shape, full)
        ex = tvm.compile(build_single_op(op, shapes, "float32", full), target=opsdk.target(target))
        ins = _inputs(d, shapes, "float32", np.random.default_rng(11))
        out = relax.VirtualMachine(ex, DEV)["main"](
            *[tvm.runtime.tensor(a, DEV) for a in ins.values()]
        ).numpy()
        ref = d.run_reference(ins, full)
        assert np.all(np.abs(out - ref) <= _bound(ref, "float32", int(np.prod(shape))))


@pytest.mark.parametrize("shift", [0, 1])
def test_scratch_moves_into_the_output_only_when_rows_read_their_own_row(shift):
    from tvm import te

    from opsdk.schedules._rows import schedule_rows

    x = te.placeholder((8, 64), "float32", name="x")
    e = te.compute((8, 64), lambda i, j: x[i, j] * 2.0, name="e")
    k = te.reduce_axis((0, 64), name="k")
    def row(i):
        return (i + shift) % 8 if shift else i

    s = te.compute((8,), lambda i: te.sum(e[row(i), k], axis=k), name="s")
    y = te.compute((8, 64), lambda i, j: e[i, j] * s[i], name="y")
    sch = schedule_rows(te.create_prim_func([x, y]), opsdk.target("x86"), accumulators=2)
    f = sch.mod["main"]
    allocs = [b.name for b in f.body.block.alloc_buffers]
    # shift 1: row i sums row i+1's scratch, which that row's output pass overwrites in place,
    # and which is not the chunk the same iteration computes: no merged pass either
    assert ("e" in allocs) == bool(shift)
    assert _shares_a_loop(f, "e", "s_rf_update", "y") == (not shift)
    ex = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
    xv = np.random.default_rng(2).normal(size=(8, 64)).astype("float32")
    out = tvm.runtime.empty((8, 64), "float32", DEV)
    ex["main"](tvm.runtime.tensor(xv, DEV), out)
    ev = xv.astype(np.float64) * 2
    ref = ev * np.roll(ev, -shift, axis=0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


def _run1(op: str, x: np.ndarray, *extra: np.ndarray, **attrs) -> np.ndarray:
    params = [relax.Var(f"a{i}", relax.TensorType(a.shape, "float32"))
              for i, a in enumerate((x, *extra))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit_output(getattr(opsdk.relax, op)(*params, **attrs))
        bb.emit_func_output(y)
    vm = relax.VirtualMachine(opsdk.compile(bb.get(), "x86"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in (x, *extra)]).numpy()


def test_special_values_follow_the_documented_semantics():
    # docs/verification.md, "Infinities, NaN and huge inputs"
    inf, nan = np.inf, np.nan
    v = np.array([[-inf, -3e38, -1e37, -10, 0, 10, 3e38, inf, nan]], "float32")
    for approx in ("none", "tanh"):
        y = _run1("gelu", v, approximate=approx)[0]
        assert np.isnan(y[0]) and np.isnan(y[-1]) and y[-2] == inf
        assert np.all(y[1:3] == 0) and y[4] == 0 and y[5] == 10 and y[6] == np.float32(3e38)
        assert -2e-6 < y[3] <= 0  # gelu(-10): tiny, negative or -0
    rows = np.array([[-inf] * 4, [1, -inf, 2, -inf], [inf, 1, 2, 3], [1e38, 3e38, -3e38, 0],
                     [nan, 1, 2, 3]], "float32")
    p = _run1("softmax", rows, axis=-1)
    assert np.isnan(p[[0, 2, 4]]).all()
    np.testing.assert_allclose(p[1], [1 / (1 + np.e), 0, np.e / (1 + np.e), 0], rtol=1e-6)
    assert np.array_equal(p[3], [0, 1, 0, 0])
    big = np.array([[1e37, -1e37, 3e37, 0], [1, 2, 3, inf], [1, 2, 3, 4]], "float32")
    ones = np.ones(4, "float32")
    for op, extra in (("layer_norm", (ones, np.zeros(4, "float32"))), ("rms_norm", (ones,))):
        y = _run1(op, big, *extra, begin_axis=-1, epsilon=1e-5)
        assert np.isnan(y[:2]).all() and np.isfinite(y[2]).all(), (op, y)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
def test_partial_sum_loops_stay_rolled_with_the_same_results(op, monkeypatch):
    """On x86 the rows rule hides the trip count of its partial-sum loops from LLVM, which
    would otherwise unroll them completely (64 loads and FMAs per 1024-wide row, measurably
    slower): the kernel keeps far fewer FMAs than the row has vectors, and its values are
    bit-identical to the unrolled kernel's (same operations in the same order)."""
    from opsdk.bench._cases import Case
    from opsdk.bench._run import _inputs as bench_inputs
    from opsdk.bench._run import _opsdk_module
    from opsdk.schedules import _rows

    tgt = opsdk.target("x86")
    # The unrolling happens where a row is few vectors: 64 zmm-wide steps of a 1024-wide row
    # (AVX-512, inspected on a pinned CPU whatever the host); AVX2's 128 ymm steps LLVM
    # leaves rolled by itself. The values are compared on the host.
    avx512 = opsdk.target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"})
    case = Case(op, (64, 1024), "float32")
    ins = bench_inputs(case, np.random.default_rng(0))

    def run():
        ex = tvm.compile(_opsdk_module(case), target=tgt)
        out = relax.VirtualMachine(ex, DEV)["main"](*[tvm.runtime.tensor(v) for v in
                                                      ins.values()]).numpy()
        return asm_of(tvm.compile(_opsdk_module(case), target=avx512)), out

    asm, out = run()
    with monkeypatch.context() as m:
        m.setattr(_rows, "rolled_partial_sums", lambda f: f)
        asm_unrolled, want = run()
    def vector_ops(a: str) -> int:  # the partial sums' FMAs / adds / maxes
        return sum(any(i in ln for i in ("vfmadd", "vaddps", "vmaxps")) for ln in a.splitlines())

    assert vector_ops(asm) < vector_ops(asm_unrolled), (vector_ops(asm), vector_ops(asm_unrolled))
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "gelu", "bias_gelu", "softmax"])
def test_dram_sized_outputs_stream_with_the_same_results(op, monkeypatch):
    """A float32 output of 32 MB or more (row kernels: 8 MB) is written with streaming stores
    (vmovntps, one sfence per parallel task); the values are exactly those of the ordinary
    stores (softmax: its exp in a row buffer instead of in the output, which it otherwise
    reuses). Smaller static shapes take the same path with the threshold lowered (odd row
    counts: tasks of a divisor of the rows; a row that is not whole vectors keeps ordinary
    stores)."""
    from opsdk.bench._cases import Case
    from opsdk.bench._run import _inputs as bench_inputs
    from opsdk.bench._run import _opsdk_module
    from opsdk.schedules import _stream

    tgt = opsdk.target("x86")
    rng = np.random.default_rng(0)

    def build(shape):
        mod = _opsdk_module(Case(op, shape, "float32"))
        ex = tvm.compile(mod, target=tgt)
        ins = bench_inputs(Case(op, shape, "float32"), rng)
        out = relax.VirtualMachine(ex, DEV)["main"](*[tvm.runtime.tensor(v) for v in
                                                      ins.values()]).numpy()
        return asm_of(ex), out, ins

    def plain(shape, ins):
        with monkeypatch.context() as m:
            m.setattr(_stream, "STREAM_MIN_BYTES", 1 << 62)
            m.setattr(_stream, "ROWS_STREAM_MIN_BYTES", 1 << 62)
            ex = tvm.compile(_opsdk_module(Case(op, shape, "float32")), target=tgt)
        return relax.VirtualMachine(ex, DEV)["main"](*[tvm.runtime.tensor(v) for v in
                                                       ins.values()]).numpy()

    big = (8192, 1024)  # 32 MB
    asm, out, ins = build(big)
    assert "vmovntps" in asm and "sfence" in asm
    np.testing.assert_array_equal(out, plain(big, ins))
    # 12 MB: row kernels stream (they do not keep it in a shared L3), elementwise ones not
    asm, _, _ = build((4096, 768))
    assert ("vmovntps" in asm) == (op not in ("gelu", "bias_gelu")), op
    monkeypatch.setattr(_stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(_stream, "ROWS_STREAM_MIN_BYTES", 0)
    cases = [((37, 48), True), ((3, 2000), True), ((5, 1024), True), ((6, 20), False)]
    for shape, streams in cases:
        asm, out, ins = build(shape)
        assert ("vmovntps" in asm) == streams, shape
        np.testing.assert_array_equal(out, plain(shape, ins))


@pytest.mark.parametrize(("fn", "kwargs", "ref"), [
    (relax.op.cumsum, {"axis": 1}, lambda a: np.cumsum(a, 1)),
    (relax.op.cumsum, {"axis": -1, "exclusive": True}, lambda a: np.cumsum(a, -1) - a),
    (relax.op.cumsum, {}, lambda a: np.cumsum(a)),  # the flattened input
    (relax.op.cumprod, {"axis": 0}, lambda a: np.cumprod(a, 0)),
    (relax.op.cumsum, {"axis": 2, "dtype": "int64"}, lambda a: np.cumsum(a, 2)),
])
def test_cumsum_and_cumprod_lower_and_match_numpy(fn, kwargs, ref):
    # TVM 0.27 has no legalization for them: they reached VM codegen unlowered.
    x = relax.Var("x", relax.TensorType((3, 4, 5), "int32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(fn(x, **kwargs))
        bb.emit_func_output(y)
    ex = opsdk.compile(bb.get(), "x86")
    a = np.random.default_rng(0).integers(-3, 4, (3, 4, 5)).astype("int32")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a)).numpy()
    np.testing.assert_array_equal(got, ref(a.astype(np.int64)).astype(got.dtype))
