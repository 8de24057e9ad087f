"""``opsdk build`` and ``opsdk run``: argument parsing and reports."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time
from typing import Any

from .._cliargs import (
    UsageError,
    add_farm_arguments,
    host_port,
    model_file,
    named_shapes,
    output_path,
    parse_entry_args,
    positive_int,
)
from .._files import write_text_atomic
from .._timings import record_timings
from ..runners import DeviceCrash, DeviceTimeout, InputMismatch, RunnerUnavailable
from ._artifact import ArtifactError, build_artifact
from ._run import format_run, run_artifact

__all__ = ["add_build_arguments", "add_run_arguments", "run_build_command",
           "run_run_command"]


def _progress(msg: str) -> None:
    # Progress goes to stderr, the manifest summary (the result) to stdout.
    print(msg, file=sys.stderr, flush=True)


def _usage(msg: str) -> Exception:
    return UsageError(msg)


def add_build_arguments(s: argparse.ArgumentParser) -> None:
    """The arguments of ``opsdk build``."""
    s.add_argument("model",
                   help="a Python file with a build_model() entry (like the "
                   "examples), a torch.export .pt2 file, or an .onnx file; or a decoder LLM: "
                   "a name opsdk generate takes (gpt2, llama-1b, ...) or a Hugging Face "
                   "checkpoint folder (then --weights / --activations apply)")
    s.add_argument("-o", "--out", required=True, metavar="FOLDER",
                   help="the artifact folder to write (new or empty; an up-to-date "
                   "artifact of this model is kept as it is; --force replaces an earlier "
                   "artifact)")
    s.add_argument("--target", default="arm",
                   help="arm, arm-dotprod, arm-sve, x86 (default: arm)")
    s.add_argument("--entry", default="build_model", help="the model file's entry function")
    s.add_argument("--model-arg", action="append", metavar="NAME=VALUE",
                   help="keyword argument of the entry function (default: DEFAULT_ARGS)")
    s.add_argument("--shape", action="append", metavar="NAME=D0xD1...",
                   help="input shape of an ONNX model with symbolic dims")
    s.add_argument("--max-dim", action="append", metavar="NAME=N",
                   help="largest value of a symbolic input dim (e.g. s77=8, the batch): TVM "
                   "plans the intermediates' memory for it (torch.export's default is 1024)")
    s.add_argument("--int8", action="store_true",
                   help="quantize the dense layers to int8 first (opsdk quantize's defaults: "
                   "per-channel weights, asymmetric min/max activations)")
    s.add_argument("--calibration", type=positive_int, default=32, metavar="N",
                   help="with --int8: random normal calibration samples (default 32; pass "
                   "opsdk.deploy.build_artifact(calibration=...) for real data)")
    s.add_argument("--force", action="store_true", help="replace an earlier artifact in FOLDER")
    s.add_argument("--with-runtime", action="store_true",
                   help="also copy libtvm_runtime.so and libtvm_ffi.so for the target into "
                   "FOLDER/runtime/ (what the board needs beside model.so)")
    s.add_argument("--no-winograd", action="store_true",
                   help="compute every conv directly (by default 3x3 stride-1 convs with 16+ "
                   "channels run Winograd F(2x2, 3x3): 1.5-2x faster, 16/9 their weights' "
                   "memory at run time; the artifact stores them once either way)")
    s.add_argument("--bundle-weights", action="store_true",
                   help="keep the weights in model.so, transformed at compile time (format 1: "
                   "no weights.params, no transform at load; larger with Winograd)")
    s.add_argument("--weights", choices=("float32", "int8", "int4"),
                   help="a decoder's linear layers: float32 (default), int8 per channel or "
                   "int4 q4_0 groups (weight-only, as opsdk generate)")
    s.add_argument("--activations", choices=("float32", "q8_0"),
                   help="with a decoder's int8 / int4 weights: what they multiply (default: "
                   "q8_0 where the target has an integer rule, as opsdk generate)")
    s.add_argument("--json", action="store_true", help="print the manifest as JSON")
    s.add_argument("--tuning", metavar="DB",
                   help="schedule with the verified records of this tuning database (opsdk "
                   "tune) where one matches a kernel; the artifact ships and lists them")
    s.add_argument("--watch", action="store_true",
                   help="stay running: rebuild FOLDER whenever the model file, a module of "
                   "yours it imports or a file it reads changes (one process: imports and "
                   "unchanged kernels are not paid again); Ctrl-C stops")
    s.add_argument("--timings", action="store_true",
                   help="also print the seconds of each phase (import, legalize, fold "
                   "constants, schedule, kernel codegen, link, ...) and the kernels the "
                   "kernel cache reused; with --json under \"timings\"")


def _tuning(args: argparse.Namespace) -> list[Any]:
    """The records of ``--tuning DB`` for ``--target`` (none without the flag)."""
    if not getattr(args, "tuning", None):
        return []
    from ..targets import target as resolve_target  # heavy: TVM
    from ..tune import TuningDB, TuningDBError

    try:
        return TuningDB(args.tuning).records(resolve_target(args.target))
    except (TuningDBError, ValueError) as e:
        raise _usage(str(e)) from None


def _shapes(items: list[str] | None) -> dict[str, list[int]]:
    try:  # one parser for every command's --shape ('1_0', '+4' and a repeated name passed)
        return named_shapes(items)
    except ValueError as e:
        raise _usage(str(e)) from None


def _max_dims(items: list[str] | None) -> dict[str, int]:
    out = {}
    for it in items or []:
        name, sep, n = it.partition("=")
        # ASCII digits: '²'.isdigit() is true and int() of it raised
        if not sep or not name or not re.fullmatch(r"[0-9]+", n) or int(n) < 1:
            raise _usage(f"--max-dim expects NAME=N with N >= 1, got {it!r}")
        if name in out:
            raise _usage(f"--max-dim {it!r}: {name!r} is given twice")
        out[name] = int(n)
    return out


def _is_decoder(spec: str) -> bool:
    """A decoder name of ``opsdk generate`` or a Hugging Face checkpoint folder."""
    from pathlib import Path

    if (Path(spec) / "config.json").is_file():
        return True
    if Path(spec).is_file():  # a model file (and no TVM import for an up-to-date one)
        return False
    from ..llm import MODELS  # heavy: TVM

    return spec in MODELS


def _build_decoder(args: argparse.Namespace) -> dict[str, Any]:
    for flag, given in (("--int8", args.int8), ("--shape", args.shape),
                        ("--max-dim", args.max_dim), ("--model-arg", args.model_arg),
                        ("--bundle-weights", args.bundle_weights)):
        if given:
            raise _usage(f"{flag} is for model files; {args.model} is a decoder (its weights: "
                         "--weights int8 / int4)")
    if args.activations == "q8_0" and args.weights in (None, "float32"):
        raise _usage("--activations q8_0 needs --weights int8 or int4")
    from ._decoder import build_decoder_artifact

    return build_decoder_artifact(args.model, args.out, weights=args.weights or "float32",
                                  activations=args.activations, target=args.target,
                                  force=args.force, with_runtime=args.with_runtime,
                                  log=None if args.json else _progress)


def run_build_command(args: argparse.Namespace) -> int:
    """``opsdk build``."""
    spec = args.model
    decoder = _is_decoder(spec)
    if not decoder:
        try:
            model_file(spec)
        except argparse.ArgumentTypeError as e:
            raise _usage(f"{e} (nor a decoder name of opsdk generate)") from None
        for flag, given in (("--weights", args.weights), ("--activations", args.activations)):
            if given:
                raise _usage(f"{flag} is for decoders (opsdk generate's models); "
                             f"{spec} is a model file: --int8 quantizes it")
    try:
        entry_args = parse_entry_args(args.model_arg)
    except ValueError as e:
        raise _usage(str(e)) from None
    if args.watch:
        if decoder:
            raise _usage(f"--watch rebuilds a model file when it changes; {spec} is a decoder")
        if args.json:
            raise _usage("--watch prints a line per rebuild; drop --json (a build without "
                         "--watch prints the manifest as JSON)")
        return _watch(args, entry_args)
    t0 = time.perf_counter()
    with record_timings() as timings:
        m = _build_once(args, entry_args, args.force, decoder)
    total = time.perf_counter() - t0  # the build, or an up-to-date artifact's check
    if args.json:
        print(json.dumps(m | ({"timings": _timings_dict(timings, total)} if args.timings
                              else {}), indent=2))
        return 0
    print(_format_manifest(m, args.out))
    if args.timings:
        print(_format_timings(timings, total))
    return 0


def _build_once(args: argparse.Namespace, entry_args: dict[str, Any], force: bool,
                decoder: bool = False) -> dict[str, Any]:
    """One build of a model file or a decoder, its errors as usage errors naming it."""
    spec = args.model
    try:
        if decoder:
            return _build_decoder(args)
        return build_artifact(spec, args.out, target=args.target, entry=args.entry,
                              entry_args=entry_args, shapes=_shapes(args.shape) or None,
                              max_dims=_max_dims(args.max_dim) or None,
                              int8=args.int8, calibration=args.calibration,
                              force=force, with_runtime=args.with_runtime,
                              winograd=not args.no_winograd,
                              lift_weights=not args.bundle_weights,
                              tuning=_tuning(args),
                              log=None if args.json else _progress)
    except ArtifactError as e:
        raise _usage(str(e)) from None
    except ModuleNotFoundError as e:
        if e.name != spec:  # the model file's own import failed
            raise _usage(f"cannot load model {spec!r}: {e}") from None
        from ..llm import MODELS  # heavy: TVM (imported already)

        raise _usage(f"cannot load model {spec!r}: {e}; nor is it a decoder name of opsdk "
                     f"generate ({', '.join(MODELS)}) or a checkpoint folder") from None
    except (TypeError, ImportError, AttributeError, FileNotFoundError) as e:
        raise _usage(f"cannot load model {spec!r}: {e}") from None
    except OSError as e:  # a full disk while writing: nothing was left behind
        raise _usage(f"cannot write the artifact {args.out}: {e.strerror or e}") from None


def _watch(args: argparse.Namespace, entry_args: dict[str, Any]) -> int:
    """``opsdk build --watch``: the first build's report as usual, then a line per
    rebuild."""
    from ._watch import watch_build

    def report(m: Any, timings: Any, seconds: float, round_: int) -> None:
        if round_ == 0:
            print(_format_manifest(m, args.out))
        elif m.get("up_to_date"):
            print(f"{time.strftime('%H:%M:%S')} {args.out} is up to date ({seconds:.2f} s)")
        else:
            how = (f"{timings.kernels_reused} kernels reused, {timings.kernels_compiled} "
                   "compiled" if timings.kernels_reused or timings.kernels_compiled else
                   "the compiled model came from the compile cache")
            print(f"{time.strftime('%H:%M:%S')} rebuilt {args.out} in {seconds:.2f} s: {how}")
        if args.timings:
            print(_format_timings(timings, seconds))
        sys.stdout.flush()

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # a build under way cleans up its folder, as for Ctrl-C

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)  # `kill`, a supervisor: a clean stop too
    return watch_build(lambda force: _build_once(args, entry_args, force), args.model,
                       args.out, report=report, force=args.force, say=_progress)


def _timings_dict(t: Any, total: float) -> dict[str, Any]:
    """The phases' seconds, the rest of the build (starting Python, reading the options,
    the target) as ``other``, and the kernel and fold caches' counts."""
    phases = {k: round(v, 3) for k, v in t.seconds.items()}
    phases["other"] = round(max(0.0, total - sum(t.seconds.values())), 3)
    return {"seconds": phases, "total_seconds": round(total, 3),
            "kernels_reused": t.kernels_reused, "kernels_compiled": t.kernels_compiled,
            "folds_reused": t.folds_reused, "folds_computed": t.folds_computed}


