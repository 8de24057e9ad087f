"""``opsdk bench`` smoke tests (tiny shapes, no timed assertions) and structural checks that
the x86 and NEON rules produce parallel + vectorized loops for every built-in op."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, te, tirx

import opsdk
from opsdk._dtypes import eps, np_dtype
from opsdk._explain import build_single_op
from opsdk.bench import add_bench_arguments, expand_cases, run_bench, run_bench_command, summary

# The six ops of the benchmark matrix (other built-in ops get their own tests).
OPS = ["layer_norm", "rms_norm", "gelu", "bias_gelu", "softmax", "group_norm"]


def test_bench_smoke_reports_sane_fields():
    rows = run_bench(
        ["layer_norm", "softmax"], shapes=[(64, 48)], dtypes=["float32"], repeats=2, budget_ms=1
    )
    assert [r["op"] for r in rows] == ["layer_norm", "softmax"]
    ln = rows[0]
    assert ln["bytes"] == (2 * 64 * 48 + 2 * 48) * 4  # x + gamma + beta read, y written
    assert ln["rule"] == "x86.rows"
    assert ln["max_err"] < 1e-4
    for r in rows:
        for c in ("opsdk", "tvm", "dlight", "copy_tvm", "copy_numpy"):
            assert r[f"{c}_ms"] > 0 and r[f"{c}_min_ms"] <= r[f"{c}_ms"]
            assert r[f"{c}_gbps"] > 0
        assert r["copy_gbps"] == max(r["copy_tvm_gbps"], r["copy_numpy_gbps"])
        assert r["pct_copy"] > 0 and r["speedup_tvm"] > 0 and r["tvm_ceiling"] > 0
        assert isinstance(r["dlight_applied"], bool)
        # each candidate is one kernel here: timed on fixed buffers (like the copy), after a
        # bit-exact check against the VM's result
        assert r["direct"] == {"opsdk": True, "tvm": True, "dlight": True}
    s = summary(rows)
    slow = {i["case"]: (i["speedup_tvm"], i["tvm_ceiling"]) for i in s["below_8x_tvm"]}
    for r in rows:
        label = f"{r['op']} 64x48"
        if r["speedup_tvm"] < 8:
            assert slow.pop(label) == (r["speedup_tvm"], r["tvm_ceiling"])
    assert slow == {}


def test_bench_custom_op_gets_torch_through_its_mapping():
    # An op without a bench spec is compared with the aten op its OpDef.torch mapping names,
    # when that computes the op; a mapping to something else is not timed as the op.
    from tvm import te, tirx

    def hsw(x):
        return x * np.clip(x + 3, 0, 6) / 6

    def compute(x: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: (x(*i) * tirx.min(tirx.max(
            x(*i) + 3.0, 0.0), 6.0) / 6.0), name="bench_hswish")

    ok = opsdk.op(reference=hsw, dtypes=("float32",), name="bench_hswish")(compute)
    wrong = opsdk.op(reference=hsw, dtypes=("float32",), name="bench_hswish_wrong")(compute)
    ok.torch("hardswish.default")
    wrong.torch("relu.default")
    for d in (ok, wrong):
        opsdk.register(d, replace=True)
    try:
        rows = run_bench(["bench_hswish", "bench_hswish_wrong"], shapes=[(64, 48)],
                         dtypes=["float32"], repeats=1, budget_ms=1,
                         candidates=["opsdk", "torch"])
    finally:
        for d in (ok, wrong):
            opsdk.unregister(d)
    assert rows[0]["torch_ms"] > 0 and rows[0]["speedup_torch"] > 0
    assert rows[1]["torch_ms"] is None


def test_bench_hot_slice_measures_in_cache_time():
    from opsdk.bench._run import _hot_case

    # 8192 rows x 64 float32, in + out = 512 B a row: a 2048-row slice fits the 1.5 MiB budget.
    rows = run_bench(["rms_norm"], shapes=[(8192, 64)], dtypes=["float32"], repeats=2,
                     budget_ms=1, candidates=["opsdk", "copy_tvm", "hot"])
    r = rows[0]
    assert r["hot_rows"] == 2048
    assert r["hot_ms"] > 0 and r["hot_min_ms"] <= r["hot_ms"]
    assert r["pct_hot"] > 0  # median of per-round hot / opsdk ratios
    s = summary(rows)
    below = {i["case"]: i["pct_hot"] for i in s["below_80_pct_copy"]}
    assert below == ({"rms_norm 8192x64": r["pct_hot"]} if r["pct_copy"] < 80 else {})
    # Small cases (already cache-resident) and huge rows (no slice fits) get no hot figure.
    from opsdk.bench._cases import Case

    assert _hot_case(Case("gelu", (64, 48), "float32", "", {}), 64 * 48 * 8) is None
    assert _hot_case(Case("gelu", (4, 10**6), "float32", "", {}), 4 * 8 * 10**6) is None
    # group norm: one sample of the benchmark shape exceeds the budget, so H is cut instead.
    gn = Case("group_norm", (8, 64, 56, 56), "float32", "NCHW", {"num_groups": 32})
    nbytes = 2 * 8 * 64 * 56 * 56 * 4
    assert _hot_case(gn, nbytes).shape == (8, 64, 4, 56)
    nhwc = Case("group_norm", (8, 56, 56, 64), "float32", "NHWC", {"num_groups": 32})
    assert _hot_case(nhwc, nbytes).shape == (8, 4, 56, 64)


def test_bench_command_writes_json_and_png(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    args = p.parse_args(
        [
            "gelu:tanh",
            "--shapes",
            "32x40",
            "--dtypes",
            "float16",
            "--repeats",
            "1",
            "--budget-ms",
            "1",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert run_bench_command(args) == 0
    text = capsys.readouterr().out
    assert "gelu[tanh] 32x40 float16" in text and "x torch" in text
    data = json.loads(out.read_text())
    assert data["rows"][0]["attrs"]["approximate"] == "tanh"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_usage_errors():
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    assert run_bench_command(p.parse_args(["no_such_op", "--shapes", "4x4"])) == 2
    assert run_bench_command(p.parse_args(["gelu", "--target", "arm"])) == 2
    # Device runs: --emulate is for aarch64 targets, --tracker needs --key.
    assert run_bench_command(p.parse_args(["gelu", "--emulate"])) == 2
    assert run_bench_command(p.parse_args(["gelu", "--target", "arm", "--tracker",
                                           "127.0.0.1:9190"])) == 2
    with pytest.raises(SystemExit):
        p.parse_args(["gelu", "--rpc", "127.0.0.1:1", "--emulate"])
    with pytest.raises(ValueError, match="no layout"):
        expand_cases(["softmax:nope"])


def test_default_cases_cover_the_issue_matrix():
    cases = expand_cases(dtypes=["float32", "float16"])
    labels = {c.label for c in cases}
    assert "layer_norm 16384x1024 float16" in labels
    assert "group_norm[NHWC] 8x56x56x64 float32" in labels
    assert {c.op for c in cases} == set(OPS)


# ----------------------------------------------------------------------------- structure
def _lowered_funcs(op: str, target: str, layout: str, dtype: str = "float32"):
    d = opsdk.get_op(op)
    attrs = {**d.default_attrs(), **d.layouts[layout]}
    base = (2, 8, 12, 24) if op == "group_norm" else (2, 6, 40)
    n = tirx.Var("n", "int64")
    shapes = d.example_shapes((n, *base[1:]), attrs)
    mod = opsdk.transform.LowerOps(target)(build_single_op(op, shapes, dtype, attrs))
    return [
        f
        for f in mod.functions.values()
        if isinstance(f, tirx.PrimFunc) and f.attrs and f.attrs.get("opsdk.op") == op
    ]


def _loop_kinds(func: tirx.PrimFunc) -> set:
    sch = s_tir.Schedule(func)
    kinds = set()
    todo = [sch.get_sblock("root")]
    while todo:
        blk = todo.pop()
        for child in sch.get_child_blocks(blk):
            kinds |= {sch.get(lp).kind for lp in sch.get_loops(child)}
            todo.append(child)
    return kinds


@pytest.mark.parametrize("target", ["x86", "arm"])
@pytest.mark.parametrize("op", OPS)
def test_rules_make_parallel_and_vector_loops(op, target):
    d = opsdk.get_op(op)
    for layout in d.layouts:
        funcs = _lowered_funcs(op, target, layout)
        assert len(funcs) == 1
        f = funcs[0]
        prefix = "x86." if target == "x86" else "neon."
        assert str(f.attrs["opsdk.rule"]).startswith(prefix), (layout, f.attrs["opsdk.rule"])
        kinds = _loop_kinds(f)
        assert tirx.ForKind.PARALLEL in kinds, (op, layout, target)
        assert tirx.ForKind.VECTORIZED in kinds, (op, layout, target)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax"])
def test_row_reductions_keep_vector_partial_sums(op):
    """The reduction runs on a vector of partial sums (an rfactor block with a vectorized
    lane loop), not a scalar chain."""
    f = _lowered_funcs(op, "x86", next(iter(opsdk.get_op(op).layouts)))[0]
    sch = s_tir.Schedule(f)
    found = False
    todo = [sch.get_sblock("root")]
    while todo:
        blk = todo.pop()
        for child in sch.get_child_blocks(blk):
            b = sch.get(child)
            if b.name_hint.endswith("_rf_update"):
                kinds = [sch.get(lp).kind for lp in sch.get_loops(child)]
                found |= tirx.ForKind.VECTORIZED in kinds
            todo.append(child)
    assert found


# ----------------------------------------------------------------------------- tails
def _check(op: str, shape: tuple, dtype: str, attrs: dict | None = None) -> None:
    d = opsdk.get_op(op)
    attrs = {**d.default_attrs(), **(attrs or {})}
    n = tirx.Var("n", "int64")
    shapes = d.example_shapes((n, *shape[1:]), attrs)
    ex = tvm.compile(build_single_op(op, shapes, dtype, attrs), target=opsdk.target("x86"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(1)
    conc = d.example_shapes(shape, attrs)
    ins = {}
    for k, s in conc.items():
        lo, hi = d.domain.get(k, (-2.0, 2.0))
        v = rng.uniform(lo, hi, size=s) + (40.0 if k == "x" and d.kind == "norm" else 0.0)
        ins[k] = v.astype(np_dtype(dtype))
    out = vm["main"](*[tvm.runtime.tensor(a) for a in ins.values()]).numpy()
    ref = d.run_reference(ins, attrs)
    k = 1 if d.kind == "elementwise" else int(np.prod(shape[1:]))
    bound = eps(dtype) * np.abs(ref) + (eps(dtype) + 8 * k * eps("float32")) * (1 + np.abs(ref))
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= bound), (op, shape, dtype, float(err.max()))


@pytest.mark.parametrize("cols", [1, 3, 17, 769])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax", "bias_gelu"])
def test_odd_row_lengths_match_reference(op, cols):
    """Lengths that are not a multiple of the vector width (partitioned tails, restored
    predicates), with a large common offset for the norms."""
    _check(op, (3, cols), "float32")


@pytest.mark.parametrize(
    ("op", "shape", "attrs"),
    [
        ("softmax", (2, 5, 33), {"axis": 1}),
        ("group_norm", (2, 6, 5, 7), {"num_groups": 3}),
        ("group_norm", (2, 5, 7, 6), {"num_groups": 3, "layout": "NHWC"}),
        ("layer_norm", (2, 3, 17), {"begin_axis": -2}),
    ],
)
def test_middle_axes_and_groups_match_reference(op, shape, attrs):
    _check(op, shape, "float16", attrs)


def test_bench_qdense_command_smoke(capsys):
    """`opsdk bench qdense` runs on a tiny shape and reports sane fields (no timing asserts)."""
    from opsdk.cli import main

    assert main(["bench", "qdense", "--shapes", "32,64,48", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    # the host's int8 rule ran and matched exactly
    rule = ("x86.qdense_vnni" if "avx512vnni" in opsdk.targets.target_features(
        opsdk.target("x86")) else "x86.qdense_avx2")
    assert rule in out and "True" in out
    assert main(["bench", "qdense", "--shapes", "32,64"]) == 2


def test_bench_phases_script_times_both_passes():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_phases.py"
    out = subprocess.run(
        [sys.executable, str(script), "512x256", "--rounds", "2"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout
    ms = {ln.split()[0]: float(ln.split()[1]) for ln in out.splitlines()[1:5]}
    assert set(ms) == {"reduce", "stream", "rms_norm", "copy"} and min(ms.values()) > 0
    assert "rms_norm / (reduce + stream) = " in out and "copy / rms_norm = " in out


def test_a_sum_over_a_middle_axis_with_a_broadcast_factor_vectorizes_the_columns():
    # ResNeSt's split attention: (1, R, C, H, W) * (1, R, C, 1, 1) summed over R. The rows
    # rule took it with a partial-sum tree over each 2-long strided sum (1 % of the roof,
    # 3.2 ms at C=128, 56x56); the columns rule now takes it (the factor does not vary
    # along the columns): vectors along W, the sum outside them.
    from opsdk.schedules import apply_schedule, kernel_for

    x = te.placeholder((1, 2, 8, 5, 19), name="x")
    a = te.placeholder((1, 2, 8, 1, 1), name="a")
    m = te.compute(x.shape, lambda n, r, c, h, w: x[n, r, c, h, w] * a[n, r, c, 0, 0], name="m")
    k = te.reduce_axis((0, 2), name="k")
    y = te.compute((1, 8, 5, 19), lambda n, c, h, w: te.sum(m[n, k, c, h, w], axis=k), name="y")
    f = te.create_prim_func([x, a, y])
    tgt = opsdk.target("x86")
    with tgt:
        out = apply_schedule(kernel_for("radix_sum", f), f, tgt)
    assert str(out.attrs["opsdk.rule"]) == "x86.columns", out.attrs["opsdk.rule"]
    assert tirx.ForKind.VECTORIZED in _loop_kinds(out)
    lib = tvm.compile(tvm.IRModule({"main": out.with_attr("global_symbol", "main")}),
                      target=tgt)
    rng = np.random.default_rng(4)
    xs = rng.uniform(-1, 1, (1, 2, 8, 5, 19)).astype("float32")
    as_ = rng.uniform(-1, 1, (1, 2, 8, 1, 1)).astype("float32")
    got = tvm.runtime.empty((1, 8, 5, 19), "float32")
    lib(tvm.runtime.tensor(xs), tvm.runtime.tensor(as_), got)
    ref = (xs.astype(np.float64) * as_).sum(1)
    # two products and one add, each rounded once: 3 u of the magnitudes
    bound = 3 * 2.0 ** -24 * (np.abs(xs.astype(np.float64)) * np.abs(as_)).sum(1)
    assert np.all(np.abs(got.numpy() - ref) <= bound)
