"""MetaSchedule's search space for one kernel, sampled and measured in this process.

The space is MetaSchedule's own for LLVM CPUs: ``post-order-apply`` with the ``llvm``
schedule rules (multi-level tiling, auto-inline, rfactor, parallel / vectorize / unroll,
random compute location) and postprocessors (layout rewrite of constant weights included).
Candidates are drawn as MetaSchedule's ``replay-trace`` strategy draws them: a design
space's trace replayed with fresh random decisions, then the postprocessors.

Why not ``tune_tir``: in TVM 0.27 its local builder and runner pass every candidate module to
worker processes through ``save_json``, which segfaults (as it does on any scheduled IR
here), and the default mutators segfault when the space generator is built (a
``Map<Mutator, FloatImm>`` through the JSON graph); the evolutionary strategy needs those
mutators and an XGBoost cost model that is not installed. Sampling and measuring in
process avoids all three; the records are MetaSchedule traces either way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Candidate", "args_for", "draw", "export_isolated", "in_child", "sample", "search",
           "trace_json"]


@dataclass
class Candidate:
    """One sampled schedule: its trace (JSON form) and its measured seconds per call."""

    trace: Any
    seconds: float


def trace_json(trace: Any) -> Any:
    """A trace's JSON form up to ``EnterPostproc`` (the postprocessors are replayed by
    :func:`opsdk.schedules.apply_trace`: 0.27's ``as_json`` segfaults on the layout
    rewrite's index map) as plain Python lists, strings and numbers."""
    from tvm import s_tir  # heavy: TVM

    insts = list(trace.insts)
    cut = next((i for i, x in enumerate(insts) if str(x.kind.name) == "EnterPostproc"),
               len(insts))
    head = insts[:cut]
    decisions = {k: v for k, v in trace.decisions.items() if any(k.same_as(x) for x in head)}

    def plain(o: Any) -> Any:
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        if hasattr(o, "value"):  # IntImm / FloatImm
            return o.value
        return [plain(x) for x in o]

    return plain(s_tir.Trace(head, decisions).as_json(remove_postproc=False))