def _format_timings(t: Any, total: float) -> str:
    d = _timings_dict(t, total)
    w = max(len(k) for k in d["seconds"])
    lines = ["timings:"] + [f"  {k:<{w}}  {v:7.2f} s" for k, v in d["seconds"].items()]
    lines.append(f"  {'total':<{w}}  {total:7.2f} s")
    if t.kernels_reused or t.kernels_compiled:
        lines.append(f"  kernel cache: {t.kernels_reused} kernels reused, "
                     f"{t.kernels_compiled} compiled")
    if t.folds_reused or t.folds_computed:
        lines.append(f"  fold cache: {t.folds_reused} folded constants reused, "
                     f"{t.folds_computed} computed")
    return "\n".join(lines)


def _weights_line(m: dict[str, Any], mb: Any) -> str:
    lib, w = m["library"], m.get("weights") or {}
    if not w.get("file"):
        return (f"library:  model.so {mb(lib['bytes'])} (weights "
                f"{mb(lib['weights_bytes'])} bundled)")
    return (f"library:  model.so {mb(lib['bytes'])} + {w['file']} {mb(w['bytes'])} "
            f"({len(w['names'])} weights, stored once; {mb(w['loaded_bytes'])} once "
            "transformed at load)")


def _format_decoder(m: dict[str, Any], folder: str) -> str:
    d, w, lib = m["decoder"], m["weights"], m["library"]
    cfg, chk = d["config"], d["check"]
    rules: dict[str, int] = {}
    for k in m["kernels"]:
        rules[k["rule"]] = rules.get(k["rule"], 0) + 1
    quant = "" if d["weights"] == "float32" or "host_vs_float_model" not in chk else \
        f"; vs the float model {chk['host_vs_float_model'] * 100:.2f}%"
    ref = (f"; host logits vs the float64 reference {chk['host_vs_reference']:.2e}{quant}"
           if "host_vs_reference" in chk else "")
    return "\n".join([
        f"target:   {m['target']['name'] or 'custom'} ({m['target']['arch']}"
        + (f", -mcpu={m['target']['mcpu']}" if m["target"].get("mcpu") else "") + ")",
        f"needs:    {', '.join('+' + f for f in m['target']['features']) or 'no extension'}",
        f"decoder:  {cfg['arch']}, {cfg['layers']} layers, width {cfg['width']}, vocab "
        f"{cfg['vocab']}; {d['weights']} weights, {d['activations']} activations; entries "
        + ", ".join(d["entries"]),
        f"library:  model.so {lib['bytes'] / 1e6:.2f} MB (no weights) + {w['file']} "
        f"{w['loaded_bytes'] / 1e6:.2f} MB ({len(w['tensors'])} tensors in the kernels' "
        "form, each once; mapped at load, no copy)",
        f"check:    prefill {chk['prompt_tokens']} tokens + {chk['decode_steps']} steps{ref}",
        f"kernels:  {len(m['kernels'])} ("
        + ", ".join(f"{n} {r}" for r, n in sorted(rules.items(), key=lambda kv: -kv[1])) + ")",
        f"next:     opsdk run {folder}"
        + (" --emulate   (or --rpc HOST:PORT)" if m["target"]["arch"] == "aarch64" else
           "   (generate: opsdk.deploy.load_decoder)"),
    ])


