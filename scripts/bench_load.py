"""How much a busy background process slows a model down: opsdk (under several TVM thread-pool
settings) against onnxruntime, side by side.

Each setting runs in a fresh process (TVM reads its pool settings once, when the pool
starts). In it, opsdk and onnxruntime are timed call by call in interleaved rounds, each
round a block alone and a block while one extra process spins on a core; the slowdown is
the loaded median over the quiet median, for both runtimes, from the same rounds.

Usage: ``python scripts/bench_load.py MODEL.py [--rounds N] [--calls N] [--threads N]
[--settings pinned,unpinned,...] [--trials N]``
(a model file with ``build_model()``, as ``opsdk bench --model`` takes). Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_SETTLE_S = 0.3
_STALL = 5.0

#: name -> environment for TVM's pool (the thread count is added from --threads): TVM's own
#: default pins its workers; opsdk's runners leave them unpinned (pool_defaults).
SETTINGS = {
    "pinned": {"TVM_BIND_THREADS": "1"},
    "unpinned": {"TVM_BIND_THREADS": "0"},
    "spin 0": {"TVM_THREAD_POOL_SPIN_COUNT": "0", "TVM_BIND_THREADS": "1"},
    "spin 0, unpinned": {"TVM_THREAD_POOL_SPIN_COUNT": "0", "TVM_BIND_THREADS": "0"},
    "1 thread": {"TVM_NUM_THREADS": "1"},
}


def _child(model: str, rounds: int, calls: int, threads: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    import tvm
    from tvm import relax

    from opsdk.model import compile_model, load_model

    m = load_model(model)
    cm = compile_model(m.opsdk_mod, "x86")
    vm = relax.VirtualMachine(cm.ex, tvm.cpu())
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in m.inputs]
    main = vm["main"]
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    sess = ort.InferenceSession(m.onnx, so, providers=["CPUExecutionProvider"])
    feed = {i.name: a for i, a in zip(sess.get_inputs(), m.inputs)}

    def timed(fn) -> list[float]:
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    def run_ort() -> None:
        sess.run(None, feed)

    for _ in range(3):  # warm both
        timed(lambda: main(*args))
        timed(run_ort)
    # Quiet and loaded blocks alternate, so that a slow stretch of the machine lands on
    # both; the busy process is started for each loaded block and killed after it.
    samples: dict[str, dict[str, list[float]]] = {
        p: {"opsdk": [], "ort": []} for p in ("quiet", "loaded")}
    for _ in range(rounds):
        for phase in ("quiet", "loaded"):
            busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    if phase == "loaded" else None)
            time.sleep(0.5 if busy else 0.0)
            try:
                # A pause after each runtime: its idle workers spin for a while after the
                # last call and would be timed with the other (as opsdk bench does).
                samples[phase]["opsdk"] += timed(lambda: main(*args))
                time.sleep(_SETTLE_S)
                samples[phase]["ort"] += timed(run_ort)
                time.sleep(_SETTLE_S)
            finally:
                if busy:
                    busy.kill()
                    busy.wait()
    res = {phase: {f"{k}_ms": 1e3 * float(np.median(v)) for k, v in d.items()}
           for phase, d in samples.items()}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="the TVM pool settings to run, separated by commas (default: all)")
    ap.add_argument("--trials", type=int, default=1,
                    help="fresh processes per setting (the medians are printed after)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.model, a.rounds, a.calls, a.threads)))
        return 0
    print(f"{'setting':18s} {'opsdk ms':>9s} {'loaded':>8s} {'slowdown':>8s}   "
          f"{'ort ms':>7s} {'loaded':>7s} {'slowdown':>8s}")
    names = a.settings.split(",")
    for name in names:
        if name not in SETTINGS:
            ap.error(f"--settings: no setting {name!r} (known: {', '.join(SETTINGS)})")
    slow: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _ in range(a.trials):
        for name in names:
            e = {**os.environ, "TVM_NUM_THREADS": str(a.threads), **SETTINGS[name]}
            r = subprocess.run([sys.executable, __file__, a.model, "--rounds", str(a.rounds),
                                "--calls", str(a.calls), "--threads", str(a.threads),
                                "--child", "1"], env=e, capture_output=True, text=True)
            if r.returncode:
                print(f"{name:18s} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            d = json.loads(r.stdout.strip().splitlines()[-1])
            q, lo = d["quiet"], d["loaded"]
            so, sr = lo["opsdk_ms"] / q["opsdk_ms"], lo["ort_ms"] / q["ort_ms"]
            slow[name].append((so, sr))
            print(f"{name:18s} {q['opsdk_ms']:9.2f} {lo['opsdk_ms']:8.2f} {so:7.2f}x   "
                  f"{q['ort_ms']:7.2f} {lo['ort_ms']:7.2f} {sr:7.2f}x", flush=True)
    if a.trials > 1:
        print(f"median of {a.trials} trials (stalled: a loaded median over {_STALL}x the quiet):")
        for name, rows in slow.items():
            if rows:
                o, r = (sorted(x[i] for x in rows)[len(rows) // 2] for i in (0, 1))
                stalls = sum(x[0] > _STALL for x in rows)
                print(f"{name:18s} opsdk {o:.2f}x ({stalls} stalled)   onnxruntime {r:.2f}x "
                      f"({sum(x[1] > _STALL for x in rows)} stalled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
