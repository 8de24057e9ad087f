"""Sharded verify: the cells of one run (op x dtype x layout, each a hypothesis search over
its shapes) spread over the free boards of a TVM RPC tracker by the farm queue
(:mod:`opsdk.runners._farmqueue`); one report, as a single board's.

:func:`verify_handler` is what a board's worker runs per cell (verify it there, lint it on
the host); :func:`setup_worker` loads the run's op modules in the worker first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .._opdef import OpDef
from .._plugins import load_plugins
from ..registry import get_op, register_kernels, registered_ops, unregister
from ..runners import FarmCell, run_on_farm, runner_for
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
from ._report import CellResult, VerifyReport

__all__ = ["setup_worker", "verify_handler", "verify_sharded"]


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
    cells = list(cells)

    def failed(idx: int, why: str, gave_up: bool) -> tuple[CellResult, list[Any]]:
        d, dtype, layout = cells[idx]
        return (CellResult(op=d.name, target=target, dtype=dtype, layout=layout,
                           error=f"not verified: {why}" if gave_up else why), [])

    out = run_on_farm(
        [FarmCell(f"{d.name} {dtype} {layout}", (d.name, dtype, layout))
         for d, dtype, layout in cells],
        handler="opsdk.verify._shard:verify_handler", setup="opsdk.verify._shard:setup_worker",
        failed=failed, target=target, tracker=tracker, key=key, boards=boards,
        cfg={"modules": _modules_of(defs), "profile": profile, "seed": seed,
             "max_examples": max_examples, "database": database, "lints": lints,
             "kernels": any(_is_kernel_family(d) for d in defs)},
        progress=progress, cell_timeout=cell_timeout, call_timeout=call_timeout)
    report = VerifyReport(target=target, profile=profile.name, seed=seed)
    for cell, cell_lints in out.results:
        report.cells.append(cell)
        report.lints += cell_lints
    if refusals:
        for d in defs:
            report.refusals += check_refusals(d)
    report.device = {
        "device": out.device,
        "arch": runner_for(target, tracker=tracker, key=key).arch,
        "runner": "rpc-farm",
        "boards": out.boards,
        "lost": out.lost,
    }
    report.seconds = out.seconds
    return report


def setup_worker(cfg: dict[str, Any]) -> None:
    """In a board's worker, before it asks for its board: load the run's op modules (and
    the kernel families when the run verifies them)."""
    if cfg["modules"]:
        load_plugins(cfg["modules"], entry_points=False)
    if cfg["kernels"]:
        register_kernels()


def verify_handler(cfg: dict[str, Any], payload: tuple[str, str, str], runner: Any,
                   tick: Callable[[], None]) -> tuple[CellResult, list[Any]]:
    """One cell on the worker's board: its :func:`~opsdk.verify.verify_cell` and, unless the
    run skips them, its lints."""
    name, dtype, layout = payload
    d = get_op(name)
    cell = verify_cell(d, cfg["target"], dtype, layout, runner=runner, profile=cfg["profile"],
                       seed=cfg["seed"], max_examples=cfg["max_examples"],
                       database=cfg["database"], on_example=tick)
    if runner.lost:
        return cell, []  # the queue requeues it
    return cell, (lint_cell(d, cfg["target"], dtype, layout) if cfg["lints"] else [])