def _format_manifest(m: dict[str, Any], folder: str) -> str:
    if m.get("kind") == "decoder":
        return _format_decoder(m, folder)
    mem = m.get("memory") or {}

    def mb(n: int | None) -> str:
        return "?" if n is None else f"{n / 1e6:.2f} MB"

    def io(sp: dict[str, Any]) -> str:
        dims = "x".join(str(d) for d in (sp["shape"] or sp["example_shape"]))
        return f"{sp['name']}: {sp['dtype']}[{dims}]"

    rules: dict[str, int] = {}
    per_call = [k for k in m["kernels"] if not k.get("at_load")]
    for k in per_call:
        rules[k["rule"]] = rules.get(k["rule"], 0) + 1
    at_load = len(m["kernels"]) - len(per_call)
    at = ", ".join(f"{k}={v}" for k, v in (mem.get("at") or {}).items())
    bounds = mem.get("planned_for") or {}
    planned_for = ", ".join(f"{k} <= {v}" for k, v in bounds.items())
    return "\n".join([
        f"target:   {m['target']['name'] or 'custom'} ({m['target']['arch']}"
        + (f", -mcpu={m['target']['mcpu']}" if m["target"].get("mcpu") else "") + ")",
        f"needs:    {', '.join('+' + f for f in m['target']['features']) or 'no extension'}",
        _weights_line(m, mb),
        f"inputs:   {'; '.join(io(s) for s in m['inputs'])}",
        f"outputs:  {'; '.join(io(s) for s in m['outputs'])}",
        f"memory:   {mb(mem.get('planned_intermediates_bytes'))} planned for intermediates "
        f"in {mem.get('planned_blocks', 0)} blocks + {mb(mem.get('outputs_bytes'))} outputs"
        + (f" (planned for {planned_for}; outputs at {at}; --max-dim NAME=N plans for a "
           "smaller bound)" if planned_for else
           f" (at {at}; formula {mem.get('planned_intermediates_formula')} bytes)" if at
           else ""),
        *([f"int8:     {len(q['int8_layers'])} dense layers"
           + (f" ({len(q['float_layers'])} kept float)" if q["float_layers"] else "")
           + f"; output vs float: relative RMSE {q['vs_float']['rel_rmse'] * 100:.2f}%"]
          if (q := m.get("quantization")) else []),
        f"kernels:  {len(per_call)} ("
        + ", ".join(f"{n} {r}" for r, n in sorted(rules.items(), key=lambda kv: -kv[1])) + ")"
        + (f" + {at_load} run once at load (weight transforms)" if at_load else ""),
        f"next:     opsdk run {folder}"
        + (" --emulate   (or --rpc HOST:PORT)" if m["target"]["arch"] == "aarch64" else ""),
    ])


