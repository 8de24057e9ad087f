"""Command-line pieces of ``opsdk verify`` (wired into :mod:`opsdk.cli`).

Exit codes: 0 every check passed, 1 a check failed, 2 a usage error (unknown op, target,
dtype, layout or profile; a malformed ``--case``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, TextIO

import opsdk
from opsdk.targets import target_spec

from .._cliargs import (
    add_farm_arguments,
    distinct_outputs,
    host_port,
    nonneg_int,
    output_path,
)
from .._files import write_text_atomic
from .._userfile import UserCodeError
from ..runners import RunnerUnavailable
from ._engine import _runner_for, run_case, verify
from ._report import VerifyReport, run_modules
from ._shard import verify_sharded
from ._strategies import GRID_RECIPES, INT_AUX_RECIPES, RECIPES, SPECIAL_RECIPES, Case, cell_dtypes

__all__ = ["add_verify_arguments", "run_verify_command"]


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``opsdk verify`` arguments to ``parser``.

    Examples
    --------
    >>> import argparse
    >>> from opsdk.verify._cli import add_verify_arguments
    >>> p = argparse.ArgumentParser()
    >>> add_verify_arguments(p)
    >>> p.parse_args(["gelu", "--target", "x86", "--examples", "5"]).examples
    5
    """
    parser.add_argument("ops", nargs="*", metavar="OP", help="ops to verify (default: all)")
    # None when not given: a --case's own target is then the one used (see _run_case).
    parser.add_argument("--target", default=None,
                        help="x86, arm, arm-dotprod, arm-sve, c (default: host)")
    parser.add_argument("--dtypes", nargs="+", metavar="DTYPE",
                        help="only these dtypes (space or comma separated)")
    parser.add_argument("--layouts", nargs="+", metavar="LAYOUT", help="only these layouts")
    parser.add_argument("--examples", type=nonneg_int, metavar="N",
                        help="random examples per cell after the corner cases (profile default)")
    parser.add_argument("--profile", default=None, choices=["dev", "ci", "thorough"],
                        help="how hard to search (default: dev)")
    parser.add_argument("--seed", type=int, help="hypothesis seed (reproducible runs)")
    parser.add_argument("--report", metavar="OUT.json", type=output_path,
                        help="write the full report as JSON")
    parser.add_argument("--junit", metavar="OUT.xml", type=output_path,
                        help="write a JUnit XML report")
    parser.add_argument("--case", metavar="JSON",
                        help="re-run exactly one case (as printed by a failure)")
    parser.add_argument("--rpc", metavar="HOST:PORT", type=host_port,
                        help="run kernels on a TVM RPC server")
    parser.add_argument("--tracker", metavar="HOST:PORT", type=host_port,
                        help="TVM RPC tracker to get a device")
    parser.add_argument("--key", help="device key (with --tracker)")
    add_farm_arguments(parser, "cell")
    parser.add_argument("--module", action="append", metavar="MODULE",
                        help="also load ops from this module (OPS = [...])")
    parser.add_argument("--kernels", action="store_true",
                        help="verify the schedule rules of the kernels TVM's own ops lower to "
                        "(matmul, conv2d, winograd, pool: the kernel families of "
                        "opsdk.kernels) instead of the ops")
    parser.add_argument("--no-lints", action="store_true", help="skip the schedule-claim lints")
    parser.add_argument("--no-db", action="store_true",
                        help="do not read or write the example database")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--brief", action="store_true",
                        help="failures without their lowered TIR (it stays in --report)")


def _split(values: list[str] | None, flag: str) -> list[str] | None:
    if not values:
        return None
    out = [v.strip() for item in values for v in item.split(",") if v.strip()]
    if not out:  # `--dtypes ''` would otherwise mean "no filter": every dtype
        raise _Usage(f"argument {flag}: empty; name at least one (or leave {flag} out for "
                     "all)")
    return out


class _Usage(Exception):
    pass


def _load_modules(modules: list[str] | None) -> None:
    if not modules:
        return

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())

    try:
        opsdk.load_plugins(list(modules))
    except (ImportError, TypeError, ValueError, UserCodeError) as e:
        raise _Usage(f"cannot load op modules: {e}") from None


