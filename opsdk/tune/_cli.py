"""``opsdk tune``: argument parsing and the report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._cliargs import (
    UsageError,
    board_count,
    host_port,
    model_file,
    output_path,
    positive_int,
)
from ._db import TuningDB, TuningDBError

__all__ = ["add_tune_arguments", "format_tuned", "run_tune_command"]


def add_tune_arguments(s: argparse.ArgumentParser) -> None:
    """The arguments of ``opsdk tune``."""
    s.add_argument("model", nargs="?", type=model_file,
                   help="a model file (as opsdk build / explain --model take)")
    s.add_argument("--zoo", metavar="NAME", help="a zoo model instead (opsdk explain --zoo list)")
    s.add_argument("--target", default="x86",
                   help="x86 or host: tune on this machine (default x86); a device target "
                   "(arm, arm-dotprod, ...): tune on its boards, --tracker/--key or --rpc, "
                   "else the emulator (a check of the mechanism, not of speed)")
    s.add_argument("--tracker", metavar="HOST:PORT", type=host_port,
                   help="TVM RPC tracker whose boards of --key compile-check, time and verify "
                   "every candidate, spread over --boards (docs/farm.md)")
    s.add_argument("--key", help="device key (with --tracker)")
    s.add_argument("--rpc", metavar="HOST:PORT", type=host_port,
                   help="one board's TVM RPC server instead of a tracker")
    s.add_argument("--boards", type=board_count, default="all", metavar="N|all",
                   help="with --tracker: use up to N (or all) free boards of the key, one "
                   "worker each (default all)")
    s.add_argument("--kernels", metavar="K1,K2", help="tune these kernels (names as opsdk "
                   "explain --model prints them) instead of the slowest")
    s.add_argument("--top", type=positive_int, default=2, metavar="N",
                   help="tune N matmul / conv / pool / reduction kernels (default 2), picked "
                   "by --pick")
    s.add_argument("--pick", choices=("slowest", "weakest"), default="slowest",
                   help="which kernels --top takes: the slowest, or the weakest (the lowest %% "
                   "of the machine's roof in the model report, of those with 0.25 %% of the "
                   "time or more) (default slowest)")
    s.add_argument("--candidates", type=positive_int, default=6, metavar="N",
                   help="on a device: time the N tunable kernels with the most work on a "
                   "board under their hand rules, and tune the --top slowest (default 6)")
    s.add_argument("--trials", type=positive_int, default=32, metavar="T",
                   help="MetaSchedule samples per kernel (default 32); see docs/tuning.md for "
                   "budgets")
    s.add_argument("--db", metavar="DIR", help="the tuning database folder (default "
                   "$OPSDK_TUNING_DIR or tuning/ in opsdk's cache folder)")
    s.add_argument("--seed", type=int, default=0, help="the search's random seed (default 0)")
    s.add_argument("--min-speedup", type=float, default=1.03, metavar="X",
                   help="keep a verified record only when it is X times as fast as the hand "
                   "rule in the same measurement (default 1.03: above the timing noise)")
    s.add_argument("--entry", default="build_model", help="the model file's entry function")
    s.add_argument("--recheck", metavar="RECORD",
                   help="re-run the verify gate on one record file (a rejected record's "
                   "reproducer) and exit 1 if it fails")
    s.add_argument("--json", metavar="PATH", type=output_path, help="also write the report")


def _load(args: argparse.Namespace) -> Any:
    import opsdk  # heavy: TVM

    if args.zoo:
        from ..bench import select_zoo

        try:
            (z,) = select_zoo(args.zoo)
        except ValueError as e:
            raise UsageError(f"--zoo {args.zoo}: {e}") from None
        gone = z.missing()
        if gone:
            raise UsageError(f"--zoo {z.name} needs {', '.join(gone)}: pip install "
                             "'opsdk[zoo]'")
        module, example = z.build()
        return opsdk.model.LoadedModel.from_torch(z.name, module, tuple(example),
                                                  baselines=False)
    try:
        return opsdk.model.load_model(args.model, entry=args.entry, baselines=False)
    except (TypeError, ValueError, ImportError, AttributeError, FileNotFoundError) as e:
        raise UsageError(f"cannot load model {args.model!r}: {e}") from None


def run_tune_command(args: argparse.Namespace) -> int:
    """``opsdk tune``."""
    from ._tune import recheck, tune_model

    if args.recheck:
        _check_device(args)
        try:
            g = recheck(args.recheck, args.target, tracker=args.tracker, key=args.key,
                        rpc=args.rpc)
        except (TuningDBError, ValueError) as e:
            raise UsageError(str(e)) from None
        print(f"{args.recheck}: {'PASS' if g.ok else 'FAIL'}"
              + (f": {g.why}" if g.why else f" (worst error {g.worst:.3g} of the bound, "
                 f"against the {g.reference} reference, {g.draws} draws)"))
        return 0 if g.ok else 1
    if bool(args.model) == bool(args.zoo):
        raise UsageError("name a model file or --zoo NAME (one of them)")
    _check_device(args)
    try:
        db = TuningDB(args.db)
    except TuningDBError as e:
        raise UsageError(str(e)) from None
    model = _load(args)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()] if args.kernels \
        else None
    try:
        rep = tune_model(model, args.target, kernels=kernels, top=args.top, pick=args.pick,
                         trials=args.trials, db=db, seed=args.seed,
                         min_speedup=args.min_speedup,
                         log=lambda m: print(m, file=sys.stderr, flush=True),
                         tracker=args.tracker, key=args.key, boards=args.boards, rpc=args.rpc,
                         candidates=args.candidates)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(rep.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.as_dict(), f, indent=1)
    return 0


def _check_device(args: argparse.Namespace) -> None:
    """The device flags, checked together (one line naming the flag and the fix)."""
    from ..targets import target_spec

    try:
        target_spec(args.target)
    except ValueError as e:
        raise UsageError(f"--target {args.target}: {e}") from None
    if args.tracker and not args.key:
        raise UsageError("--tracker needs --key (the boards' device key; `opsdk setup farm "
                         "--status` lists the keys)")
    if args.tracker and args.rpc:
        raise UsageError("--tracker and --rpc both name the device: give one")
    if (args.tracker or args.rpc) and args.target in ("x86", "host"):
        raise UsageError(f"--target {args.target} tunes on this machine: name the boards' "
                         "target (e.g. --target arm) with --tracker / --rpc")


def format_tuned(kernels: list[Any], records: list[Any]) -> str:
    """The lines ``opsdk explain --model --tuning`` adds: which kernels run a tuned record,
    and by how much it beat the hand rule when it was kept.

    Examples
    --------
    >>> from opsdk.tune import format_tuned
    >>> format_tuned([], [])
    'tuned kernels: none (no record of the database matches a kernel of this model)'
    """
    by_rule = {r.rule_name: r for r in records}
    rows = [k for k in kernels if str(getattr(k, "rule", "")).startswith("tuned:")]
    if not rows:
        return "tuned kernels: none (no record of the database matches a kernel of this model)"
    out = [f"tuned kernels: {len(rows)} of {len(kernels)}"]
    for k in rows:
        r = by_rule.get(k.rule)
        how = f"{r.speedup:.2f}x {r.hand_rule}" if r is not None else "record not listed"
        out.append(f"  {k.name:<40} {k.rule} ({how}, verified when kept)")
    return "\n".join(out)
