"""The machine's ceilings for a model report: how fast opsdk's own kernels go on this host.

A kernel's work is its arithmetic (``flops``, TVM's estimate over the scheduled function,
epilogue included) and its compulsory traffic (``bytes``: every parameter read or written
once). A profiled kernel then has an achieved GFLOP/s and GB/s, and a *roof*: what this
machine reaches at its arithmetic intensity,

    attainable = min(peak GFLOP/s, flops / bytes * bandwidth(bytes)),

the classic roofline, with the bandwidth taken for the kernel's working-set size (a kernel
whose data fits in L2 streams faster than one that spills to memory). ``roof %`` is the
achieved rate over the attainable one; a kernel far below its roof with a large share of
the time is what to look at first.

The ceilings are measured, not assumed (the CPU changes between machines, and on a shared
or virtual one its clock too), with opsdk's own kernels at the report's thread count: the
peak is a register-blocked float32 GEMM through the target's matmul rule, the bandwidth an
elementwise add over three working-set sizes. The first report on a machine measures them
(about a second once the two small kernels are compiled) and keeps them in opsdk's cache
folder, keyed by the CPU, the target, the thread count and the versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._files import cache_dir
from ._modelcache import _truthy, _versions

__all__ = ["BANDWIDTH_SIZES", "Roof", "machine_roof"]

#: Working-set sizes (bytes read + written) of the bandwidth measurements, from an L2 to
#: beyond the last-level caches of the machines opsdk runs on (a kernel is measured
#: against the smallest that holds it).
BANDWIDTH_SIZES = (256 * 1024, 2 * 1024**2, 16 * 1024**2, 128 * 1024**2)

_FORMAT = 2
_ROOFS: dict[str, Roof] = {}


@dataclass(frozen=True)
class Roof:
    """The measured ceilings: ``gflops`` (GEMM), ``gbps`` by working-set size."""

    gflops: float
    gbps: dict[int, float]
    threads: int

    def bandwidth(self, nbytes: int) -> float:
        """GB/s for a working set of ``nbytes``: the smallest measured size holding it."""
        for size in sorted(self.gbps):
            if nbytes <= size:
                return self.gbps[size]
        return self.gbps[max(self.gbps)]

    def attainable(self, flops: float, nbytes: int) -> tuple[str, float]:
        """(``"GFLOP/s"`` or ``"GB/s"``, the rate this machine reaches for that work): a
        kernel with arithmetic is judged by its GFLOP/s, a pure copy by its GB/s."""
        bw = self.bandwidth(nbytes)
        if flops <= 0 or nbytes <= 0:
            return "GB/s", bw
        return "GFLOP/s", min(self.gflops, flops / nbytes * bw)

    def percent(self, flops: float, nbytes: int, seconds: float) -> float | None:
        """The achieved rate of a call over :meth:`attainable`, in percent."""
        if seconds <= 0 or nbytes <= 0:
            return None
        unit, top = self.attainable(flops, nbytes)
        got = (flops if unit == "GFLOP/s" else nbytes) / seconds / 1e9
        return 100.0 * got / top if top > 0 else None


def machine_roof(target: Any, threads: int) -> Roof:
    """The ceilings of this host for ``target`` at ``threads``, measured once per machine
    (kept in opsdk's cache folder; ``OPSDK_NO_CACHE=1`` measures them in each process).

    Examples
    --------
    >>> import tvm
    >>> from opsdk._roofline import machine_roof
    >>> roof = machine_roof("x86", int(tvm.get_global_func("runtime.NumThreads")()))
    >>> roof.gflops > 0 and min(roof.gbps.values()) > 0
    True
    """
    from .targets import target as resolve  # heavy: TVM

    tgt = resolve(target)
    key = _roof_key(str(tgt), threads)
    if key in _ROOFS:
        return _ROOFS[key]
    path = cache_dir() / "roofs" / f"{key}.json"
    use_disk = not _truthy(os.environ.get("OPSDK_NO_CACHE"))
    if use_disk:
        try:
            d = json.loads(path.read_text())
            roof = Roof(float(d["gflops"]), {int(k): float(v) for k, v in d["gbps"].items()},
                        int(d["threads"]))
        except (OSError, ValueError, KeyError, TypeError):
            roof = None
        if roof is not None and roof.gflops > 0 and all(v > 0 for v in roof.gbps.values()):
            _ROOFS[key] = roof
            return roof
    roof = _measure(tgt, threads)
    _ROOFS[key] = roof
    if use_disk:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(roof)))
        os.replace(tmp, path)
    return roof


def _roof_key(target: str, threads: int) -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features", "CPU part")):
                cpu += line + "\n"
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    material = json.dumps({"format": _FORMAT, "cpu": cpu, "target": target,
                           "threads": threads, "versions": _versions()}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def _measure(tgt: Any, threads: int) -> Roof:
    from tvm import relax  # heavy: TVM

    rng = np.random.default_rng(0)
    m, k, n = 256, 512, 512
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = rng.standard_normal((k, n)).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(w)))
        bb.emit_func_output(y)
    secs = _kernel_seconds(bb.get(), tgt, [rng.standard_normal((m, k)).astype("float32")])
    gflops = 2.0 * m * n * k / secs / 1e9
    gbps = {}
    for size in BANDWIDTH_SIZES:
        elems = size // 8  # an add reads and writes each element: 8 bytes of traffic
        v = relax.Var("v", relax.TensorType((elems,), "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [v]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.add(v, relax.const(1.0, "float32")))
            bb.emit_func_output(out)
        secs = _kernel_seconds(bb.get(), tgt, [np.ones(elems, "float32")])
        gbps[size] = 8.0 * elems / secs / 1e9
    return Roof(gflops, gbps, threads)


def _kernel_seconds(mod: Any, tgt: Any, inputs: list[np.ndarray]) -> float:
    """The fastest of several batches of calls of ``mod``'s one kernel, per call."""
    import tvm  # heavy: TVM
    from tvm import relax  # heavy: TVM

    from ._pipeline import pipeline  # heavy: TVM
    from ._tir import tir_pipeline  # TVM: this module is read without it (cached roofs)

    ex = tvm.compile(mod, target=tgt, relax_pipeline=pipeline(tgt), tir_pipeline=tir_pipeline())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    calls: list[tuple[Any, list]] = []

    def instrument(func, sym, before, ret, *args):
        if before and not str(sym).startswith("vm."):
            calls.append((func, list(args)))
        return 0

    vm.set_instrument(instrument)
    vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    func, args = calls[0]
    func(*args)
    t0 = time.perf_counter()
    func(*args)
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, min(1000, int(0.02 / once)))  # batches of about 20 ms
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            func(*args)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best