def _check_usage(args: argparse.Namespace) -> tuple[list[Any], str, list[str] | None,
                                                      list[str] | None]:
    _load_modules(args.module)
    try:
        tname = target_spec(args.target or "host").name
    except ValueError as e:
        raise _Usage(str(e)) from None
    if getattr(args, "kernels", False):
        from ..kernels import KERNEL_OPS
        from ..registry import register_kernels

        register_kernels()
        if not args.ops:
            args.ops = [d.name for d in KERNEL_OPS]
    defs = []
    for name in args.ops:
        try:
            defs.append(opsdk.get_op(name))
        except KeyError as e:
            raise _Usage(str(e).strip("'\"")) from None
    pool = defs or opsdk.list_ops()
    dtypes, layouts = _split(args.dtypes, "--dtypes"), _split(args.layouts, "--layouts")

    known_dt = {dt for d in pool for dt in cell_dtypes(d)}
    for dt in dtypes or []:
        if dt not in known_dt:
            raise _Usage(f"unknown dtype {dt!r} for {', '.join(d.name for d in pool)}; "
                         f"supported: {', '.join(sorted(known_dt))}")
    known_ly = {ly for d in pool for ly in d.layouts}
    for ly in layouts or []:
        if ly not in known_ly:
            raise _Usage(f"unknown layout {ly!r}; known: {', '.join(sorted(known_ly))}")
    if args.tracker and not args.key:
        raise _Usage("--tracker needs --key")
    if args.boards is not None and (not args.tracker or args.rpc or args.case):
        raise _Usage("--boards shards a run over a tracker's boards: give --tracker HOST:PORT "
                     "--key K (not --rpc or --case); `opsdk setup farm N` starts a local "
                     "farm")
    try:
        distinct_outputs(report=args.report, junit=args.junit)
    except ValueError as e:
        raise _Usage(str(e)) from None
    return defs, tname, dtypes, layouts