def add_run_arguments(s: argparse.ArgumentParser) -> None:
    """The arguments of ``opsdk run``."""
    s.add_argument("artifact", nargs="+", help="folders written by opsdk build (several: "
                   "each checked in turn, or spread over a tracker's boards with --boards)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--rpc", type=host_port, metavar="HOST:PORT",
                       help="a board running python -m tvm.exec.rpc_server")
    where.add_argument("--tracker", type=host_port, metavar="HOST:PORT",
                       help="a TVM RPC tracker (with --key)")
    where.add_argument("--emulate", action="store_true",
                       help="run an aarch64 artifact under qemu on this host")
    s.add_argument("--key", help="device key (with --tracker)")
    s.add_argument("--qemu-cpu", help="with --emulate: the emulated CPU (default: the "
                   "target's, cortex-a72 for arm, cortex-a76 for arm-dotprod)")
    given = s.add_mutually_exclusive_group()
    given.add_argument("--inputs", metavar="FILE.npz",
                       help="inputs by name (default: the example inputs stored at build time)")
    given.add_argument("--random", action="store_true", help="random inputs (--seed)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--repeats", type=positive_int, default=10,
                   help="warm runs timed on the device (default 10)")
    s.add_argument("--threads", type=positive_int,
                   help="TVM threads for a run on this host (default: every core); a board "
                   "uses what its rpc_server was started with (TVM_NUM_THREADS there)")
    add_farm_arguments(s, "artifact")
    s.add_argument("--json", metavar="PATH", type=output_path, help="also write the result")


