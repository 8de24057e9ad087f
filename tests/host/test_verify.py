"""The generic op suite (one parametrized test per registered op, like torch's OpInfo) and
the verify engine's own checks: capabilities, lints, math assumptions, CLI."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from xml.etree import ElementTree as ET

import numpy as np
import pytest
from tvm import s_tir, te, tirx

import opsdk
from opsdk._asm import asm_functions, kernel_vector_ops
from opsdk.verify import (
    MATH_ULPS,
    Case,
    capabilities,
    database_path,
    lint_cell,
    run_case,
    verify_op,
)
from opsdk.verify._cli import add_verify_arguments, run_verify_command

OPS = [d.name for d in opsdk.list_ops()]


def _explain(report) -> str:
    parts = [f.format(tir=False) for f in report.failures]
    parts += [f"{c.op} {c.dtype} {c.layout}: {c.error}" for c in report.cells if c.error]
    parts += [f"lint {x.op} {x.dtype}/{x.layout} {x.check}: {x.detail}"
              for x in report.lints if x.status == "fail"]
    parts += [f"refusal {x.op} {x.what}: {x.detail}" for x in report.refusals if not x.ok]
    return "\n\n".join(parts)


# ------------------------------------------------------------------------- the generic suite


@pytest.mark.parametrize("name", OPS)
def test_op_verifies_on_host(name: str) -> None:
    # Profile: $HYPOTHESIS_PROFILE (CI sets ci) or dev. Every claimed cell, lints, refusals.
    report = verify_op(name, "host", database=None)
    assert report.cells, f"{name}: no claimed cells on the host"
    assert report.ok, _explain(report)


@pytest.mark.parametrize("name", OPS)
def test_every_dtype_and_layout_is_claimed_on_host(name: str) -> None:
    d = opsdk.get_op(name)
    host = opsdk.targets.target_spec("host").name
    cells = {(c["dtype"], c["layout"]) for c in capabilities(d, [host]) if c["claimed"]}
    assert cells == {(dt, ly) for dt in d.dtypes for ly in d.layouts}


# ------------------------------------------------------------------------- model assumptions


def _max_error_in_u(fn, xs: np.ndarray, exact, relative: bool = True) -> float:
    a = te.placeholder((te.var("n"),), "float32", name="a")
    b = te.compute(a.shape, lambda i: fn(a[i]), name="b")
    sch = s_tir.Schedule(te.create_prim_func([a, b]))
    _, inner = sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 16])
    sch.vectorize(inner)  # the vector code path, as in the kernels
    import tvm

    ex = tvm.compile(sch.mod["main"], target=opsdk.target("host"))
    out = tvm.runtime.empty(xs.shape, "float32")
    ex["main"](tvm.runtime.tensor(xs), out)
    got = out.numpy().astype(np.float64)
    want = exact(xs.astype(np.float64))
    err = np.abs(got - want)
    if relative:
        err = err / np.abs(want)
    return float(err.max() / 2.0**-24)


def test_math_accuracy_assumptions_of_the_models_hold() -> None:
    # The error models assume these accuracies (opsdk.verify.MATH_ULPS); if TVM's lowering
    # or opsdk's vectorized math changes, this fails instead of verify crying wolf.
    rng = np.random.default_rng(0)
    wide = np.concatenate([np.linspace(-10, 10, 400_000), rng.uniform(-1e-3, 1e-3, 100_000)])
    erf = np.vectorize(math.erf, otypes=[np.float64])
    found = {
        "exp": _max_error_in_u(tirx.exp, np.linspace(-87, 88, 400_000).astype("float32"), np.exp),
        "erf": _max_error_in_u(tirx.erf, wide.astype("float32"), erf),
        "tanh_abs": _max_error_in_u(tirx.tanh, wide.astype("float32"), np.tanh, relative=False),
        "rsqrt": _max_error_in_u(tirx.rsqrt, (10.0 ** rng.uniform(-8, 8, 400_000)).astype("f4"),
                                 lambda v: 1 / np.sqrt(v)),
        "log": _max_error_in_u(tirx.log, np.concatenate([
            10.0 ** rng.uniform(-38, 38, 200_000), rng.uniform(0.5, 2, 200_000)]).astype("f4"),
            np.log),
    }
    from opsdk._vecmath import erf_f32, exp_f32, sigmoid_f32, tanh_f32

    found["exp_f32"] = _max_error_in_u(
        exp_f32, np.linspace(-87.3, 88.37, 400_000).astype("float32"), np.exp)
    found["erf_f32"] = _max_error_in_u(erf_f32, wide.astype("float32"), erf)
    # Every scheduled kernel's sigmoid / tanh (opsdk._vecmath.polynomial_math).
    found["sigmoid_f32"] = _max_error_in_u(
        sigmoid_f32, np.linspace(-87, 30, 400_000).astype("float32"),
        lambda v: 1 / (1 + np.exp(-v)))
    found["tanh_abs_f32"] = _max_error_in_u(tanh_f32, wide.astype("float32"), np.tanh,
                                            relative=False)
    for name, value in found.items():
        key = name.removesuffix("_f32")
        assert value <= MATH_ULPS[key], f"{name}: {value:.2f} u > assumed {MATH_ULPS[key]} u"


def test_sinh_and_cosh_are_within_4_u() -> None:
    # TVM 0.27 lowers tirx.sinh / cosh to intrinsics its LLVM code generator does not know
    # ("unknown intrinsic tirx.sinh"); opsdk's versions (measured 3.14 u, both: exp_f32's
    # error squared) over the whole range, tiny arguments and the polynomial's edge at 1
    from opsdk._vecmath import cosh_f32, sinh_f32

    rng = np.random.default_rng(0)
    xs = np.concatenate([np.linspace(-89.4, 89.4, 400_000), rng.uniform(-1e-3, 1e-3, 100_000),
                         np.linspace(-1.5, 1.5, 200_000)]).astype("float32")
    assert _max_error_in_u(sinh_f32, xs, np.sinh) <= 4.0
    assert _max_error_in_u(cosh_f32, xs, np.cosh) <= 4.0


def test_bfloat16_through_let_bound_math_is_exact_at_the_ends() -> None:
    # exp_f32/erf_f32 bind their operands (Let) to keep the expression linear; TVM's
    # bfloat16 storage pass does not rewrite a cast inside a Let value and its store rounding
    # copies its operand, so the widening and the narrowing are written out by bits. Checked
    # against float32 math rounded by ml_dtypes, with the vector and the scalar code path.
    import ml_dtypes
    import tvm

    from opsdk._opdef import _narrow_bf16_store
    from opsdk.te_utils import acc, exp_f32, narrow

    n = 77  # a vector tail too
    xs = np.linspace(-9, 9, n).astype(ml_dtypes.bfloat16)
    want = np.exp(xs.astype(np.float64)).astype(np.float32).astype(ml_dtypes.bfloat16)
    x = te.placeholder((n,), "bfloat16", name="x")
    for widen, store in [(acc, narrow), (lambda v: v.astype("float32"), narrow),
                         # an author's plain .astype: OpDef.call_compute rewrites it
                         (acc, lambda v, dt: v.astype(dt))]:
        y = te.compute((n,), lambda i: store(exp_f32(widen(x[i])), "bfloat16"), name="y")  # noqa: B023
        y = _narrow_bf16_store(y)
        for vector in (True, False):
            sch = s_tir.Schedule(te.create_prim_func([x, y]))
            if vector:
                _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
                sch.vectorize(inner)
            ex = tvm.compile(sch.mod["main"], target=opsdk.target("host"))
            out = tvm.runtime.empty((n,), "bfloat16")
            ex["main"](tvm.runtime.tensor(xs), out)
            got = out.numpy().astype(np.float32)
            # exp_f32 is within 2 u of float32; rounded to bfloat16 that is at most 1 ulp.
            ulp = np.spacing(want.astype(np.float32)) * 2.0**16
            assert np.all(np.abs(got - want.astype(np.float32)) <= ulp), (vector, got, want)


# ------------------------------------------------------------------------- lints


def test_asm_parser_counts_only_the_kernels_vector_arithmetic() -> None:
    asm = "\n".join([
        "\t.type\t__tvm_ffi_main,@function",
        "\t.type\topsdk_demo_compute_,@function",
        "__tvm_ffi_main:",
        "\tvmovups\t%ymm0, 72(%rsp)",
        ".Lfunc_end0:",
        "opsdk_demo_compute_:",
        "\tvmovups\t(%rdi), %zmm1",
        "\tvaddps\t%zmm1, %zmm2, %zmm3",
        "\tvfmadd213ps\t%ymm1, %ymm2, %ymm3",
        "\tvaddss\t%xmm1, %xmm2, %xmm3",
        "\tvmulps\t%xmm1, %xmm2, %xmm3",
        ".Lfunc_end1:",
    ])
    assert set(asm_functions(asm)) == {"__tvm_ffi_main", "opsdk_demo_compute_"}
    assert kernel_vector_ops(asm, "x86_64", "opsdk_demo") == {"zmm": 1, "ymm": 1, "xmm": 1}
    neon = "\t.type\topsdk_demo,%function\nopsdk_demo:\n\tfmla\tv0.4s, v1.4s, v2.4s\n" \
           "\tldr\tq0, [x0]\n\tmov\tv1.16b, v0.16b\n.Lfunc_end0:\n"
    assert kernel_vector_ops(neon, "aarch64", "opsdk_demo") == {"neon": 1}


def test_lints_flag_a_rule_whose_claims_do_not_hold() -> None:
    gelu = opsdk.get_op("gelu")

    @opsdk.op(reference=gelu.reference, layouts=gelu.layouts, domain=gelu.domain,
              kind="elementwise", examples=gelu.examples)
    def lint_demo_gelu(x: opsdk.Tensor, *, approximate: str = "none") -> te.Tensor:
        return gelu.compute(x, approximate=approximate)

    @opsdk.rule("lint_demo_gelu", "cpu", name="test.claims_too_much", priority=1000,
                claims=("vectorize", "parallel"))
    def _nothing(func, target):
        return s_tir.Schedule(func)  # claims vectorize + parallel, does neither

    opsdk.register(lint_demo_gelu, replace=True)
    try:
        results = lint_cell(lint_demo_gelu, "host", "float32", "erf")
    finally:
        opsdk.unregister(lint_demo_gelu)
    status = {x.check: x.status for x in results}
    assert status["vectorize:tir"] == "fail"
    assert status["parallel:tir"] == "fail"
    assert status["parallel:asm"] == "fail"


def test_a_builtin_rule_that_raises_fails_the_example() -> None:
    # The driver falls back to the generic lowering with a warning; verify must not pass
    # the example as if the rule had run, whether the rule is a user's or opsdk's own.
    gelu = opsdk.get_op("gelu")

    @opsdk.op(reference=gelu.reference, layouts=gelu.layouts, domain=gelu.domain,
              kind="elementwise", examples=gelu.examples)
    def raising_demo_gelu(x: opsdk.Tensor, *, approximate: str = "none") -> te.Tensor:
        return gelu.compute(x, approximate=approximate)

    def _raises(func, target):
        raise RuntimeError("planted")

    _raises.__module__ = "opsdk.schedules.cpu.x86"  # as a built-in rule's
    opsdk.rule("raising_demo_gelu", "cpu", name="test.raises", priority=1000)(_raises)
    opsdk.register(raising_demo_gelu, replace=True)
    try:
        report = verify_op(raising_demo_gelu, "host", dtypes=["float32"], layouts=["erf"],
                           max_examples=1, database=None, lints=False, refusals=False)
    finally:
        opsdk.unregister(raising_demo_gelu)
    (cell,) = report.cells
    assert cell.failure is not None and cell.failure.status == "error", cell
    assert "test.raises" in cell.failure.message, cell.failure.message


# ------------------------------------------------------------------------- cases and CLI


def _cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_verify_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # an argument type refused it (a bad path, port, count): exit 2
        return int(e.code)
    return run_verify_command(args)


@pytest.mark.parametrize("argv", [
    ["no_such_op"],
    ["gelu", "--target", "no_such_target"],
    ["gelu", "--dtypes", "float64"],
    ["gelu", "--layouts", "NCHW"],
    ["gelu", "--case", "{not json"],
    ["gelu", "--case", '{"op": "softmax"}'],
    ["gelu", "--case", '{"bogus_field": 1}'],
    ["gelu", "--case", '{"layout": "zzz", "dtype": "float32", "shape": [2, 3]}'],  # bad field
    ["gelu", "--case", '{"layout": "erf", "dtype": "float32", "shape": [2], "seed": "x"}'],
    ["gelu", "--case", '{"layout": "erf", "dtype": "float32", "shape": [2], "data": {"x": "z"}}'],
    ["gelu", "--case", '{"layout": "erf", "dtype": "float32", "shape": [-1, "a"]}'],
    ["gelu", "--case", '{"layout": "erf", "dtype": "float32", "shape": [2],'
                       ' "attrs": {"approximate": "fast"}}'],
    ["gelu", "--target", "arm", "--rpc", "127.0.0.1:1",  # nothing listens: refused at once
     "--case", '{"layout": "erf", "dtype": "float32", "shape": [2]}'],
])
def test_cli_usage_errors_exit_2(argv: list[str], capsys) -> None:
    assert _cli([*argv, "--quiet", "--no-db"]) == 2
    assert "error" in capsys.readouterr().err


def test_cli_runs_cells_and_writes_reports(tmp_path, capsys) -> None:
    rep, junit = tmp_path / "r.json", tmp_path / "j.xml"
    rc = _cli(["gelu", "--target", "x86", "--dtypes", "float32", "--layouts", "erf",
               "--examples", "2", "--no-db", "--quiet", "--seed", "1",
               "--report", str(rep), "--junit", str(junit)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gelu" in out and "worst ulp" in out and "s wall" in out and "PASS" in out
    data = json.loads(rep.read_text())
    assert data["ok"] and data["device"]["device"] and data["cells"][0]["examples"] > 2
    # per cell: how close the worst case came to its bound, and which error model set it
    cell = data["cells"][0]
    assert 0 < cell["ratio"] <= 1 and cell["model"] == "built-in gelu"
    assert "error model" in out and "passed above 0.9 of their bound" in out
    assert cell["margin"] in ("", "rounding", "underflow")
    assert ET.fromstring(junit.read_text()).get("failures") == "0"


def test_near_bound_cells_say_why_when_the_margin_is_sound() -> None:
    from opsdk.verify._engine import margin_reason

    # A result below float32's normal range returned in [0, 2^-126] where the reference
    # underflows: within the models' underflow term, however close to it.
    assert margin_reason(1e-300, 2.0**-127, 8e6) == "underflow"
    assert margin_reason(1e-300, 2.0**-120, 8e6) == ""
    report = verify_op("softmax", "x86", dtypes=["float16"], layouts=["last"], max_examples=2,
                       database=None, lints=False, refusals=False, seed=0)
    (cell,) = report.cells  # float16 output: the output's own rounding dominates the bound
    assert cell.ratio > 0.9 and cell.margin == "rounding", (cell.ratio, cell.margin)
    assert f"softmax float16 last {cell.ratio:.3f} (rounding)" in report.format_table()


def test_cli_brief_failures_and_report_paths(tmp_path, capsys, monkeypatch) -> None:
    # --brief drops the TIR from a failure (the JSON keeps it); two reports on one path, or
    # in a missing directory, are usage errors before any work.
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))  # verify_mutants
    rep = tmp_path / "r.json"
    rc = _cli(["mut_softmax_no_max", "--module", "verify_mutants", "--target", "x86",
               "--dtypes", "float32", "--layouts", "last", "--examples", "0", "--brief",
               "--no-db", "--quiet", "--seed", "0", "--report", str(rep)])
    cap = capsys.readouterr()
    out = cap.out
    assert rc == 1 and "FAILED opsdk.mut_softmax_no_max" in out and "reproduce:" in out, cap
    assert "lowered TIR" not in out and "'of bound' is the worst fraction" in out
    assert json.loads(rep.read_text())["cells"][0]["failure"]["tir"]  # the TIR stays here
    assert _cli(["gelu", "--report", str(rep), "--junit", str(rep), "--quiet"]) == 2
    assert "same file" in capsys.readouterr().err
    assert _cli(["gelu", "--report", str(tmp_path / "no" / "r.json"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_case_reruns_one_case(capsys) -> None:
    case = Case("softmax", "x86", "float16", "axis1", (3, 5, 17), {"axis": 1}, (),
                {"x": "large"}, 5)
    assert _cli(["softmax", "--case", case.to_json(), "--quiet"]) == 0
    assert "pass" in capsys.readouterr().out
    assert run_case(case).ok


def test_cases_regenerate_identical_data() -> None:
    from opsdk.verify import make_inputs

    d = opsdk.get_op("layer_norm")
    case = Case("layer_norm", "x86", "bfloat16", "last", (4, 33), {"epsilon": 1e-3},
                ("beta",), {"x": "offset", "beta": "mixed"}, 123)
    a, b = make_inputs(d, case), make_inputs(d, Case.from_json(case.to_json()))
    assert a.keys() == b.keys() == {"x", "beta"}
    assert all(np.array_equal(a[k].view(np.uint16), b[k].view(np.uint16)) for k in a)


def test_database_lives_under_the_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OPSDK_CACHE", str(tmp_path))
    assert database_path() == tmp_path / "hypothesis"
