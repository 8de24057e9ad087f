"""qdense schedules: bit-exact against the reference through Relax, and the instructions they
promise (x86 ``vpdpbusd``, or ``vpmaddwd`` without VNNI; ``sdot`` / NEON cross-compiled for
aarch64).

One Relax module holds a function per case (every layout x activation dtype, zero points at both
ends of the range, saturating output scales, K in {1, 3, 4, 17, 64, 100}, N in {1, 5, 16, 33},
a symbolic batch run with M = 1 and M = 7), so one compile covers the matrix. The arm tests
(``tests/arm/test_int8_arm.py``) import :func:`make_cases` / :func:`case_module` /
:func:`check_cases` from here and run the same matrix under qemu; :func:`basic_blocks_with`
finds a kernel's hot loop in assembly for the register checks elsewhere too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx

import opsdk
from opsdk._asm import asm_of
from opsdk._explain import build_single_op
from opsdk.ops._quant import QRANGE, round_to_te
from opsdk.ops.qdense import qdense
from opsdk.schedules import last_choices, load_builtin_rules, rules_for

KS = (1, 3, 4, 17, 64, 100)
NS = (1, 5, 16, 33)
MS = (1, 7)
ZERO_POINT_ENDS = {"int8": (-128, 127), "uint8": (0, 255)}
OUT_ZERO_POINTS = (-128, 127, 0, -3)


@dataclass
class QCase:
    """One Relax function of the matrix: its attributes and inputs for the largest batch."""

    name: str
    layout: str
    attrs: dict[str, Any]
    inputs: dict[str, np.ndarray]

    def at(self, m: int) -> dict[str, np.ndarray]:
        return {k: (v[:m] if k == "x" else v) for k, v in self.inputs.items()}


def _data(rng: np.random.Generator, xdt: str, k: int, n: int, per_channel: bool, bias: bool):
    lo, hi = QRANGE[xdt]
    x = rng.integers(lo, hi + 1, (max(MS), k))
    x[1], x[2] = lo, hi  # extreme rows (row 0 stays random: it is the whole batch at M = 1)
    w = rng.integers(-128, 128, (n, k))
    w[0] = -128
    if n > 1:
        w[-1] = 127
    ins = {
        "x": x.astype(xdt),
        "w": w.astype("int8"),
        "w_scale": rng.uniform(0.001, 0.05, n if per_channel else 1).astype("float32"),
    }
    if bias:
        ins["bias"] = rng.integers(-5000, 5001, n).astype("int32")
    return ins


def make_cases(seed: int = 0) -> list[QCase]:
    """Every layout x activation dtype over all K; N, zero points and bias rotate so that each
    combination sees every N and both zero-point ends; int8 outputs are scaled to saturate."""
    cases = []
    rng = np.random.default_rng(seed)
    combos = [(layout, xdt) for layout in qdense.layouts for xdt in qdense.dtypes]
    for c, (layout, xdt) in enumerate(combos):
        for i, k in enumerate(KS):
            n = NS[(i + c) % len(NS)]
            attrs = {**qdense.default_attrs(), **qdense.layouts[layout]}
            attrs["x_zero_point"] = ZERO_POINT_ENDS[xdt][(i + c) % 2]
            attrs["x_scale"] = (0.05, 0.5, 1e-3)[i % 3]
            attrs["out_zero_point"] = OUT_ZERO_POINTS[(i + c) % len(OUT_ZERO_POINTS)]
            ins = _data(rng, xdt, k, n, attrs["per_channel"], bias=(i + c) % 3 != 2)
            if attrs["out_dtype"] == "int8":
                raw = qdense.run_reference(ins, {**attrs, "out_dtype": "int32"})
                v = np.abs(raw.astype(np.float64) * attrs["x_scale"] * float(ins["w_scale"].max()))
                # the 60th percentile of |output| maps to 100: the top quarter or so saturates,
                # at both ends across the matrix (asserted by the tests)
                attrs["out_scale"] = float(max(np.percentile(v, 60), 1e-3) / 100.0)
            cases.append(QCase(f"q{c}_{i}_{layout}_{xdt}_k{k}_n{n}", layout, attrs, ins))
    return cases


def case_module(cases: Sequence[QCase], op: opsdk.OpDef = qdense) -> tvm.IRModule:
    """A Relax module with one function per case calling ``op``; ``x``'s batch is symbolic."""
    bb = relax.BlockBuilder()
    for case in cases:
        m = tirx.Var("m", "int64")
        shapes = {
            name: ((m, *a.shape[1:]) if name == "x" else a.shape) for name, a in case.inputs.items()
        }
        params = [
            relax.Var(name, relax.TensorType(list(s), str(case.inputs[name].dtype)))
            for name, s in shapes.items()
        ]
        with bb.function(case.name, params):
            with bb.dataflow():
                call = op(**dict(zip(shapes, params)), **case.attrs)
                out = bb.emit_output(bb.emit(call))
            bb.emit_func_output(out)
    return bb.get()


