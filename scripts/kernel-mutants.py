"""Catch rate of the kernel-rule mutants, and false alarms of the real rules (issue #35).

Each mutant in ``tests/host/verify_mutants.py``'s ``KERNEL_MUTANTS`` is a real schedule rule
(x86.matmul, x86.conv2d, x86.winograd, x86.pool, the rows / columns rules, the int8 qdense
and qconv2d rules) with one planted bug, registered for a copy of the kernel family or op.
For every mutant and seed this runs ``verify_op`` as ``opsdk verify --kernels`` runs a
family (the given profile, every cell, no database, fail-fast) and counts the seeds that
flag it; then it verifies the unmutated families and ops the mutants copy over
``--false-alarm-seeds`` seeds and counts the seeds with any failure.

On ``--target arm`` the float mutants run on ``arm`` (Cortex-A72, NEON) and the int8 ones
on ``arm-dotprod`` (Cortex-A76: the sdot rules), under the emulator. A mutant whose rule
never applies there (the x86-only qconv2d rule) is reported ``n/a``.

Usage::

    python scripts/kernel-mutants.py [--target x86|arm] [--seeds 10]
        [--false-alarm-seeds 20] [--first-seed 0] [--profile dev] [--mutants NAME ...]

Prints one line per mutant (seeds caught / seeds run, seconds) and the false-alarm seeds;
exits 1 when a mutant was missed on a seed or a real rule failed. Slow: one verify per
mutant and seed (5-30 s each, shrinking included), and a full ``--kernels`` verify per
false-alarm seed.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

_HOST_TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "host"
_INT8 = ("qdense", "qconv2d")


def _int8(d) -> bool:
    return any(n in d.name for n in _INT8)


def _targets(target: str, d) -> str:
    """The target a mutant (or real op) runs on: arm's int8 rules are the sdot ones."""
    return "arm-dotprod" if target == "arm" and _int8(d) else target


def _verify(d, target: str, seed: int, profile: str, runners: dict):
    from opsdk.verify import verify_op

    dtypes = None if _int8(d) else ["float32"]
    return verify_op(d, target, dtypes=dtypes, profile=profile, seed=seed, database=None,
                     lints=False, refusals=False, fail_fast=True,
                     runner=runners.get(target))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="x86", choices=("x86", "arm"))
    ap.add_argument("--seeds", type=int, default=10, help="seeds per mutant")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the first seed (of the mutants' and the false-alarm seeds)")
    ap.add_argument("--false-alarm-seeds", type=int, default=20,
                    help="seeds of the unmutated rules (0: skip)")
    ap.add_argument("--profile", default="dev")
    ap.add_argument("--mutants", nargs="*", help="a subset of KERNEL_MUTANTS")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(_HOST_TESTS))
    import verify_mutants as M

    import opsdk
    from opsdk.registry import register_kernels
    from opsdk.runners import runner_for

    register_kernels()
    if args.target == "arm":
        from opsdk.runners import setup_arm

        setup_arm(log=lambda *_: None)
    by_name = {d.name: d for d in M.OPS}
    names = args.mutants or list(M.KERNEL_MUTANTS)
    failed = False
    with contextlib.ExitStack() as stack:
        runners: dict = {}

        def runner(target: str):
            if target not in runners:  # one (emulated) server per target for the whole run
                runners[target] = stack.enter_context(runner_for(target))
            return runners[target]

        if args.seeds:
            print(f"kernel-rule mutants, target {args.target}, profile {args.profile}, "
                  f"seeds {args.first_seed}..{args.first_seed + args.seeds - 1}")
            print(f"{'mutant':28} {'class':26} {'caught':>7} {'s':>6}  bug")
        for name in names if args.seeds else ():
            d = by_name[name]
            target = _targets(args.target, d)
            runner(target)
            opsdk.register(d, replace=True)
            caught, applied, t0 = 0, False, time.perf_counter()
            try:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    rep = _verify(d, target, seed, args.profile, runners)
                    caught += not rep.ok
                    applied |= not rep.ok or any(r.startswith("mut.") for c in rep.cells
                                                 for r in c.rules)
            finally:
                opsdk.unregister(d)
            if not applied:
                cell = "n/a"
            else:
                cell = f"{caught}/{args.seeds}"
                failed |= caught < args.seeds
            print(f"{name:28} {M.KERNEL_MUTANTS[name]:26} {cell:>7} "
                  f"{time.perf_counter() - t0:6.0f}  {M.BUGS[name]}", flush=True)

        if args.false_alarm_seeds:
            from opsdk.kernels import KERNEL_OPS

            real = [*KERNEL_OPS, *(opsdk.get_op(n) for n in _INT8)]
            alarms = []
            t0 = time.perf_counter()
            for seed in range(args.first_seed, args.first_seed + args.false_alarm_seeds):
                t1, before = time.perf_counter(), len(alarms)
                for d in real:
                    target = _targets(args.target, d)
                    runner(target)
                    rep = _verify(d, target, seed, args.profile, runners)
                    bad = [f.format(tir=False) for f in rep.failures]
                    bad += [f"{c.op} {c.dtype} {c.layout}: {c.error}" for c in rep.cells
                            if c.error]
                    if bad:
                        alarms.append((seed, d.name, bad))
                        print(f"false alarm: seed {seed} {d.name}\n" + "\n".join(bad),
                              flush=True)
                print(f"seed {seed}: {len(alarms) - before} ops with a false alarm "
                      f"({time.perf_counter() - t1:.0f} s)", flush=True)
            seeds = sorted({s for s, *_ in alarms})
            print(f"unmutated rules ({', '.join(d.name for d in real)}): "
                  f"{len(seeds)} of {args.false_alarm_seeds} seeds with a false alarm "
                  f"({time.perf_counter() - t0:.0f} s)")
            failed |= bool(alarms)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
