"""``opsdk tune``: a model's slowest kernels tuned with MetaSchedule, every record gated."""

from __future__ import annotations

import difflib
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._userfile import one_line
from ._db import TuningDB, read_record, versions
from ._gate import GateResult, speed_ratios, verify_trace
from ._remote import board_kernel, kernel_inputs, tune_handler
from ._search import search

__all__ = ["TUNABLE_KINDS", "WEAKEST_MIN_SHARE", "KernelTuning", "TuneReport", "recheck",
           "tune_model"]

#: Kernel kinds tuned unless named: the families with reductions worth tiling.
TUNABLE_KINDS = ("matmul", "conv2d", "winograd", "pool", "reduction")


@dataclass
class KernelTuning:
    """What tuning did for one kernel."""

    kernel: str
    kind: str
    hand_rule: str
    workload: str
    hand_ms: float | None = None  # in the model report
    candidates: int = 0
    verified: list[GateResult] = field(default_factory=list)
    ratio: float | None = None  # hand / tuned, same measurement
    hand_ms_gate: float | None = None
    tuned_ms_gate: float | None = None
    kept: bool = False
    why: str = ""
    record: str = ""  # the record file written (kept or rejected)
    reproducer: str = ""

    def line(self) -> str:
        gate = (f"{self.ratio:.2f}x the hand rule ({self.hand_ms_gate:.3f} -> "
                f"{self.tuned_ms_gate:.3f} ms)" if self.ratio is not None else "not timed")
        checked = sum(g.ok for g in self.verified)
        head = (f"{self.kernel:<40} {self.kind:<10} {self.hand_rule:<16} "
                f"{checked}/{len(self.verified)} verified, {gate}")
        return head + (": kept" if self.kept else f": not kept ({self.why})")


@dataclass
class TuneReport:
    """The result of :func:`tune_model`."""

    model: str
    target: str
    trials: int
    kernels: list[KernelTuning] = field(default_factory=list)
    db: str = ""

    def format(self) -> str:
        out = [f"opsdk tune {self.model} ({self.target}, {self.trials} trials per kernel; "
               f"database {self.db})"]
        out += ["  " + k.line() for k in self.kernels]
        for k in self.kernels:
            if k.reproducer:
                out.append(f"  rejected {k.kernel}: {k.why}\n    reproduce: {k.reproducer}")
        kept = [k for k in self.kernels if k.kept]
        out.append(f"  {len(kept)} of {len(self.kernels)} kernels kept")
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "trials": self.trials,
                "db": self.db, "kernels": [
                    {**{k: v for k, v in vars(t).items() if k != "verified"},
                     "verified": [g.as_dict() for g in t.verified]} for t in self.kernels]}


def _reproducer(path: Path, device: str = "") -> str:
    return f"opsdk tune --recheck {shlex.quote(str(path))}{device}"


def _device_flags(target: str, tracker: str | None, key: str | None, rpc: str | None) -> str:
    """The flags that name the device again (a reproducer's)."""
    out = f" --target {shlex.quote(target)}"
    if tracker:
        out += f" --tracker {shlex.quote(tracker)}"
    if rpc:
        out += f" --rpc {shlex.quote(rpc)}"
    if key:
        out += f" --key {shlex.quote(key)}"
    return out


#: ``pick="weakest"`` leaves out kernels under this share of the model's kernel time: far
#: below the roof or not, they cannot move the model.
WEAKEST_MIN_SHARE = 0.0025


def _roof_order(r: Any) -> float:
    """A kernel's percent of its roof (lowest first), or infinity for one the profile gave
    no roof or a negligible share of the time."""
    if r.roof_pct is None or (r.share or 0.0) < WEAKEST_MIN_SHARE:
        return float("inf")
    return r.roof_pct


def _pick(rep: Any, kernels: list[str] | None, top: int, pick: str = "slowest") -> list[Any]:
    rows = list(rep.kernels)
    if kernels:
        names = {r.name.removesuffix("_prepacked"): r for r in rows}
        out = []
        for k in kernels:
            r = names.get(k.removesuffix("_prepacked"))
            if r is None:
                near = difflib.get_close_matches(k, sorted(names), n=1)
                raise ValueError(f"--kernels: the model has no kernel {k!r}"
                                 + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + "; opsdk explain --model lists its kernels")
            out.append(r)
        return out
    cand = [r for r in rows if r.kind in TUNABLE_KINDS and r.rule != "generic"
            and not r.rule.startswith("tuned:")]
    if not cand:
        raise ValueError("the model has no tunable kernel (kinds "
                         f"{', '.join(TUNABLE_KINDS)}); name one with --kernels")
    if pick == "weakest":
        cand.sort(key=_roof_order)
    else:
        cand.sort(key=lambda r: -(r.time_ms or 0.0))
    return cand[:max(1, top)]


