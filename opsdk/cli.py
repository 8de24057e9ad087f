"""opsdk: write, verify, explain and benchmark custom TVM operators and the models using them.

Exit codes: 0 success, 1 a check failed, 2 a usage error (unknown op, target, dtype, ...).
Only the chosen subcommand's arguments are built (and its modules imported), so
``opsdk --help`` and ``opsdk --version`` answer without importing TVM.
"""

from __future__ import annotations

import sys


def _interrupted_at_start(kind: type[BaseException], value: BaseException, tb: object) -> None:
    """Ctrl-C while the console script still imports this module (before :func:`main`'s
    handler): a word and exit 130, not a traceback of the imports."""
    if issubclass(kind, KeyboardInterrupt):
        import os

        try:
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
        finally:
            os._exit(130)
    sys.__excepthook__(kind, value, tb)  # type: ignore[arg-type]


# First, before the imports below: only for the `opsdk` script (a library importing this
# module keeps its own hook); main() puts the previous hook back.
_PREVIOUS_HOOK = sys.excepthook
if sys.argv and sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".exe") == "opsdk":
    sys.excepthook = _interrupted_at_start

import argparse  # noqa: E402
import atexit  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import NoReturn  # noqa: E402

from opsdk._cliargs import (  # noqa: E402
    NEGATIVE_NUMBER,
    UsageError,
    model_file,
    output_path,
    parse_name_values,
)

__all__ = ["console", "main"]


def _load_ops(modules: Sequence[str] | None) -> None:
    import os

    import opsdk

    # Like `python -m`, resolve --module names against the current directory too.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())

    from opsdk._userfile import UserCodeError

    try:
        opsdk.load_plugins(list(modules or []))
    except (ImportError, TypeError, ValueError, UserCodeError) as e:
        raise UsageError(f"cannot load op modules: {e}") from None


