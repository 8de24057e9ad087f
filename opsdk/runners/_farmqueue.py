"""Cells of one run spread over the free boards of a TVM RPC tracker: the queue that
``opsdk verify --boards`` and ``opsdk bench --boards`` share.

One worker process per board session (requested from the tracker, so two runs on one farm
share it as the tracker decides) takes cells from one queue. A worker is a whole
interpreter: the host's part of a cell (drawing, compiling, cross-compiling, checking) runs in
parallel across workers, not only the remote calls.

A board that dies mid-cell (its worker's :class:`~opsdk.runners.FarmRunner` finds it gone
from the tracker or refusing connections) or hangs (no result within the per-cell time
limit: the worker is killed) has its cell requeued on another board, and is named in
:attr:`FarmOutcome.lost`. Every cell gets exactly one result, in the order of the cells; a
cell that lost :data:`MAX_ATTEMPTS` boards, or that no board is left for, gets the caller's
``failed`` result.

What a cell does is the caller's: ``handler`` names a function (``"module:function"``)
that the worker imports and calls as ``handler(cfg, payload, runner, tick)`` (``tick()``
reports progress), returning a picklable result; ``setup`` (optional) is called once as
``setup(cfg)`` before the worker asks for its board. The worker is this module run as a
program: ``python -m opsdk.runners._farmqueue FD`` reads a configuration and then cells
(pickles) on stdin and writes its messages to file descriptor ``FD`` (its stdout and stderr
go to a log: hypothesis and TVM may print).
"""

from __future__ import annotations

import contextlib
import importlib
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

__all__ = ["MAX_ATTEMPTS", "FarmCell", "FarmOutcome", "free_boards", "run_on_farm"]

#: Boards a cell may lose before it gets a failed result instead of being requeued again (a
#: cell that takes every board down with it is more likely the cause than the victim).
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class FarmCell:
    """One unit of work: ``label`` names it in notes and progress (``"gelu float32 erf"``),
    ``payload`` (picklable) is what the worker's handler gets."""

    label: str
    payload: Any


@dataclass
class FarmOutcome:
    """What :func:`run_on_farm` gives back: one result per cell in the cells' order, the
    cells each board ran (``{"127.0.0.1:40113": 3}``), a note per lost board, and the wall
    time in seconds."""

    results: list[Any]
    boards: dict[str, int]
    lost: list[str]
    seconds: float
    tracker: str = ""
    key: str = ""

    @property
    def device(self) -> str:
        """The run's device line: ``rpc tracker 127.0.0.1:9190 key opsdk-farm, 2 boards``."""
        n = len(self.boards)
        return f"rpc tracker {self.tracker} key {self.key}, {n} board{'s' if n != 1 else ''}"

    def facts(self) -> dict[str, Any]:
        """``device``, ``boards``, ``lost`` and ``seconds``: what a report or JSON carries."""
        return {"device": self.device, "boards": self.boards, "lost": self.lost,
                "seconds": self.seconds}


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


@dataclass
class _Plan:
    cells: list[FarmCell]
    failed: Callable[[int, str, bool], Any]
    results: dict[int, Any] = field(default_factory=dict)
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


def free_boards(tracker: str, key: str) -> int:
    """The free boards of ``key`` at ``tracker``; ``ValueError`` (one line naming the flag
    and the fix) when the tracker is unreachable, the key has no board or none is free."""
    from ._farm import FarmError, tracker_boards

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
    return free


