"""Attention's ``Q @ K^T`` with a size no NEON tile divides (rows and columns padded) is on
``neon.matmul``: its k loop is unpredicated NEON (``fmla v.4s``), and it matches float64
under emulated aarch64."""

from __future__ import annotations

import re

import pytest
import tvm
from tvm import s_tir, te, tirx
from tvm_ffi.structural import structural_walk

import opsdk
from opsdk.kernels import tvm_matmul
from opsdk.schedules import apply_schedule, kernel_for
from opsdk.verify import Case, run_case

pytestmark = pytest.mark.arm


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.registry import register_kernels
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)
    register_kernels()


def test_padded_scores_verify_on_arm():
    # 37 rows and 33 columns: no NEON tile divides either (both are padded).
    case = Case("tvm_matmul", "arm", "float32", "batched_nk", (2, 37, 8),
                {"layout": "batched_nk", "n": 33, "activation": "none"}, ("residual",), {},
                3, static=True)
    res = run_case(case, op=tvm_matmul)
    assert res.ok, res.format(tir=False)
    assert res.rule == "neon.matmul"


def test_padded_scores_k_loop_is_unpredicated_neon():
    b, m, n, k = 2, 37, 33, 8
    q = te.placeholder((b, m, k), name="q")
    kt = te.placeholder((b, n, k), name="kt")
    mask = te.placeholder((m, n), name="mask")
    r = te.reduce_axis((0, k), name="r")
    mm = te.compute((b, m, n), lambda s, i, j: te.sum(q[s, i, r] * kt[s, j, r], axis=r),
                    name="matmul")
    out = te.compute((b, m, n), lambda s, i, j: mm[s, i, j] * 0.5 + mask[i, j], name="scores")
    f = te.create_prim_func([q, kt, mask, out])
    tgt = opsdk.target("arm")
    with tgt:
        sched = apply_schedule(kernel_for("scores", f), f, tgt)
    assert str(sched.attrs["opsdk.rule"]) == "neon.matmul"
    realizes: list = []
    structural_walk(sched, [(s_tir.SBlockRealize, realizes.append)])
    updates = [x for x in realizes if x.block.name_hint.endswith("_update")]
    assert len(updates) == 1
    assert isinstance(updates[0].predicate, tirx.IntImm) and int(updates[0].predicate) == 1
    ex = tvm.compile(tvm.IRModule({"main": sched}), target=tgt)
    assert re.search(r"\bfmla\s+v\d+\.4s", ex.mod.inspect_source("asm")), "no NEON FMA"