class _Progress:
    """Plain-text progress on stderr: a rewritten line on a terminal, one line per cell else."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        self.stream, self.quiet = stream, quiet
        self.tty = stream.isatty()
        self.label = ""
        self.t0 = time.perf_counter()

    def __call__(self, label: str, done: int) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            self.stream.write(f"\r\033[K[{done:5d} examples {elapsed:6.1f}s] {label}")
            self.stream.flush()
        elif label != self.label:
            self.stream.write(f"[{done:5d} examples {elapsed:6.1f}s] {label}\n")
            self.stream.flush()
        self.label = label

    def close(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run_verify_command(args: argparse.Namespace) -> int:
    """Run ``opsdk verify`` for parsed ``args``; returns the exit code (0, 1 or 2).

    Examples
    --------
    >>> import argparse
    >>> from opsdk.verify._cli import add_verify_arguments, run_verify_command
    >>> p = argparse.ArgumentParser()
    >>> add_verify_arguments(p)
    >>> run_verify_command(p.parse_args(["no_such_op", "--quiet"]))
    2
    """
    with run_modules(args.module):  # a failure's reproducer loads them again
        return _run_verify(args)


def _run_verify(args: argparse.Namespace) -> int:
    try:
        defs, tname, dtypes, layouts = _check_usage(args)
        if args.case:
            return _run_case(args, defs, tname)
    except (_Usage, RunnerUnavailable) as e:
        print(f"opsdk verify: error: {e}", file=sys.stderr)
        return 2

    progress = _Progress(sys.stderr, args.quiet)
    common = dict(dtypes=dtypes, layouts=layouts, profile=args.profile or "dev",
                  seed=args.seed, max_examples=args.examples,
                  database=None if args.no_db else "default", lints=not args.no_lints,
                  progress=progress)
    try:
        if args.boards is not None:
            report = verify_sharded(defs or None, tname, tracker=args.tracker, key=args.key,
                                    boards=args.boards, cell_timeout=args.cell_timeout,
                                    **common)
        else:
            report = verify(defs or None, tname, rpc=args.rpc, tracker=args.tracker,
                            key=args.key, **common)
    except (ValueError, RunnerUnavailable) as e:
        progress.close()
        print(f"opsdk verify: error: {e}", file=sys.stderr)
        return 2
    progress.close()
    print(report.format_table())
    for f in report.failures:
        print()
        print(f.format(tir=not args.brief))
    for c in report.cells:
        if c.error:
            print(f"\nERROR {c.op} {c.dtype} {c.layout}: {c.error}")
    examples = sum(c.examples for c in report.cells)
    device = report.device.get("device", "?")
    if report.device.get("boards"):
        print("\ncells per board: " + ", ".join(f"{b} {n}" for b, n in
                                                report.device["boards"].items()))
    for note in report.device.get("lost", []):
        print(note)
    print(
        f"\n{len(report.cells)} cells, {examples} examples, profile {report.profile}, "
        f"target {report.target} on {device}: {report.seconds:.1f} s wall"
    )
    print("PASS" if report.ok else "FAIL")
    _write(args, report.to_json(), report.to_junit())
    return 0 if report.ok else 1


def _run_case(args: argparse.Namespace, defs: list[Any], tname: str) -> int:
    try:
        raw = json.loads(args.case, object_pairs_hook=_no_duplicate_keys)
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        if defs:
            raw.setdefault("op", defs[0].name)
            if len(defs) != 1 or raw["op"] != defs[0].name:
                raise ValueError(f"the case is for op {raw['op']!r}, not {args.ops}")
        if args.target is not None and "target" in raw and raw["target"] != tname:
            # Else one of the two was silently ignored (an arm case ran under --target x86).
            raise ValueError(f"the case is for target {raw['target']!r} but --target is "
                             f"{tname!r}; drop --target to run the case's target, or edit its "
                             "\"target\"")
        raw.setdefault("target", tname)
        case = Case.from_dict(raw)
        from ..targets import target as resolve_target

        resolve_target(case.target)  # an unknown target is a usage error, not a traceback
    except (ValueError, TypeError, KeyError) as e:
        raise _Usage(f"bad --case: {e}") from None

    try:
        d = opsdk.get_op(case.op)
    except KeyError as e:
        raise _Usage(str(e).strip("'\"")) from None
    _check_case_fields(case, d)

    try:
        runner = _runner_for(case.target, args.rpc, args.tracker, args.key)
    except ValueError as e:  # the up-front connection check (as for a whole run)
        raise RunnerUnavailable(str(e)) from None
    try:
        runner.__enter__()
    except (RuntimeError, OSError) as e:
        raise RunnerUnavailable(f"cannot start the {case.target} runner: {e}") from e
    with runner:
        res = run_case(case, runner=runner, op=d)
        device = runner.device_info().get("device", "?")
    if res.ok:
        print(f"pass: opsdk.{case.op} {case.dtype} {case.layout} {list(case.shape)} on {device} "
              f"({res.ratio:.2f} of the bound, {res.max_ulps:.3g} ulp)")
    else:
        print(res.format(tir=not args.brief))
    report = VerifyReport(target=case.target, device={"device": device})
    _write(args, json.dumps(res.to_dict(), indent=2), report.to_junit())
    return 0 if res.ok else 1


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: ``json.loads`` keeps the last of two silently."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"field {k!r} is given twice")
        out[k] = v
    return out


#: The largest float64 copy of one input a --case may need (verify keeps several).
_MAX_CASE_BYTES = 4 * 2**30


def _check_case_fields(case: Any, d: Any) -> None:
    """A hand-edited ``--case`` is a usage error (exit 2) naming the field, not a failed case
    (a typo of a layout even passed, as the default layout)."""

    recipes = {*RECIPES, *INT_AUX_RECIPES, *GRID_RECIPES, *SPECIAL_RECIPES}
    problems = []
    if case.dtype not in cell_dtypes(d):
        problems.append(f"dtype {case.dtype!r} is not one of {', '.join(cell_dtypes(d))}")
    if case.layout not in d.layouts:
        problems.append(f"layout {case.layout!r} is not one of {', '.join(d.layouts)}")
    problems += [f"data {k!r}: {v!r} is not a recipe ({', '.join(sorted(recipes))})"
                 for k, v in case.data.items() if v not in recipes]
    inputs = [p.name for p in d.tensor_params]
    problems += [f"data {k!r} is not an input of the op ({', '.join(inputs)})"
                 for k in case.data if k not in inputs]  # else its recipe was ignored
    if not isinstance(case.seed, int) or isinstance(case.seed, bool):
        problems.append(f"seed {case.seed!r} is not a whole number")
    if not case.shape or any(n < 1 for n in case.shape):
        problems.append(f"shape {list(case.shape)} needs positive dims")
    else:  # else a failed build or a MemoryError, blamed on the op
        lo, hi = d.ranks
        if not lo <= len(case.shape) <= hi:
            problems.append(f"shape {list(case.shape)} has rank {len(case.shape)}; the op "
                            f"takes rank {lo}..{hi} (ranks=)")
        elif math.prod(case.shape) * 8 > _MAX_CASE_BYTES:  # float64 reference copies
            problems.append(f"shape {list(case.shape)} needs "
                            f"{math.prod(case.shape) * 8 / 2**30:.1f} GiB per float64 input "
                            f"copy; keep a case under {_MAX_CASE_BYTES // 2**30} GiB")
    if not isinstance(case.static, bool):  # "no" is truthy: it compiled static silently
        problems.append(f"static {case.static!r} is not true or false")
    if not isinstance(case.packed, bool):
        problems.append(f"packed {case.packed!r} is not true or false")
    elif case.packed and not d.weights:  # else it ran with runtime inputs, as unpacked
        problems.append("packed: the op declares no weights (weights= in @opsdk.op)")
    free_dims = getattr(d, "free_dims", {})
    for k, v in case.free.items():  # an unknown name was ignored: the default size ran
        if k not in free_dims:
            problems.append(f"free dim {k!r} is not one of the op's free dims "
                            f"({', '.join(free_dims) or 'it has none'})")
        elif not free_dims[k][0] <= v <= free_dims[k][1]:
            problems.append(f"free dim {k!r}: {v} is outside its range {free_dims[k]}")
    optional = [p.name for p in d.tensor_params if p.optional]
    problems += [f"present {p!r} is not an optional input "
                 f"({', '.join(optional) or 'the op has none'})"
                 for p in case.present if p not in optional]
    try:  # an attribute value the op refuses is the edit's fault, not a failed kernel
        d.bind_attrs(case.attrs)
    except ValueError as e:
        problems.append(f"attrs: {e}")
    if problems:
        raise _Usage(f"bad --case for {d.name}: " + "; ".join(problems))


def _write(args: argparse.Namespace, report_json: str, junit: str) -> None:
    for path, text in ((args.report, report_json), (args.junit, junit)):
        if path:
            write_text_atomic(path, text)
