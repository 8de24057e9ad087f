"""Seconds per phase of model imports and compiles (``opsdk build --timings``): a recorder
the import and compile paths add to, in a module that imports nothing heavy, so a command can
time a build that never reaches TVM (an up-to-date artifact)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompileTimings", "phase", "record_phases", "record_timings"]


@dataclass
class CompileTimings:
    """Seconds per phase of the model imports and compiles inside :func:`record_timings`
    (summed by phase, in the order first seen), and the kernels the kernel cache reused
    and compiled."""

    seconds: dict[str, float] = field(default_factory=dict)
    kernels_reused: int = 0
    kernels_compiled: int = 0
    #: Folded constants read from the kernel cache's folder and computed.
    folds_reused: int = 0
    folds_computed: int = 0

    def add(self, seconds: Mapping[str, float]) -> None:
        for k, v in seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v


_RECORDER: contextvars.ContextVar[CompileTimings | None] = contextvars.ContextVar(
    "opsdk_model_timings", default=None)


@contextlib.contextmanager
def record_timings() -> Iterator[CompileTimings]:
    """Record the phases of every model import (:func:`load_model`) and compile
    (:func:`compile_model`) in the block (``opsdk build --timings`` prints them).

    Examples
    --------
    >>> import opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(x))
    ...     _ = bb.emit_func_output(y)
    >>> with opsdk.model.record_timings() as t:
    ...     _ = opsdk.model.compile_model(bb.get(), "x86", cache=False)
    >>> "schedule" in t.seconds and all(v >= 0 for v in t.seconds.values())
    True
    """
    rec = CompileTimings()
    token = _RECORDER.set(rec)
    try:
        yield rec
    finally:
        _RECORDER.reset(token)


def record_phases(seconds: Mapping[str, float], kernel_build: Any = None,
                  folds: Any = None) -> None:
    """Add phases' seconds (and a compile's kernel and fold cache counts) to the recorder of
    the enclosing :func:`record_timings`, if any."""
    rec = _RECORDER.get()
    if rec is not None:
        rec.add(seconds)
        if folds is not None:
            rec.folds_reused += folds.reused
            rec.folds_computed += folds.computed
        if kernel_build is not None:
            rec.kernels_reused += len(kernel_build.hits)
            rec.kernels_compiled += len(kernel_build.misses)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the enclosing :func:`record_timings`, less what
    phases recorded inside it took (a compile the block starts counts as its own phases,
    once).

    Examples
    --------
    >>> from opsdk._timings import phase, record_phases, record_timings
    >>> with record_timings() as t:
    ...     with phase("outer"):
    ...         record_phases({"inner": 0.0})
    >>> sorted(t.seconds)
    ['inner', 'outer']
    """
    rec = _RECORDER.get()
    before = sum(rec.seconds.values()) if rec is not None else 0.0
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if rec is not None:
            inner = sum(rec.seconds.values()) - before
            rec.add({name: max(0.0, time.perf_counter() - t0 - inner)})
