"""Sharded verify: the cells of one run spread over the free boards of a TVM RPC tracker.

One worker process per board session (requested from the tracker, so two runs on one farm
share it as the tracker decides) takes cells (op x dtype x layout, each a hypothesis
search over its shapes) from one queue. A worker is a whole interpreter: drawing, compiling,
cross-compiling and checking a cell run in parallel across workers, not only the remote
calls (the host's part is most of a cell's time, see docs/design.md section 23).

A board that dies mid-cell (its worker's :class:`~opsdk.runners._farm.FarmRunner` finds it
gone from the tracker or refusing connections) or hangs (no result within the per-cell time
limit: the worker is killed) has its cell requeued on another board, and is named in the
report's ``device["lost"]``. Every claimed cell is reported exactly once, in the order a
single-board run reports it; a cell that lost :data:`MAX_ATTEMPTS` boards, or that no board
is left for, is reported as an error cell.

The worker is this module run as a program: ``python -m opsdk.verify._shard FD`` reads a
configuration and then cells (pickles) on stdin and writes its messages to file descriptor
``FD`` (its stdout and stderr go to a log: hypothesis and TVM may print).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .._cliargs import split_host_port
from .._opdef import OpDef
from .._plugins import load_plugins
from ..registry import get_op, register_kernels, registered_ops, unregister
from ..runners import FarmError, FarmRunner, RunnerUnavailable, runner_for, tracker_boards
from ._engine import (
    _as_def,
    _claimed_cells,
    _is_kernel_family,
    _resolve_profile,
    _target_name,
    check_refusals,
    lint_cell,
    verify_cell,
)
from ._profiles import Profile
from ._report import CellResult, LintResult, VerifyReport

__all__ = ["MAX_ATTEMPTS", "board_count", "verify_sharded"]

#: Boards a cell may lose before it is reported as an error instead of requeued again (a
#: cell that takes every board down with it is more likely the cause than the victim).
MAX_ATTEMPTS = 3


def board_count(text: str) -> int | str:
    """``--boards``: a positive number or ``all`` (every free board of the key).

    Examples
    --------
    >>> board_count("4"), board_count("all")
    (4, 'all')
    """
    import argparse

    if text.strip().lower() == "all":
        return "all"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of boards >= 1 or 'all', got "
                                         f"{text!r}")
    return n


@dataclass
class _Worker:
    wid: int
    proc: subprocess.Popen[bytes]
    log: Path
    board: str | None = None
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0
    dead: bool = False
    cells: int = 0


@dataclass
class _Plan:
    target: str
    cells: list[tuple[OpDef, str, str]]
    results: dict[int, tuple[CellResult, list[LintResult]]] = field(default_factory=dict)
    attempts: Counter[int] = field(default_factory=Counter)
    lost_at: dict[int, list[str]] = field(default_factory=dict)


_SEND_LOCK = threading.Lock()  # a worker sends from the runner's call thread too


def _send(fh: BinaryIO, obj: Any) -> None:
    with _SEND_LOCK:
        pickle.dump(obj, fh, protocol=pickle.HIGHEST_PROTOCOL)
        fh.flush()


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # opsdk from wherever this one came
    path = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _modules_of(defs: Sequence[OpDef]) -> list[str]:
    return sorted({d.module for d in defs if not d.module.startswith("opsdk.")})


def verify_sharded(
    ops: Sequence[str | OpDef] | None,
    target: str,
    *,
    tracker: str,
    key: str,
    boards: int | str = "all",
    dtypes: Sequence[str] | None = None,
    layouts: Sequence[str] | None = None,
    profile: str | Profile | None = None,
    seed: int | None = None,
    max_examples: int | None = None,
    database: Any = "default",
    lints: bool = True,
    refusals: bool = True,
    progress: Callable[[str, int], None] | None = None,
    cell_timeout: float = 900.0,
    call_timeout: float = 120.0,
) -> VerifyReport:
    """:func:`~opsdk.verify.verify` with its cells spread over up to ``boards`` (a number or
    ``"all"``) free boards of ``key`` at ``tracker``; one report, as a single board's.

    Each board gets a worker process; a cell whose board dies, or that gives no result
    within ``cell_timeout`` seconds, is requeued on another board. ``device["boards"]``
    counts the cells each board ran; ``device["lost"]`` says which board was lost at which
    cell (``"board 127.0.0.1:40113 lost at cell gelu float32 erf (refused the connection),
    requeued"``). Raises ``ValueError`` (one line naming the flag and the fix) when the
    tracker is unreachable, the key has no board or none is free.

    Examples
    --------
    >>> from opsdk.verify import verify_sharded
    >>> r = verify_sharded(["gelu"], "arm", tracker="127.0.0.1:9190", key="opsdk-farm",
    ...                    max_examples=3)  # doctest: +SKIP
    >>> r.device["boards"]  # doctest: +SKIP
    {'127.0.0.1:40113': 1, '127.0.0.1:41705': 2}
    """
    prof = _resolve_profile(profile)
    target = _target_name(target)
    temporary: list[OpDef] = []  # ops registered for this run only
    defs = ([_as_def(o, temporary) for o in ops] if ops else
            [d for d in registered_ops() if not d.module.startswith("opsdk.kernels")])
    try:
        return _sharded(defs, list(_claimed_cells(defs, target, dtypes, layouts)), target,
                        tracker=tracker, key=key, boards=boards, profile=prof, seed=seed,
                        max_examples=max_examples, database=database, lints=lints,
                        refusals=refusals, progress=progress, cell_timeout=cell_timeout,
                        call_timeout=call_timeout)
    finally:
        for d in temporary:
            unregister(d)


def _sharded(
    defs: Sequence[OpDef],
    cells: Sequence[tuple[OpDef, str, str]],
    target: str,
    *,
    tracker: str,
    key: str,
    boards: int | str,
    profile: Profile,
    seed: int | None,
    max_examples: int | None,
    database: Any,
    lints: bool,
    refusals: bool,
    progress: Callable[[str, int], None] | None,
    cell_timeout: float,
    call_timeout: float,
) -> VerifyReport:
    if database is not None and not isinstance(database, (str, os.PathLike)):
        raise ValueError("a sharded run takes database= as 'default', a path or None (the "
                         "workers open it themselves)")
    host, port = split_host_port(tracker)
    try:
        registered, free = tracker_boards(host, port, key)
    except FarmError as e:
        raise ValueError(str(e)) from None
    if not registered:
        raise ValueError(f"no board is registered under --key {key} at tracker {tracker}; "
                         "check --key (`opsdk setup farm --status --tracker "
                         f"{tracker}` lists the keys) or start boards (docs/farm.md)")
    if free < 1:
        raise ValueError(f"all {len(registered)} boards of --key {key} at {tracker} are busy "
                         "(other sessions hold them); wait for one to be free (`opsdk setup "
                         f"farm --status --tracker {tracker}` shows them) and run again")
    want = free if boards == "all" else min(int(boards), free)
    t0 = time.perf_counter()
    plan = _Plan(target=target, cells=list(cells))
    report = VerifyReport(target=target, profile=profile.name, seed=seed)
    lost_notes: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="opsdk-shard-"))
    msgs: queue.Queue[tuple[int, Any]] = queue.Queue()
    workers: list[_Worker] = []
    cfg = {
        "path": list(sys.path), "modules": _modules_of(defs),
        "tracker": tracker, "key": key, "target": target, "profile": profile, "seed": seed,
        "max_examples": max_examples, "database": database, "lints": lints,
        "call_timeout": call_timeout,
        "kernels": any(_is_kernel_family(d) for d in defs),
    }
    done_examples = 0
    failed: list[str] = []
    pending = deque(range(len(plan.cells)))
    start_by = time.monotonic() + 60.0
    try:
        for wid in range(max(1, min(want, len(plan.cells)))):
            workers.append(_start_worker(wid, cfg, tmp, msgs))
        while len(plan.results) < len(plan.cells):
            live = [w for w in workers if not w.dead]
            if not live and not plan.results and not any(w.board for w in workers):
                raise ValueError(f"no worker could start on a board of --key {key} at "
                                 f"{tracker}: {failed[0] if failed else 'all exited'}")
            if not live:
                for idx in list(pending):
                    _give_up(plan, idx, "no board left to run it on (every worker's board was "
                             "lost or none could be had from the tracker)")
                pending.clear()
                break
            # Cells go out once every worker has its board (or failed, or 60 s passed): the
            # first ready worker would otherwise take cells a slower-starting one could run.
            starting = any(not w.ready for w in live) and time.monotonic() < start_by
            for w in live:
                if w.ready and w.task is None and pending and not starting:
                    idx = pending.popleft()
                    d, dtype, layout = plan.cells[idx]
                    w.task, w.deadline = idx, time.monotonic() + cell_timeout
                    try:
                        _send(w.proc.stdin, (idx, d.name, dtype, layout))  # type: ignore[arg-type]
                    except OSError:
                        w.task = None
                        pending.appendleft(idx)
            now = time.monotonic()
            busy = [w.deadline for w in live if w.task is not None]
            wait = max(0.05, min(busy) - now) if busy else 1.0
            try:
                wid, msg = msgs.get(timeout=min(wait, 5.0))
            except queue.Empty:
                wid, msg = -1, None
            if msg is not None:
                w = workers[wid]
                kind = msg[0]
                if kind == "tick":
                    done_examples += 1
                    if progress and w.task is not None:
                        d, dtype, layout = plan.cells[w.task]
                        progress(f"{d.name} {dtype} {layout}", done_examples)
                elif kind == "ready":
                    w.ready, w.board = True, msg[1]
                elif kind == "board":  # a new session, so a hang can name its board
                    w.board = msg[1]
                elif kind == "fail":  # no board for it (preflight), or it could not load ops
                    w.dead = True
                    _stop(w)
                    failed.append(msg[1])
                    lost_notes.append(f"a worker got no board: {msg[1]}")
                    if w.task is not None:  # not expected: it fails before it is ready
                        pending.appendleft(w.task)
                        w.task = None
                elif kind == "done" and not w.dead and w.task == msg[1]:
                    idx = msg[1]
                    w.board = msg[2]
                    if idx not in plan.results:
                        plan.results[idx] = (msg[3], msg[4])
                        w.cells += 1
                        report.device.setdefault("boards", {})
                        report.device["boards"][w.board] = report.device["boards"].get(
                            w.board, 0) + 1
                    w.task = None
                elif kind == "lost" and not w.dead:
                    _lose(plan, w, msg[2] or w.board, msg[3], pending, lost_notes)
                elif kind == "eof" and not w.dead:
                    w.proc.poll()
                    why = (f"its worker exited (status {w.proc.returncode}): "
                           f"{_last_line(w.log)}")
                    failed.append(why)
                    _lose(plan, w, w.board, why, pending, lost_notes)
            for w in workers:
                if not w.dead and w.task is not None and time.monotonic() > w.deadline:
                    _lose(plan, w, w.board, f"no result within the {cell_timeout:.0f} s "
                          "per-cell limit (hung)", pending, lost_notes)
    finally:
        for w in workers:
            _stop(w)
        for w in workers:
            _finish(w)
        shutil.rmtree(tmp, ignore_errors=True)
    for idx in range(len(plan.cells)):
        cell, cell_lints = plan.results[idx]
        report.cells.append(cell)
        report.lints += cell_lints
    if refusals:
        for d in defs:
            report.refusals += check_refusals(d)
    used = report.device.pop("boards", {})
    report.device = {
        "device": f"rpc tracker {tracker} key {key}, {len(used)} board"
                  + ("s" if len(used) != 1 else ""),
        "arch": runner_for(target, tracker=tracker, key=key).arch,
        "runner": "rpc-farm",
        "boards": dict(sorted(used.items())),
        "lost": lost_notes,
    }
    report.seconds = time.perf_counter() - t0
    return report


def _give_up(plan: _Plan, idx: int, why: str) -> None:
    d, dtype, layout = plan.cells[idx]
    lost = plan.lost_at.get(idx, [])
    boards = f" (lost boards: {', '.join(lost)})" if lost else ""
    cell = CellResult(op=d.name, target=plan.target, dtype=dtype, layout=layout,
                      error=f"not verified: {why}{boards}")
    plan.results[idx] = (cell, [])


def _lose(plan: _Plan, w: _Worker, board: str | None, why: str, pending: deque[int],
          notes: list[str]) -> None:
    """Worker ``w``'s board is lost: stop the worker, requeue its cell (or give it up)."""
    w.dead = True
    _stop(w)
    idx, w.task = w.task, None
    name = board or "(no board yet)"
    if idx is None:
        notes.append(f"board {name} lost between cells ({why})")
        return
    d, dtype, layout = plan.cells[idx]
    plan.attempts[idx] += 1
    plan.lost_at.setdefault(idx, []).append(name)
    if plan.attempts[idx] >= MAX_ATTEMPTS:
        notes.append(f"board {name} lost at cell {d.name} {dtype} {layout} ({why}); not "
                     f"requeued: it lost {plan.attempts[idx]} boards")
        _give_up(plan, idx, f"it lost {plan.attempts[idx]} boards; the cell itself may take "
                 "a board down")
    else:
        notes.append(f"board {name} lost at cell {d.name} {dtype} {layout} ({why}), requeued")
        pending.appendleft(idx)


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _start_worker(wid: int, cfg: dict[str, Any], tmp: Path,
                  msgs: queue.Queue[tuple[int, Any]]) -> _Worker:
    r, wfd = os.pipe()
    log = tmp / f"worker{wid}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "opsdk.verify._shard", str(wfd)],
            stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT, pass_fds=(wfd,),
            env=_worker_env(), start_new_session=True,  # its own group: killed as a whole
        )
    os.close(wfd)
    w = _Worker(wid=wid, proc=proc, log=log)
    _send(proc.stdin, cfg)  # type: ignore[arg-type]

    def read() -> None:
        with os.fdopen(r, "rb") as fh:
            while True:
                try:
                    msgs.put((wid, pickle.load(fh)))
                except (EOFError, OSError, pickle.UnpicklingError):
                    break
        msgs.put((wid, ("eof",)))

    threading.Thread(target=read, name=f"opsdk-shard-{wid}", daemon=True).start()
    return w


