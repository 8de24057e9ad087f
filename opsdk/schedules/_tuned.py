"""Tuned records as rules: a MetaSchedule trace, verified by ``opsdk tune``, keyed by the
structural hash of the one kernel it was tuned for.

A record enters the registry as an ordinary rule (``tuned:<hash8>``, above every hand rule),
so the same driver picks it, ``opsdk explain`` names it and verify runs it like any rule. It
declines every function but its own workload, so a model whose kernel changed falls back to
the hand rules instead of running a trace made for another function.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

__all__ = [
    "TUNED_PRIORITY",
    "TunedRecord",
    "apply_trace",
    "postprocs_for",
    "tensor_intrinsics",
    "tuned_rule_fn",
    "workload_key",
]

#: Above every hand rule (the highest built-in priority is in the tens).
TUNED_PRIORITY = 10_000


def workload_key(func: tirx.PrimFunc) -> str:
    """The workload a record is for: the structural hash of ``func`` without its attributes
    (``global_symbol``, ``layout_free_buffers`` differ between a plain and a lifted-weights
    compile of the same kernel), as 16 hex digits.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.schedules import workload_key
    >>> a = te.placeholder((8,), name="a")
    >>> len(workload_key(te.create_prim_func([a, te.compute((8,), lambda i: a[i] * 2)])))
    16
    """
    import tvm_ffi  # heavy: TVM's FFI (loaded with tvm)

    bare = func
    for k in list((func.attrs or {}).keys()):
        bare = bare.without_attr(str(k))
    return f"{tvm_ffi.structural_hash(bare, map_free_vars=True) & (2**64 - 1):016x}"


@dataclass(frozen=True)
class TunedRecord:
    """One verified MetaSchedule trace for one workload (what the driver needs of a
    database record; ``opsdk.tune`` keeps the rest).

    ``trace`` is the trace's JSON form (``Trace.as_json``, postprocessors included),
    ``hand_rule`` the rule it beat and ``speedup`` by how much (hand time / tuned time)."""

    workload: str
    trace: Any
    hand_rule: str = ""
    speedup: float = 0.0
    kernel: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def rule_name(self) -> str:
        """``tuned:<first 8 hex digits of the workload>``."""
        return f"tuned:{self.workload[:8]}"


def apply_trace(func: tirx.PrimFunc, trace: Any, target: Target | None = None
                ) -> s_tir.Schedule:
    """A schedule of ``func`` with the JSON ``trace`` replayed on it, then MetaSchedule's
    LLVM postprocessors (layout rewrite of constant weights, parallel / vectorize / unroll
    rewrites: deterministic, so a record stores the trace up to ``EnterPostproc`` only; 0.27
    segfaults serializing the layout rewrite's index map). Raises the schedule error when
    the trace does not replay, ValueError when a postprocessor refuses the result.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.schedules import apply_trace
    >>> a = te.placeholder((8,), name="a")
    >>> f = te.create_prim_func([a, te.compute((8,), lambda i: a[i] * 2)])
    >>> apply_trace(f, [[], []], opsdk.target("x86")).mod["main"].body is not None
    True
    """
    if "global_symbol" in (func.attrs or {}):
        func = func.without_attr("global_symbol")
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    # a tensorized trace names intrinsics, which exist once TVM's tensor_intrin is imported
    with tensor_intrinsics("Tensorize" in str(trace)):
        s_tir.Trace.apply_json_to_schedule(trace, sch)
    _check_decisions(trace, sch)
    sch.enter_postproc()
    for p in postprocs_for(target if target is not None else Target.current()):
        if not p.apply(sch):
            raise ValueError(f"MetaSchedule postprocessor {type(p).__name__} refused the "
                             "schedule the trace makes")
    return sch


def _plain(o: Any) -> Any:
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    if hasattr(o, "value"):
        return o.value
    return [_plain(x) for x in o]


def _check_decisions(trace: Any, sch: s_tir.Schedule) -> None:
    """Raise ValueError when the replay did not take a recorded decision: TVM re-samples a
    tile decision that does not cover its loop (a corrupted tile edge) instead of failing,
    so the schedule run would not be the one verified."""
    insts = list(sch.trace.insts)
    got = sch.trace.decisions
    for idx, want in (trace[1] if len(trace) > 1 else []):
        inst = insts[int(idx)] if int(idx) < len(insts) else None
        have = _plain(got[inst]) if inst is not None and inst in got else None
        if have != want:
            raise ValueError(f"instruction {idx} ({inst.kind.name if inst is not None else '?'})"
                             f": the record's decision {want} was not taken (replayed as "
                             f"{have}); a tile that does not cover its loop")


_POSTPROCS: dict[str, list[Any]] = {}


def postprocs_for(target: Target) -> list[Any]:
    """MetaSchedule's LLVM postprocessors, initialized for ``target`` (kept per target)."""
    from tvm.s_tir import meta_schedule as ms  # heavy: MetaSchedule

    key = str(target)
    if key not in _POSTPROCS:
        spec = dict(target.export())
        spec["keys"] = list(spec.get("keys", ()))
        spec.setdefault("num-cores", int(tvm.get_global_func("runtime.NumThreads")()))
        mod = tvm.IRModule({"main": _stub()})
        space = ms.space_generator.PostOrderApply(sch_rules=[], postprocs="llvm",
                                                  mutator_probs={})
        with tensor_intrinsics(False):  # no schedule rules: no intrinsic is looked up
            ctx = ms.TuneContext(mod=mod, target=Target(spec), space_generator=space,
                                 task_name="main", num_threads=int(spec["num-cores"]))
        _POSTPROCS[key] = list(ctx.space_generator.postprocs)
    return _POSTPROCS[key]


@contextlib.contextmanager
def tensor_intrinsics(needed: bool) -> Iterator[None]:
    """Import TVM's tensor intrinsics only where ``needed``: ``TuneContext`` imports
    ``tvm.s_tir.tensor_intrin`` on every construction, which parses every target's
    intrinsics (CUDA, Hexagon, ...) from TVMScript, 20 s in a bare process and 60-90 s in
    one with opsdk's models loaded. Without ``needed`` (no rule or trace that tensorizes) the
    block sees a placeholder module, removed after it, so a later real import still works.

    Examples
    --------
    >>> import opsdk
    >>> from tvm.s_tir import meta_schedule as ms
    >>> from opsdk.schedules import tensor_intrinsics
    >>> with tensor_intrinsics(False):  # a context for postprocessors only: no 20 s import
    ...     ctx = ms.TuneContext(target=opsdk.target("x86"), task_name="k", num_threads=1)
    >>> ctx.task_name
    'k'
    """
    name = "tvm.s_tir.tensor_intrin"
    if needed:
        import tvm.s_tir.tensor_intrin  # noqa: F401  (registers the intrinsics)
    if needed or name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        if isinstance(sys.modules.get(name), types.ModuleType) and \
                not hasattr(sys.modules[name], "__file__"):
            del sys.modules[name]


def _stub() -> tirx.PrimFunc:
    from tvm import te  # heavy: TVM

    a = te.placeholder((1,), "float32", name="a")
    return te.create_prim_func([a, te.compute((1,), lambda i: a[i], name="b")])


def tuned_rule_fn(rec: TunedRecord) -> Any:
    """The rule function of ``rec``: its trace on its own workload, None on any other."""

    def fn(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        if workload_key(func) != rec.workload:
            return None
        return apply_trace(func, rec.trace, target)

    fn.__doc__ = (f"MetaSchedule record, verified, {rec.speedup:.2f}x "
                  f"{rec.hand_rule or 'the hand rule'}")
    return fn