def check_cases(
    cases: Sequence[QCase], run: Callable[[str, list[np.ndarray]], np.ndarray]
) -> dict[str, int]:
    """Run every case at every batch size; return mismatch counts (empty when all exact) and
    how many int8 outputs saturated at each end (under the keys ``sat_lo`` / ``sat_hi``)."""
    bad: dict[str, int] = {}
    sat = {"sat_lo": 0, "sat_hi": 0}
    for case in cases:
        for m in MS:
            ins = case.at(m)
            got = run(case.name, list(ins.values()))
            ref = qdense.run_reference(ins, case.attrs)
            if got.dtype != ref.dtype or not np.array_equal(got, ref):
                diff = got.shape != ref.shape or got.astype(np.float64) != ref
                bad[f"{case.name} M={m}"] = int(np.sum(diff))
            if ref.dtype == np.int8:
                sat["sat_lo"] += int((ref == -128).sum())
                sat["sat_hi"] += int((ref == 127).sum())
    return {**bad, **sat}


@pytest.fixture(scope="module")
def cases() -> list[QCase]:
    return make_cases()


def _compile(mod: tvm.IRModule, target: str | tvm.target.Target) -> tuple[Any, list[str]]:
    before = len(last_choices())
    ex = tvm.compile(mod, target=opsdk.target(target))
    rules = [c.rule for c in last_choices()[before:] if c.op == "qdense"]
    return ex, rules


@pytest.fixture(scope="module")
def x86_build(cases) -> tuple[Any, list[str]]:
    return _compile(case_module(cases), "x86")


# ----------------------------------------------------------------------------- x86 (VNNI)

needs_vnni = pytest.mark.skipif(
    "avx512vnni" not in opsdk.targets.target_features(opsdk.target("x86")),
    reason="host CPU lacks AVX-512 VNNI",
)


