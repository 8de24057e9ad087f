"""``opsdk explain --zoo``: the zoo's structure on a target (compiles, kernels on the catch-all
rule, heavy kernels without vector instructions, the output against torch on the host), and
the rule fixes it found: a plain reduction (no epilogue) on the rows rule, a split (several
outputs) and a concatenate (a select per input range) on the elementwise rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from tvm import te, tirx, topi

from opsdk._asm import asm_of, kernel_vector_moves, kernel_vector_ops, loop_kinds
from opsdk._explain import ZooCheck, catch_all_rules, format_zoo_check
from opsdk.cli import main
from opsdk.schedules import choose, load_builtin_rules
from opsdk.schedules._kernels import kernel_for
from opsdk.targets import target


def test_explain_zoo_small_on_x86_compiles_matches_torch_and_has_no_fallback(tmp_path,
                                                                             capsys):
    out = tmp_path / "zoo.json"
    rc = main(["explain", "--zoo", "small", "--target", "x86", "--strict", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    (row,) = json.loads(out.read_text())["models"]
    assert row["model"] == "unet_tiny" and row["compiled"] and row["kernels"] > 10
    assert row["fallback"] == [] and row["unvectorized"] == [] and row["problems"] == []
    assert row["torch"]["ok"], row["torch"]
    assert "zoo check: 1 model, all pass" in cap.out


def test_explain_zoo_bad_selector_is_a_usage_error(capsys):
    assert main(["explain", "--zoo", "resnet5"]) == 2
    assert "unknown zoo model 'resnet5'" in capsys.readouterr().err
    assert main(["explain", "layer_norm", "--zoo", "small"]) == 2


def test_zoo_check_fails_on_fallback_unvectorized_mismatch_or_no_compile():
    ok = ZooCheck("a", "arm", compiled=True, kernels=3)
    fb = ZooCheck("b", "arm", compiled=True, kernels=3, fallback=["k (reduction, neon.fallback)"])
    unv = ZooCheck("c", "arm", compiled=True, kernels=3, unvectorized=["cat (elementwise, x)"])
    bad = ZooCheck("d", "x86", compiled=True, kernels=3,
                   torch={"ok": False, "max_abs": 1.0, "max_rel": 0.5})
    gone = ZooCheck("e", "arm", error="ValueError: no lowering")
    prob = ZooCheck("f", "arm", compiled=True, kernels=3, problems=["k: serial"])
    assert not ok.failed(strict=True)
    assert all(r.failed() for r in (fb, unv, bad, gone))
    assert not prob.failed() and prob.failed(strict=True)
    text = format_zoo_check([ok, fb, unv, bad, gone])
    assert "b: fallback: k (reduction, neon.fallback)" in text
    assert "c: no vector instructions: cat (elementwise, x)" in text
    assert "d: torch: max abs error 1" in text and "e      arm     NO" in text
    assert text.endswith("4 failed (b, c, d, e)")
    assert {"x86.fallback", "neon.fallback"} <= catch_all_rules()


def _choose(f: tirx.PrimFunc, tgt: str):
    load_builtin_rules()
    return choose(kernel_for("k", f), f, target(tgt))


def _run_x86(func: tirx.PrimFunc, arrays: list[np.ndarray]) -> list[np.ndarray]:
    ex = tvm.compile(tvm.IRModule({"main": func}), target=target("x86"))
    ts = [tvm.runtime.tensor(a) for a in arrays]
    ex["main"](*ts)
    return [t.numpy() for t in ts]


def _row_any(keep: bool) -> tirx.PrimFunc:
    """DeiT's mask check: max over the last axis of int8(!(x == -inf)), one block."""
    x = te.placeholder((1, 6, 37, 45), "float32", name="x")
    k = te.reduce_axis((0, 45), "k")
    ninf = tirx.const(float("-inf"), "float32")
    r = te.compute((1, 6, 37, 1) if keep else (1, 6, 37), lambda *i: te.max(
        tirx.Cast("int8", tirx.Not(x[i[0], i[1], i[2], k] == ninf)), axis=k), name="r")
    return te.create_prim_func([x, r])