def run_on_farm(
    cells: Sequence[FarmCell],
    *,
    handler: str,
    failed: Callable[[int, str, bool], Any],
    target: str,
    tracker: str,
    key: str,
    boards: int | str = "all",
    cfg: dict[str, Any] | None = None,
    setup: str | None = None,
    progress: Callable[[str, int], None] | None = None,
    cell_timeout: float = 900.0,
    call_timeout: float = 120.0,
) -> FarmOutcome:
    """Run ``cells`` on up to ``boards`` (a number or ``"all"``) free boards of ``key`` at
    ``tracker``, one worker process per board.

    ``failed(index, why, gave_up)`` makes the result of a cell that has none: ``gave_up``
    True when its boards were lost (``why`` says how), False when the handler raised on the
    host (``why`` is the exception's first line). ``progress(label, ticks)`` is called on
    each ``tick()`` of a handler. ``cfg`` (picklable) reaches ``setup`` and every handler
    call, with ``target``, ``tracker``, ``key`` and ``call_timeout`` added. Raises
    ``ValueError`` as :func:`free_boards` does, or when no worker could get a board.

    Examples
    --------
    >>> from opsdk.runners._farmqueue import FarmCell, run_on_farm
    >>> out = run_on_farm([FarmCell("gelu float32", ("gelu", "float32"))],
    ...                   handler="opsdk.verify._shard:verify_handler",
    ...                   failed=lambda i, why, gave_up: why, target="arm",
    ...                   tracker="127.0.0.1:9190", key="opsdk-farm")  # doctest: +SKIP
    >>> out.boards  # doctest: +SKIP
    {'127.0.0.1:40113': 1}
    """
    free = free_boards(tracker, key)
    want = free if boards == "all" else min(int(boards), free)
    t0 = time.perf_counter()
    plan = _Plan(cells=list(cells), failed=failed)
    used: Counter[str] = Counter()
    lost_notes: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="opsdk-farm-"))
    msgs: queue.Queue[tuple[int, Any]] = queue.Queue()
    workers: list[_Worker] = []
    wcfg = {**(cfg or {}), "path": list(sys.path), "handler": handler, "setup": setup,
            "tracker": tracker, "key": key, "target": target, "call_timeout": call_timeout}
    ticks = 0
    failures: list[str] = []
    pending = deque(range(len(plan.cells)))
    start_by = time.monotonic() + 60.0
    try:
        for wid in range(max(1, min(want, len(plan.cells)))):
            workers.append(_start_worker(wid, wcfg, tmp, msgs))
        while len(plan.results) < len(plan.cells):
            live = [w for w in workers if not w.dead]
            if not live and not plan.results and not any(w.board for w in workers):
                raise ValueError(f"no worker could start on a board of --key {key} at "
                                 f"{tracker}: {failures[0] if failures else 'all exited'}")
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
                    w.task, w.deadline = idx, time.monotonic() + cell_timeout
                    try:
                        _send(w.proc.stdin, (idx, plan.cells[idx].payload))  # type: ignore[arg-type]
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
                    ticks += 1
                    if progress and w.task is not None:
                        progress(plan.cells[w.task].label, ticks)
                elif kind == "ready":
                    w.ready, w.board = True, msg[1]
                elif kind == "board":  # a new session, so a hang can name its board
                    w.board = msg[1]
                elif kind == "fail":  # no board for it (preflight), or its setup failed
                    w.dead = True
                    _stop(w)
                    failures.append(msg[1])
                    lost_notes.append(f"a worker got no board: {msg[1]}")
                    if w.task is not None:  # not expected: it fails before it is ready
                        pending.appendleft(w.task)
                        w.task = None
                elif kind in ("done", "error") and not w.dead and w.task == msg[1]:
                    idx = msg[1]
                    w.board = msg[2]
                    if idx not in plan.results:
                        plan.results[idx] = (msg[3] if kind == "done" else
                                             plan.failed(idx, msg[3], False))
                        used[w.board] += 1
                    w.task = None
                elif kind == "lost" and not w.dead:
                    _lose(plan, w, msg[2] or w.board, msg[3], pending, lost_notes)
                elif kind == "eof" and not w.dead:
                    w.proc.poll()
                    why = (f"its worker exited (status {w.proc.returncode}): "
                           f"{_last_line(w.log)}")
                    failures.append(why)
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
    return FarmOutcome(results=[plan.results[i] for i in range(len(plan.cells))],
                       boards=dict(sorted(used.items())), lost=lost_notes,
                       seconds=time.perf_counter() - t0, tracker=tracker, key=key)


def _give_up(plan: _Plan, idx: int, why: str) -> None:
    lost = plan.lost_at.get(idx, [])
    boards = f" (lost boards: {', '.join(lost)})" if lost else ""
    plan.results[idx] = plan.failed(idx, f"{why}{boards}", True)


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
    label = plan.cells[idx].label
    plan.attempts[idx] += 1
    plan.lost_at.setdefault(idx, []).append(name)
    if plan.attempts[idx] >= MAX_ATTEMPTS:
        notes.append(f"board {name} lost at cell {label} ({why}); not requeued: it lost "
                     f"{plan.attempts[idx]} boards")
        _give_up(plan, idx, f"it lost {plan.attempts[idx]} boards; the cell itself may take "
                 "a board down")
    else:
        notes.append(f"board {name} lost at cell {label} ({why}), requeued")
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
            [sys.executable, "-m", "opsdk.runners._farmqueue", str(wfd)],
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

    threading.Thread(target=read, name=f"opsdk-farm-{wid}", daemon=True).start()
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


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# The worker


def _worker(fd: int) -> int:
    import faulthandler
    import signal

    from . import runner_for
    from ._base import RunnerUnavailable
    from ._farm import FarmRunner

    # `kill -USR1 PID` writes every thread's stack to the worker's log (a hung worker).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    out = os.fdopen(fd, "wb")
    inp = sys.stdin.buffer
    cfg = pickle.load(inp)
    for p in reversed(cfg["path"]):  # the coordinator's path: its --module's folder too
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        handler = _resolve(cfg["handler"])
        if cfg["setup"]:
            _resolve(cfg["setup"])(cfg)
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
                idx, payload = pickle.load(inp)
            except EOFError:
                break
            try:
                result = handler(cfg, payload, runner, lambda: _send(out, ("tick",)))
            except RunnerUnavailable:
                raise
            except Exception as e:  # the host's fault, not the board's: the cell's error
                if runner.lost:
                    _send(out, ("lost", idx, runner.board, runner.lost))
                    return 0
                _send(out, ("error", idx, runner.board,
                            f"{type(e).__name__}: {e}".split("\n")[0][:2000]))
                continue
            if runner.lost:
                _send(out, ("lost", idx, runner.board, runner.lost))
                return 0
            _send(out, ("done", idx, runner.board, result))
    except RunnerUnavailable as e:
        _send(out, ("lost", None, runner.board, str(e)))
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(int(sys.argv[1])))