@needs_vnni
def test_x86_vnni_is_bit_exact(cases, x86_build) -> None:
    ex, rules = x86_build
    assert rules == ["x86.qdense_vnni"] * len(cases)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(cases, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    sat = {k: result.pop(k) for k in ("sat_lo", "sat_hi")}
    assert result == {}, f"mismatching cases: {result}"
    assert sat["sat_lo"] > 0 and sat["sat_hi"] > 0, sat


_TWO_THREADS = """
import sys, numpy as np, tvm, opsdk
from tvm import relax
sys.path.insert(0, sys.argv[1])
import test_int8_schedules as T
assert tvm.get_global_func("runtime.NumThreads")() == 2
cases = [c for c in T.make_cases() if c.inputs["x"].shape[1] >= 64][:8]
for c in cases:  # 7 rows and more channel tiles than threads: tiles split across workers
    c.inputs["x"] = np.concatenate([c.inputs["x"]] * 5)
ex = tvm.compile(T.case_module(cases), target=opsdk.target("x86"))
vm = relax.VirtualMachine(ex, tvm.cpu())
T.MS = (35,)
res = T.check_cases(cases, lambda n, ins: vm[n](*map(tvm.runtime.tensor, ins)).numpy())
print({k: v for k, v in res.items() if not k.startswith("sat_")})
"""


@needs_vnni
def test_x86_vnni_bit_exact_on_two_threads() -> None:
    # TVM's default pool on x86 is half the CPUs (1 here), so the parallel tile loop is
    # checked in a fresh process with TVM_NUM_THREADS=2.
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TVM_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_THREADS, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "{}", proc.stdout[-2000:]


JUMP = r"^(j\w*|b(\.\w+)?|cbn?z|tbn?z)\s"  # x86 and aarch64 branches


def basic_blocks_with(asm: str, mnemonic: str) -> list[list[str]]:
    """Basic blocks of ``asm`` (split at labels and after jumps) containing ``mnemonic``."""
    blocks: list[list[str]] = [[]]
    for line in asm.splitlines():
        line = line.strip()
        if re.match(r"^\.?\w+:", line) and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
        if re.match(JUMP, line):
            blocks.append([])
    return [b for b in blocks if any(ln.startswith(mnemonic) for ln in b)]


@needs_vnni
def test_x86_asm_has_vpdpbusd_with_register_accumulators(x86_build) -> None:
    ex, _ = x86_build
    asm = asm_of(ex)
    count = len(re.findall(r"^\s*vpdpbusd\s", asm, flags=re.M))
    assert count >= len(KS) * 8, count  # every case, every tile
    # The 6 x 64 tile of a wide layer: 24 accumulators held in zmm registers across the K loop,
    # no store in the loop (a spilled tile stores after every vpdpbusd: 2.5x slower).
    wide, _ = _compile(case_module([_wide_case()]), "x86")
    loops = basic_blocks_with(asm_of(wide), "vpdpbusd")
    assert loops, "no vpdpbusd loop"
    hot = max(loops, key=lambda b: sum(ln.startswith("vpdpbusd") for ln in b))
    assert sum(ln.startswith("vpdpbusd") for ln in hot) >= 24
    assert re.match(JUMP, hot[-1]), hot[-3:]  # a loop: it ends in its back edge
    stores = [ln for ln in hot if re.match(r"vmov\w*\s+%zmm\d+, .*\(", ln)]
    assert stores == [], stores


def _wide_case() -> QCase:
    rng = np.random.default_rng(1)
    ins = _data(rng, "int8", 256, 128, True, bias=True)
    attrs = {**qdense.default_attrs(), "x_zero_point": 3, "x_scale": 0.05, "out_scale": 2.0}
    return QCase("wide", "int8_per_channel", attrs, ins)


def test_rules_and_claims_per_target() -> None:
    load_builtin_rules()  # (a compile loads them; on a host without VNNI none ran yet)
    names = {r.name: r for r in rules_for(qdense)}
    assert {"x86.qdense_vnni", "neon.qdense_dotprod", "neon.qdense"} <= set(names)
    assert names["x86.qdense_vnni"].claims == ("vectorize", "parallel", "insn:vpdpbusd")
    assert names["neon.qdense_dotprod"].claims == ("vectorize", "parallel", "insn:sdot")
    assert names["neon.qdense"].claims == ("vectorize", "parallel")
    func = _generic_func()
    from opsdk.schedules import choose

    want = {"arm-dotprod": "neon.qdense_dotprod", "arm": "neon.qdense", "c": "generic"}
    if "avx512vnni" in opsdk.targets.target_features(opsdk.target("x86")):
        want["x86"] = "x86.qdense_vnni"
    for target, rule in want.items():
        ch = choose(qdense, func, opsdk.target(target))
        assert ch.rule == rule, (target, ch.reasons)
    ch = choose(qdense, func, HASWELL)  # AVX2 without VNNI: the vpmaddwd rule
    assert ch.rule == "x86.qdense_avx2", ch.reasons
    assert any("lacks avx512vnni" in r for r in ch.reasons), ch.reasons
    assert names["x86.qdense_avx2"].claims == ("vectorize", "parallel", "insn:vpmaddwd")
    # A CPU with neither (baseline x86-64, SSE2) keeps the generic lowering.
    ch = choose(qdense, func, tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}))
    assert ch.rule == "generic"
    assert any("lacks avx2" in r for r in ch.reasons), ch.reasons