def _stop(w: _Worker) -> None:
    """Kill the worker's process group (it may be stuck in a remote call)."""
    import signal

    if w.proc.poll() is None:
        with contextlib.suppress(OSError):
            w.proc.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGKILL if w.dead else signal.SIGTERM)


def _finish(w: _Worker) -> None:
    import signal

    try:
        w.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# The worker


def _worker(fd: int) -> int:
    import faulthandler
    import signal

    # `kill -USR1 PID` writes every thread's stack to the worker's log (a hung worker).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    out = os.fdopen(fd, "wb")
    inp = sys.stdin.buffer
    cfg = pickle.load(inp)
    for p in reversed(cfg["path"]):  # the coordinator's path: its --module's folder too
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        if cfg["modules"]:
            load_plugins(cfg["modules"], entry_points=False)
        if cfg["kernels"]:
            register_kernels()
        host, port = split_host_port(cfg["tracker"])
        arch = runner_for(cfg["target"], tracker=cfg["tracker"], key=cfg["key"]).arch
        runner = FarmRunner.from_tracker(host, port, cfg["key"], arch=arch,
                                         timeout=cfg["call_timeout"])
        runner.preflight()  # a free board within 20 s, or say so
        runner.on_board = lambda board: _send(out, ("board", board))
    except Exception as e:
        _send(out, ("fail", f"{type(e).__name__}: {e}".split("\n")[0]))
        return 1
    _send(out, ("ready", runner.board))
    try:
        while True:
            try:
                task = pickle.load(inp)
            except EOFError:
                break
            idx, name, dtype, layout = task
            try:
                d = get_op(name)
                cell = verify_cell(d, cfg["target"], dtype, layout, runner=runner,
                                   profile=cfg["profile"], seed=cfg["seed"],
                                   max_examples=cfg["max_examples"], database=cfg["database"],
                                   on_example=lambda: _send(out, ("tick",)))
                if runner.lost:
                    _send(out, ("lost", idx, runner.board, runner.lost))
                    return 0
                cell_lints = (lint_cell(d, cfg["target"], dtype, layout) if cfg["lints"]
                              else [])
            except Exception as e:  # the host's fault, not the board's: the cell's error
                cell = CellResult(op=name, target=cfg["target"], dtype=dtype, layout=layout,
                                  error=f"{type(e).__name__}: {e}".split("\n")[0][:2000])
                cell_lints = []
            _send(out, ("done", idx, runner.board, cell, cell_lints))
    except RunnerUnavailable as e:  # raised outside a cell's examples (not expected)
        _send(out, ("lost", None, runner.board, str(e)))
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(int(sys.argv[1])))
