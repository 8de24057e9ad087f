"""``opsdk quantize MODEL``: calibrate, quantize, report per-layer sensitivity, check and time."""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._cliargs import UsageError, model_file, output_path, percent, positive_int
from .._files import write_bytes_atomic, write_text_atomic
from ..runners import LocalRunner
from . import QuantConfig, agreement, find_sites, quantize_model

__all__ = ["add_quantize_arguments", "run_quantize_command"]


def _usage(msg: str) -> Exception:
    return UsageError(msg)


def add_quantize_arguments(s: argparse.ArgumentParser) -> None:
    """The arguments of ``opsdk quantize``."""
    s.add_argument("model", type=model_file, nargs="?",
                   help="a Python file with a build_model() entry (like the "
                   "examples), a .pt2 file or an .onnx file (or use --zoo)")
    s.add_argument("--zoo", metavar="MODEL",
                   help="quantize a model of bench --zoo instead of a file (random weights, "
                   "no downloads; see bench --zoo list)")
    s.add_argument("--entry", default="build_model", help="the model file's entry function")
    s.add_argument("--model-arg", action="append", metavar="NAME=VALUE",
                   help="keyword argument of the entry function (default: DEFAULT_ARGS)")
    s.add_argument("--calibration", default="64", metavar="N|FILE.npz",
                   help="calibration inputs: N random normal samples shaped like the example "
                   "inputs (default 64), or an .npz with one array per input name, samples "
                   "along the first axis (read one sample at a time)")
    s.add_argument("--method", choices=["minmax", "percentile", "mse"], default="minmax",
                   help="activation range (default minmax)")
    s.add_argument("--percentile", type=percent, default=99.99)
    s.add_argument("--weights", choices=["per_channel", "per_tensor"], default="per_channel")
    s.add_argument("--scheme", choices=["int8", "w8", "w4"], default="int8",
                   help="int8: activations and weights (default); weight-only for "
                   "memory-bound dense layers: w8 (int8 per channel, dense_w8) or w4 (int4 "
                   "ggml q4_0 groups, dense_q4); convs stay float then")
    s.add_argument("--q8-activations", action="store_true",
                   help="with --scheme w8 / w4: quantize each dense layer's input per 32 "
                   "values at run time and multiply in integers (llama.cpp's q8_0 numerics)")
    s.add_argument("--activations", choices=["asymmetric", "symmetric"], default="asymmetric")
    s.add_argument("--mixed-precision", metavar="K|T",
                   help="keep the K worst layers (an integer) or every layer whose relative "
                   "RMSE exceeds T (a fraction, e.g. 0.02) in float")
    s.add_argument("--bench", action="store_true",
                   help="also time int8 vs opsdk float, torch float, torch dynamic int8 and "
                   "onnxruntime static int8 with int8 and with uint8 activations "
                   "(interleaved, same threads)")
    s.add_argument("--repeats", type=positive_int, default=11)
    s.add_argument("--threads", type=positive_int, help="threads for every runtime")
    s.add_argument("--json", metavar="PATH", type=output_path, help="write the report as JSON")
    s.add_argument("--plot", metavar="PATH", type=output_path,
                   help="write the per-layer sensitivity as a PNG bar chart")