def test_insn_claim_lint_counts_the_instruction() -> None:
    from opsdk._asm import kernel_instruction_count
    from opsdk.verify._engine import lint_cell

    targets = {"arm-dotprod": "sdot"}
    if "avx512vnni" in opsdk.targets.target_features(opsdk.target("x86")):
        targets["x86"] = "vpdpbusd"
    for target, insn in targets.items():
        res = [r for r in lint_cell(qdense, target, "int8", "int8_per_channel")
               if r.check == f"insn:{insn}"]
        assert len(res) == 1 and res[0].status == "pass", res
        assert int(res[0].detail.split()[0]) >= 16, res[0].detail
    # The same claim fails on a kernel without the instruction (plain NEON: smull, no sdot).
    mod = build_single_op("qdense", {"x": (8, 64), "w": (32, 64), "w_scale": (32,)}, "int8",
                          qdense.default_attrs())
    asm = asm_of(tvm.compile(mod, target=opsdk.target("arm")))
    assert re.search(r"\bsmull", asm)
    assert kernel_instruction_count(asm, "sdot", "opsdk_qdense") == 0


def _generic_func() -> tirx.PrimFunc:
    m = tirx.Var("m", "int64")
    x = te.placeholder((m, 20), "int8", name="x")
    w = te.placeholder((33, 20), "int8", name="w")
    s = te.placeholder((33,), "float32", name="w_scale")
    y = qdense.call_compute([x, w, s, None], qdense.default_attrs())
    return te.create_prim_func([x, w, s, y])


# ----------------------------------------------------------------------------- x86 (AVX2)

#: An AVX2 CPU without VNNI: its code runs on every x86-64 host the suite runs on.
HASWELL = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})

needs_avx2 = pytest.mark.skipif(
    "avx2" not in opsdk.targets.target_features(opsdk.target("x86")),
    reason="host CPU lacks AVX2",
)


