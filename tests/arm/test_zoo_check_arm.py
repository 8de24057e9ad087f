"""``opsdk explain --zoo`` for arm (cross-compile only: nothing runs), and the NEON rules the
zoo check made take its kernels: a plain reduction on neon.rows, a split and a channel
concatenate on neon.elementwise, each with NEON instructions in its assembly."""

from __future__ import annotations

import json

import pytest
import tvm
from tvm import te, tirx, topi

from opsdk._asm import asm_of, kernel_vector_moves, kernel_vector_ops
from opsdk.cli import main
from opsdk.schedules import choose, load_builtin_rules
from opsdk.schedules._kernels import kernel_for
from opsdk.targets import target

pytestmark = pytest.mark.arm


def test_explain_zoo_small_cross_compiles_for_arm_without_fallback(tmp_path, capsys):
    out = tmp_path / "zoo.json"
    rc = main(["explain", "--zoo", "small", "--target", "arm", "--strict", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    (row,) = json.loads(out.read_text())["models"]
    assert row["compiled"] and row["fallback"] == [] and row["unvectorized"] == []
    assert row["torch"] is None  # nothing ran: an aarch64 target on an x86 host


def _neon(f: tirx.PrimFunc, rule: str) -> tuple[int, int]:
    load_builtin_rules()
    ch = choose(kernel_for("k", f), f, target("arm"))
    assert ch.rule == rule, ch.reasons
    fn = ch.func.with_attr("global_symbol", "k")
    asm = asm_of(tvm.compile(tvm.IRModule({"k": fn}), target=target("arm")))
    return (sum(kernel_vector_ops(asm, "aarch64", "k").values()),
            kernel_vector_moves(asm, "aarch64", "k"))


def test_the_zoo_kernels_take_neon_rules_with_neon_instructions():
    x = te.placeholder((1, 6, 37, 45), "float32", name="x")
    k = te.reduce_axis((0, 45), "k")
    ninf = tirx.const(float("-inf"), "float32")
    r = te.compute((1, 6, 37, 1), lambda *i: te.max(
        tirx.Cast("int8", tirx.Not(x[i[0], i[1], i[2], k] == ninf)), axis=k), name="r")
    ops, _ = _neon(te.create_prim_func([x, r]), "neon.rows")
    assert ops > 0
    s = te.placeholder((2, 64, 120), "float32", name="s")
    outs = topi.split(topi.reshape(s, (2, 64, 3, 40)), 3, axis=2)
    _, moves = _neon(te.create_prim_func([s, *outs]), "neon.elementwise")
    assert moves >= 6  # a vector load and store per output at least
    ins = [te.placeholder((1, 20, 20, c), "float32", name=f"a{i}") for i, c in
           enumerate((16, 32))]
    _, moves = _neon(te.create_prim_func([*ins, topi.concatenate(ins, axis=3)]),
                     "neon.elementwise")
    assert moves >= 4  # was 0: a scalar select per lane