def draw(shape: Any, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """A random array: uniform in [-1, 1] for floats, 0 / 1 for bool, small integers
    otherwise."""
    if dtype.startswith("float"):
        return rng.uniform(-1, 1, shape).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(-4, 5, shape).astype(dtype)


def args_for(func: Any, seed: int = 0, dev: Any = None) -> list[Any]:
    """Random arguments for ``func``'s buffers (:func:`draw`), as TVM tensors on ``dev``
    (the CPU by default)."""
    import tvm  # heavy: TVM
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo  # heavy: TVM

    rng = np.random.default_rng(seed)
    dev = dev or tvm.cpu()
    return [tvm.runtime.tensor(draw([int(d) for d in info.shape], str(info.dtype), rng), dev)
            for info in ArgInfo.from_prim_func(func)]


def ms_target(target: Any, threads: int) -> Any:
    """``target`` with the ``num-cores`` MetaSchedule's parallel rules read."""
    from tvm.target import Target  # heavy: TVM

    spec = dict(target.export())
    spec["keys"] = list(spec.get("keys", ()))
    spec["num-cores"] = int(threads)
    return Target(spec)


def time_call(fn: Any, args: list[Any], budget_s: float = 0.02, repeats: int = 3) -> float:
    """Median seconds per call of ``fn(*args)`` over ``repeats`` batches of about
    ``budget_s`` each."""
    fn(*args)
    t0 = time.perf_counter()
    fn(*args)
    per = max(time.perf_counter() - t0, 1e-7)
    n = max(1, min(1000, int(budget_s / per)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        out.append((time.perf_counter() - t0) / n)
    return float(np.median(out))


def build_func(func: Any, target: Any) -> Any:
    """``func`` compiled alone with opsdk's TIR pipeline; the callable ``main``."""
    import tvm  # heavy: TVM

    from ..transform import tir_pipeline

    f = func.with_attr("global_symbol", "main")
    return tvm.tirx.build(tvm.IRModule({"main": f}), target=target,
                          pipeline=tir_pipeline())["main"]


def in_child(work: Any, timeout_s: float = 120.0) -> bool:
    """Run ``work()`` in a forked child; True when it returned, False when it raised,
    crashed or ran past ``timeout_s`` (then the child is killed).

    A sample of MetaSchedule's space can crash TVM's or LLVM's code generation (a conv2d
    sample killed the whole ``opsdk tune`` without a message); ``tune_tir`` builds in worker
    processes for the same reason."""
    pid = os.fork()
    if pid == 0:  # the child: no Python exit handlers, no return to the caller
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return False
        time.sleep(0.02)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def export_isolated(func: Any, target: Any, path: Path, *, cc: str | None = None,
                    timeout_s: float = 120.0) -> bool:
    """``func`` compiled with opsdk's TIR pipeline in a forked child (:func:`in_child`) and
    exported to ``path`` (with the compiler ``cc``: a cross compiler for a board); False
    when the compile failed, crashed or ran past ``timeout_s``."""
    import tvm  # heavy: TVM

    from ..targets import LINK_OPTIONS

    def work() -> None:
        lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                             target=target, pipeline=_pipeline_name())
        if cc is None:
            lib.export_library(str(path), options=list(LINK_OPTIONS))
        else:
            lib.export_library(str(path), cc=cc)

    return in_child(work, timeout_s) and path.exists()


def build_isolated(func: Any, target: Any, path: Path, timeout_s: float = 120.0) -> Any:
    """``func`` compiled in a forked child and exported to ``path``, then loaded here: the
    callable ``main``, or None when the compile failed, crashed or ran past ``timeout_s``."""
    import tvm  # heavy: TVM

    if not export_isolated(func, target, path, timeout_s=timeout_s):
        return None
    return tvm.runtime.load_module(str(path))["main"]


def _pipeline_name() -> str:
    from ..transform import tir_pipeline

    return tir_pipeline()


def sample(func: Any, target: Any, *, trials: int = 16, seed: int = 0,
           threads: int | None = None, log: Any = None) -> Iterator[tuple[int, Any, Any]]:
    """Draw ``trials`` schedules of ``func`` from MetaSchedule's CPU space for ``target``
    (its parallel rules sized for ``threads`` cores: this machine's by default, a board's
    for a remote target) as ``(trial, trace JSON, scheduled IRModule)``; a draw that does
    not replay, a postprocessor refuses or that repeats an earlier one is skipped."""
    import tvm  # heavy: TVM
    import tvm_ffi  # heavy: TVM
    from tvm import s_tir  # heavy: TVM
    from tvm.s_tir import meta_schedule as ms  # heavy: TVM

    from ..schedules import apply_trace, tensor_intrinsics

    if threads is None:
        threads = int(tvm.get_global_func("runtime.NumThreads")())
    mtgt = ms_target(target, threads)
    mod = tvm.IRModule({"main": func.without_attr("global_symbol")
                        if "global_symbol" in (func.attrs or {}) else func})
    space = ms.space_generator.PostOrderApply(sch_rules="llvm", postprocs="llvm",
                                              mutator_probs={})  # see the module's note
    # The x86 rules tensorize integer dot products only (VNNI): a float kernel's search
    # needs no intrinsic, and TVM's import of them all costs 20-90 s.
    text = func.script()
    ints = '"int8"' in text or '"uint8"' in text
    with tensor_intrinsics(ints):
        ctx = ms.TuneContext(mod=mod, target=mtgt, space_generator=space, task_name="main",
                             num_threads=threads, rand_state=seed + 1)
        spaces = ctx.generate_design_space()
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    for t in range(trials):
        base = spaces[t % len(spaces)].trace
        sch = s_tir.Schedule(mod, seed=int(rng.integers(1, 2**30)))
        try:
            s_tir.Trace(base.insts, {}).apply_to_schedule(sch, remove_postproc=True)
            trace = trace_json(sch.trace)  # the record: replayed below as it is stored
            sch = apply_trace(func, trace, target)
        except Exception as e:  # a sample the space allows but TVM cannot replay: skipped
            if log:
                log(f"    trial {t + 1}: skipped ({type(e).__name__})")
            continue
        h = int(tvm_ffi.structural_hash(sch.mod))
        if h in seen:
            continue
        seen.add(h)
        yield t, trace, sch.mod


def search(func: Any, target: Any, *, trials: int = 16, seed: int = 0, keep: int = 3,
           log: Any = None) -> list[Candidate]:
    """Sample ``trials`` schedules of ``func`` from MetaSchedule's CPU space for
    ``target`` (:func:`sample`), time each here on random arguments, and return the ``keep``
    fastest distinct ones (fastest first). Candidates that fail a postprocessor or the
    build are skipped.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.tune import search
    >>> a = te.placeholder((16, 16), name="a")
    >>> k = te.reduce_axis((0, 16), name="k")
    >>> f = te.create_prim_func([a, te.compute((16,), lambda i: te.sum(a[i, k], axis=k))])
    >>> len(search(f, opsdk.target("x86"), trials=2, keep=1)) <= 1
    True
    """
    args = args_for(func, seed)
    found: list[Candidate] = []
    work = tempfile.mkdtemp(prefix="opsdk-tune-")
    for t, trace, mod in sample(func, target, trials=trials, seed=seed, log=log):
        try:
            fn = build_isolated(mod["main"], target, Path(work) / f"c{t}.so")
            if fn is None:
                if log:
                    log(f"    trial {t + 1}: skipped (the build failed or crashed)")
                continue
            secs = time_call(fn, args)
        except Exception as e:  # a sample TVM cannot build or run: skipped
            if log:
                log(f"    trial {t + 1}: skipped ({type(e).__name__})")
            continue
        found.append(Candidate(trace, secs))
        if log:
            log(f"    trial {t + 1}/{trials}: {secs * 1e3:.3f} ms")
    shutil.rmtree(work, ignore_errors=True)  # the loaded libraries stay mapped
    found.sort(key=lambda c: c.seconds)
    return found[:keep]
