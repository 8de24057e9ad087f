"""`opsdk verify` executes on aarch64: an ARM-only schedule bug is caught on arm (and not on
x86), and verify reaches a separately started RPC server exactly as it would a board."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from tvm import s_tir, te, tirx
from tvm.target import Target
from tvm_ffi.structural import structural_mutate

import opsdk
from opsdk import Tensor
from opsdk.ops import gelu as _gelu_mod
from opsdk.te_utils import acc
from opsdk.verify import verify, verify_op

pytestmark = pytest.mark.arm
_gelu_module = __import__("sys").modules[_gelu_mod.module]


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)


# A correct GELU (the built-in's math and reference, so it shares the built-in error model)...
@opsdk.op(reference=_gelu_module._reference, domain={"x": (-6.0, 6.0)}, kind="elementwise",
          examples=[(2, 3, 8)])
def neon_tail_bug(x: Tensor, *, approximate: str = "none") -> te.Tensor:
    """GELU; its ARM rule (below) drops the partial last NEON vector of each row."""
    return te.compute(
        x.shape,
        lambda *i: _gelu_module.gelu_expr(acc(x(*i)), approximate).astype(x.dtype),
        name="neon_tail_bug",
    )


# ... whose ARM-only schedule forgets the tail when a row is not a multiple of 4 lanes.
@opsdk.rule("neon_tail_bug", "arm_cpu", name="mut.neon_without_tail", requires=("neon",),
            priority=1000, claims=("vectorize",))
def _neon_without_tail(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    sch = s_tir.Schedule(func)
    loop = sch.get_loops(sch.get_sblock("neon_tail_bug"))[-1]
    n = sch.get(loop).extent
    outer, inner = sch.split(loop, factors=[None, 4])
    sch.vectorize(inner)
    var = sch.get(outer).loop_var

    def cut(node: tirx.For, mut) -> tirx.For:
        if not node.loop_var.same_as(var):
            return mut.default_mutate(node)
        return tirx.For(node.loop_var, node.min, tirx.floordiv(n, 4), node.kind,
                        mut.mutate(node.body), node.thread_binding, node.annotations)

    return s_tir.Schedule(structural_mutate(sch.mod["main"], [(tirx.For, cut)]))


def test_arm_only_schedule_bug_caught_on_arm_not_on_x86():
    opsdk.register(neon_tail_bug)
    try:
        common = {"dtypes": ["float32"], "profile": "ci", "max_examples": 10, "database": None,
                  "lints": False, "refusals": False}
        on_x86 = verify_op("neon_tail_bug", "x86", **common)
        assert on_x86.ok, on_x86.format_table()
        on_arm = verify_op("neon_tail_bug", "arm", **common)
        assert not on_arm.ok
        (fail,) = on_arm.failures
        assert fail.rule == "mut.neon_without_tail"
        assert on_arm.device["arch"] == "aarch64"
        assert fail.case.shape[-1] % 4 != 0  # shrunk to a row with a partial vector
    finally:
        opsdk.unregister(neon_tail_bug)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_verify_over_rpc_against_a_separately_started_server():
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "opsdk.runners.emulated", "--port", str(port),
         "--host", "127.0.0.1", "--cpu", "cortex-a72"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until the board-like server accepts connections
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        report = verify(["softmax"], "arm", rpc=f"127.0.0.1:{port}", dtypes=["float32"],
                        profile="ci", max_examples=5, database=None, lints=False,
                        refusals=False)
        assert report.ok, report.format_table()
        assert report.device["device"].startswith("rpc 127.0.0.1")
        assert sum(c.examples for c in report.cells) >= 10
        # the CLI spelling users type
        r = subprocess.run(
            [sys.executable, "-m", "opsdk", "verify", "gelu", "--target", "arm",
             "--rpc", f"127.0.0.1:{port}", "--dtypes", "float32", "--examples", "3",
             "--no-lints"],
            capture_output=True, text=True, timeout=600, env={**os.environ},
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "PASS" in r.stdout
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _mutants():
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "host"))
    import verify_mutants as M

    return M


def _corner_misses(M, target: str, runner) -> list[str]:
    """The CORNER_MUTANTS checked on ``target`` that none of verify's corner cases of their
    cell flags in their own rule (one cell each, no random search: the suite's budget;
    scripts/kernel-mutants.py --target arm runs the full search, int8 on arm-dotprod)."""
    by_name = {d.name: d for d in M.OPS}
    missed = []
    for name, (dtype, layout, t) in M.CORNER_MUTANTS.items():
        if t != target:
            continue
        d = by_name[name]
        opsdk.register(d, replace=True)
        try:
            res = M.first_failing_corner(d, target, dtype, layout, runner=runner)
        finally:
            opsdk.unregister(d)
        if res is None or res.rule != "mut." + name.removeprefix("mut_"):
            missed.append(f"{name} ({M.BUGS[name]}): {res and res.rule}")
    return missed


def test_rule_mutants_are_flagged_on_arm() -> None:
    # The schedule-rule mutants of tests/host/verify_mutants.py (their rules are keyed
    # "cpu", so they schedule the aarch64 build too), run under the emulator: the older
    # ones by the default profile (float32), the newer kernel-rule ones (epilogue order,
    # padding, packing, pool window, int8 compensation, q4 scales) by their cell's corners.
    M = _mutants()
    from opsdk.runners import runner_for

    by_name = {d.name: d for d in M.OPS}
    missed = []
    with runner_for("arm") as runner:  # one emulated server for all (its start is ~7 s)
        for name in M.RULE_MUTANTS:
            d = by_name[name]
            opsdk.register(d, replace=True)
            try:
                report = verify_op(d, "arm", dtypes=["float32"], profile="dev", seed=0,
                                   database=None, lints=False, refusals=False,
                                   fail_fast=True, runner=runner)
            finally:
                opsdk.unregister(d)
            if report.ok:
                missed.append(f"{name} ({M.BUGS[name]})")
        missed += _corner_misses(M, "arm", runner)
    assert not missed, f"not flagged on arm: {missed}"


@pytest.mark.parametrize("last", [19, 21, 23])
def test_odd_vector_tails_are_right_on_arm(last) -> None:
    # requantize on a static (39, 19) tensor: the 3-element tail as one <3 x i64> vector
    # came back -128 for 127 on aarch64 (found by verify's static residues); tails are now
    # power-of-two vectors (2 + 1), and 5- and 7-element tails stay right.
    from opsdk.verify import Case, run_case

    attrs = {"axis": -1, "per_channel": False, "input_zero_point": 0, "output_zero_point": 0,
             "out_dtype": "int8"}
    c = Case("requantize", "arm", "int32", "per_tensor", (39, last), attrs, (),
             {"x": "domain", "multiplier": "domain", "shift": "domain"}, 9, static=True)
    r = run_case(c)
    assert r.ok and r.rule == "neon.elementwise", r.format(tir=False)


def test_a_reshaping_transpose_through_an_l1_tile_is_right_on_arm() -> None:
    # neon.elementwise's L1-tile transpose (a detector head's flattened channels-last
    # scales, transposed and concatenated), run under emulation against numpy.
    import numpy as np
    import tvm
    from tvm import te, tirx

    import opsdk
    from opsdk.runners import runner_for

    a = te.placeholder((1, 10, 10, 32), name="a")
    b = te.placeholder((1, 5, 5, 32), name="b")

    def body(z, c, p):
        return tirx.if_then_else(p < 100, a[z, p // 10, p % 10, c],
                                 b[z, (p - 100) // 5, (p - 100) % 5, c])

    f = te.create_prim_func([a, b, te.compute((1, 32, 125), body, name="head")])
    tgt = opsdk.target("arm")
    s = opsdk.schedules.apply_schedule(opsdk.schedules.kernel_for("k", f), f, tgt)
    assert s.attrs["opsdk.rule"] == "neon.elementwise"
    assert any(str(buf.scope()) == "local" for buf in s.body.block.alloc_buffers)
    ex = tvm.compile(tvm.IRModule({"main": s.with_attr("global_symbol", "main")}), target=tgt)
    rng = np.random.default_rng(9)
    av = rng.standard_normal((1, 10, 10, 32)).astype("float32")
    bv = rng.standard_normal((1, 5, 5, 32)).astype("float32")
    with runner_for("arm") as runner:
        (y,) = runner.run(ex, [av, bv], outputs=[((1, 32, 125), "float32")])
    want = np.concatenate([av.reshape(1, 100, 32), bv.reshape(1, 25, 32)], axis=1)
    np.testing.assert_array_equal(y, want.transpose(0, 2, 1))


def test_a_transpose_in_tiles_through_a_local_buffer_is_right_on_arm() -> None:
    # neon.elementwise's tiled transpose (NCHW -> NHWC, 4-lane tiles), run under emulation
    import numpy as np
    import tvm
    from tvm import te

    import opsdk
    from opsdk.runners import runner_for

    a = te.placeholder((1, 12, 8, 16), name="a")
    out = te.compute((1, 8, 16, 12), lambda n, h, w, c: a[n, c, h, w], name="T_transpose")
    f = te.create_prim_func([a, out])
    tgt = opsdk.target("arm")
    s = opsdk.schedules.apply_schedule(opsdk.schedules.kernel_for("k", f), f, tgt)
    assert s.attrs["opsdk.rule"] == "neon.elementwise"
    assert [str(b.scope()) for b in s.body.block.alloc_buffers] == ["local"]
    ex = tvm.compile(tvm.IRModule({"main": s.with_attr("global_symbol", "main")}), target=tgt)
    x = np.random.default_rng(2).standard_normal((1, 12, 8, 16)).astype("float32")
    with runner_for("arm") as runner:
        (y,) = runner.run(ex, [x], outputs=[((1, 8, 16, 12), "float32")])
    np.testing.assert_array_equal(y, x.transpose(0, 2, 3, 1))