@pytest.mark.parametrize("keep", [True, False])
def test_a_plain_reduction_takes_the_rows_rule_vectorized_and_right(keep):
    ch = _choose(_row_any(keep), "x86")
    assert ch.rule == "x86.rows", ch.reasons
    assert loop_kinds(ch.func)["PARALLEL"] == 1
    # an integer max with a tail (45 = 32 + 13): the plain row loop, which LLVM vectorizes
    f = ch.func.with_attr("global_symbol", "k")
    asm = asm_of(tvm.compile(tvm.IRModule({"k": f}), target=target("x86")))
    assert sum(kernel_vector_ops(asm, "x86_64", "k").values()) > 0
    x = np.random.default_rng(0).standard_normal((1, 6, 37, 45)).astype("float32")
    x[0, 2, 5, :] = -np.inf  # a fully masked row: 0
    x[0, 3, 7, :-1] = -np.inf  # one finite element: 1
    out = np.full((1, 6, 37, 1) if keep else (1, 6, 37), 7, "int8")
    got = _run_x86(ch.func, [x, out])[1]
    np.testing.assert_array_equal(got, (~np.isneginf(x)).max(-1, keepdims=keep).astype("int8"))
    # a float sum over the last axis, no epilogue, 45 = 2 x 16 + 13 (a tail)
    xs = te.placeholder((70, 45), "float32", name="x")
    f = te.create_prim_func([xs, topi.sum(xs, axis=1)])
    ch = _choose(f, "x86")
    assert ch.rule == "x86.rows" and loop_kinds(ch.func)["VECTORIZED"] >= 1, ch.reasons
    got = _run_x86(ch.func, [x.reshape(-1)[: 70 * 45].reshape(70, 45).clip(-4, 4),
                             np.zeros(70, "float32")])
    ref = x.reshape(-1)[: 70 * 45].reshape(70, 45).clip(-4, 4).astype(np.float64).sum(1)
    # a sum of 45 terms in float32: |err| <= gamma_45 * sum |x|
    bound = 45 * 2.0 ** -24 / (1 - 45 * 2.0 ** -24) * np.abs(got[0]).sum(1)
    assert np.all(np.abs(got[1] - ref) <= bound)


def test_a_split_takes_the_elementwise_rule_each_output_vectorized():
    x = te.placeholder((2, 64, 120), "float32", name="x")
    outs = topi.split(topi.reshape(x, (2, 64, 3, 40)), 3, axis=2)
    ch = _choose(te.create_prim_func([x, *outs]), "x86")
    assert ch.rule == "x86.elementwise", ch.reasons
    kinds = loop_kinds(ch.func)
    # the outputs share their outer positions: one parallel pass over the input
    assert kinds["PARALLEL"] == 1 and kinds["VECTORIZED"] >= 3, kinds
    xs = np.random.default_rng(1).standard_normal((2, 64, 120)).astype("float32")
    got = _run_x86(ch.func, [xs, *[np.zeros((2, 64, 1, 40), "float32")] * 3])[1:]
    for g, r in zip(got, np.split(xs.reshape(2, 64, 3, 40), 3, axis=2)):
        np.testing.assert_array_equal(g, r)


def test_a_channel_split_reads_each_row_once_in_vectors():
    # InceptionNeXt's token mixer: 96 channels split 72 + 8 + 8 + 8. The 72-channel part
    # was fused with the pixel axis (a vector straddled two 96-wide rows: a gather) and each
    # part had a parallel pass of its own: 156 us at (1, 56, 56, 96), now 32.
    x = te.placeholder((1, 9, 7, 96), "float32", name="x")
    outs = topi.split(x, [72, 80, 88], axis=3)
    ch = _choose(te.create_prim_func([x, *outs]), "x86")
    assert ch.rule == "x86.elementwise", ch.reasons
    kinds = loop_kinds(ch.func)
    # 72 = 64 (4 vectors) + 8, then 8, 8, 8: five vector loops in one parallel pass
    assert kinds["PARALLEL"] == 1 and kinds["VECTORIZED"] == 5, kinds
    f = ch.func.with_attr("global_symbol", "k")
    asm = asm_of(tvm.compile(tvm.IRModule({"k": f}), target=target("x86")))
    assert "vgather" not in asm and "vpgather" not in asm
    xs = np.random.default_rng(1).standard_normal((1, 9, 7, 96)).astype("float32")
    shapes = [(1, 9, 7, c) for c in (72, 8, 8, 8)]
    got = _run_x86(ch.func, [xs, *[np.zeros(s, "float32") for s in shapes]])[1:]
    for g, r in zip(got, np.split(xs, [72, 80, 88], axis=3)):
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize(("chans", "loops"), [((16, 32, 16), 3), ((3, 5), 2),
                                              ((72, 8, 8, 8), 5), ((8, 40), 4)])
def test_a_channel_concatenate_is_one_vector_loop_per_input(chans, loops):
    # Each input's range its own vector loops (72 = 64 + 8; 3 = 2 + 1, 5 = 4 + 1, the
    # single elements scalar; 40 from offset 8 as 16 + 16 + 8), not a select per lane
    # (InceptionNeXt's concat + BN: 83 -> 16 us).
    ins = [te.placeholder((2, 5, 7, c), "float32", name=f"a{i}") for i, c in enumerate(chans)]
    ch = _choose(te.create_prim_func([*ins, topi.concatenate(ins, axis=3)]), "x86")
    assert ch.rule == "x86.elementwise", ch.reasons
    assert loop_kinds(ch.func)["VECTORIZED"] == loops
    if sum(chans) >= 16:
        f = ch.func.with_attr("global_symbol", "k")
        asm = asm_of(tvm.compile(tvm.IRModule({"k": f}), target=target("x86")))
        # a vector load and store per input at least (the select per lane had one in all)
        assert kernel_vector_moves(asm, "x86_64", "k") >= 2 * len(chans)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((2, 5, 7, c)).astype("float32") for c in chans]
    got = _run_x86(ch.func, [*xs, np.zeros((2, 5, 7, sum(chans)), "float32")])[-1]
    np.testing.assert_array_equal(got, np.concatenate(xs, axis=3))
