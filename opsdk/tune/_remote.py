"""``opsdk tune`` for a device that is not this machine: a board over TVM RPC, every free
board of an RPC tracker's key, or (aarch64 on another host) the emulator.

The host samples MetaSchedule's space (cheap); everything measured or checked runs on the
device, in *cells* that the farm queue (:func:`opsdk.runners.run_on_farm`) spreads over the
boards, so the cross-compiles (the expensive part) run in parallel too, one worker process
per board:

- ``time``: a kernel under its hand rule, timed on the board (which kernels to tune, and the
  board's thread count the search's parallel rules are sized for);
- ``search``: one sampled trace, compiled and timed on the board;
- ``gate``: a kernel's fastest candidates through the verify gate (the kernel and the
  unscheduled one run on the board on random draws, the float64 reference here), then the
  best verified one timed against the hand rule, alternating on one board (the median of
  the per-round ratios).

A kernel is timed in its *harness*: a one-kernel Relax module compiled by the model pipeline
with the kernel's weights (its ``layout_free_buffers``) as constants, so a weight packing is
folded at compile time exactly as in the model, for the hand rule and the record alike.

Each compile runs in a forked child (:func:`opsdk.tune._search.in_child`): a sample that
crashes LLVM costs its cell, not the worker and its board.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._search import draw

__all__ = ["board_kernel", "kernel_harness", "kernel_inputs", "tune_handler"]


def kernel_inputs(fused: Any) -> dict[str, int]:
    """How many of each kernel's parameters are inputs (the rest are its outputs), read from
    the ``call_tir`` calls of ``fused``'s Relax functions."""
    from tvm import relax  # heavy: TVM

    from .._walk import calls_of  # heavy: TVM

    out: dict[str, int] = {}
    for _, f in fused.functions.items():
        if isinstance(f, relax.Function):
            for e in calls_of(f.body, "relax.call_tir"):
                out[e.args[0].name_hint] = len(e.args[1].fields)
    return out


def _specs(func: Any) -> list[tuple[tuple[int, ...], str]]:
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo  # heavy: TVM

    return [(tuple(int(d) for d in a.shape), str(a.dtype)) for a in ArgInfo.from_prim_func(func)]


def _inputs(specs: list[tuple[tuple[int, ...], str]], free: set[int], n_in: int,
            seed: int) -> list[np.ndarray]:
    """Random values for a kernel's inputs that are not weights (its own generator, so
    they are the same without drawing the weights)."""
    rng = np.random.default_rng(seed)
    return [draw(shape, dtype, rng) for i, (shape, dtype) in enumerate(specs[:n_in])
            if i not in free]


def _free(func: Any) -> set[int]:
    return {int(i) for i in (func.attrs or {}).get("layout_free_buffers", [])}


def kernel_harness(func: Any, name: str, n_in: int, seed: int = 0
                   ) -> tuple[Any, list[np.ndarray]]:
    """A Relax module calling only ``func`` (``n_in`` inputs, then its outputs), its weights
    (the ``layout_free_buffers``) random constants and its other inputs parameters of
    ``main``; and random values for those. Compiled by :func:`opsdk.model.compile_model`,
    the kernel keeps its workload (a record for it applies) and its packing is folded.

    Examples
    --------
    >>> import numpy as np, tvm, opsdk
    >>> from tvm import relax
    >>> from opsdk.model import fused_module
    >>> from opsdk.tune import kernel_harness, kernel_inputs
    >>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.matmul(x, relax.const(np.ones((16, 8), "float32"))))
    ...     _ = bb.emit_func_output(y)
    >>> fused = fused_module(bb.get())
    >>> (gv, f), = [(g, f) for g, f in fused.functions.items()
    ...             if isinstance(f, tvm.tirx.PrimFunc)]
    >>> mod, inputs = kernel_harness(f, gv.name_hint, kernel_inputs(fused)[gv.name_hint])
    >>> [x.shape for x in inputs]
    [(4, 16)]
    """
    from tvm import relax  # heavy: TVM

    specs = _specs(func)
    free = _free(func)
    rng = np.random.default_rng(seed + 1)  # the weights'
    params, args = [], []
    for i, (shape, dtype) in enumerate(specs[:n_in]):
        if i in free:
            args.append(relax.const(draw(shape, dtype, rng)))
        else:
            p = relax.Var(f"in{i}", relax.TensorType(list(shape), dtype))
            params.append(p)
            args.append(p)
    outs = [relax.TensorType(list(s), d) for s, d in specs[n_in:]]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            gv = bb.add_func(func, name)
            y = bb.emit_output(relax.call_tir(gv, args, outs if len(outs) > 1 else outs[0]))
        bb.emit_func_output(y)
    return bb.get(), _inputs(specs, free, n_in, seed)


def _export_harness(func: Any, name: str, n_in: int, target: Any, path: Path,
                    cc: str | None, records: Sequence[Any] = ()) -> str | None:
    """The harness of ``func`` compiled for ``target`` (with ``records``) in a forked child
    and exported to ``path``; the rule that scheduled the kernel, or None when the compile
    failed or crashed."""
    from ..model import compile_model
    from ._search import in_child

    facts = path.with_suffix(".json")

    def work() -> None:
        mod, _ = kernel_harness(func, name, n_in)
        cm = compile_model(mod, target, tuning=list(records), cache=False)
        if cm.library is not None:  # linked at compile time (a loaded library: not again)
            shutil.copyfile(cm.library, path)
        elif cc is None:
            cm.ex.export_library(str(path))
        else:
            cm.ex.export_library(str(path), cc=cc)
        facts.write_text(json.dumps([k["rule"] for k in cm.kernels]))

    if not in_child(work) or not facts.exists():
        return None
    rules = json.loads(facts.read_text())
    return ",".join(rules)