@needs_avx2
def test_x86_avx2_is_bit_exact(cases) -> None:
    # AVX2 without VNNI: the vpmaddwd rule on the whole matrix, symbolic batch at M = 1, 7.
    ex, rules = _compile(case_module(cases), HASWELL)
    assert rules == ["x86.qdense_avx2"] * len(cases)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(cases, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    sat = {k: result.pop(k) for k in ("sat_lo", "sat_hi")}
    assert result == {}, f"mismatching cases: {result}"
    assert sat["sat_lo"] > 0 and sat["sat_hi"] > 0, sat


def test_x86_avx2_keeps_its_accumulators_in_registers() -> None:
    # A wide layer's 4 x 16 tile: 8 ymm accumulators across the K loop; per step 16 vpmaddwd
    # and 8 vphaddd, no store and no stack slot in the loop (16 registers: a spill shows here).
    ex, rules = _compile(case_module([_wide_case()]), HASWELL)
    assert rules == ["x86.qdense_avx2"]
    asm = asm_of(ex)
    hot = max(basic_blocks_with(asm, "vpmaddwd"),
              key=lambda b: sum(ln.startswith("vpmaddwd") for ln in b))
    assert sum(ln.startswith("vpmaddwd") for ln in hot) >= 16, hot
    assert sum(ln.startswith("vphaddd") for ln in hot) >= 8, hot
    assert re.match(JUMP, hot[-1]), hot[-3:]
    assert not [ln for ln in hot if re.match(r"vmov\w*\s+%ymm\d+, .*\(", ln)], hot
    assert not [ln for ln in hot if "(%rsp)" in ln or "zmm" in ln], hot


@needs_avx2
def test_a_bug_planted_in_the_avx2_kernel_is_caught(cases, monkeypatch) -> None:
    # The micro-kernel adds the first channel half's pair sums twice (a wrong vphaddd
    # operand): every case with more than 4 output channels must mismatch.
    from opsdk.schedules.cpu import avx2

    def wrong(acc, a, load_b):
        a16 = tirx.Cast("int16x16", avx2.splat4(a, "int8x16", 4))
        x, _ = avx2._halves(load_b(0, 32))
        px = tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", x, a16)
        return acc + tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.phadd.d", px, px)

    monkeypatch.setattr(avx2, "AVX2_PMADDWD", avx2.Microkernel("vpmaddwd", 8, wrong))
    subset = [c for c in cases if c.name.endswith(("k17_n33", "k64_n16"))][:4]
    ex = tvm.compile(case_module(subset), target=HASWELL)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(subset, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    bad = {k for k in result if not k.startswith("sat_")}
    assert {k.split(" ")[0] for k in bad} == {c.name for c in subset}, result


# ----------------------------------------------------------------------------- aarch64 asm


@pytest.mark.parametrize(
    ("target", "rule", "present", "absent"),
    [
        ("arm-dotprod", "neon.qdense_dotprod", ("sdot",), ("smull",)),
        ("arm", "neon.qdense", ("smull", "saddlp", "addp"), ("sdot", "udot")),
    ],
)
def test_aarch64_asm(cases, target, rule, present, absent) -> None:
    subset = [c for c in cases if c.name.endswith(("k100_n33", "k64_n16"))][:3]
    ex, rules = _compile(case_module(subset), target)
    assert set(rules) == {rule}
    asm = asm_of(ex)
    counts = {m: len(re.findall(rf"^\s*{m}\s+v\d+\.", asm, flags=re.M)) for m in present + absent}
    assert all(counts[m] > 0 for m in present), counts
    assert all(counts[m] == 0 for m in absent), counts
    # 4 x 16 tile: 16 accumulators stay in q registers across the K loop (no store in it)
    hot = max(
        basic_blocks_with(asm, present[0]),
        key=lambda b: sum(ln.startswith(present[0]) for ln in b),
    )
    assert sum(ln.startswith(present[0]) for ln in hot) >= 16, hot
    assert re.match(JUMP, hot[-1]), hot[-3:]
    assert not [ln for ln in hot if re.match(r"(str|stp|st1)\s", ln)], hot


@pytest.mark.parametrize(
    ("target", "rule", "instruction"),
    [
        ("x86", "x86.qdense_vnni", "vpdpbusd"),
        ("arm-dotprod", "neon.qdense_dotprod", "sdot"),
        ("arm", "neon.qdense", "smull"),
    ],
)
def test_explain_shows_rule_and_instruction(target, rule, instruction) -> None:
    if target == "x86" and "avx512vnni" not in opsdk.targets.target_features(opsdk.target("x86")):
        pytest.skip("host CPU lacks AVX-512 VNNI")
    e = opsdk.explain("qdense", target)
    assert e.rule == rule, e.reasons
    assert e.claims[:2] == ("vectorize", "parallel")
    # explain counts vector registers only; count the instruction in the same module's asm
    attrs = qdense.default_attrs()
    shapes = qdense.example_shapes((tirx.Var("n", "int64"), *max(qdense.examples)[1:]), attrs)
    mod = build_single_op("qdense", shapes, "int8", attrs)
    asm = asm_of(tvm.compile(mod, target=opsdk.target(target)))
    assert len(re.findall(rf"^\s*{instruction}\s", asm, flags=re.M)) > 0
    if target != "arm-dotprod":
        assert not re.search(r"^\s*[su]dot\s", asm, flags=re.M)


# ----------------------------------------------------------------------------- mutants


def _mutant(name: str, *, acc16: bool = False, zp_sign: int = -1) -> opsdk.OpDef:
    """qdense's compute copied with one deliberate bug, declared with the true reference."""

    def compute(
        x: opsdk.Tensor,
        w: opsdk.Tensor,
        w_scale: opsdk.Tensor,
        bias: opsdk.Tensor | None = None,
        *,
        x_scale: float = 1.0,
        x_zero_point: int = 0,
        out_dtype: Literal["int8", "int32", "float32"] = "int8",
        out_scale: float = 1.0,
        out_zero_point: int = 0,
        per_channel: bool = True,
    ) -> te.Tensor:
        m, k = x.shape
        n = w.shape[0]
        rk = te.reduce_axis((0, k), name="k")
        acc_t = "int16" if acc16 else "int32"  # bug 1: a 16-bit accumulator
        acc = te.compute(
            (m, n),
            lambda i, j: te.sum(
                # bug 2: zp_sign=+1 adds the zero point instead of subtracting it
                (
                    (x(i, rk).astype("int32") + zp_sign * x_zero_point) * w(j, rk).astype("int32")
                ).astype(acc_t),
                axis=rk,
            ),
            name="acc",
        )

        def scale(j):
            return tirx.const(x_scale, "float32") * w_scale(j if per_channel else 0)

        def body(i, j):
            v = acc(i, j).astype("int32")
            v = v if bias is None else v + bias(j)
            if out_dtype == "int32":
                return v
            f = v.astype("float32")
            if out_dtype == "float32":
                return f * scale(j)
            return round_to_te(f * (scale(j) / tirx.const(out_scale, "float32")),
                               out_zero_point, out_dtype)

        return te.compute((m, n), body, name="qdense")

    compute.__name__ = name
    return opsdk.op(
        reference=qdense.reference,
        dtypes={"x": qdense.dtypes, **qdense.input_dtypes},
        ranks=qdense.ranks,
        free_dims=qdense.free_dims,
        input_shapes=qdense.input_shapes,
        check=qdense.check,
        layouts=qdense.layouts,
        domain=qdense.domain,
        attr_domain=qdense.attr_domain,
        kind=qdense.kind,
        examples=qdense.examples,
    )(compute)


@pytest.mark.parametrize(
    ("name", "bug"),
    [
        ("qdense_copy", {}),  # control: the copy without a bug passes
        ("qdense_mut_acc16", {"acc16": True}),
        ("qdense_mut_zpsign", {"zp_sign": 1}),
    ],
)
def test_mutants_are_caught_by_exact_comparison(cases, name, bug) -> None:
    d = _mutant(name, **bug)
    opsdk.register(d)
    try:
        # a non-zero zero point and K large enough to overflow int16 on the extreme rows
        subset = [c for c in cases if c.attrs["x_zero_point"] != 0 and c.inputs["x"].shape[1] >= 64]
        assert {c.layout for c in subset} == set(qdense.layouts)
        ex = tvm.compile(case_module(subset, d), target=opsdk.target("x86"))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        result = check_cases(subset, lambda nm, ins: vm[nm](*map(tvm.runtime.tensor, ins)).numpy())
        bad = {k: v for k, v in result.items() if not k.startswith("sat_")}
        if not bug:
            assert bad == {}
            return
        missed = [c.name for c in subset if f"{c.name} M={max(MS)}" not in bad]
        assert missed == [], f"{name} passed the exact comparison on {missed}: {bad}"
    finally:
        opsdk.unregister(d)


# ----------------------------------------------------------------------------- benchmark


@needs_vnni
def test_bench_qdense_smoke() -> None:
    pytest.importorskip("torch")
    from opsdk.bench._qdense import bench_qdense

    r = bench_qdense(64, 128, 64, repeats=1, calls=1, pause=0.0)
    assert r["exact"] and r["rule"] == "x86.qdense_vnni" and r["vpdpbusd"] > 0, r
    assert r["tvm_ms"] > 0 and r["torch_f32_ms"] > 0 and r["torch_dynamic_int8_ms"] > 0
