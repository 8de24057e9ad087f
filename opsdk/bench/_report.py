"""Bench output: the text table, a PNG chart and the ``opsdk bench`` command."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._cliargs import (
    add_farm_arguments,
    distinct_outputs,
    host_port,
    model_file,
    output_path,
    parse_dims,
    positive_float,
    positive_int,
)
from .._files import write_bytes_atomic, write_text_atomic
from .._userfile import UserCodeError
from ..runners import runner_for
from ._zoo import ZOO, select_zoo

__all__ = ["add_bench_arguments", "format_table", "plot", "run_bench_command", "summary"]


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The bench results as a fixed-width text table (times are medians in ms).

    Examples
    --------
    >>> from opsdk.bench import format_table
    >>> print(format_table([]).splitlines()[0].split()[:2])
    ['case', 'rule']
    """
    head = (
        f"{'case':<36} {'rule':<15} {'opsdk':>8} {'GB/s':>6} {'%copy':>6} "
        f"{'tvm':>8} {'dlight':>8} {'torch':>8} {'ort':>8} {'copy':>7} {'np.copy':>7} "
        f"{'x tvm':>7} {'x dl':>7} {'x torch':>7} {'x ort':>6} {'hot%':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        case = f"{_label(r)} {r['dtype']}"
        dl = r.get("dlight_ms") if r.get("dlight_applied", True) else None
        lines.append(
            f"{case:<36} {r.get('rule', '-'):<15} {_f(r.get('opsdk_ms'), '8.3f')} "
            f"{_f(r.get('opsdk_gbps'), '6.1f')} {_f(r.get('pct_copy'), '6.0f')} "
            f"{_f(r.get('tvm_ms'), '8.3f')} {_f(dl, '8.3f')} {_f(r.get('torch_ms'), '8.3f')} "
            f"{_f(r.get('onnxruntime_ms'), '8.3f')} "
            f"{_f(r.get('copy_tvm_ms'), '7.3f')} {_f(r.get('copy_numpy_ms'), '7.3f')} "
            f"{_f(r.get('speedup_tvm'), '7.1f')} "
            f"{_f(r.get('speedup_dlight') if dl else None, '7.1f')} "
            f"{_f(r.get('speedup_torch'), '7.2f')} {_f(r.get('speedup_onnxruntime'), '6.2f')} "
            f"{_f(r.get('pct_hot'), '5.0f')}"
        )
    lines.append(
        "times: median ms over interleaved repeats; GB/s = (inputs + output bytes) / time; "
        "%copy = the faster copy's time / opsdk's time (copy = TVM parallel copy, np.copy = "
        "numpy, same bytes); x = speedup of opsdk; %copy, x and hot% are medians of per-round "
        "ratios; dlight '-' = no dlight rule applied; ort = onnxruntime's fused CPU kernel "
        "(LayerNormalization, SimplifiedLayerNormalization, Gelu/FastGelu, BiasGelu, Softmax, "
        "GroupNormalization; '-' where it has none: NHWC group norm, bfloat16); "
        "hot% = time of the same kernel on a cache-resident slice of the rows (scaled to all "
        "rows) / its time here: near 100 the op is compute-bound at this size"
    )
    return "\n".join(lines)


def _geomean(vals: Sequence[float]) -> float | None:
    vals = [v for v in vals if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summary(rows: Sequence[dict[str, Any]], dtype: str = "float32") -> dict[str, Any]:
    """Acceptance figures over the ``dtype`` rows: worst/geomean speedups and % of copy.

    Examples
    --------
    >>> from opsdk.bench import summary
    >>> summary([])["cases"]
    0
    """
    sel = [r for r in rows if r["dtype"] == dtype]
    return {
        "dtype": dtype,
        "cases": len(sel),
        "min_speedup_tvm": min(
            (r["speedup_tvm"] for r in sel if r.get("speedup_tvm")), default=None
        ),
        "geomean_speedup_torch": _geomean([r.get("speedup_torch") for r in sel]),
        "geomean_speedup_onnxruntime": _geomean([r.get("speedup_onnxruntime") for r in sel]),
        "below_1x_onnxruntime": [
            {"case": _label(r), "speedup_onnxruntime": r["speedup_onnxruntime"]}
            for r in sel
            if r.get("speedup_onnxruntime") is not None and r["speedup_onnxruntime"] < 1.0
        ],
        "min_pct_copy": min((r["pct_copy"] for r in sel if r.get("pct_copy")), default=None),
        "geomean_pct_copy": _geomean([r.get("pct_copy") for r in sel]),
        "below_80_pct_copy": [
            {"case": _label(r), "pct_copy": r["pct_copy"], "pct_hot": r.get("pct_hot")}
            for r in sel
            if r.get("pct_copy") is not None and r["pct_copy"] < 80
        ],
        "below_8x_tvm": [
            {"case": _label(r), "speedup_tvm": r["speedup_tvm"], "tvm_ceiling": r["tvm_ceiling"]}
            for r in sel
            if r.get("speedup_tvm") is not None and r["speedup_tvm"] < 8
        ],
    }


def _label(r: dict[str, Any]) -> str:
    name = r["op"] + (f"[{r['layout']}]" if r.get("layout") else "")
    return f"{name} {'x'.join(map(str, r['shape']))}"


def _why(item: dict[str, Any]) -> str:
    hot = item.get("pct_hot")
    if hot is None:
        return "no cache-resident slice measured"
    kind = "compute-bound" if hot >= 80 else "memory-side"
    return f"{kind}: in-cache time is {hot:.0f} % of it"


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Grouped bar chart of achieved GB/s per case and candidate (copy = the roofline)."""
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    cands = [
        ("opsdk", "opsdk"),
        ("tvm", "TVM default"),
        ("dlight", "TVM dlight"),
        ("torch", "torch eager"),
        ("copy_tvm", "copy (TVM)"),
        ("copy_numpy", "copy (numpy)"),
    ]
    labels = [
        (
            r["op"]
            + (f"[{r['layout']}]" if r.get("layout") else "")
            + f"\n{'x'.join(map(str, r['shape']))}\n{r['dtype']}"
        )
        for r in rows
    ]
    width = 0.8 / len(cands)
    fig, ax = plt.subplots(figsize=(min(22.0, max(8.0, 0.9 * len(rows) + 3)), 6))
    for k, (c, name) in enumerate(cands):
        vals = [r.get(f"{c}_gbps") or 0.0 for r in rows]
        ax.bar(
            [i + (k - len(cands) / 2 + 0.5) * width for i in range(len(rows))],
            vals,
            width,
            label=name,
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("GB/s (inputs + output bytes / median time)")
    ax.set_title("opsdk bench: achieved bandwidth (higher is better)")
    ax.legend(fontsize=8, ncols=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_bytes_atomic(path, buf.getvalue())
    plt.close(fig)


def _message(e: BaseException) -> str:
    """An error's text without the quotes a KeyError's repr adds (either kind)."""
    return str(e).strip("'\"")


def _shape(text: str) -> tuple[int, ...]:
    try:
        return parse_dims(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad shape {e}") from None


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``opsdk bench`` options to ``parser``.

    Examples
    --------
    >>> import argparse
    >>> from opsdk.bench import add_bench_arguments
    >>> p = argparse.ArgumentParser()
    >>> add_bench_arguments(p)
    >>> p.parse_args(["layer_norm", "--shapes", "64x32"]).shapes
    [(64, 32)]
    """
    parser.add_argument(
        "ops", nargs="*", help="ops to run, NAME or NAME:LAYOUT (default: all built-in ops)"
    )
    parser.add_argument("--target", default="x86",
                        help="x86 (the host, default); with --rpc/--emulate: arm, arm-dotprod")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--rpc", type=host_port, metavar="HOST:PORT",
                       help="time the ops on a board running python -m tvm.exec.rpc_server "
                       "(opsdk vs TVM's lowering, timed on the device)")
    where.add_argument("--tracker", type=host_port, metavar="HOST:PORT",
                       help="a TVM RPC tracker (with --key)")
    where.add_argument("--emulate", action="store_true",
                       help="like --rpc, under qemu on this host (checks the path; emulated "
                       "timings are not performance)")
    parser.add_argument("--key", help="device key (with --tracker)")
    add_farm_arguments(parser, "op case")
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=_shape,
        metavar="SHAPE",
        help="shapes like 4096x768 (default: the issue's benchmark shapes per op)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16"],
        metavar="DTYPE",
        help="dtypes (default: float32 float16)",
    )
    parser.add_argument("--repeats", type=positive_int, default=15,
                        help="interleaved samples per case")
    parser.add_argument(
        "--budget-ms",
        type=positive_float,
        default=20.0,
        help="length of one timed batch of calls (default 20 ms)",
    )
    parser.add_argument("--threads", type=positive_int,
                        help="threads for torch (default: all cores)")
    parser.add_argument(
        "--module", action="append",
        help="also load ops from this module (custom ops: compared with their unscheduled "
        "lowering, the copy roofline and, through an OpDef.torch mapping, torch eager; pass "
        "--shapes)",
    )
    parser.add_argument(
        "--model", action="append", metavar="FILE", type=model_file,
        help="benchmark a whole model end to end (opsdk vs TVM default, torch eager, "
        "onnxruntime): a Python file whose ENTRY returns (torch module, example args), or an "
        ".onnx file (repeatable)",
    )
    parser.add_argument(
        "--examples", action="store_true",
        help="benchmark the three example models at their default sizes",
    )
    parser.add_argument(
        "--zoo", nargs="?", const="all", metavar="MODELS",
        help="benchmark the model zoo (public architectures, random weights, no downloads) "
        "against the peers of --peers: numerics, compile time, library size, peak memory, "
        "median and p99 latency; MODELS: all (default), small, or names separated by commas "
        "(see --zoo list)",
    )
    parser.add_argument(
        "--decode", metavar="MODEL",
        help="benchmark LLM decode (a model opsdk generate takes: gpt2, llama-1b, ..., or a "
        "checkpoint folder): prefill ms, decode tokens/s and peak memory of opsdk's int4 / "
        "int8 weights (a decoder artifact for this host, as deployed) against llama.cpp's "
        "q4_0 / q8_0 and torch, interleaved rounds (--repeats), --threads threads",
    )
    parser.add_argument(
        "--decode-weights", metavar="LIST", default="int4,int8",
        help="with --decode: opsdk weight modes, separated by commas (default int4,int8; "
        "also float32)",
    )
    parser.add_argument(
        "--peers", metavar="LIST",
        help="runtimes to compare with, separated by commas, from tvm_default, torch, "
        "onnxruntime, openvino, executorch, torch_compile; --model / --examples default to "
        "tvm_default,torch,onnxruntime (TVM's default pipeline takes seconds to minutes per "
        "call on a large model: leave it out with --peers torch,onnxruntime), --zoo to "
        "onnxruntime,openvino,executorch,torch,torch_compile; with --decode: llamacpp,torch "
        "(default); a peer that is not installed is skipped with one line",
    )
    parser.add_argument(
        "--use-cache", action="store_true",
        help="with --zoo: let opsdk's compile cache answer (default: compile afresh, so the "
        "compile time and peak memory are a real compile's)",
    )
    parser.add_argument("--entry", default="build_model", help="model entry function")
    parser.add_argument(
        "--model-arg", action="append", metavar="NAME=VALUE",
        help="keyword argument of the entry function (JSON value; default: the file's "
        "DEFAULT_ARGS)",
    )
    parser.add_argument(
        "--gemm", nargs="*", type=_shape, metavar="MxNxK",
        help="fp32 GEMM x[M,K] @ w[K,N] vs torch.matmul in GFLOPS (no shapes: 1024x1024x1024 "
        "and 128x3072x768)",
    )
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write the results as JSON")
    parser.add_argument("--plot", "--chart", metavar="PATH", type=output_path,
                        help="write a bar chart (PNG; with --zoo also .svg or .html)")
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip checking opsdk outputs against the float64 reference",
    )