def board_kernel(runner: Any, target: Any, n_in: int, tmp: Path) -> Callable[..., Any]:
    """:func:`opsdk.tune.verify_trace`'s ``device`` for ``runner``: compiles a kernel for
    ``target`` (in a forked child), runs it there on its ``n_in`` inputs and returns every
    parameter (the inputs as given, the outputs as computed)."""
    from ..runners import cross_compiler
    from ..targets import target_arch
    from ._search import export_isolated

    cc = cross_compiler(target_arch(target))
    built: dict[int, Path] = {}

    def run(func: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        path = built.get(id(func))
        if path is None:
            path = tmp / f"k{len(built)}.so"
            if not export_isolated(func, target, path, cc=cc):
                raise ValueError(f"compiling it for {target_arch(target)} failed or crashed")
            built[id(func)] = path
        outs = runner.run(str(path), arrays[:n_in],
                          outputs=[(a.shape, str(a.dtype)) for a in arrays[n_in:]])
        return [*arrays[:n_in], *outs]

    return run


def _timed(runner: Any, lib: str, inputs: list[np.ndarray], repeats: int) -> float:
    """The median ms of ``repeats`` calls on the device; ``lib`` the same ``str`` object
    call after call (a runner keeps what it uploaded by the object's identity)."""
    _, t = runner.run_timed(lib, inputs, repeats=repeats)
    return float(t["median_ms"])


def tune_handler(cfg: dict[str, Any], payload: dict[str, Any], runner: Any,
                 tick: Callable[[], None]) -> dict[str, Any]:
    """One cell on one board (see the module's note); ``payload``: ``op`` (``time``,
    ``search`` or ``gate``), the kernel's ``name``, ``script`` (TVMScript), ``n_in`` and
    ``workload``; ``trace`` (search) or ``traces`` (gate, fastest first), ``draws``,
    ``seed``, ``rounds``."""
    import tvm  # heavy: TVM

    from ..runners import cross_compiler
    from ..targets import target as resolve_target
    from ..targets import target_arch

    tgt = resolve_target(cfg["target"])
    cc = cross_compiler(target_arch(tgt))
    func = tvm.script.from_source(payload["script"])
    if isinstance(func, tvm.IRModule):
        func = next(iter(func.functions.values()))
    name, n_in, op = payload["name"], int(payload["n_in"]), payload["op"]
    inputs = _inputs(_specs(func), _free(func), n_in, 0)  # as the harness draws them
    tmp = Path(tempfile.mkdtemp(prefix="opsdk-tune-board-"))
    try:
        return _cell(op, func, name, n_in, inputs, payload, tgt, cc, runner, tick, tmp,
                     int(cfg.get("repeats", 5)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # uploaded and loaded already


def _cell(op: str, func: Any, name: str, n_in: int, inputs: list[np.ndarray],
          payload: dict[str, Any], tgt: Any, cc: str | None, runner: Any,
          tick: Callable[[], None], tmp: Path, repeats: int) -> dict[str, Any]:
    from ..schedules import TunedRecord
    from ._gate import verify_trace

    hand = tmp / "hand.so"
    if op == "time":
        rule = _export_harness(func, name, n_in, tgt, hand, cc)
        if rule is None:
            return {"error": "the hand-ruled kernel did not compile"}
        ms = _timed(runner, str(hand), inputs, repeats)
        threads = runner.device_threads() if hasattr(runner, "device_threads") else None
        return {"ms": ms, "rule": rule, "threads": threads}
    if op == "search":
        rec = TunedRecord(payload["workload"], payload["trace"])
        path = tmp / "cand.so"
        rule = _export_harness(func, name, n_in, tgt, path, cc, [rec])
        if rule is None or not rule.startswith("tuned:"):
            return {"error": "the build failed or crashed" if rule is None else
                    f"the record did not schedule the kernel ({rule} did)"}
        tick()
        return {"ms": _timed(runner, str(path), inputs, repeats)}
    if op != "gate":
        raise ValueError(f"unknown cell {op!r}")
    device = board_kernel(runner, tgt, n_in, tmp)
    gates = []
    for trace in payload["traces"]:
        g = verify_trace(func, trace, tgt, draws=int(payload.get("draws", 3)),
                         seed=int(payload.get("seed", 0)), device=device)
        gates.append(g.as_dict())
        tick()
    best = next((t for t, g in zip(payload["traces"], gates) if g["ok"]), None)
    out: dict[str, Any] = {"gates": gates}
    if best is None:
        return out
    rec = TunedRecord(payload["workload"], best)
    tuned = tmp / "tuned.so"
    hand_rule = _export_harness(func, name, n_in, tgt, hand, cc)
    tuned_rule = _export_harness(func, name, n_in, tgt, tuned, cc, [rec])
    if hand_rule is None or tuned_rule is None or not tuned_rule.startswith("tuned:"):
        out["speed_error"] = "the kernel's harness did not compile"
        return out
    th, tt, ratios = [], [], []
    libs = str(hand), str(tuned)  # uploaded once each, then timed in alternating order
    for r in range(int(payload.get("rounds", 7))):
        order = [(libs[0], th), (libs[1], tt)] if r % 2 == 0 else \
            [(libs[1], tt), (libs[0], th)]
        for lib, into in order:
            into.append(_timed(runner, lib, inputs, repeats))
        ratios.append(th[-1] / max(tt[-1], 1e-9))
        tick()
    out.update(best=payload["traces"].index(best), hand_rule=hand_rule,
               hand_ms=float(np.median(th)), tuned_ms=float(np.median(tt)),
               ratio=float(np.median(ratios)))
    return out