def _cmd_list(args: argparse.Namespace) -> int:
    import opsdk
    from opsdk.schedules import load_builtin_rules, rules_for

    _load_ops(args.module)
    load_builtin_rules()
    rows = []
    for d in opsdk.list_ops():
        rules = [r.name for r in rules_for(d)]
        rows.append(
            {
                "name": d.name,
                "kind": d.kind,
                "source": d.source,
                "dtypes": list(d.dtypes),
                "layouts": list(d.layouts),
                "rules": rules,
                "torch": list(d.torch_maps),
                "onnx": list(d.onnx_maps),
                "fusions": [n for n, _ in d.fusions],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    w = max(len(r["name"]) for r in rows) if rows else 4
    wl = max([14, *(len(",".join(r["layouts"])) for r in rows)])
    print(f"{'op':<{w}}  {'kind':<11}  {'dtypes':<26}  {'layouts':<{wl}}  rules / source / "
          "models")
    for r in rows:
        models = [f"torch:{','.join(r['torch'])}"] if r["torch"] else []
        models += [f"onnx:{','.join(r['onnx'])}"] if r["onnx"] else []
        models += [f"fusion:{','.join(r['fusions'])}"] if r["fusions"] else []
        print(
            f"{r['name']:<{w}}  {r['kind']:<11}  {','.join(r['dtypes']):<26}  "
            f"{','.join(r['layouts']):<{wl}}  {' '.join(r['rules']) or 'generic only'}  "
            f"[{r['source']}]" + ("  " + " ".join(models) if models else "")
        )
    return 0


def _parse_attrs(items: Sequence[str] | None) -> dict:
    try:
        return parse_name_values(items, "--attr")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _explain_record_key(args: argparse.Namespace) -> tuple[pathlib.Path, str] | None:
    """(cache folder, record name) of ``explain --model FILE`` with these arguments; None
    when the cache is off or the model is a module name."""
    import os

    from opsdk._modelcache import caches_off, default_dir, source_key

    path = pathlib.Path(args.model)
    if getattr(args, "no_cache", False) or caches_off() or not path.is_file():
        return None
    return default_dir(), source_key({
        "command": "explain --model", "model": str(path.resolve()), "entry": args.entry,
        "model_arg": args.model_arg, "module": args.module, "target": args.target,
        "profile": not args.no_profile, "asm": not args.no_asm,
        "threads": os.environ.get("TVM_NUM_THREADS")})


def _explain_from_record(args: argparse.Namespace) -> int | None:
    """``explain --model`` of a model file whose source, and everything it imported, is
    as when it was last explained: the report from the compile cache without importing the
    model (torch, torch.export and the import were most of a cached run). None: not
    recorded, changed, or anything amiss -- the ordinary path runs."""
    found = _explain_record_key(args)
    if found is None:
        return None
    from opsdk._modelcache import read_inputs, read_record

    root, key = found
    rec = read_record(root, key)
    if rec is None:
        return None
    # TVM's FFI imports torch when it can (2-3 s); nothing on this path needs it.
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import opsdk.model

        cm = opsdk.model.load_compiled(rec["compile_key"], args.target)
        if cm is None:
            return None
        inputs = read_inputs(root, key) if not args.no_profile else None
        # the verify cells as the first run kept them (none kept: the ordinary path)
        rep = opsdk.model.report(cm, args.target, inputs=inputs, profile=not args.no_profile,
                                 asm=not args.no_asm, name=rec["name"], cells=True,
                                 verify_kernels=args.verify_kernels)
    except Exception:  # e.g. the asm counts not stored: the ordinary path states them
        return None
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return _print_model_report(args, rep)


def _print_model_report(args: argparse.Namespace, rep) -> int:
    from opsdk._explain import catch_all_rules

    catch_all = catch_all_rules()
    for k in rep.kernels:  # a kind no rule took: named, as explain --zoo names it
        note = f"on the catch-all rule {k.rule}: no rule for its kind ({k.kind}) took it"
        if k.rule in catch_all and note not in k.problems and not any(
                "catch-all" in p for p in k.problems):
            k.problems.append(note)
    print(rep.format())
    if args.json:
        _write_json(args.json, rep.as_dict())
    if rep.verified is not None and rep.verified["failed"]:  # a kernel's own case failed
        return 1
    return 1 if rep.problems and args.strict else 0


def _cmd_explain_model(args: argparse.Namespace) -> int:
    import opsdk

    try:
        opsdk.target(args.target)
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = args.model
    try:
        entry_args = opsdk.model.parse_entry_args(args.model_arg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        # The report compiles and times opsdk's import only: no TVM import, no ONNX export.
        m = opsdk.model.load_model(spec, entry=args.entry, entry_args=entry_args,
                                   baselines=False)
    except (TypeError, ValueError, ImportError, AttributeError, FileNotFoundError) as e:
        raise UsageError(f"cannot load model {spec!r}: {e}") from None
    records = _tuning_records(args)
    if records is not None:  # the report of the model as compiled with the records
        cm = opsdk.model.compile_model(m.opsdk_mod, args.target, tuning=records)
        rep = opsdk.model.report(cm, args.target, inputs=m.inputs, source=m.opsdk_mod,
                                 name=m.name, profile=not args.no_profile,
                                 asm=not args.no_asm, cells=True,
                                 verify_kernels=args.verify_kernels)
    else:
        rep = opsdk.model.report(m, args.target, profile=not args.no_profile,
                                 asm=not args.no_asm, cells=True,
                                 verify_kernels=args.verify_kernels)
    found = _explain_record_key(args)
    if found is not None and rep.cache_key:  # the next explain of this source reads it back
        from opsdk._modelcache import module_dependencies, write_record

        write_record(*found, {"compile_key": rep.cache_key, "name": rep.model,
                              "deps": module_dependencies(list(sys.modules))},
                     None if args.no_profile else m.inputs)
    code = _print_model_report(args, rep)
    if records is not None:
        from opsdk.tune import format_tuned

        print(format_tuned(rep.kernels, records))
    return code


def _tuning_records(args: argparse.Namespace) -> list | None:
    """The records of ``--tuning DB`` for ``--target`` (None without the flag)."""
    if not getattr(args, "tuning", None):
        return None
    import opsdk
    from opsdk.tune import TuningDB, TuningDBError

    try:
        return TuningDB(args.tuning).records(opsdk.target(args.target))
    except TuningDBError as e:
        raise UsageError(str(e)) from None


def _cmd_explain_zoo(args: argparse.Namespace) -> int:
    """``opsdk explain --zoo [MODELS] --target T``: each zoo model's structure on a target
    (compiles, kernels on a catch-all rule, heavy kernels without vector instructions; on the
    host its output against torch), nothing timed."""

    from opsdk.bench import ZOO, select_zoo

    if args.op or args.model:
        raise UsageError("--zoo runs on its own (drop the op name and --model)")
    if args.zoo == "list":
        for z in ZOO.values():
            gone = z.missing()
            print(f"{z.name:<20} {z.description}"
                  + (f" [needs {', '.join(gone)}: pip install 'opsdk[zoo]']" if gone else ""))
        return 0
    try:
        zoo = select_zoo(args.zoo)
    except ValueError as e:
        raise UsageError(str(e)) from None
    import opsdk
    from opsdk._explain import check_zoo_model, format_zoo_check
    from opsdk.runners.local import pool_defaults

    try:
        opsdk.target(args.target)
    except ValueError as e:
        raise UsageError(str(e)) from None
    pool_defaults()
    _load_ops(args.module)
    rows, skipped = [], {}
    for z in zoo:
        gone = z.missing()
        if gone:  # one line per model that cannot be built here, as bench --zoo says it
            skipped[z.name] = f"needs {', '.join(gone)} (pip install 'opsdk[zoo]')"
            print(f"opsdk explain: skipped {z.name}: {skipped[z.name]}", file=sys.stderr)
            continue
        print(f"  {z.name} ...", file=sys.stderr, flush=True)
        rows.append(check_zoo_model(z, args.target, asm=not args.no_asm,
                                    cache=False if getattr(args, "no_cache", False) else None,
                                    verify_kernels=args.verify_kernels))
    print(format_zoo_check(rows, strict=args.strict))
    if args.json:
        _write_json(args.json, {"target": args.target, "skipped": skipped,
                                "models": [r.as_dict() for r in rows]})
    return 1 if any(r.failed(args.strict) for r in rows) else 0


def _cmd_explain(args: argparse.Namespace) -> int:
    import opsdk

    if args.verify_kernels and not (args.model or args.zoo):
        raise UsageError("--verify-kernels runs the kernels of a model: add --model FILE or "
                         "--zoo MODELS")
    if args.zoo is not None:
        return _cmd_explain_zoo(args)
    if args.model and not args.op:
        from opsdk.runners.local import pool_defaults  # no TVM: before anything imports it

        # Time the kernels on every core, as the model bench does (an explicit
        # TVM_NUM_THREADS wins).
        pool_defaults()
        done = _explain_from_record(args)  # before anything imports TVM (and so torch)
        if done is not None:
            return done
    _load_ops(args.module)
    if args.model:
        if args.op:
            raise UsageError("give an op or --model, not both")
        return _cmd_explain_model(args)
    if not args.op:
        raise UsageError("name an op (opsdk list shows them) or pass --model FILE")
    try:
        opsdk.get_op(args.op)
        opsdk.target(args.target)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e).strip("'\"")) from None
    shape = _parse_shape(args.shape) if args.shape is not None else None  # '' too
    attrs = _parse_attrs(args.attr)
    if args.layout is not None:  # a layout's attribute settings, under any --attr
        layouts = opsdk.get_op(args.op).layouts
        if args.layout not in layouts:
            raise UsageError(f"--layout {args.layout!r}: {args.op} has the layouts "
                             f"{', '.join(layouts)}")
        attrs = {**layouts[args.layout], **(attrs or {})}
    try:
        e = opsdk.explain(
            args.op,
            args.target,
            shape=shape,
            dtype=args.dtype,
            attrs=attrs,
            asm=not args.no_asm,
        )
    except ValueError as err:  # schema errors name the op and the argument already
        raise UsageError(str(err)) from None
    print(e.format())
    if args.json:
        _write_json(args.json, e.as_dict())
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    """``4096x768`` (as ``opsdk bench --shapes`` writes it) or ``4096,768``."""
    from opsdk._cliargs import parse_dims

    try:
        return parse_dims(text)
    except ValueError as e:
        raise UsageError(f"--shape {e}") from None


def _write_json(path: str, data: object) -> None:
    from opsdk._files import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=2))