def run_bench_command(args: argparse.Namespace) -> int:
    """Run ``opsdk bench`` with parsed ``args``; returns the exit code (2: usage error)."""
    from ._run import run_bench  # heavy: TVM

    try:  # before any work: the plot would silently replace the JSON
        distinct_outputs(json=getattr(args, "json", None), plot=getattr(args, "plot", None))
    except ValueError as e:
        print(f"opsdk bench: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "boards", None) is not None and not (
            getattr(args, "tracker", None) and args.key):
        print("opsdk bench: error: --boards shards the op cases over a tracker's boards: give "
              "--tracker HOST:PORT --key K (not --rpc or --emulate); `opsdk setup farm N` "
              "starts a local farm", file=sys.stderr)
        return 2
    if getattr(args, "module", None):
        from .._plugins import load_plugins

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        from .._userfile import UserCodeError

        try:
            load_plugins(list(args.module))
        except (ImportError, TypeError, ValueError, UserCodeError) as e:
            print(f"opsdk bench: error: cannot load op modules: {e}", file=sys.stderr)
            return 2
    if getattr(args, "decode", None):
        return _bench_decode(args)
    if getattr(args, "zoo", None) is not None:
        return _bench_zoo(args)
    if getattr(args, "model", None) or getattr(args, "examples", False) or \
            getattr(args, "gemm", None) is not None:
        return _bench_models(args)
    if args.ops and "qdense" in args.ops:
        return _bench_qdense(args)
    if getattr(args, "rpc", None) or getattr(args, "tracker", None) or \
            getattr(args, "emulate", False):
        return _bench_remote(args)
    for dt in args.dtypes:
        if dt not in ("float32", "float16", "bfloat16"):
            print(f"opsdk bench: error: unsupported dtype {dt!r}", file=sys.stderr)
            return 2
    try:
        rows = run_bench(
            args.ops or None,
            target=args.target,
            shapes=args.shapes,
            dtypes=args.dtypes,
            repeats=args.repeats,
            threads=args.threads,
            budget_ms=args.budget_ms,
            check=not args.no_check,
            progress=lambda s: print(f"  {s} ...", file=sys.stderr, flush=True),
        )
    except (KeyError, ValueError) as e:
        print(f"opsdk bench: error: {_message(e)}", file=sys.stderr)
        return 2
    print(format_table(rows))
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        s = summary(rows, dt)
        print(
            f"{dt}: min x tvm {_f(s['min_speedup_tvm'], '.1f')}, geomean x torch "
            f"{_f(s['geomean_speedup_torch'], '.2f')}, geomean x ort "
            f"{_f(s['geomean_speedup_onnxruntime'], '.2f')}, % of copy min "
            f"{_f(s['min_pct_copy'], '.0f')} / geomean {_f(s['geomean_pct_copy'], '.0f')}"
        )
        for item in s["below_80_pct_copy"]:
            print(f"  below 80 % of copy: {item['case']} {item['pct_copy']:.0f} % ({_why(item)})")
        for item in s["below_1x_onnxruntime"]:
            print(f"  below 1.0x onnxruntime: {item['case']} {item['speedup_onnxruntime']:.2f}x")
        for item in s["below_8x_tvm"]:
            ceil = item["tvm_ceiling"]
            limit = f"; at the copy's speed it would be {ceil:.1f}x" if ceil else ""
            print(f"  below 8x tvm: {item['case']} {item['speedup_tvm']:.1f}x{limit}")
    if args.json:
        write_text_atomic(args.json, json.dumps(
            {"rows": rows, "summary": [summary(rows, d) for d in args.dtypes]}, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    """``opsdk bench OP --target arm --rpc HOST:PORT`` (or ``--emulate``)."""
    from ._remote import format_remote_table, run_remote_bench  # heavy: TVM

    def fail(msg: str) -> int:
        print(f"opsdk bench: error: {msg}", file=sys.stderr)
        return 2

    if args.tracker and not args.key:
        return fail("--tracker needs --key (the device key registered with the tracker)")
    if getattr(args, "boards", None) is not None:
        return _bench_sharded(args, fail)
    try:
        runner = runner_for(args.target, rpc=args.rpc, tracker=args.tracker, key=args.key)
        if args.emulate and runner.name == "local":
            return fail(f"--emulate runs aarch64 targets; {args.target!r} runs on this host: "
                        "drop --emulate")
    except ValueError as e:
        return fail(str(e))
    try:
        with runner:
            preflight = getattr(runner, "preflight", None)
            if (args.rpc or args.tracker) and preflight is not None:
                preflight()
            rows = run_remote_bench(
                runner, args.ops or None, target=args.target, shapes=args.shapes,
                dtypes=args.dtypes, repeats=args.repeats, check=not args.no_check,
                progress=lambda s: print(f"  {s} ...", file=sys.stderr, flush=True))
            device = runner.device_info()["device"]
    except (KeyError, ValueError) as e:
        return fail(_message(e))
    except RuntimeError as e:
        return fail(f"cannot run on the device: {str(e).strip().splitlines()[0]}")
    print(format_remote_table(rows, device))
    if args.emulate:
        print("warning: emulated timings are not performance; the ratios show only that "
              "both kernels ran")
    if args.json:
        write_text_atomic(args.json, json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


def _bench_sharded(args: argparse.Namespace, fail: Callable[[str], int]) -> int:
    """``opsdk bench OPS --target arm --tracker HOST:PORT --key K --boards N|all``."""
    from ._remote import format_remote_table, run_remote_bench_sharded  # heavy: TVM

    try:
        rows, device = run_remote_bench_sharded(
            args.ops or None, target=args.target, tracker=args.tracker, key=args.key,
            boards=args.boards, shapes=args.shapes, dtypes=args.dtypes, repeats=args.repeats,
            check=not args.no_check, modules=list(args.module or ()),
            cell_timeout=args.cell_timeout,
            progress=lambda s: print(f"  {s} ...", file=sys.stderr, flush=True))
    except (KeyError, ValueError) as e:
        return fail(_message(e))
    print(format_remote_table(rows, device["device"], device["lost"]))
    print("cases per board: " + ", ".join(f"{b} {n}" for b, n in device["boards"].items()))
    if args.json:
        write_text_atomic(args.json, json.dumps({**device, "rows": rows}, indent=2))
    return 1 if any("error" in r for r in rows) else 0


def _bench_qdense(args: argparse.Namespace) -> int:
    """``opsdk bench qdense [--shapes M,K,N]``: int8 qdense vs torch float32 / dynamic int8."""
    from ._qdense import bench_qdense  # heavy: TVM

    if args.ops != ["qdense"]:
        print("opsdk bench: error: bench qdense on its own", file=sys.stderr)
        return 2
    shapes = args.shapes or [(1024, 1024, 1024)]
    rows = []
    for shp in shapes:
        if len(shp) != 3:
            print(f"opsdk bench: error: qdense shapes are M,K,N, got {shp}", file=sys.stderr)
            return 2
        m, k, n = shp
        rows.append(bench_qdense(m, k, n, repeats=args.repeats, threads=args.threads,
                                 target=args.target))
    print(f"{'M x K x N':<18}{'rule':<18}{'qdense ms':>10}{'torch f32':>11}{'torch dyn':>11}"
          f"{'x f32':>8}{'x dyn':>8}{'GOP/s':>8}  exact")
    for r in rows:
        print(f"{'x'.join(map(str, r['shape'])):<18}{r['rule']:<18}{r['tvm_ms']:>10.3f}"
              f"{r['torch_f32_ms']:>11.3f}{r['torch_dynamic_int8_ms']:>11.3f}"
              f"{r['vs_torch_f32']:>8.2f}{r['vs_torch_dynamic_int8']:>8.2f}{r['gops']:>8.1f}"
              f"  {r['exact']}")
    print(f"threads: torch {rows[0]['threads']}, TVM {rows[0]['tvm_threads']}; medians of "
          f"{rows[0]['repeats']} interleaved rounds; int8 -> int8 per-channel")
    if args.json:
        write_text_atomic(args.json, json.dumps(rows, indent=2, default=list))
    return 0


def _peers(spec: str | None, default: Sequence[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the peers of ``--peers`` that can run here, {peer: why not} for the others, each
    said in one line); ``default`` when ``spec`` is None. ValueError names an unknown one."""
    from ._model import ALL_CANDIDATES, peer_missing  # heavy: TVM

    peers = tuple(default) if spec is None else tuple(
        dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    bad = [p for p in peers if p not in ALL_CANDIDATES or p == "opsdk"]
    if bad:
        raise ValueError(f"--peers: unknown peer {bad[0]!r}; choose from "
                         f"{', '.join(c for c in ALL_CANDIDATES if c != 'opsdk')}")
    skipped = {}
    for p in peers:  # one line per peer that cannot run here, not one per model
        why = peer_missing(p)
        if why:
            skipped[p] = why
            print(f"opsdk bench: skipped {p}: {why}", file=sys.stderr)
    return tuple(p for p in peers if p not in skipped), skipped


def _bench_models(args: argparse.Namespace) -> int:
    """``opsdk bench --model FILE`` / ``--examples`` / ``--gemm``."""
    from ._model import (
        EXAMPLES,
        MODEL_CANDIDATES,
        examples_dir,
        format_gemm_table,
        format_model_table,
        run_gemm_bench,
        run_model_bench,
    )  # heavy: TVM

    out: dict[str, Any] = {}
    models = list(args.model or [])
    if args.examples:
        missing = [e for e in EXAMPLES if not (examples_dir() / e).exists()]
        if missing:
            print(f"opsdk bench: error: --examples needs a source checkout ({examples_dir()} "
                  f"lacks {', '.join(missing)})", file=sys.stderr)
            return 2
        models += [str(examples_dir() / e) for e in EXAMPLES]
    from ..model import parse_entry_args  # heavy: TVM

    try:
        entry_args = parse_entry_args(args.model_arg)
    except ValueError as e:
        print(f"opsdk bench: error: {e}", file=sys.stderr)
        return 2
    try:
        if models:
            peers, _ = _peers(args.peers, MODEL_CANDIDATES[1:])
            rows = run_model_bench(
                models, target=args.target, threads=args.threads, repeats=args.repeats,
                budget_ms=max(args.budget_ms, 50.0), entry=args.entry, entry_args=entry_args,
                candidates=("opsdk", *peers),
                progress=lambda s: print(f"  {s} ...", file=sys.stderr, flush=True),
            )
            print(format_model_table(rows, peers))
            out["models"] = rows
        if args.gemm is not None:
            shapes = [tuple(s) for s in args.gemm] or [(1024, 1024, 1024), (128, 3072, 768)]
            bad = [s for s in shapes if len(s) != 3]
            if bad:
                print(f"opsdk bench: error: --gemm shapes are MxNxK, got {bad[0]}",
                      file=sys.stderr)
                return 2
            grows = run_gemm_bench(shapes, target=args.target, threads=args.threads,
                                   repeats=args.repeats, budget_ms=max(args.budget_ms, 50.0))
            print(format_gemm_table(grows))
            out["gemm"] = grows
    except UserCodeError as e:  # python -m opsdk.bench too: one line, quotes kept
        print(f"opsdk bench: error: {e}", file=sys.stderr)
        return 2
    except (KeyError, ValueError, TypeError, ImportError, AttributeError,
            FileNotFoundError) as e:
        print(f"opsdk bench: error: {_message(e)}", file=sys.stderr)
        return 2
    if args.json:
        write_text_atomic(args.json, json.dumps(out, indent=2))
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    """``opsdk bench --decode MODEL``: opsdk.bench._decode."""
    from ..llm import WEIGHT_MODES, load_decoder_weights  # heavy: TVM
    from ._decode import bench_decode, print_decode_report  # heavy: TVM

    modes = [m.strip() for m in args.decode_weights.split(",") if m.strip()]
    peers = ["llamacpp", "torch"] if args.peers is None else [
        p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [m for m in modes if m not in WEIGHT_MODES] + [
        p for p in peers if p not in ("llamacpp", "torch")]
    if bad or not modes:
        print(f"opsdk bench: error: --decode: unknown {', '.join(bad) or 'empty list'}; "
              f"weights: {', '.join(WEIGHT_MODES)}; peers: llamacpp, torch", file=sys.stderr)
        return 2
    try:
        weights = load_decoder_weights(args.decode)
    except ValueError as e:  # names the model and the fix
        print(f"opsdk bench: error: --decode {e}", file=sys.stderr)
        return 2
    rep = bench_decode(args.decode, weights_modes=modes, peers=peers, rounds=args.repeats,
                       threads=args.threads or 2, weights=weights)
    print_decode_report(rep)
    if args.json:
        write_text_atomic(args.json, json.dumps(rep, indent=2) + "\n")
    return 0


def _bench_zoo(args: argparse.Namespace) -> int:
    """``opsdk bench --zoo [MODELS] [--peers LIST]``."""
    from ._model import run_model_bench  # heavy: TVM
    from ._zooreport import (
        DEFAULT_PEERS,
        format_zoo_table,
        machine_load,
        plot_zoo,
        zoo_geomeans,
    )  # heavy: TVM

    def fail(msg: str) -> int:
        print(f"opsdk bench: error: {msg}", file=sys.stderr)
        return 2

    if args.model or args.examples or args.gemm is not None or args.ops:
        return fail("--zoo runs on its own (drop --model, --examples, --gemm and op names)")
    if args.zoo == "list":
        for z in ZOO.values():
            gone = z.missing()
            print(f"{z.name:<20} {z.description}"
                  + (f" [needs {', '.join(gone)}: pip install 'opsdk[zoo]']" if gone else ""))
        return 0
    try:
        zoo = select_zoo(args.zoo)
    except ValueError as e:
        return fail(str(e))
    try:
        peers, skipped = _peers(args.peers, DEFAULT_PEERS)
    except ValueError as e:
        return fail(str(e))
    runnable = []
    for z in zoo:
        gone = z.missing()
        if gone:
            skipped[z.name] = f"needs {', '.join(gone)} (pip install 'opsdk[zoo]')"
            print(f"opsdk bench: skipped {z.name}: {skipped[z.name]}", file=sys.stderr)
        else:
            runnable.append(z)
    load_before = machine_load()
    rows = run_model_bench(
        runnable, target=args.target, threads=args.threads, repeats=args.repeats,
        budget_ms=max(args.budget_ms, 50.0), candidates=("opsdk", *peers), details=True,
        keep_going=True, cache=None if args.use_cache else False,
        progress=lambda s: print(f"  {s} ...", file=sys.stderr, flush=True))
    print(format_zoo_table(rows, peers))
    if args.json:
        write_text_atomic(args.json, json.dumps({
            "zoo": rows, "peers": list(peers), "skipped": skipped,
            "geomean": zoo_geomeans(rows, peers),
            "machine": {"before": load_before, "after": machine_load()},
        }, indent=2))
    if args.plot:
        plot_zoo(rows, peers, args.plot)
    return 0
