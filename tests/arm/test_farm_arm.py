"""A sharded verify over a local farm: TVM's RPC tracker and 2 emulated aarch64 boards
registered to it (`opsdk setup farm`). Every cell is reported exactly once whether or not a
board dies mid-run, both boards get work, and a killed board is named in the report."""

from __future__ import annotations

import gc
import os
import signal
import socket
import time
from collections import Counter

import numpy as np
import pytest

from opsdk.runners import farm_state, request_board, start_farm, stop_farm, tracker_boards
from opsdk.verify import verify_sharded
from opsdk.verify._cli import add_verify_arguments, run_verify_command
from opsdk.verify._engine import _claimed_cells, _target_name

pytestmark = pytest.mark.arm

OPS = ["gelu"]  # 2 float32 cells (erf, tanh), one per board; corner cases only
KEY = "opsdk-test-farm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)
    state_dir = tmp_path_factory.mktemp("farm")
    state = start_farm(2, key=KEY, port=_free_port(), state_dir=state_dir)
    try:
        yield state, state_dir
    finally:
        stopped = stop_farm(state_dir)
        assert len(stopped) >= 2, stopped  # the tracker and the board(s) still running
        assert farm_state(state_dir) is None
        left = [_stat(p) for p in [state.tracker_pid, *state.board_pids] if _stat(p)]
        assert left == [], left  # nothing it started is left
        # ... nor a board's qemu server (its command line names the tracker it served)
        deadline = time.monotonic() + 10
        while _processes_naming(state.tracker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_naming(state.tracker) == []


def _stat(pid: int) -> str:
    """The process's /proc stat line, "" when it is gone (or a zombie awaiting its reap)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            line = fh.read()
    except OSError:
        return ""
    return "" if line[line.rfind(")") + 2:].startswith("Z") else line[:80]


def _processes_naming(word: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if word in cmd and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def _all_free(state, n: int = 2) -> None:
    """Wait until the farm's n boards are free again: a run's sessions end when its workers
    exit, and the tracker hears of it a moment later (a run started before then gets fewer
    boards)."""
    deadline = time.monotonic() + 30
    while tracker_boards("127.0.0.1", state.tracker_port, KEY)[1] < n:
        assert time.monotonic() < deadline, "the boards did not come back"
        time.sleep(0.2)


def _expected_cells() -> list[tuple[str, str, str]]:
    import opsdk

    defs = [opsdk.get_op(n) for n in OPS]
    return [(d.name, dt, ly) for d, dt, ly in
            _claimed_cells(defs, _target_name("arm"), ["float32"], None)]


def _cells(report) -> list[tuple[str, str, str]]:
    return [(c.op, c.dtype, c.layout) for c in report.cells]


def test_farm_registers_its_boards_on_loopback(farm):
    state, _ = farm
    boards, free = tracker_boards("127.0.0.1", state.tracker_port, KEY)
    assert sorted(boards) == sorted(state.boards) and free == 2
    assert all(b.startswith("127.0.0.1:") for b in boards)


def test_sharded_verify_reports_every_cell_once_on_both_boards(farm):
    state, _ = farm
    _all_free(state)
    report = verify_sharded(OPS, "arm", tracker=state.tracker, key=KEY, boards="all",
                            dtypes=["float32"], max_examples=0, database=None, lints=False,
                            seed=0)
    assert report.ok, report.format_table()
    assert _cells(report) == _expected_cells()  # each once, in a single-board run's order
    assert all(c.examples > 0 for c in report.cells)
    used = report.device["boards"]
    assert set(used) == set(state.boards), used  # both boards got work
    assert sum(used.values()) == len(report.cells)
    assert report.device["lost"] == []
    assert len(report.refusals) > 0  # the refusals of a single-board run are there too


def test_bad_tracker_or_key_is_one_line_exit_2(farm, capsys):
    import argparse

    state, _ = farm
    p = argparse.ArgumentParser()
    add_verify_arguments(p)
    cases = [
        (["gelu", "--target", "arm", "--boards", "2"], "--boards shards a run over a tracker"),
        (["gelu", "--target", "arm", "--tracker", f"127.0.0.1:{_free_port()}", "--key", KEY,
          "--boards", "all"], "cannot connect"),
        (["gelu", "--target", "arm", "--tracker", state.tracker, "--key", "no-such-key",
          "--boards", "all"], "no board is registered under --key no-such-key"),
    ]
    for argv, words in cases:
        assert run_verify_command(p.parse_args([*argv, "--quiet", "--no-db"])) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err and "Traceback" not in err, err
    # every board held by another session: no free board
    held = [request_board("127.0.0.1", state.tracker_port, KEY, wait=30) for _ in range(2)]
    try:
        argv = ["gelu", "--target", "arm", "--tracker", state.tracker, "--key", KEY, "--boards",
                "all", "--quiet", "--no-db"]
        assert run_verify_command(p.parse_args(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert f"all 2 boards of --key {KEY}" in err and "busy" in err and "\n" not in err, err
    finally:
        held.clear()
        gc.collect()  # the sessions end; the boards register as free again
        _all_free(state)


def test_a_users_op_module_is_sharded_like_a_builtin(farm, tmp_path):
    # `opsdk verify --module` over the farm: the op is registered in the command's process
    # (the boards only run its built kernels), its cells spread, each reported once.
    import json
    import subprocess
    import sys

    from opsdk._scaffold import new_op

    state, _ = farm
    pkg = tmp_path / "farmpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    new_op("swish", kind="elementwise", directory=pkg)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "opsdk", "verify", "swish", "--module", "farmpkg.swish",
         "--target", "arm", "--tracker", state.tracker, "--key", KEY, "--boards", "all",
         "--dtypes", "float32", "--examples", "2", "--seed", "0", "--no-db",
         "--report", str(tmp_path / "r.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    cells = [(c["op"], c["dtype"], c["layout"]) for c in rep["cells"]]
    assert cells and {c[0] for c in cells} == {"swish"} and len(set(cells)) == len(cells)
    assert all(c["examples"] > 0 and c["status"] == "pass" for c in rep["cells"]), rep["cells"]
    used = rep["device"]["boards"]
    assert set(used) <= set(state.boards) and sum(used.values()) == len(cells), used
    assert rep["device"]["lost"] == []


def test_sharded_bench_times_every_case_once_on_one_board_each(farm, capsys, tmp_path):
    # `opsdk bench --boards all`: the cases of a device bench spread over the farm through the
    # queue verify uses; one table in the single-board order, each row naming its board.
    import argparse
    import json

    import numpy as np

    from opsdk.bench import expand_cases
    from opsdk.bench._report import add_bench_arguments, run_bench_command

    state, _ = farm
    _all_free(state)
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    argv = ["gelu", "layer_norm", "--target", "arm", "--tracker", state.tracker, "--key", KEY,
            "--boards", "all", "--shapes", "64x32", "128x16", "--dtypes", "float32",
            "--repeats", "2"]
    assert run_bench_command(p.parse_args([*argv, "--json", str(tmp_path / "b.json")])) == 0
    out = json.loads((tmp_path / "b.json").read_text())
    table = capsys.readouterr().out
    cases = expand_cases(["gelu", "layer_norm"], [(64, 32), (128, 16)], ["float32"])
    rows = out["rows"]
    assert [(r["op"], tuple(r["shape"])) for r in rows] == [(c.op, c.shape) for c in cases]
    assert set(out["boards"]) == set(state.boards), out["boards"]  # both boards got work
    assert sum(out["boards"].values()) == len(rows) and out["lost"] == []
    eps = np.finfo(np.float32).eps
    for r in rows:
        assert r["board"] in state.boards and f"  {r['board']}" in table
        assert r["opsdk_ms"] > 0 and r["tvm_ms"] > 0 and r["samples"] == 2 * 3
        assert r["rule"].startswith("neon."), r  # the NEON rule ran on the board
        # outputs of magnitude <= 2 (gelu) or ~3 (a row of 16 normalized): 32 ulps
        assert r["max_err"] <= 32 * eps * 4, r
    # without a tracker: one line, exit 2
    assert run_bench_command(p.parse_args(["gelu", "--target", "arm", "--boards", "2"])) == 2
    err = capsys.readouterr().err.strip()
    assert "--boards shards the op cases over a tracker" in err and "\n" not in err, err


def test_artifacts_checked_over_the_farm_once_each(farm, relu_mod, tmp_path, capsys):
    # `opsdk run A B --boards all`: model checks spread over the boards, each artifact run
    # and compared with its host build on one board.
    import json

    import numpy as np

    from opsdk.cli import main
    from opsdk.deploy import build_artifact

    state, _ = farm
    _all_free(state)
    arts = []
    for i, rows in enumerate((2, 5)):
        art = tmp_path / f"art{i}"
        build_artifact(relu_mod, art, target="arm", inputs=[np.linspace(
            -1, 1, rows * 16, dtype="float32").reshape(rows, 16)], log=None)
        arts.append(str(art))
    argv = ["run", *arts, "--tracker", state.tracker, "--key", KEY, "--boards", "all",
            "--repeats", "2", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0, capsys.readouterr()
    out = json.loads((tmp_path / "r.json").read_text())
    assert [r["artifact"] for r in out["runs"]] == arts  # each once, in the order given
    for r in out["runs"]:
        assert r["ok"] and r["board"] in state.boards, r
        (o,) = r["outputs"]
        assert o["vs_host"]["ok"] and o["vs_host"]["max_abs"] == 0.0, o  # relu: exact
    assert set(out["boards"]) == set(state.boards) and out["lost"] == []
    assert "2 artifacts: 2 pass" in capsys.readouterr().out
    # artifacts of two architectures cannot share a key: one line, exit 2
    x86 = tmp_path / "x86"
    build_artifact(relu_mod, x86, target="x86", inputs=[np.ones((2, 16), "float32")],
                   log=None)
    assert main(["run", arts[0], str(x86), "--tracker", state.tracker, "--key", KEY,
                 "--boards", "all"]) == 2
    err = capsys.readouterr().err.strip()
    assert "different architectures" in err and "\n" not in err, err


def _tiny_model():
    import numpy as np
    from tvm import relax

    from opsdk.model import LoadedModel

    rng = np.random.default_rng(3)
    x = relax.Var("x", relax.TensorType((32, 64), "float32"))
    w = rng.standard_normal((64, 48)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, relax.const(w))))
        bb.emit_func_output(y)
    mod = bb.get()
    m = LoadedModel("tiny", mod, mod, [rng.standard_normal((32, 64)).astype("float32")])
    return m, w


@pytest.fixture(scope="module")
def farm_tuned(farm, tmp_path_factory):
    """One tune over the farm (3 samples of a 32x64x48 matmul + ReLU), every record kept
    that passes the verify gate (``min_speedup=0``: emulated timings are no speed)."""
    from opsdk.tune import TuningDB, tune_model

    state, _ = farm
    _all_free(state)
    db = TuningDB(tmp_path_factory.mktemp("tuning"))
    m, w = _tiny_model()
    rep = tune_model(m, "arm", trials=3, keep=2, draws=2, db=db, log=None, min_speedup=0.0,
                     tracker=state.tracker, key=KEY)
    return m, w, db, rep


def test_tune_on_the_farm_times_and_verifies_every_candidate_on_the_boards(farm, farm_tuned):
    import opsdk
    from opsdk.tune import read_record, recheck

    state, _ = farm
    _, _, db, rep = farm_tuned
    assert rep.target == f"arm (rpc tracker {state.tracker} key {KEY}, 2 boards)", rep.target
    (k,) = rep.kernels
    assert k.kind == "matmul" and k.hand_rule == "neon.matmul"
    assert k.hand_ms and k.hand_ms > 0  # timed on a board under the hand rule
    assert 1 <= len(k.verified) <= 2 and k.candidates == len(k.verified)
    for g in k.verified:  # the board's outputs against the float64 reference made here
        assert g.ok and g.reference == "float64" and g.draws == 2
        assert 0 < g.worst <= 1.0 and g.generic_worst > 0
    assert k.ratio is not None and k.hand_ms_gate > 0 and k.tuned_ms_gate > 0
    assert k.kept, k.why
    (path,) = db.folder(opsdk.target("arm")).glob("*.json")
    rec = read_record(path)
    assert rec["workload"] == k.workload and rec["n_in"] == 2 and rec["status"] == "kept"
    assert rec["device"] == rep.target
    assert recheck(path, "arm", tracker=state.tracker, key=KEY, draws=1).ok


def test_a_farm_tuned_record_schedules_the_arm_model_and_matches_the_host(farm, farm_tuned):
    import numpy as np

    import opsdk
    from opsdk.model import compile_model, report
    from opsdk.runners import runner_for

    state, _ = farm
    m, w, db, _ = farm_tuned
    tgt = opsdk.target("arm")
    records = db.records(tgt)
    cm = compile_model(m.opsdk_mod, tgt, tuning=records, cache=False)
    r = report(cm, tgt, source=m.opsdk_mod, asm=False, profile=False)
    assert [k.rule for k in r.kernels] == [records[0].rule_name]
    _all_free(state)
    with runner_for("arm", tracker=state.tracker, key=KEY) as board:
        (got,) = board.run(cm.ex, m.inputs)
    want = np.maximum(m.inputs[0].astype("float64") @ w.astype("float64"), 0)
    # float32 GEMM: K = 64 products and sums, gamma_64 of |x| @ |w| bounds each element
    bound = 64 * 2.0 ** -24 / (1 - 64 * 2.0 ** -24) * (np.abs(m.inputs[0]) @ np.abs(w))
    assert np.all(np.abs(got - want) <= bound + 1e-30)


def test_the_board_gate_rejects_a_miscomputing_kernel_and_a_corrupted_record(
        farm, farm_tuned, tmp_path):
    import copy
    import tempfile
    from pathlib import Path

    import opsdk
    from opsdk.model import fused_module
    from opsdk.runners import runner_for
    from opsdk.tune import TuningDB, kernel_inputs, read_record, recheck, verify_trace
    from opsdk.tune._remote import board_kernel

    state, _ = farm
    m, _, db, rep = farm_tuned
    tgt = opsdk.target("arm")
    (path,) = db.folder(tgt).glob("*.json")
    good = read_record(path)["trace"]
    fused = fused_module(m.opsdk_mod, tgt)
    (func,) = [f for gv, f in fused.functions.items() if gv.name_hint == rep.kernels[0].kernel]
    n_in = kernel_inputs(fused)[rep.kernels[0].kernel]
    _all_free(state)
    with runner_for("arm", tracker=state.tracker, key=KEY) as board:
        run = board_kernel(board, tgt, n_in, Path(tempfile.mkdtemp(dir=tmp_path)))

        def one_row_wrong(kernel, arrays):  # the tuned kernel, one output row wrong
            out = run(kernel, arrays)
            if kernel is not func:
                out[-1][5] = out[-1][5] * np.float32(1.001) + np.float32(1e-3)
            return out

        g = verify_trace(func, good, tgt, draws=1, device=one_row_wrong)
        assert not g.ok and "output 2 at (5, " in g.why and "float64 reference" in g.why, g.why
        assert verify_trace(func, good, tgt, draws=1, device=run).ok
    # A wrong tile edge: refused at replay, with the device's reproducer flags
    bad = copy.deepcopy(good)
    for d in bad[1]:
        if bad[0][d[0]][0] == "SamplePerfectTile" and d[1][0] > 1:
            d[1] = [d[1][0] - 1, *d[1][1:]]
            break
    else:
        raise AssertionError("no tile split with an outer factor above 1")
    rec = {**read_record(path), "trace": bad, "status": "rejected: planted"}
    bad_path = TuningDB(tmp_path).put(tgt, rec, kept=False)
    g = recheck(bad_path, "arm", tracker=state.tracker, key=KEY, draws=1)
    assert not g.ok and "does not replay" in g.why


def test_a_board_killed_mid_run_has_its_cell_requeued_and_is_named(farm):
    # Last in this module: it takes one of the two boards down for good.
    state, _ = farm
    _all_free(state)
    victim_pid, victim = state.board_pids[0], state.boards[0]
    killed = []

    def progress(label: str, done: int) -> None:
        # The kill waits until the tracker has no free board: both workers hold theirs, so
        # the victim is lost by the worker that knows its address. (Killed at the first
        # tick, under a loaded suite the second worker could still be asking the tracker
        # for a board, and lost it as "(no board yet)".)
        if not killed and tracker_boards("127.0.0.1", state.tracker_port, KEY)[1] == 0:
            os.killpg(victim_pid, signal.SIGKILL)  # the board's server, as a power cut
            killed.append(label)

    report = verify_sharded(OPS, "arm", tracker=state.tracker, key=KEY, boards="all",
                            dtypes=["float32"], max_examples=0, database=None, lints=False,
                            seed=0, progress=progress)
    assert killed
    assert report.ok, report.format_table()
    counts = Counter(_cells(report))
    assert sorted(counts) == sorted(_expected_cells()) and set(counts.values()) == {1}
    lost = report.device["lost"]
    assert len(lost) == 1 and lost[0].startswith(f"board {victim} lost at cell "), lost
    assert lost[0].endswith("requeued"), lost
    survivor = next(b for b in state.boards if b != victim)
    assert report.device["boards"][survivor] >= 1
