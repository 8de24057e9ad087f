"""Timing primitives every benchmark of opsdk shares: a candidate's timer, the steps that
run it ``k`` times (from Python, each call timed, or in TVM's C++ loop), and the thread
settings that give TVM, torch and onnxruntime the same cores."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..runners.local import pool_defaults

__all__ = ["Timer", "calls_step", "ort_session", "py_step", "setup_threads", "vm_step"]


class Timer:
    """One candidate: ``step(k)`` runs it ``k`` times and returns seconds per call."""

    def __init__(self, step: Callable[[int], float]) -> None:
        self.step = step
        self.number = 1
        self.samples: list[float] = []
        self.calls: list[float] = []  # per-call seconds, when ``step`` records them (.last)

    def calibrate(self, budget_s: float) -> None:
        self.step(1)  # warm-up (first-touch pages, thread pool start)
        per = max(self.step(1), 1e-7)
        self.number = max(1, min(10_000, int(budget_s / per)))


def py_step(fn: Callable[[], Any]) -> Callable[[int], float]:
    def step(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return (time.perf_counter() - t0) / k

    return step


def calls_step(fn: Callable[[], Any]) -> Callable[[int], float]:
    """Like :func:`py_step`, timing each call too: ``step.last`` holds the last batch's."""

    def step(k: int) -> float:
        ts = []
        t0 = time.perf_counter()
        for _ in range(k):
            a = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - a)
        step.last = ts  # type: ignore[attr-defined]
        return (time.perf_counter() - t0) / k

    step.last = []  # type: ignore[attr-defined]
    return step


def vm_step(vm: Any, args: list, dev: Any) -> Callable[[int], float]:
    cache: dict[int, Any] = {}

    def step(k: int) -> float:
        if k not in cache:  # the C++ timer loop: no Python overhead per call
            cache[k] = vm.time_evaluator("main", dev, number=k, repeat=1)
        return float(cache[k](*args).mean)

    return step


def setup_threads(threads: int | None) -> int:
    """Give TVM, torch and onnxruntime the same thread count; returns it.

    TVM 0.27 sizes its pool to half the logical CPUs on x86 unless ``TVM_NUM_THREADS`` is set
    before the pool starts. TVM's idle workers keep their default spin (``sched_yield``
    rounds, which give way to another runtime's threads): cutting it makes every parallel
    call wake sleeping workers, which on a virtual machine costs more than the kernel
    (measured: softmax 4096x768 0.90 ms with the default, 3.2 ms with 1000 rounds).
    """
    n = threads or os.cpu_count() or 1
    pool_defaults(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass
    return n


def ort_session(onnx_bytes: bytes, threads: int) -> Any:
    """An onnxruntime CPU session with ``threads`` intra-op threads (all graph
    optimizations, its default), quiet."""
    import onnxruntime as ort  # heavy: onnxruntime

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