def _cmd_setup(args: argparse.Namespace) -> int:
    if args.what == "farm":
        return _cmd_setup_farm(args)
    if args.what != "arm":
        raise UsageError(f"unknown setup target {args.what!r}; supported: arm, farm")
    if args.boards is not None or args.stop or args.status:
        raise UsageError("a number of boards, --stop and --status are for `opsdk setup farm`")
    from opsdk.runners import setup_arm

    try:
        path = setup_arm(force=args.force)
    except RuntimeError as e:  # missing tools, no apt-get, a failed download: say which
        raise UsageError(str(e)) from None  # exit 2, as verify's "cannot start the runner"
    print(f"arm emulation ready: {path}")
    return 0


def _cmd_setup_farm(args: argparse.Namespace) -> int:
    """``opsdk setup farm N | --stop | --status``: a local farm of emulated boards."""
    from opsdk.runners import FarmError, farm_status, start_farm, stop_farm

    if args.stop + args.status + (args.boards is not None) != 1:
        raise UsageError("opsdk setup farm: give the number of boards to start (e.g. "
                         "`opsdk setup farm 4`), or --stop, or --status")
    try:
        if args.stop:
            stopped = stop_farm()
            print(f"stopped {', '.join(stopped)}" if stopped else "no local farm was running")
            return 0
        if args.status:
            print(farm_status(args.tracker, args.key))
            return 0
        state = start_farm(args.boards, key=args.key or "opsdk-farm", port=args.port,
                           cpu=args.cpu, log=print)
    except FarmError as e:
        raise UsageError(str(e)) from None
    print(f"farm ready: opsdk verify --target arm --tracker {state.tracker} --key {state.key} "
          "--boards all\nstop it with: opsdk setup farm --stop")
    return 0


