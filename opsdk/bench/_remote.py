"""``opsdk bench OP --target arm --rpc HOST:PORT``: op kernels timed on a board.

torch and onnxruntime cannot be called through TVM RPC, so on a device the comparison is
opsdk's kernel against TVM's own lowering of the same op (both compiled for the device's
target), plus the float64 reference check of opsdk's output there. Each candidate is timed
on the device by TVM's time evaluator (one VM call per sample, dispatch included, the same
for both); rounds alternate the candidates and the speed-up is the median of per-round
ratios.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tvm

from ..registry import get_op
from ..schedules import generic_only, last_choices
from ..targets import target as resolve_target
from ._cases import SPECS, Case
from ._run import _attrs, _inputs, _opsdk_module, _tvm_module, expand_cases

__all__ = ["bench_case", "bench_handler", "format_remote_table", "run_remote_bench",
           "run_remote_bench_sharded", "setup_worker"]


def _tvm_executable(case: Any, tgt: Any) -> Any:
    if case.op in SPECS:
        return tvm.compile(_tvm_module(case), target=tgt)

    with generic_only():
        return tvm.compile(_opsdk_module(case), target=tgt)


def run_remote_bench(
    runner: Any,
    ops: Sequence[str] | None = None,
    *,
    target: str = "arm",
    shapes: Sequence[tuple[int, ...]] | None = None,
    dtypes: Sequence[str] = ("float32",),
    repeats: int = 10,
    rounds: int = 3,
    check: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Time opsdk's kernel and TVM's lowering of each case on ``runner``'s device.

    Returns one dict per case: ``op``, ``shape``, ``dtype``, ``rule``, ``opsdk_ms`` /
    ``tvm_ms`` (medians of every sample, timed on the device), ``speedup_tvm`` (median of
    per-round ratios), ``opsdk_gbps`` (bytes moved / time) and ``max_err`` (opsdk's output
    on the device vs the float64 reference).

    Examples
    --------
    >>> from opsdk.bench._remote import run_remote_bench
    >>> from opsdk.runners import LocalRunner
    >>> with LocalRunner() as host:
    ...     rows = run_remote_bench(host, ["gelu"], target="x86", shapes=[(64, 32)],
    ...                             repeats=2, rounds=1)
    >>> rows[0]["speedup_tvm"] > 0
    True
    """
    tgt = resolve_target(target)
    rows = []
    for case in expand_cases(ops, shapes, dtypes):
        if progress:
            progress(case.label)
        rows.append(bench_case(case, runner, tgt, repeats=repeats, rounds=rounds, check=check))
    return rows


def bench_case(case: Case, runner: Any, tgt: Any, *, repeats: int = 10, rounds: int = 3,
               check: bool = True) -> dict[str, Any]:
    """One case of :func:`run_remote_bench` on ``runner``'s device (its inputs drawn from
    a generator seeded per case, so a sharded run times the same arrays)."""
    ins = _inputs(case, np.random.default_rng(0))
    arrays = list(ins.values())
    d = get_op(case.op)
    before = len(last_choices())
    ex_opsdk = tvm.compile(_opsdk_module(case), target=tgt)
    chosen = [c.rule for c in last_choices()[before:] if c.op == case.op]
    ex_tvm = _tvm_executable(case, tgt)
    samples: dict[str, list[float]] = {"opsdk": [], "tvm": []}
    ratios = []
    got = None
    for _ in range(rounds):
        med = {}
        for name, ex in (("opsdk", ex_opsdk), ("tvm", ex_tvm)):
            out, timing = runner.run_timed(ex, arrays, repeats=repeats)
            samples[name] += timing["samples_ms"]
            med[name] = timing["median_ms"]
            if name == "opsdk":
                got = out[0]
        ratios.append(med["tvm"] / med["opsdk"])
    out_bytes = got.nbytes if got is not None else 0
    nbytes = sum(a.nbytes for a in arrays) + out_bytes
    t_opsdk = float(np.median(samples["opsdk"]))
    row: dict[str, Any] = {
        "op": case.op, "layout": case.layout, "shape": list(case.shape),
        "dtype": case.dtype, "rule": chosen[-1] if chosen else "generic",
        "opsdk_ms": t_opsdk, "tvm_ms": float(np.median(samples["tvm"])),
        "speedup_tvm": float(np.median(ratios)),
        "opsdk_gbps": nbytes / (t_opsdk * 1e-3) / 1e9, "bytes": int(nbytes),
        "samples": len(samples["opsdk"]),
    }
    if check and got is not None:
        ref = d.run_reference(ins, _attrs(case))
        row["max_err"] = float(np.max(np.abs(got.astype(np.float64) - ref)))
    return row