def tune_model(model: Any, target: Any = "x86", *, kernels: list[str] | None = None,
               top: int = 2, pick: str = "slowest", trials: int = 16,
               db: TuningDB | str | None = None,
               seed: int = 0, keep: int = 3, draws: int = 3, name: str = "",
               min_speedup: float = 1.03, log: Any = print, tracker: str | None = None,
               key: str | None = None, boards: int | str = "all", rpc: str | None = None,
               candidates: int = 6) -> TuneReport:
    """Tune ``top`` of ``model``'s kernels (or the ``kernels`` named) for ``target`` (the
    host) and store every record that passes both gates in ``db``. ``pick`` chooses them:
    ``"slowest"``, or ``"weakest"`` (the lowest percent of the machine's roof at the
    kernel's arithmetic intensity in the model report, among kernels with at least
    :data:`WEAKEST_MIN_SHARE` of the time: where MetaSchedule has room to win; the hand
    rules keep the big GEMMs and convs near the roof).

    Each kernel: ``trials`` MetaSchedule samples measured alone (:func:`search`); its
    ``keep`` fastest verified (:func:`verify_trace`: float64 reference and the unscheduled
    kernel on ``draws`` random inputs); the best verified one timed in the compiled model
    against the hand rule (:func:`speed_ratios`) and kept only when at least ``min_speedup``
    times faster (the default 3 % is above the ratio's run-to-run noise: a quiet-machine
    mobilenet_v2 conv measured 1.01x, which is no gain worth a record). Rejected records
    go to ``rejected/`` with a reproducer (``opsdk tune --recheck FILE``).

    ``model``: a :class:`opsdk.model.LoadedModel` (its inputs time the kernels). Raises
    ValueError naming the argument for an unknown kernel, a model without a tunable kernel
    or a target this machine cannot run without a device.

    **On a device** (``target`` a name such as ``"arm"``, with ``tracker`` and ``key``: every
    free board of the key, up to ``boards``; or ``rpc`` ``HOST:PORT``: one board; or,
    for aarch64 on another host, the emulator: a check of the mechanism, not of speed):
    the host samples the space and the boards compile and time every candidate and run both
    gates (:mod:`opsdk.tune._remote`). Without ``kernels``, the ``candidates`` tunable
    kernels with the most work are timed on a board under their hand rules and the ``top``
    slowest tuned (``pick="weakest"`` needs this machine's profile).

    Examples
    --------
    >>> import numpy as np, tempfile, opsdk
    >>> from tvm import relax
    >>> from opsdk.model import LoadedModel
    >>> x = relax.Var("x", relax.TensorType((32, 64), "float32"))
    >>> w = relax.const(np.random.rand(64, 48).astype("float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
    ...     _ = bb.emit_func_output(y)
    >>> m = LoadedModel("mm", bb.get(), bb.get(), [np.random.rand(32, 64).astype("float32")])
    >>> r = tune_model(m, trials=2, db=tempfile.mkdtemp(), log=None)  # doctest: +SKIP
    >>> [k.kind for k in r.kernels]  # doctest: +SKIP
    ['matmul']

    (Skipped in the doctest run for its 20-60 s; ``tests/host/test_tune.py`` runs it.)
    """
    import numpy as np

    from ..model import LoadedModel, compile_model, fused_module, report
    from ..runners.local import host_arch
    from ..targets import target as resolve_target
    from ..targets import target_arch

    say = log or (lambda *_: None)
    if pick not in ("slowest", "weakest"):
        raise ValueError(f"pick={pick!r}: 'slowest' or 'weakest'")
    tgt = resolve_target(target)
    store = db if isinstance(db, TuningDB) else TuningDB(db)
    if not isinstance(model, LoadedModel):
        raise TypeError("tune_model takes a LoadedModel (opsdk.model.load_model): its "
                        "example inputs time the kernels")
    if tracker or rpc or target_arch(tgt) != host_arch():
        if not isinstance(target, str):
            raise ValueError("tuning on a device takes the target by name (arm, "
                             "arm-dotprod, ...): the boards' workers resolve it")
        if pick == "weakest":
            raise ValueError("--pick weakest reads this machine's roof; on a device use "
                             "--pick slowest (timed on a board) or name --kernels")
        return _tune_on_device(model, target, tgt, store, kernels=kernels, top=top,
                               trials=trials, seed=seed, keep=keep, draws=draws,
                               name=name, min_speedup=min_speedup, say=say,
                               tracker=tracker, key=key, boards=boards, rpc=rpc,
                               candidates=candidates)
    mod, inputs = model.opsdk_mod, [np.asarray(a) for a in model.inputs]
    say("compiling with the hand rules ...")
    rep = report(model, tgt, asm=False)
    chosen = _pick(rep, kernels, top, pick)
    fused = fused_module(mod, tgt)
    funcs = {gv.name_hint: f for gv, f in fused.functions.items()
             if gv.name_hint in {r.name.removesuffix("_prepacked") for r in chosen}}
    out = TuneReport(name or model.name or "model", str(target), trials, db=str(store.root))
    from ..schedules import workload_key

    best: dict[str, tuple[Any, dict[str, Any]]] = {}
    for r in chosen:
        kname = r.name.removesuffix("_prepacked")
        func = funcs[kname]
        kt = KernelTuning(kname, r.kind, r.rule, workload_key(func), hand_ms=r.time_ms)
        out.kernels.append(kt)
        dt = {str(p.dtype) for p in _buffer_dtypes(func)}
        if not dt <= {"float32"}:
            kt.why = f"dtypes {sorted(dt)}: only float32 kernels are tuned"
            continue
        say(f"  {kname} ({r.kind}, {r.rule}, {r.time_ms or 0:.3f} ms): {trials} trials")
        cands = search(func, tgt, trials=trials, seed=seed, keep=keep,
                       log=(lambda m: say(m)) if log else None)
        kt.candidates = len(cands)
        if not cands:
            kt.why = "no candidate built"
            continue
        script = func.script()
        base = {"workload": kt.workload, "kernel": kname, "kind": r.kind,
                "model": out.model, "hand_rule": r.rule, "workload_script": script,
                "trials": trials, "seed": seed}
        for c in cands:
            g = verify_trace(func, c.trace, tgt, draws=draws, seed=seed)
            kt.verified.append(g)
            rec = {**base, "trace": c.trace, "search_ms": c.seconds * 1e3,
                   "verify": g.as_dict()}
            if g.ok:
                best.setdefault(kname, (c, rec))
            else:
                path = store.put(tgt, {**rec, "status": "rejected: " + g.why}, kept=False)
                kt.record, kt.why = str(path), g.why
                kt.reproducer = _reproducer(path)
                say(f"    rejected: {g.why}\n    reproduce: {kt.reproducer}")
        if kname not in best:
            kt.why = kt.why or "no candidate verified"
    if best:
        from ..schedules import TunedRecord

        recs = [TunedRecord(rec["workload"], rec["trace"], rec["hand_rule"], 0.0, k)
                for k, (_, rec) in best.items()]
        say("compiling with the verified records; timing them against the hand rules ...")
        hand = compile_model(mod, tgt)
        tuned = compile_model(mod, tgt, tuning=recs, cache=False)
        ratios = speed_ratios(hand.ex, tuned.ex, inputs, list(best))
        for kt in out.kernels:
            if kt.kernel not in best:
                continue
            _, rec = best[kt.kernel]
            got = ratios.get(kt.kernel)
            if got is None:
                kt.why = "the tuned kernel was not called in the model"
                continue
            kt.ratio, kt.hand_ms_gate, kt.tuned_ms_gate = (got["ratio"], got["hand_ms"],
                                                           got["tuned_ms"])
            rec = {**rec, "speedup": got["ratio"], "hand_ms": got["hand_ms"],
                   "tuned_ms": got["tuned_ms"], "versions": versions()}
            if got["ratio"] >= min_speedup:
                kt.kept = True
                kt.reproducer = ""
                kt.record = str(store.put(tgt, {**rec, "status": "kept"}))
            else:
                kt.why = (f"not {min_speedup:.2f}x faster than {kt.hand_rule} "
                          f"({got['ratio']:.2f}x)")
                kt.record = str(store.put(tgt, {**rec, "status": "rejected: " + kt.why},
                                          kept=False))
    return out


