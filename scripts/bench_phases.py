"""Where a row-wise norm's time goes at a DRAM-sized shape: its two passes timed apart.

rms_norm reads a row once to reduce it (sum of squares) and then streams it again from L1
while writing the output. This times, side by side (interleaved rounds, medians of per-round
ratios), on the bench's thread count:

- ``reduce``: the reduction pass alone (reads the tensor, writes one float per row);
- ``stream``: the output pass alone (``y = x * s[row]``: reads and writes the tensor);
- ``rms_norm``: opsdk's kernel, which does both;
- ``copy``: the bench's copy roofline (same bytes as ``stream``).

If ``rms_norm`` takes about ``reduce + stream``, the passes do not overlap in DRAM and the
kernel cannot reach the copy's bandwidth without changing the order of its memory traffic.

Usage: ``python scripts/bench_phases.py [ROWSxCOLS] [--rounds N]`` (default 16384x1024).
"""

from __future__ import annotations

import argparse
import os

# Before TVM starts its pool: both cores (TVM defaults to half the logical CPUs) and a short
# spin after parallel calls, as ``opsdk bench`` sets them.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "1000")

import numpy as np
import tvm
from tvm import s_tir, te

import opsdk
from opsdk._explain import build_single_op
from opsdk.bench._run import _copy_kernel, _mod_step
from opsdk.bench._timing import Timer
from opsdk.schedules._core import vector_lanes, vectorize_loop
from opsdk.schedules._rfactor import rfactor_reduction, vectorize_rfactor


def _build(sch: s_tir.Schedule, tgt) -> tvm.runtime.Executable:
    return tvm.compile(sch.mod, target=tgt)


def _reduce_kernel(rows: int, cols: int, tgt, lanes: int):
    x = te.placeholder((rows, cols), "float32", name="x")
    k = te.reduce_axis((0, cols), name="k")
    ss = te.compute((rows,), lambda i: te.sum(x[i, k] * x[i, k], axis=k), name="ss")
    sch = s_tir.Schedule(te.create_prim_func([x, ss]))
    info = rfactor_reduction(sch, sch.get_sblock("ss"), 1, 2 * lanes)  # as x86.rows does
    row = sch.get_loops(sch.get_sblock("ss"))[0]
    sch.parallel(row)
    for rv in reversed(sch.get_child_blocks(sch.get_sblock("root"))[:-1]):
        sch.compute_at(rv, row, preserve_unit_loops=True)
    vectorize_rfactor(sch, info)
    return _build(sch, tgt)


def _stream_kernel(rows: int, cols: int, tgt, lanes: int):
    x = te.placeholder((rows, cols), "float32", name="x")
    s = te.placeholder((rows,), "float32", name="s")
    y = te.compute((rows, cols), lambda i, j: x[i, j] * s[i], name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, s, y]))
    i, j = sch.get_loops(sch.get_sblock("y"))
    sch.parallel(i)
    vectorize_loop(sch, j, lanes)
    return _build(sch, tgt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", nargs="?", default="16384x1024")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    rows, cols = (int(v) for v in a.shape.split("x"))
    tgt, dev = opsdk.target("x86"), tvm.cpu()
    lanes = vector_lanes(tgt)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return tvm.runtime.tensor(rng.standard_normal(shape).astype("float32"), dev)

    x, s, gamma = arr(rows, cols), arr(rows), arr(cols)
    y, ss = (
        tvm.runtime.empty((rows, cols), "float32", dev),
        tvm.runtime.empty((rows,), "float32", dev),
    )
    flat_in, flat_out = arr(rows * cols), tvm.runtime.empty((rows * cols,), "float32", dev)
    mod = build_single_op(
        "rms_norm",
        {"x": (rows, cols), "gamma": (cols,)},
        "float32",
        {"begin_axis": -1, "epsilon": 1e-6},
    )
    lowered = opsdk.transform.LowerOps(tgt)(mod)
    (prim,) = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    rms = tvm.compile(tvm.IRModule({"main": prim.with_attr("global_symbol", "main")}), target=tgt)
    timers = {
        "reduce": Timer(_mod_step(_reduce_kernel(rows, cols, tgt, lanes), [x, ss], dev)),
        "stream": Timer(_mod_step(_stream_kernel(rows, cols, tgt, lanes), [x, s, y], dev)),
        "rms_norm": Timer(_mod_step(rms, [x, gamma, y], dev)),
        "copy": Timer(
            _mod_step(_copy_kernel(rows * cols, "float32", tgt), [flat_in, flat_out], dev)
        ),
    }
    for t in timers.values():
        t.calibrate(0.02)
    for _ in range(a.rounds):
        for t in timers.values():
            t.samples.append(t.step(t.number))
    med = {k: float(np.median(t.samples)) * 1e3 for k, t in timers.items()}
    base = timers["rms_norm"].samples

    def ratio(num: list[float], den: list[float]) -> float:
        return float(np.median([a / b for a, b in zip(num, den)]))

    both = [r + st for r, st in zip(timers["reduce"].samples, timers["stream"].samples)]
    threads = os.environ["TVM_NUM_THREADS"]
    print(f"rms_norm {rows}x{cols} float32, {threads} threads, {a.rounds} rounds (median ms)")
    for k, v in med.items():
        print(f"  {k:9s} {v:8.3f}")
    print(f"  reduce + stream {float(np.median(both)) * 1e3:8.3f}")
    print(f"  rms_norm / (reduce + stream) = {ratio(base, both):.2f}")
    print(f"  copy / rms_norm = {ratio(timers['copy'].samples, base):.2f}")


if __name__ == "__main__":
    main()