def run_remote_bench_sharded(
    ops: Sequence[str] | None = None,
    *,
    target: str = "arm",
    tracker: str,
    key: str,
    boards: int | str = "all",
    shapes: Sequence[tuple[int, ...]] | None = None,
    dtypes: Sequence[str] = ("float32",),
    repeats: int = 10,
    rounds: int = 3,
    check: bool = True,
    modules: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    cell_timeout: float = 900.0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`run_remote_bench` with its cases spread over up to ``boards`` (a number or
    ``"all"``) free boards of ``key`` at ``tracker`` (the farm queue of ``verify
    --boards``): one worker per board, a case whose board dies or hangs requeued on another.

    Every board of a key should be the same kind of device: each case is timed on one board
    (both candidates, interleaved, on that board), so its ratio is a same-board ratio. Returns
    the rows in :func:`run_remote_bench`'s order (each with the ``board`` that timed it; a
    case no board could finish has an ``error`` and no timings) and the device facts:
    ``device``, ``boards`` (cases per board) and ``lost`` (a note per lost board).
    ``modules`` are op modules the workers load (``--module``).

    Examples
    --------
    >>> from opsdk.bench import run_remote_bench_sharded
    >>> rows, device = run_remote_bench_sharded(
    ...     ["gelu"], tracker="127.0.0.1:9190", key="opsdk-farm")  # doctest: +SKIP
    >>> sorted(device["boards"].values())  # doctest: +SKIP
    [2, 2]
    """
    from ..runners import FarmCell, run_on_farm

    cases = expand_cases(ops, shapes, dtypes)

    def failed(idx: int, why: str, gave_up: bool) -> dict[str, Any]:
        c = cases[idx]
        return {"op": c.op, "layout": c.layout, "shape": list(c.shape), "dtype": c.dtype,
                "error": f"not timed: {why}" if gave_up else why}

    out = run_on_farm(
        [FarmCell(c.label, c) for c in cases], handler="opsdk.bench._remote:bench_handler",
        setup="opsdk.bench._remote:setup_worker", failed=failed, target=target,
        tracker=tracker, key=key, boards=boards,
        cfg={"modules": list(modules), "repeats": repeats, "rounds": rounds, "check": check},
        progress=(lambda label, _n: progress(label)) if progress else None,
        cell_timeout=cell_timeout)
    return out.results, out.facts()


def setup_worker(cfg: dict[str, Any]) -> None:
    """In a board's worker: load the run's op modules (``--module``)."""
    if cfg["modules"]:
        from .._plugins import load_plugins

        load_plugins(cfg["modules"], entry_points=False)


def bench_handler(cfg: dict[str, Any], case: Case, runner: Any,
                  tick: Callable[[], None]) -> dict[str, Any]:
    """One case on the worker's board (:func:`bench_case`), the board named in its row."""
    tick()
    row = bench_case(case, runner, resolve_target(cfg["target"]), repeats=cfg["repeats"],
                     rounds=cfg["rounds"], check=cfg["check"])
    return {**row, "board": runner.board}


def format_remote_table(rows: Sequence[dict[str, Any]], device: str,
                        lost: Sequence[str] = ()) -> str:
    """The device bench as a text table (with the board of each case for a sharded run,
    and a line per lost board)."""
    boards = any("board" in r for r in rows)
    lines = [f"device: {device}",
             f"{'case':<34} {'rule':<16} {'opsdk ms':>9} {'tvm ms':>9} {'x tvm':>7} "
             f"{'GB/s':>6} {'max err':>9}" + ("  board" if boards else "")]
    for r in rows:
        op = f"{r['op']}:{r['layout']}" if r["layout"] else r["op"]
        case = f"{op} {'x'.join(map(str, r['shape']))} {r['dtype']}"
        if "error" in r:
            lines.append(f"{case:<34} error: {r['error']}")
            continue
        err = r.get("max_err")
        lines.append(f"{case:<34} {r['rule']:<16} {r['opsdk_ms']:>9.3f} {r['tvm_ms']:>9.3f} "
                     f"{r['speedup_tvm']:>7.1f} {r['opsdk_gbps']:>6.2f} "
                     f"{'-' if err is None else format(err, '.2e'):>9}"
                     + (f"  {r.get('board', '')}" if boards else ""))
    lines += [f"lost: {note}" for note in lost]
    lines.append("timed on the device (TVM time evaluator, one VM call per sample); x tvm: "
                 "median of per-round ratios; torch and onnxruntime run only on the host")
    return "\n".join(lines)
