"""opsdk tune: MetaSchedule records verified before use (issue #34).

One tiny tune (a 32x64x48 matmul + ReLU, 3 samples) shared by the tests: its records are
verified, a corrupted one (a tile edge that drops the last tile) is rejected with a
reproducer, a verified record is the rule the driver picks, the database round-trips. No
timing is asserted: whether a record is kept depends on the machine.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from tvm import relax

import opsdk
from opsdk.model import LoadedModel, compile_model, fused_module, report
from opsdk.schedules import TunedRecord, workload_key
from opsdk.tune import (
    TuningDB,
    TuningDBError,
    float64_twin,
    read_record,
    recheck,
    search,
    tune_model,
    verify_trace,
)


def _model() -> LoadedModel:
    rng = np.random.default_rng(3)
    x = relax.Var("x", relax.TensorType((32, 64), "float32"))
    w = relax.const(rng.standard_normal((64, 48)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    mod = bb.get()
    return LoadedModel("tiny", mod, mod, [rng.standard_normal((32, 64)).astype("float32")])


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    m = _model()
    db = TuningDB(tmp_path_factory.mktemp("tuning"))
    rep = tune_model(m, "x86", trials=3, keep=1, draws=2, db=db, log=None, pick="weakest")
    fused = fused_module(m.opsdk_mod, opsdk.target("x86"))
    (func,) = [f for gv, f in fused.functions.items()
               if gv.name_hint == rep.kernels[0].kernel]
    return m, db, rep, func


def _verified_trace(db, func):
    """A verified trace of the workload: from the database (kept, or rejected only for
    speed), else sampled again."""
    tgt = opsdk.target("x86")
    folder = db.folder(tgt)
    for p in [*folder.glob("*.json"), *folder.glob("rejected/*.json")]:
        rec = read_record(p)
        if rec.get("verify", {}).get("ok"):
            return rec["trace"]
    return search(func, tgt, trials=3, keep=1)[0].trace


def test_every_record_is_verified(tuned):
    m, db, rep, func = tuned
    with pytest.raises(ValueError, match="pick='fastest'"):
        tune_model(m, "x86", pick="fastest", db=db, log=None)
    (k,) = rep.kernels
    assert k.kind == "matmul" and k.workload == workload_key(func)
    assert k.verified, "no candidate reached the verify gate"
    for g in k.verified:
        assert g.reference == "float64" and g.draws == 2
        assert g.ok == (g.worst <= 1.0)
        # Against a real float64 reference the float32 kernels differ from it.
        assert g.generic_worst > 0
    tgt = opsdk.target("x86")
    files = [*db.folder(tgt).glob("*.json"), *db.folder(tgt).glob("rejected/*.json")]
    assert files
    for p in files:  # kept only when verified and faster; a rejection says why
        rec = read_record(p)
        assert rec["workload"] == k.workload and rec["kernel"] == k.kernel
        if rec["status"] == "kept":
            assert rec["verify"]["ok"] and rec["speedup"] >= 1.03
            assert recheck(p).ok
        else:
            assert rec["status"].startswith("rejected: ")


def _drop_last_tile(trace):
    """The trace with one tile split's outermost factor one smaller: the split no longer
    covers the loop (the last tile is dropped)."""
    bad = copy.deepcopy(trace)
    insts, decisions = bad
    for d in decisions:
        idx, val = d
        if insts[idx][0] == "SamplePerfectTile" and val[0] > 1:
            d[1] = [val[0] - 1, *val[1:]]
            return bad
    raise AssertionError("no tile split with an outer factor above 1")


def test_corrupted_record_is_rejected_with_a_reproducer(tuned, tmp_path, capsys):
    _, db, rep, func = tuned
    tgt = opsdk.target("x86")
    good = _verified_trace(db, func)
    assert verify_trace(func, good, tgt, draws=1).ok
    bad = _drop_last_tile(good)
    g = verify_trace(func, bad, tgt, draws=1)
    assert not g.ok and "does not replay" in g.why
    # Stored as a rejection, its reproducer fails the same way.
    path = TuningDB(tmp_path).put(tgt, {"workload": rep.kernels[0].workload, "trace": bad,
                        "workload_script": func.script(), "status": "rejected: " + g.why},
                  kept=False)
    from opsdk.cli import main

    assert main(["tune", "--recheck", str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_verified_record_is_the_rule_the_driver_picks(tuned):
    m, db, rep, func = tuned
    tgt = opsdk.target("x86")
    rec = TunedRecord(workload_key(func), _verified_trace(db, func), "x86.matmul", 1.5,
                      rep.kernels[0].kernel)
    cm = compile_model(m.opsdk_mod, tgt, tuning=[rec], cache=False)
    r = report(cm, tgt, inputs=m.inputs, source=m.opsdk_mod, asm=False, profile=False)
    assert [k.rule for k in r.kernels if k.kind == "matmul"] == [rec.rule_name]
    # The tuned model computes what the hand-ruled one does (within float32 rounding).
    from opsdk.runners.local import LocalRunner

    hand = compile_model(m.opsdk_mod, tgt)
    with LocalRunner() as host:
        a = host.run(hand.ex, m.inputs)[0]
        b = host.run(cm.ex, m.inputs)[0]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    # A record of another workload declines: the hand rule keeps the kernel.
    other = TunedRecord("0" * 16, rec.trace, "x86.matmul", 1.5)
    cm2 = compile_model(m.opsdk_mod, tgt, tuning=[other], cache=False)
    assert [k["rule"] for k in cm2.kernels if k["kind"] == "matmul"] == ["x86.matmul"]


def test_the_database_round_trips_and_refuses_a_corrupt_file(tmp_path):
    tgt = opsdk.target("x86")
    db = TuningDB(tmp_path)
    trace = [[["GetSBlock", [], ["C", "main"], ["b0"]]], []]
    db.put(tgt, {"workload": "0123456789abcdef", "trace": trace, "workload_script": "# x",
                 "hand_rule": "x86.matmul", "speedup": 1.7, "kernel": "fused_matmul",
                 "status": "kept"})
    (r,) = TuningDB(tmp_path).records(tgt)
    assert (r.workload, r.trace, r.hand_rule, r.speedup, r.kernel) == \
        ("0123456789abcdef", trace, "x86.matmul", 1.7, "fused_matmul")
    assert r.rule_name == "tuned:01234567"
    (db.folder(tgt) / "fedcba9876543210.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(TuningDBError, match=r"fedcba9876543210\.json: lacks .*delete it"):
        db.records(tgt)


def test_an_artifact_ships_the_records_that_scheduled_a_kernel(tmp_path):
    from opsdk.deploy._artifact import _ship_tuning

    used_rec = TunedRecord("2b9a6e0c9c20f1fc", [[], []], "x86.matmul", 1.3, "k")
    unused = TunedRecord("0" * 16, [[], []], "x86.conv2d", 1.5, "c")
    kernels = [{"name": "k_weight_prepack", "rule": "tuned:2b9a6e0c"},
               {"name": "k", "rule": "tuned:2b9a6e0c"}, {"name": "z", "rule": "x86.rows"}]
    (m,) = _ship_tuning(tmp_path, [used_rec, unused], kernels)
    assert (m["kernel"], m["kernels"], m["rule"]) == \
        ("k", ["k", "k_weight_prepack"], "tuned:2b9a6e0c")
    shipped = json.loads((tmp_path / m["file"]).read_text())
    assert (shipped["workload"], shipped["trace"]) == (used_rec.workload, used_rec.trace)
    assert not (tmp_path / "tuning" / f"{unused.workload}.json").exists()


def test_the_magnitude_run_drops_value_clamps_but_keeps_index_clamps():
    """The bound's magnitude run (``float64_twin(..., clamps=False)``) is hardswish without
    its clamp, operator precedence kept, while an index's clamp (a gather's edge) stays."""
    import tvm
    from tvm import te

    n = 16
    x = te.placeholder((n,), name="x")
    hs = te.compute((n,), lambda i: x[i] * te.min(te.max(x[i] + 3.0, 0.0), 6.0) / 6.0)
    edge = te.compute((n,), lambda i: x[te.min(i + 1, n - 1)] + hs[i])
    f = te.create_prim_func([x, edge])
    loose = tvm.compile(float64_twin(f, clamps=False), target="llvm")
    xs = np.linspace(-8, 8, n)
    out = np.zeros(n)
    args = [tvm.runtime.tensor(v, tvm.cpu()) for v in (xs, out)]
    loose(*args)
    want = xs[np.minimum(np.arange(n) + 1, n - 1)] + xs * (xs + 3.0) / 6.0
    np.testing.assert_allclose(args[1].numpy(), want, rtol=1e-12)


def test_a_clamped_epilogue_is_judged_against_float64():
    """ReLU6 after a matmul: a sampled trace passes the float64 gate on its own bound."""
    rng = np.random.default_rng(5)
    x = relax.Var("x", relax.TensorType((16, 96), "float32"))
    w = relax.const(rng.standard_normal((96, 32)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.clip(relax.op.matmul(x, w), 0.0, 6.0))
        bb.emit_func_output(y)
    tgt = opsdk.target("x86")
    fused = fused_module(bb.get(), tgt)
    (func,) = [f for gv, f in fused.functions.items() if gv.name_hint.startswith("fused_matmul")]
    (cand,) = search(func, tgt, trials=2, keep=1)
    g = verify_trace(func, cand.trace, tgt, draws=2)
    assert g.ok and g.reference == "float64" and not g.notes
    assert 0 < g.generic_worst <= 1.0
