"""Time dense_q4 / dense_w8 (float32 and q8_0 activations) against a float32 dense under
opsdk's matmul rule, kernel alone.

Each candidate is a one-op Relax module with random constant weights compiled by
``opsdk.compile`` (the packing folded at compile time, as in a model), timed through the VM
(``time_evaluator`` on ``main``: the VM call adds ~1-3 us to every number alike). Prints
microseconds per call (median over interleaved rounds), GB/s of weight bytes, GFLOP/s and
the speed-up over float32 (``x f32``).

    .venv/bin/python scripts/bench_wdense.py [--target x86] [--rows 1 64] [--rounds 7]
        [--kinds q4 q4q8 w8 w8q8 f32]

Kinds: ``q4`` / ``w8`` float32 activations, ``q4q8`` / ``w8q8`` ``activations="q8_0"``
(integer dot products), ``f32`` the float32 matmul.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
import tvm
from tvm import relax

import opsdk
from opsdk.ops.dense_q4 import quantize_q4_0
from opsdk.ops.dense_w8 import quantize_w8

#: GPT-2 small: attention qkv, attention out, MLP up, MLP down, tied LM head.
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)]


def _module(kind: str, m: int, k: int, n: int, rng: np.random.Generator,
            symbolic: bool = False):
    wf = (rng.standard_normal((n, k)) * 0.05).astype("float32")
    rows = tvm.tirx.Var("n", "int64") if symbolic else m  # opsdk.llm's prefill: n symbolic
    x = relax.Var("x", relax.TensorType((rows, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            acts = "q8_0" if kind.endswith("q8") else "float32"
            if kind.startswith("q4"):
                qs, d = quantize_q4_0(wf)
                y = opsdk.relax.dense_q4(x, relax.const(qs), relax.const(d), activations=acts)
                wbytes = qs.nbytes + d.nbytes
            elif kind.startswith("w8"):
                q, s = quantize_w8(wf)
                y = opsdk.relax.dense_w8(x, relax.const(q), relax.const(s), activations=acts)
                wbytes = q.nbytes + s.nbytes
            else:
                y = relax.op.matmul(x, relax.const(np.ascontiguousarray(wf.T)))
                wbytes = wf.nbytes
            out = bb.emit_output(bb.emit(y))
        bb.emit_func_output(out)
    return bb.get(), wbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="x86")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median taken)")
    ap.add_argument("--head-prefill", action="store_true", help="also M > 1 for the LM head")
    ap.add_argument("--symbolic", action="store_true",
                    help="compile with a symbolic row count (as opsdk.llm's prefill), run M rows")
    ap.add_argument("--kinds", nargs="+", default=["q4q8", "q4", "w8q8", "w8", "f32"],
                    help="candidates (f32 is the baseline of the 'x f32' column)")
    ap.add_argument("--shapes", nargs="+", type=int, default=None,
                    help="indices into SHAPES (default: all)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    # Build everything first, then time the candidates of a shape interleaved, round after
    # round: a shared machine's load changes between rounds, not within one.
    print(f"load before: {os.getloadavg()}")
    print(f"{'M':>3} {'K':>5} {'N':>6} {'kind':>4} {'us':>9} {'GB/s':>7} {'GFLOP/s':>8}"
          f" {'x f32':>6}")
    for m in args.rows:
        for k, n in [SHAPES[i] for i in (args.shapes or range(len(SHAPES)))]:
            if m > 1 and n > 10000 and not args.head_prefill:
                continue
            cands = {}
            for kind in args.kinds:
                mod, wbytes = _module(kind, m, k, n, rng, args.symbolic)
                vm = relax.VirtualMachine(opsdk.compile(mod, args.target), dev)
                xv = tvm.runtime.tensor(rng.uniform(-1, 1, (m, k)).astype("float32"), dev)
                vm["main"](xv)
                per = max(1, int(2e5 / max(1, m * k * n / 1e3)))  # ~1-2 ms per repeat
                cands[kind] = (vm.time_evaluator("main", dev, number=per, repeat=3), xv, wbytes)
            times: dict[str, list[float]] = {kind: [] for kind in cands}
            for _ in range(args.rounds):
                for kind, (f, xv, _) in cands.items():
                    times[kind] += list(f(xv).results)
            med = {kind: statistics.median(t) * 1e6 for kind, t in times.items()}
            for kind, us in med.items():
                wbytes = cands[kind][2]
                print(f"{m:>3} {k:>5} {n:>6} {kind:>4} {us:>9.1f} {wbytes / us / 1e3:>7.1f} "
                      f"{2 * m * k * n / us / 1e3:>8.1f} {med.get('f32', us) / us:>6.2f}",
                      flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