def _cmd_new_op(args: argparse.Namespace) -> int:
    from opsdk._scaffold import ScaffoldError, new_op

    _load_ops(args.module)
    targets = [t for t in (args.targets or "").split(",") if t]
    if not targets:  # `--targets ''`: an op with no rules would have been written silently
        raise UsageError(f"--targets {args.targets!r}: name at least one of x86, arm (the "
                         "generic lowering needs no rule: leave the schedules file out)")
    try:
        r = new_op(
            args.name,
            kind=args.kind,
            from_op=args.from_op,
            directory=args.dir,
            targets=targets,
            force=args.force,
        )
    except ScaffoldError as e:
        raise UsageError(str(e)) from None
    for p in r.files:
        print(f"wrote    {p}")
    for p in r.replaced:
        print(f"replaced {p} (--force)")
    import os

    root = r.package_root
    hint = "" if root == pathlib.Path(os.getcwd()).resolve() else f"PYTHONPATH={root} "
    print(f"\nnext: {hint}opsdk verify {r.name} --module {r.module} --target x86")
    if "arm" in targets:
        print(f"      {hint}opsdk verify {r.name} --module {r.module} --target arm")
    return 0


#: Subcommands and their one-line help, in the order ``opsdk --help`` lists them.
COMMANDS: dict[str, str] = {
    "new-op": "scaffold an op file, its schedule rules and a test",
    "verify": "differential verification against float64 references",
    "explain": "which schedule rule lowers an op (or every kernel of a --model) on a target, "
               "and why",
    "list": "list registered ops, their capability matrix and rules",
    "bench": "time ops or whole models against TVM's lowering, torch, onnxruntime and a copy "
             "roofline",
    "drift": "fused vs unfused difference per rewritten site of a model",
    "quantize": "int8 post-training quantization of a model: calibrate, per-layer "
                "sensitivity, mixed precision, accuracy and speed",
    "tune": "MetaSchedule tuning of a model's slowest kernels; a record is kept only when "
            "verified and faster than the hand rule",
    "build": "compile a model into a deployable artifact (library, manifest, checks)",
    "run": "run an artifact on a board (--rpc), the emulator (--emulate) or the host; check "
           "and time it",
    "generate": "decode with a GPT-2-style model (KV cache, float32 / int8 / int4 weights): "
                "prefill and tokens/s, logits checked",
    "setup": "prepare an execution environment (arm: cross compiler + qemu; farm N: a "
             "tracker and N emulated boards)",
}


def _args_list(s: argparse.ArgumentParser) -> None:
    s.add_argument("--module", action="append", help="also load ops from this module (OPS = [...])")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=_cmd_list)