def _random_batches(inputs: Sequence[np.ndarray], n: int, seed: int = 1
                    ) -> Iterator[list[np.ndarray]]:
    """``n`` random samples shaped like ``inputs``: standard normal for float inputs; an
    integer input (token ids, indices) draws from the example's own values, the only ones
    known to be valid (a rounded normal would index embeddings at -1)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield [rng.choice(a.ravel(), a.shape) if a.dtype.kind in "iub" else
               rng.standard_normal(a.shape).astype(a.dtype) for a in inputs]


def _npz_batches(path: str, names: Sequence[str], inputs: Sequence[np.ndarray]
                 ) -> tuple[int, Iterator[list[np.ndarray]]]:
    try:
        z = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise _usage(f"--calibration {path}: cannot read it as .npz ({e})") from None
    missing = [n for n in names if n not in z.files]
    if missing:
        raise _usage(f"--calibration {path}: no array for input(s) {', '.join(missing)}; "
                     f"it has {', '.join(z.files) or 'none'}")
    arrays = [z[n] for n in names]
    counts = {a.shape[0] if a.ndim else 0 for a in arrays}
    if len(counts) != 1 or 0 in counts:
        raise _usage(f"--calibration {path}: the arrays need the same number (>= 1) of "
                     "samples along their first axis")
    for n, a, ex in zip(names, arrays, inputs):
        if a.shape[1:] != ex.shape or a.dtype != ex.dtype:
            raise _usage(f"--calibration {path}: samples of {n!r} are {a.dtype}"
                         f"{list(a.shape[1:])}, the model takes {ex.dtype}{list(ex.shape)}")
    total = counts.pop()

    def gen() -> Iterator[list[np.ndarray]]:
        for i in range(total):
            yield [np.ascontiguousarray(a[i]) for a in arrays]

    return total, gen()


def _progress(total: int) -> Any:
    # A rewritten line on a terminal; in a log (not a tty) one line at the end, no "\r".
    tty = sys.stderr.isatty()

    def show(k: int) -> None:
        if tty:
            end = "\n" if k >= total else ""
            print(f"\r  calibrating {k}/{total}", end=end, file=sys.stderr, flush=True)
        elif k >= total:
            print(f"  calibrated on {total} samples", file=sys.stderr, flush=True)

    return show


def format_sensitivity(rows: Sequence[dict[str, Any]], keep: Sequence[str]) -> str:
    """The per-layer table, worst first (weight shape: K x N of a dense, OIHW of a conv)."""
    out = [f"{'layer':<10} {'weight':<12} {'rel RMSE':>9} {'cosine':>9} {'max abs':>9}  "
           "x range"]
    for r in rows:
        tag = "  (kept float)" if r["site"] in keep else ""
        out.append(f"{r['site']:<10} {'x'.join(map(str, r['shape'])):<12} "
                   f"{r['rel_rmse'] * 100:>8.2f}% {r['cosine']:>9.5f} {r['max_abs']:>9.3g}  "
                   f"[{r['x_range'][0]:.3g}, {r['x_range'][1]:.3g}]{tag}")
    return "\n".join(out)


def _plot(rows: Sequence[dict[str, Any]], keep: Sequence[str], path: str) -> None:
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(rows) + 2), 3))
    names = [r["site"] for r in rows]
    vals = [r["rel_rmse"] * 100 for r in rows]
    ax.bar(names, vals, color=["tab:gray" if n in keep else "tab:blue" for n in names])
    ax.set_ylabel("relative RMSE of the layer (%)")
    ax.set_title("int8 sensitivity per layer (gray: kept float)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def _load_zoo(name: str, *, baselines: bool) -> Any:
    """The zoo model ``name`` imported as :func:`opsdk.model.load_model` imports a file
    (ValueError for an unknown name, ImportError when its package is missing)."""
    from ..bench import ZOO  # heavy: TVM
    from ..model import LoadedModel  # heavy: TVM

    if name not in ZOO:
        raise ValueError(f"no zoo model {name!r}; choose from {', '.join(ZOO)}")
    module, example = ZOO[name].build()
    return LoadedModel.from_torch(name, module, tuple(example), baselines=baselines)


def run_quantize_command(args: argparse.Namespace) -> int:
    """``opsdk quantize``: exit 0 when quantized, 2 on a usage error."""
    from ..bench import setup_threads  # heavy: TVM
    from ..model import compile_model, load_model, parse_entry_args  # heavy: TVM

    if (args.model is None) == (args.zoo is None):
        raise _usage("name one model: a MODEL file or --zoo MODEL")
    if args.zoo is not None and (args.model_arg or args.entry != "build_model"):
        raise _usage("--entry and --model-arg go with a MODEL file, not --zoo")
    spec = args.model or args.zoo
    mp: int | float | None = None
    if args.mixed_precision is not None:
        try:
            mp = int(args.mixed_precision) if args.mixed_precision.isdigit() else float(
                args.mixed_precision)
        except ValueError:
            mp = -1
        if mp < 0 or (isinstance(mp, float) and not 0 < mp < 1):
            raise _usage(f"--mixed-precision {args.mixed_precision!r}: a count of layers "
                         "(0, 1, 2, ...) or a relative-RMSE threshold in (0, 1)")
    # Before TVM's pool starts (calibration runs the model): every runtime gets the same
    # threads, as the benchmark reports.
    setup_threads(args.threads)
    try:
        if args.zoo is not None:
            loaded = _load_zoo(args.zoo, baselines=args.bench)
        else:
            entry_args = parse_entry_args(args.model_arg)
            loaded = load_model(spec, entry=args.entry, entry_args=entry_args,
                                baselines=args.bench)
    except (TypeError, ValueError, ImportError, AttributeError, FileNotFoundError) as e:
        raise _usage(f"cannot load model {spec!r}: {e}") from None
    names = [str(p.name) for p in loaded.opsdk_mod["main"].params]
    if args.calibration.isdigit():
        total = int(args.calibration)
        if total < 1:
            raise _usage("--calibration N needs N >= 1")
        batches: Any = _random_batches(loaded.inputs, total)
    else:
        total, batches = _npz_batches(args.calibration, names, loaded.inputs)
    calib_kept: list[list[np.ndarray]] = []

    def stream() -> Iterator[list[np.ndarray]]:
        for b in batches:
            if len(calib_kept) < 64 and args.bench:  # onnxruntime's calibration reader
                calib_kept.append(b)
            yield b

    if args.q8_activations and args.scheme == "int8":
        raise _usage("--q8-activations goes with --scheme w8 or w4")
    cfg = QuantConfig(weights=args.weights, activations=args.activations, method=args.method,
                      percentile=args.percentile, scheme=args.scheme,
                      weight_only_activations="q8_0" if args.q8_activations else "float32")
    if not find_sites(loaded.opsdk_mod):
        print(f"{spec}: no dense or conv2d layer with a constant float32 weight to quantize")
        return 0
    try:
        qm = quantize_model(loaded.opsdk_mod, stream(), cfg, mixed_precision=mp,
                            progress=_progress(total))
    except ValueError as e:  # bad calibration data: the message names the batch and input
        if sys.stderr.isatty():
            print(file=sys.stderr)  # (ends the progress line)
        raise _usage(f"{spec}: {e}") from None
    rows = qm.sensitivity()
    keep = list(qm.config.keep_float)
    print(format_sensitivity(rows, keep))
    # End to end: the int8 model against the float one on the example inputs (the bench
    # compiles and runs both anyway).
    bench = None
    if args.bench:
        from ..bench import run_int8_bench

        bench = run_int8_bench(loaded, qm, calib_kept, threads=args.threads,
                               repeats=args.repeats)
        e2e = bench["agreement"]["opsdk_int8"]
    else:
        with LocalRunner() as host:
            ref = host.run(compile_model(loaded.opsdk_mod, "host").ex, loaded.inputs)[0]
            got = host.run(compile_model(qm.mod, "host").ex, loaded.inputs)[0]
        e2e = agreement(got, ref)
    kind = {"int8": "int8", "w8": "int8-weight", "w4": "int4-weight"}[cfg.scheme]
    print(f"{kind} layers: {len(qm.quantized)} of {len(qm.sites)}"
          + (f" (float: {', '.join(keep)})" if keep else "")
          + f"; model output vs float: relative RMSE {e2e['rel_rmse'] * 100:.2f}%, cosine "
          f"{e2e['cosine']:.5f}"
          + (f", top-1 agreement {e2e['top1_agreement'] * 100:.1f}%"
             if "top1_agreement" in e2e else ""))
    report: dict[str, Any] = {"model": spec, "config": qm.config.__dict__ | {
        "keep_float": keep}, "calibration_samples": total, "layers": rows,
        "quantized": qm.quantized, "end_to_end": e2e}
    if bench is not None:
        b = report["bench"] = bench
        print(f"threads {b['threads']}; median ms (x: opsdk int8's speed-up over it)")
        for c, ms in b["ms"].items():
            x = b["speedup"].get(c)
            print(f"  {c:<26} {ms:>8.3f} ms" + (f"  x{x:.2f}" if x else ""))
        for c, a in b["agreement"].items():
            if c != "opsdk_int8":
                print(f"  {c} vs opsdk float: relative RMSE {a['rel_rmse'] * 100:.2f}%")
        for c, why in b["notes"].items():
            print(f"  {c}: not measured ({why})")
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=2, default=str) + "\n")
    if args.plot:
        _plot(rows, keep, args.plot)
    return 0