def run_run_command(args: argparse.Namespace) -> int:
    """``opsdk run``: exit 0 when every output matches, 1 when one does not."""

    if args.tracker and not args.key:
        raise _usage("--tracker needs --key (the device key registered with the tracker)")
    if args.boards is not None:
        if not args.tracker:
            raise _usage("--boards spreads the artifacts over a tracker's boards: give "
                         "--tracker HOST:PORT --key K (not --rpc or --emulate); `opsdk setup "
                         "farm N` starts a local farm")
        return _run_sharded(args)
    from ..runners.local import pool_defaults  # heavy: TVM

    pool_defaults(args.threads)  # before TVM's pool starts
    results = []
    for folder in args.artifact:
        if len(args.artifact) > 1:
            print(f"== {folder}")
        try:
            res = run_artifact(folder, rpc=args.rpc, tracker=args.tracker, key=args.key,
                               emulate=args.emulate, qemu_cpu=args.qemu_cpu,
                               inputs=args.inputs, random_inputs=args.random, seed=args.seed,
                               repeats=args.repeats)
        except (ArtifactError, InputMismatch) as e:
            raise _usage(str(e)) from None
        except (DeviceCrash, DeviceTimeout) as e:
            print(f"opsdk run: FAIL: the model did not run to the end on the device: {e}")
            res = {"ok": False, "artifact": str(folder), "error": str(e)}
        except (RunnerUnavailable, RuntimeError) as e:
            raise _usage(f"cannot run on the device: {str(e).strip().splitlines()[0]}") \
                from None
        else:
            print(format_run(res))
        results.append(res)
    if args.json:
        doc = results[0] if len(results) == 1 else {"runs": results}
        write_text_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    if len(results) > 1:
        bad = [r["artifact"] for r in results if not r["ok"]]
        print(f"{len(results)} artifacts: {len(results) - len(bad)} pass"
              + (f", {len(bad)} fail ({', '.join(bad)})" if bad else ""))
    return 0 if all(r["ok"] for r in results) else 1


def _run_sharded(args: argparse.Namespace) -> int:
    """``opsdk run A B ... --tracker H:P --key K --boards N|all``."""
    from ._run import run_artifacts_sharded  # heavy: TVM

    try:
        results, device = run_artifacts_sharded(
            args.artifact, tracker=args.tracker, key=args.key, boards=args.boards,
            inputs=args.inputs, random_inputs=args.random, seed=args.seed,
            repeats=args.repeats, cell_timeout=args.cell_timeout,
            progress=lambda f: _progress(f"running {f} on a board"))
    except (ArtifactError, ValueError) as e:
        raise _usage(str(e)) from None
    for r in results:
        print(f"== {r['artifact']}" + (f" (board {r['board']})" if r.get("board") else ""))
        print(format_run(r) if "error" not in r else f"FAIL: {r['error']}")
    print(f"\n{device['device']}: "
          + ", ".join(f"{b} {n}" for b, n in device["boards"].items()))
    for note in device["lost"]:
        print(note)
    bad = [r["artifact"] for r in results if not r["ok"]]
    print(f"{len(results)} artifacts: {len(results) - len(bad)} pass"
          + (f", {len(bad)} fail ({', '.join(bad)})" if bad else "")
          + f", {device['seconds']:.1f} s wall")
    if args.json:
        write_text_atomic(args.json, json.dumps({**device, "runs": results}, indent=2) + "\n")
    return 0 if not bad else 1
