"""Benchmark ``qdense`` against torch: float32 ``F.linear`` and dynamic-quantized int8 linear.

:func:`bench_qdense` compiles ``qdense`` (int8 activations, per-channel int8 weights, int32 bias,
requantized int8 output) through Relax with a symbolic batch, as a model would, and times it
interleaved with torch's eager float32 ``torch.nn.functional.linear`` and a
``torch.ao.quantization.quantize_dynamic`` ``nn.Linear`` (fbgemm/x86 int8 GEMM that quantizes
its float input on the fly), all on the same number of threads. Medians of per-call times over
rounds are reported; the machine may be shared, so read the ratios rather than absolute times.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from .._asm import asm_of
from ..ops.qdense import qdense
from ..registry import builder, is_registered, register, unregister
from ..schedules import last_choices
from ..targets import target as resolve_target

__all__ = ["bench_qdense", "tvm_threads"]


def _set_tvm_threads(n: int) -> int:
    """Resize the calling thread's TVM pool to ``n`` workers; return the count in effect."""

    ncpu = os.cpu_count() or 1
    # -3: workers share the listed CPUs (no pinning). The explicit CPU list is what lifts the
    # concurrency cap; querying NumThreads first would create the pool at the default size.
    tvm.get_global_func("runtime.config_threadpool")(-3, n, [str(i) for i in range(max(n, ncpu))])
    return int(tvm.get_global_func("runtime.NumThreads")())