def _args_explain(s: argparse.ArgumentParser) -> None:
    s.add_argument("op", nargs="?", help="an op name (or use --model)")
    s.add_argument(
        "--model", metavar="FILE", type=model_file,
        help="report every kernel of a compiled model: kind, rule, vector/parallel facts, "
        "vector instructions, share of the run time (host)",
    )
    s.add_argument(
        "--zoo", nargs="?", const="all", metavar="MODELS",
        help="check the model zoo's structure on --target, nothing timed: per model whether "
        "it compiles (arm: cross-compiled only), kernels on the catch-all rule or "
        "unscheduled, heavy kernels with no vector instructions and, on the host, its output "
        "against torch; exit 1 if any. MODELS as bench --zoo: all (default), small, or names "
        "separated by commas (see --zoo list)",
    )
    s.add_argument("--entry", default="build_model", help="the model file's entry function")
    s.add_argument("--model-arg", action="append", metavar="NAME=VALUE",
                   help="keyword argument of the entry function (default: DEFAULT_ARGS)")
    s.add_argument("--json", metavar="PATH", type=output_path,
                   help="also write the report as JSON")
    s.add_argument("--no-profile", action="store_true",
                   help="with --model: skip timing the kernels")
    s.add_argument("--tuning", metavar="DB",
                   help="with --model: compile with the verified records of this tuning "
                   "database (opsdk tune) and list the kernels they schedule")
    s.add_argument("--strict", action="store_true",
                   help="with --model / --zoo: exit 1 when a kernel has a problem (unscheduled, "
                   "serial, on the catch-all rule, no vector instructions, ...)")
    s.add_argument("--verify-kernels", action="store_true",
                   help="with --model / --zoo: run opsdk verify on each distinct kernel's own "
                   "case (its real shapes, attributes and epilogue) and show pass/fail per "
                   "kernel with the command that reruns it; exit 1 if one fails")
    s.add_argument(
        "--target", default="host", help="x86, arm, arm-dotprod, arm-sve, c (default: host)"
    )
    s.add_argument("--dtype", help="dtype of the first input (default: the op's first dtype)")
    s.add_argument("--shape", help="primary input shape, e.g. 4096x768 (default: symbolic batch)")
    s.add_argument("--attr", action="append", help="attribute NAME=VALUE (JSON values)")
    s.add_argument("--layout", help="a layout of the op (opsdk list shows them): its attribute "
                   "settings, e.g. dense_q4 --layout q8_0")
    s.add_argument(
        "--no-asm", action="store_true", help="skip compiling and counting vector instructions"
    )
    s.add_argument("--module", action="append", help="also load ops from this module")
    s.set_defaults(fn=_cmd_explain)


def _args_new_op(s: argparse.ArgumentParser) -> None:
    s.add_argument("name", help="op name (a Python identifier)")
    s.add_argument(
        "--kind", default="elementwise",
        choices=["elementwise", "binary", "reduction", "norm", "residual_norm"],
        help="the template: elementwise (one input), binary (two inputs, broadcasting), "
        "reduction (over one axis, the axis dropped), norm (over trailing axes, with a "
        "scale) or residual_norm (x + r and its LayerNorm, two outputs, with a fusion "
        "rule); default elementwise",
    )
    s.add_argument(
        "--from",
        dest="from_op",
        metavar="EXISTING_OP",
        help="start from a built-in op instead of a template",
    )
    s.add_argument("--dir", default=".", help="where to write the files (default: .)")
    s.add_argument("--targets", default="x86,arm", help="schedule rules for (default: x86,arm)")
    s.add_argument("--force", action="store_true", help="replace existing files (listed)")
    s.add_argument("--module", action="append", help="also load ops from this module")
    s.set_defaults(fn=_cmd_new_op)


def _args_setup(s: argparse.ArgumentParser) -> None:
    from opsdk._cliargs import host_port, positive_int

    s.add_argument("what", choices=["arm", "farm"])
    s.add_argument("boards", nargs="?", type=positive_int, metavar="N",
                   help="farm: start TVM's RPC tracker and N emulated aarch64 boards registered "
                   "to it, on 127.0.0.1 only (docs/farm.md)")
    s.add_argument("--force", action="store_true", help="rebuild the cached aarch64 environment")
    s.add_argument("--key", help="farm: the boards' device key (default opsdk-farm); with "
                   "--status, only this key")
    s.add_argument("--port", type=positive_int, default=9190,
                   help="farm: the tracker's port (default 9190)")
    s.add_argument("--cpu", default="cortex-a72", help="farm: the boards' qemu -cpu "
                   "(default cortex-a72)")
    s.add_argument("--stop", action="store_true",
                   help="farm: stop the processes `opsdk setup farm N` started, and only those")
    s.add_argument("--status", action="store_true",
                   help="farm: the tracker's boards per key (the local farm's, or --tracker's)")
    s.add_argument("--tracker", type=host_port, metavar="HOST:PORT",
                   help="farm --status: another tracker than the local farm's")
    s.set_defaults(fn=_cmd_setup)