def _boards_back(tracker: str, key: str, want: int, timeout: float = 30.0) -> None:
    """Wait, up to ``timeout`` seconds, until ``want`` boards of ``key`` are free again: a
    round's workers have exited, but the tracker hears their sessions end a moment later
    (the next round would otherwise find "all boards busy", or take fewer)."""
    import time

    from .._cliargs import split_host_port
    from ..runners import tracker_boards

    host, port = split_host_port(tracker)
    deadline = time.monotonic() + timeout
    while want > 0 and time.monotonic() < deadline:
        try:
            if tracker_boards(host, port, key)[1] >= want:
                return
        except Exception:  # unreachable: run_on_farm says so in one line
            return
        time.sleep(0.2)


def _run_cells(payloads: list[dict[str, Any]], labels: list[str], target: str, *,
               tracker: str | None, key: str | None, boards: int | str, rpc: str | None,
               runner: list[Any], say: Callable[[str], None], want: int = 0
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``payloads`` run as cells of :func:`opsdk.tune._remote.tune_handler`: over the
    tracker's boards (the farm queue), or one after another on one runner (``rpc``, or the
    emulator; ``runner`` holds it between calls). A cell that failed gets ``{"error"}``."""
    from ..runners import FarmCell, run_on_farm, runner_for

    def failed(idx: int, why: str, gave_up: bool) -> dict[str, Any]:
        return {"error": why}

    if tracker:
        _boards_back(tracker, key or "", want)
        out = run_on_farm([FarmCell(lb, p) for lb, p in zip(labels, payloads)],
                          handler="opsdk.tune._remote:tune_handler", failed=failed,
                          target=target, tracker=tracker, key=key or "", boards=boards)
        for note in out.lost:
            say(f"  {note}")
        return out.results, out.facts()
    if not runner:
        runner.append(runner_for(target, rpc=rpc, key=key))
    results = []
    for p in payloads:
        try:
            results.append(tune_handler({"target": target}, p, runner[0], lambda: None))
        except Exception as e:  # the cell's failure, as the farm reports it
            results.append({"error": one_line(e)})
    return results, {"device": runner[0].device_info()["device"]}


def _tune_on_device(model: Any, target: str, tgt: Any, store: TuningDB, *,
                    kernels: list[str] | None, top: int, trials: int, seed: int, keep: int,
                    draws: int, name: str, min_speedup: float, say: Callable[[str], None],
                    tracker: str | None, key: str | None, boards: int | str,
                    rpc: str | None, candidates: int) -> TuneReport:
    """:func:`tune_model` on a device (see its note)."""
    from ..model import fused_module, report
    from ..schedules import workload_key
    from ._search import sample

    runner: list[Any] = []
    used: Counter[str] = Counter()
    where: list[str] = []
    last = [0]  # boards the previous round ran on

    def run(payloads: list[dict[str, Any]], labels: list[str]
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if not payloads:
            return [], {}
        # the boards the last round held, back before this one asks for them
        got, facts = _run_cells(payloads, labels, target, tracker=tracker, key=key,
                                boards=boards, rpc=rpc, runner=runner, say=say,
                                want=last[0])
        last[0] = len(facts.get("boards", {}))
        used.update(facts.get("boards", {}))
        where[:] = [facts["device"]]
        return got, facts

    try:
        if not (tracker or rpc):
            say("note: no --tracker or --rpc: the candidates run on the emulator (qemu), a "
                "check of the mechanism; its timings are not a board's speed")
        say("compiling with the hand rules ...")
        rep = report(model, tgt, profile=False, asm=False)
        fused = fused_module(model.opsdk_mod, tgt)
        n_in = kernel_inputs(fused)
        funcs = {gv.name_hint: f for gv, f in fused.functions.items()
                 if gv.name_hint in n_in and hasattr(f, "params")}
        if kernels:
            pool = _pick(rep, kernels, len(kernels))
        else:
            pool = [r for r in rep.kernels if r.kind in TUNABLE_KINDS and r.rule != "generic"
                    and not r.rule.startswith("tuned:")]
            if not pool:
                raise ValueError("the model has no tunable kernel (kinds "
                                 f"{', '.join(TUNABLE_KINDS)}); name one with --kernels")
            pool.sort(key=lambda r: -(r.flops or 0.0) * max(r.calls, 1))
            pool = pool[:max(candidates, top)]
        rows = [(r, r.name.removesuffix("_prepacked")) for r in pool]
        rows = [(r, k) for r, k in rows if k in funcs]
        if not rows:
            raise ValueError("none of the chosen kernels is called from the model's Relax "
                             "functions; name kernels with --kernels")
        base = {k: {"name": k, "script": funcs[k].script(), "n_in": n_in[k],
                    "workload": workload_key(funcs[k])} for _, k in rows}
        say(f"timing {len(rows)} kernels under their hand rules on the device ...")
        timed, facts = run([{**base[k], "op": "time"} for _, k in rows],
                           [f"time {k}" for _, k in rows])
        threads = min((t["threads"] for t in timed if t.get("threads")), default=None)
        ranked = sorted(zip(rows, timed), key=lambda x: -(x[1].get("ms") or 0.0)
                        * max(x[0][0].calls, 1))
        chosen = ranked if kernels else ranked[:max(1, top)]
        out = TuneReport(name or model.name or "model", f"{target} ({facts['device']})",
                         trials, db=str(store.root))
        todo: list[tuple[KernelTuning, dict[str, Any]]] = []
        for (r, k), t in chosen:
            kt = KernelTuning(k, r.kind, t.get("rule") or r.rule, base[k]["workload"],
                              hand_ms=t.get("ms"))
            out.kernels.append(kt)
            dt = {str(p.dtype) for p in _buffer_dtypes(funcs[k])}
            if "error" in t:
                kt.why = f"not timed on the device: {t['error']}"
            elif not dt <= {"float32"}:
                kt.why = f"dtypes {sorted(dt)}: only float32 kernels are tuned"
            else:
                todo.append((kt, base[k]))
        traces: list[tuple[KernelTuning, Any]] = []
        for kt, _ in todo:
            say(f"  {kt.kernel} ({kt.kind}, {kt.hand_rule}, {kt.hand_ms or 0:.3f} ms on the "
                f"device): sampling {trials} trials")
            traces += [(kt, tr) for _, tr, _ in sample(funcs[kt.kernel], tgt, trials=trials,
                                                       seed=seed, threads=threads)]
        say(f"compiling and timing {len(traces)} candidates on the device ...")
        got, _ = run([{**base[kt.kernel], "op": "search", "trace": tr} for kt, tr in traces],
                     [f"search {kt.kernel} #{i}" for i, (kt, _) in enumerate(traces)])
        fastest: dict[str, list[tuple[float, Any]]] = {}
        for (kt, tr), g in zip(traces, got):
            if "ms" in g:
                fastest.setdefault(kt.kernel, []).append((g["ms"], tr))
        gated = []
        for kt, b in todo:
            cands = sorted(fastest.get(kt.kernel, []), key=lambda c: c[0])[:keep]
            kt.candidates = len(cands)
            if not cands:
                kt.why = "no candidate built"
                continue
            gated.append((kt, b, cands))
        say(f"verifying {sum(len(c) for _, _, c in gated)} candidates and timing the best "
            "against the hand rules on the device ...")
        verdicts, _ = run([{**b, "op": "gate", "traces": [tr for _, tr in c], "draws": draws,
                            "seed": seed} for _, b, c in gated],
                          [f"gate {kt.kernel}" for kt, _, _ in gated])
        if tracker:  # every board that ran a cell, over the three rounds
            n = len(used)
            where[:] = [f"rpc tracker {tracker} key {key}, {n} board{'s' if n != 1 else ''}"]
        out.target = f"{target} ({where[0]})"
        for (kt, b, cands), v in zip(gated, verdicts):
            _keep_or_reject(kt, b, cands, v, out, store, tgt, trials, seed, min_speedup,
                            say, _device_flags(target, tracker, key, rpc))
        return out
    finally:
        for r in runner:
            r.close()


def _keep_or_reject(kt: KernelTuning, b: dict[str, Any], cands: list[tuple[float, Any]],
                    v: dict[str, Any], out: TuneReport, store: TuningDB, tgt: Any,
                    trials: int, seed: int, min_speedup: float,
                    say: Callable[[str], None], flags: str) -> None:
    base = {"workload": b["workload"], "kernel": kt.kernel, "kind": kt.kind,
            "model": out.model, "hand_rule": kt.hand_rule, "workload_script": b["script"],
            "trials": trials, "seed": seed, "device": out.target, "n_in": b["n_in"]}
    if "error" in v:
        kt.why = f"not gated: {v['error']}"
        return
    for (ms, tr), g in zip(cands, v["gates"]):
        kt.verified.append(GateResult(g["ok"], g["why"], g["worst_error_over_bound"],
                                      g["generic_error_over_bound"], g["reference"],
                                      g["draws"], list(g["notes"])))
        if not g["ok"]:
            rec = {**base, "trace": tr, "search_ms": ms, "verify": g}
            path = store.put(tgt, {**rec, "status": "rejected: " + g["why"]}, kept=False)
            kt.record, kt.why = str(path), g["why"]
            kt.reproducer = _reproducer(path, flags)
            say(f"    rejected: {g['why']}\n    reproduce: {kt.reproducer}")
    if "best" not in v:
        kt.why = v.get("speed_error") or kt.why or "no candidate verified"
        return
    ms, tr = cands[v["best"]]
    kt.ratio, kt.hand_ms_gate, kt.tuned_ms_gate = v["ratio"], v["hand_ms"], v["tuned_ms"]
    rec = {**base, "trace": tr, "search_ms": ms, "verify": v["gates"][v["best"]],
           "speedup": v["ratio"], "hand_ms": v["hand_ms"], "tuned_ms": v["tuned_ms"],
           "versions": versions()}
    if v["ratio"] >= min_speedup:
        kt.kept, kt.reproducer, kt.why = True, "", ""
        kt.record = str(store.put(tgt, {**rec, "status": "kept"}))
    else:
        kt.why = f"not {min_speedup:.2f}x faster than {kt.hand_rule} ({v['ratio']:.2f}x)"
        kt.record = str(store.put(tgt, {**rec, "status": "rejected: " + kt.why}, kept=False))


def _buffer_dtypes(func: Any) -> list[Any]:
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo  # heavy: TVM

    return list(ArgInfo.from_prim_func(func))


def recheck(path: str | Path, target: Any = "x86", *, draws: int = 3,
            tracker: str | None = None, key: str | None = None,
            rpc: str | None = None) -> GateResult:
    """Re-run the verify gate on a record file (its own workload script and trace): the
    reproducer ``opsdk tune --recheck FILE`` prints. A record for a device (``target`` a
    name whose architecture is not this machine's, ``tracker`` / ``key`` / ``rpc`` as
    :func:`tune_model` takes them) runs its kernels on that device.

    Examples
    --------
    >>> import json, tempfile, pathlib, opsdk
    >>> from tvm import te
    >>> from opsdk.tune import recheck
    >>> a = te.placeholder((8,), name="a")
    >>> f = te.create_prim_func([a, te.compute((8,), lambda i: a[i] * 2)])
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.json"
    >>> _ = p.write_text(json.dumps({"format": 1, "workload": "0" * 16, "trace": [[], []],
    ...                              "workload_script": f.script()}))
    >>> recheck(p).ok
    True
    """
    import shutil
    import tempfile

    import tvm  # heavy: TVM

    from ..runners import runner_for
    from ..runners.local import host_arch
    from ..targets import target as resolve_target
    from ..targets import target_arch

    rec = read_record(path)
    try:
        func = tvm.script.from_source(rec["workload_script"])
    except Exception as e:
        raise ValueError(f"--recheck {path}: its workload_script does not parse "
                         f"({type(e).__name__}); the record is damaged") from None
    if isinstance(func, tvm.IRModule):
        func = next(iter(func.functions.values()))
    tgt = resolve_target(target)
    if not (tracker or rpc or target_arch(tgt) != host_arch()):
        return verify_trace(func, rec["trace"], tgt, draws=draws)
    if "n_in" not in rec:
        raise ValueError(f"--recheck {path}: the record does not say how many of the "
                         "kernel's parameters are inputs (a record tuned on this machine); "
                         "recheck it with --target x86")
    runner = runner_for(str(target), rpc=rpc, tracker=tracker, key=key)
    tmp = Path(tempfile.mkdtemp(prefix="opsdk-recheck-"))
    try:
        return verify_trace(func, rec["trace"], tgt, draws=draws,
                            device=board_kernel(runner, tgt, int(rec["n_in"]), tmp))
    finally:
        runner.close()
        shutil.rmtree(tmp, ignore_errors=True)