def _default_tvm_threads() -> int:
    env = os.environ.get("TVM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if env:
        return int(env)
    ncpu = os.cpu_count() or 1
    return max(ncpu // 2 if platform.machine() in ("x86_64", "AMD64") else ncpu, 1)


@contextlib.contextmanager
def tvm_threads(n: int) -> Iterator[int]:
    """Run TVM's CPU thread pool (of the calling thread) with ``n`` workers inside the block.

    Without ``TVM_NUM_THREADS``, TVM 0.27 uses half the logical CPUs on x86 (it assumes
    hyper-threading): one thread on a 2-core machine without SMT, which halves a parallel
    kernel's speed. Yields the worker count in effect, which is less than ``n`` when this
    thread's pool already existed with fewer workers (it cannot grow then: set
    ``TVM_NUM_THREADS`` before the process starts instead); restores TVM's default count after.

    Examples
    --------
    >>> from opsdk.bench._qdense import tvm_threads
    >>> with tvm_threads(1) as n:
    ...     n
    1
    """
    actual = _set_tvm_threads(n)
    try:
        yield actual
    finally:
        _set_tvm_threads(_default_tvm_threads())


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


def _build(k: int, n: int, target: Any, attrs: dict[str, Any]) -> tuple[Any, str]:
    m = tirx.Var("m", "int64")
    shapes = {"x": (m, k), "w": (n, k), "w_scale": (n,), "bias": (n,)}
    dts = qdense.dtypes_for("int8", shapes)
    params = [relax.Var(name, relax.TensorType(list(s), dts[name])) for name, s in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(builder(qdense)(*params, **attrs)))
        bb.emit_func_output(out)
    before = len(last_choices())
    ex = tvm.compile(bb.get(), target=resolve_target(target))
    chosen = [c.rule for c in last_choices()[before:] if c.op == "qdense"]
    return ex, (chosen[-1] if chosen else "generic")


def bench_qdense(
    m: int = 1024,
    k: int = 1024,
    n: int = 1024,
    repeats: int = 7,
    *,
    calls: int = 3,
    threads: int | None = None,
    target: str = "x86",
    seed: int = 0,
    pause: float = 0.05,
) -> dict[str, Any]:
    """Time ``qdense`` (int8 -> int8, per-channel) against torch float32 and dynamic int8.

    Parameters
    ----------
    m, k, n
        ``x`` is ``(m, k)``, the weight ``(n, k)``.
    repeats
        Interleaved rounds; each round times ``calls`` calls of every contender.
    calls
        Calls per contender per round (their mean is one sample).
    threads
        Threads for torch (``torch.set_num_threads``) and TVM's pool (:func:`tvm_threads`);
        default: all cores.
    target
        opsdk target name for the qdense kernel.
    seed
        Seed of the random inputs.
    pause
        Seconds to sleep before each batch (then one untimed call), so that the previous
        contender's spinning worker threads have gone idle.

    Returns
    -------
    dict
        ``tvm_ms``, ``torch_f32_ms``, ``torch_dynamic_int8_ms`` (medians), the speedups
        ``vs_torch_f32`` / ``vs_torch_dynamic_int8`` (torch time / qdense time),
        ``fixed_ms`` (qdense on 6 rows: weight packing and compensation, paid per call),
        ``tvm_threads`` (TVM workers actually used, see :func:`tvm_threads`),
        ``gops`` (2 m k n / time), the chosen ``rule``, the ``vpdpbusd`` count in the
        assembly and ``exact`` (the first rows equal the reference bit for bit).

    Examples
    --------
    >>> from opsdk.bench._qdense import bench_qdense
    >>> r = bench_qdense(64, 64, 64, repeats=1, calls=1)
    >>> r["exact"], sorted(r)[:3]
    (True, ['calls', 'exact', 'fixed_ms'])
    """
    import torch  # heavy: torch

    threads = threads or os.cpu_count() or 1
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (m, k)).astype("int8")
    w = rng.integers(-127, 128, (n, k)).astype("int8")
    w_scale = rng.uniform(0.001, 0.01, n).astype("float32")
    bias = rng.integers(-5000, 5000, n).astype("int32")
    attrs = {
        "x_scale": 0.05,
        "x_zero_point": 3,
        "out_dtype": "int8",
        "out_scale": 0.05 * 0.005 * 120.0 * k**0.5,  # ~3 sigma of the output inside int8
        "out_zero_point": -2,
        "per_channel": True,
    }

    registered_here = not is_registered("qdense")
    if registered_here:
        register(qdense)
    try:
        ex, rule = _build(k, n, target, attrs)
    finally:
        if registered_here:
            unregister("qdense")
    asm = asm_of(ex)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(a, dev) for a in (x, w, w_scale, bias)]
    rows = min(m, 7)
    small = [tvm.runtime.tensor(x[:rows], dev), *args[1:]]
    got = vm["main"](*small).numpy()
    ref = qdense.run_reference({"x": x[:rows], "w": w, "w_scale": w_scale, "bias": bias}, attrs)
    exact = bool(np.array_equal(got, ref))
    fixed_in = [tvm.runtime.tensor(x[:6], dev), *args[1:]]

    xf = torch.from_numpy(x.astype(np.float32) * np.float32(0.05))
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w.astype(np.float32) * w_scale[:, None]))
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        qlin = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8
        )

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    tvm_workers = _set_tvm_threads(threads)
    contenders: dict[str, Callable[[], Any]] = {
        "tvm": lambda: vm["main"](*args),
        "torch_f32": lambda: torch.nn.functional.linear(xf, lin.weight, lin.bias),
        "torch_dynamic_int8": lambda: qlin(xf),
        "fixed": lambda: vm["main"](*fixed_in),
    }
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        with torch.no_grad():
            for fn in contenders.values():  # warm up: thread pools, caches, lazy init
                fn()
            names = list(contenders)
            for rnd in range(repeats):
                # Rotate the order each round. Before each batch: pause (TVM's and torch's thread
                # pools spin-wait after a parallel region, stealing the other's cores), then one
                # untimed call (the first call after idling pays the pool's wake-up: measured
                # up to 2.5x on torch's float32 linear).
                for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    # TVM's idle workers slow torch's float32 linear (measured 13 -> 40 ms in
                    # some calls): shrink TVM's pool while torch runs.
                    _set_tvm_threads(threads if name in ("tvm", "fixed") else 1)
                    time.sleep(pause)
                    fn = contenders[name]
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    samples[name].append((time.perf_counter() - t0) / calls)
    finally:
        torch.set_num_threads(prev_threads)
        _set_tvm_threads(_default_tvm_threads())

    med = {name: _median_ms(v) for name, v in samples.items()}
    return {
        "shape": (m, k, n),
        "threads": threads,
        "tvm_threads": tvm_workers,
        "repeats": repeats,
        "calls": calls,
        "rule": rule,
        "vpdpbusd": len(re.findall(r"\bvpdpbusd\b", asm)),
        "exact": exact,
        "tvm_ms": med["tvm"],
        "torch_f32_ms": med["torch_f32"],
        "torch_dynamic_int8_ms": med["torch_dynamic_int8"],
        "fixed_ms": med["fixed"],
        "vs_torch_f32": round(med["torch_f32"] / med["tvm"], 2),
        "vs_torch_dynamic_int8": round(med["torch_dynamic_int8"] / med["tvm"], 2),
        "gops": round(2.0 * m * k * n / (med["tvm"] * 1e-3) / 1e9, 1),
    }