#: Commands whose arguments and runner live in their concept's module, imported only when
#: the command is chosen: name -> (module, add-arguments function, command function).
_LAZY_COMMANDS = {
    "bench": ("opsdk.bench", "add_bench_arguments", "run_bench_command"),
    "drift": ("opsdk.drift", "add_drift_arguments", "run_drift_command"),
    "verify": ("opsdk.verify._cli", "add_verify_arguments", "run_verify_command"),
    "build": ("opsdk.deploy._cli", "add_build_arguments", "run_build_command"),
    "tune": ("opsdk.tune._cli", "add_tune_arguments", "run_tune_command"),
    "run": ("opsdk.deploy._cli", "add_run_arguments", "run_run_command"),
    "quantize": ("opsdk.quant._cli", "add_quantize_arguments", "run_quantize_command"),
    "generate": ("opsdk.llm._cli", "add_generate_arguments", "run_generate_command"),
}


def _lazy_args(name: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(s: argparse.ArgumentParser) -> None:
        import importlib

        module, add_args, command = _LAZY_COMMANDS[name]
        m = importlib.import_module(module)
        getattr(m, add_args)(s)
        s.set_defaults(fn=getattr(m, command))

    return add


_ARGS = {"list": _args_list, "explain": _args_explain, "new-op": _args_new_op,
         "setup": _args_setup, **{n: _lazy_args(n) for n in _LAZY_COMMANDS}}


#: Commands that compile whole models through the compile cache (opsdk._modelcache).
_CACHED_COMMANDS = ("explain", "bench", "drift", "build", "quantize", "generate")
_NO_CACHE_HELP = ("compile afresh: neither read nor write the compile caches of built models "
                  "and kernels, nor the records that let an unchanged model skip work "
                  "(explain's report, build's up-to-date artifact) (also OPSDK_NO_CACHE=1)")


_VERBOSE_HELP = ("show the third-party warnings and TVM log lines that opsdk hides as "
                 "known-harmless (also OPSDK_VERBOSE=1)")


def _build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s arguments are added (the others get their help line
    only, so ``opsdk --help`` imports none of their modules)."""
    p = argparse.ArgumentParser(
        prog="opsdk", description=__doc__.split("\n")[0],
        epilog="`opsdk COMMAND --help` describes a command's arguments.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        s = sub.add_parser(name, help=text, description=text)
        s._negative_number_matcher = NEGATIVE_NUMBER  # `--shape -4x768`: a value, refused
        if command == name:
            _ARGS[name](s)
            # `opsdk build ... -v` as well as `opsdk -v build ...`
            s.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                           help=_VERBOSE_HELP)
            if name in _CACHED_COMMANDS:
                s.add_argument("--no-cache", action="store_true", help=_NO_CACHE_HELP)
    return p


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first argument that names one)."""
    return next((a for a in argv if a in COMMANDS), None)


def console() -> NoReturn:
    """The ``opsdk`` console script and ``python -m opsdk``: :func:`main`, then the exit."""
    _fewer_collections()
    _exit(main())


#: CPython's cyclic collector thresholds for an ``opsdk`` process (default 700, 10, 10).
_COLLECTOR_THRESHOLDS = (100_000, 50, 100)


def _fewer_collections() -> None:
    # A command imports torch, timm and TVM (millions of objects) and then allocates
    # millions of short-lived ones. At the default thresholds the collector ran 1418 young,
    # 129 middle and 8 full collections in a cold ResNet-50 build, 1.2 s of its 11.6 s, the
    # full ones scanning the whole heap at about 0.12 s each (most of them while the model
    # file imported torch and timm). Cycles are still collected, just in larger batches:
    # the peak memory of that build grew by 2 MB of 1.1 GB. Only the console script: a
    # program that imports opsdk keeps its own settings.
    gc.set_threshold(*_COLLECTOR_THRESHOLDS)


def _exit(rc: int) -> NoReturn:
    # Python's teardown of a process that imported torch and TVM takes about a second
    # (module globals, C++ static destructors) and does nothing a finished command needs.
    # The exit handlers (temporary folders, logs) still run; a command that left a
    # non-daemon thread running exits the usual way, which waits for it.
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(rc)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(rc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opsdk`` command line ``argv`` (default: ``sys.argv[1:]``) and return its
    exit code (what :func:`console`, the console script, exits with)."""
    if sys.excepthook is _interrupted_at_start:  # from here on, the handler below
        sys.excepthook = _PREVIOUS_HOOK
    argv = list(sys.argv[1:] if argv is None else argv)
    _printable_output()
    previous_hook, sys.unraisablehook = sys.unraisablehook, _interrupt_not_swallowed
    try:  # Ctrl-C at any point, start-up (importing TVM) included: a word, not a traceback
        try:
            rc = _main(argv)
        finally:  # main() called as a function (tests, scripts) leaves the hook as it was
            sys.unraisablehook = previous_hook
        sys.stdout.flush()  # a full disk shows here, not as "Exception ignored" at exit
        return rc
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `opsdk verify | head`: the reader left; no traceback
        _drop_stdout()
        return 141  # 128 + SIGPIPE, as a shell tool killed by it
    except OSError as e:
        import errno

        # `opsdk list > /dev/full`: a write to stdout (or any file) on a full or lost disk
        # (no file named: not an open() failure), in one line for every command.
        if e.filename or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
            raise
        import contextlib

        with contextlib.suppress(OSError, ValueError):  # what stdout can still take
            sys.stdout.flush()
        _drop_stdout()
        print(f"opsdk: error: cannot write the output ({e.strerror or e}); free some space "
              "or write elsewhere", file=sys.stderr)
        return 1


def _interrupt_not_swallowed(unraisable: sys.UnraisableHookArgs) -> None:
    """A Ctrl-C that lands in a garbage-collector callback (hypothesis installs one) is
    "ignored" by Python, with a traceback, and the command ran on: delivered again to the
    main thread instead, where ``main`` turns it into exit 130."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        import _thread
        import threading

        # From another thread: raised here, it would be swallowed again.
        threading.Timer(0.01, _thread.interrupt_main).start()
        return
    sys.__unraisablehook__(unraisable)


def _drop_stdout() -> None:
    """Point the broken stdout at /dev/null, or the flush at exit raises again."""
    import contextlib
    import os

    with contextlib.suppress(OSError, ValueError):  # no real stdout (captured)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _printable_output() -> None:
    """Let stdout / stderr print any path: under ``LC_ALL=C`` or ``PYTHONIOENCODING=ascii`` a
    folder named ``ünï`` raised UnicodeEncodeError mid-report; it prints as ``\\xfcn\\xef``."""
    import contextlib

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # not a TextIOWrapper
            if stream.errors in ("strict", None):
                stream.reconfigure(errors="backslashreplace")


def _main(argv: list[str]) -> int:
    parser = _build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    if args.version:
        from opsdk import __version__

        print(f"opsdk {__version__}")
        return 0
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    if getattr(args, "no_cache", False):  # every compile of this run, however deep
        import os

        os.environ["OPSDK_NO_CACHE"] = "1"
    from opsdk._cliargs import distinct_outputs
    from opsdk._files import OutputError
    from opsdk._userfile import UserCodeError
    from opsdk.errors import UnloweredOpError

    try:  # every command: a second output on the path of the first silently replaced it
        distinct_outputs(**{k: getattr(args, k, None) for k in ("report", "junit", "json",
                                                                "plot")})
    except ValueError as e:
        print(f"opsdk {args.command}: error: {e}", file=sys.stderr)
        return 2
    from opsdk._quiet import quiet

    try:
        with quiet(show_all=args.verbose):
            return int(args.fn(args) or 0)
    except (UsageError, UserCodeError) as e:  # a user's file: its line, not our traceback
        print(f"opsdk {args.command}: error: {e}", file=sys.stderr)
        return 2
    except UnloweredOpError as e:  # a layer opsdk cannot lower: which one, not a traceback
        print(f"opsdk {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OutputError as e:  # the results are printed above; the file is as it was
        print(f"opsdk {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
