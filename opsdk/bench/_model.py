"""Whole-model and GEMM benchmarks: opsdk against TVM's default pipeline, torch eager and
onnxruntime, measured side by side in one process.

Every candidate runs with the same thread count. One round times each candidate once (a
batch of calls lasting about ``budget_ms``), with a pause after each so the previous
runtime's spinning workers go idle; the reported figures are medians of the per-round times
and of the per-round ratios (a host that slows down for a while changes both sides of a
ratio alike). Outputs are checked against torch (or onnxruntime) before timing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._run import _py_step, _Timer, _vm_step

__all__ = [
    "EXAMPLES",
    "MODEL_CANDIDATES",
    "format_gemm_table",
    "format_model_table",
    "ort_session",
    "run_gemm_bench",
    "run_model_bench",
]

#: The examples benchmarked by ``opsdk bench --examples`` (each defines ``DEFAULT_ARGS``).
EXAMPLES = ("transformer_block.py", "conv_net.py", "mobilenet_block.py")
#: Model candidates in table order.
MODEL_CANDIDATES = ("opsdk", "tvm_default", "torch", "onnxruntime")
_PEER_SETTLE_S = 0.05  # torch's OpenMP and onnxruntime's workers spin after a run
_PEERS = ("torch", "onnxruntime")


def setup_threads(threads: int | None) -> int:
    """Give TVM, torch and onnxruntime the same thread count; returns it.

    TVM 0.27 sizes its pool to half the logical CPUs on x86 unless ``TVM_NUM_THREADS`` is set
    before the pool starts. TVM's idle workers keep their default spin (``sched_yield``
    rounds, which give way to another runtime's threads): cutting it makes every parallel
    call wake sleeping workers, which on a virtual machine costs more than the kernel
    (measured: softmax 4096x768 0.90 ms with the default, 3.2 ms with 1000 rounds).
    """
    n = threads or os.cpu_count() or 1
    os.environ.setdefault("TVM_NUM_THREADS", str(n))
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass
    return n


def _vm_timed(ex: Any, inputs: Sequence[np.ndarray]) -> tuple[_Timer, np.ndarray]:
    import tvm
    from tvm import relax

    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs]
    out = _first(vm["main"](*args))
    return _Timer(_vm_step(vm, args, dev)), out


def _first(out: Any) -> np.ndarray:
    import tvm

    while not isinstance(out, tvm.runtime.Tensor):
        out = out[0]
    return out.numpy()


def ort_session(onnx_bytes: bytes, threads: int) -> Any:
    """An onnxruntime CPU session with ``threads`` intra-op threads (all graph
    optimizations, its default), quiet."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])


def _interleave(timers: Mapping[str, _Timer], repeats: int, budget_s: float) -> None:
    for t in timers.values():
        t.calibrate(budget_s)
    for _ in range(max(1, repeats)):
        for c, t in timers.items():
            # An untimed warm-up batch first: it wakes this runtime's workers (and the
            # virtual CPUs) after the previous candidate, whose spinning peers had a pause.
            t.step(max(1, t.number // 4))
            t.samples.append(t.step(t.number))
            if c in _PEERS:
                time.sleep(_PEER_SETTLE_S)


def _ratio(timers: Mapping[str, _Timer], c: str, base: str = "opsdk") -> float | None:
    t, b = timers.get(c), timers.get(base)
    if t is None or b is None:
        return None
    return float(np.median([x / y for x, y in zip(t.samples, b.samples) if y > 0]))


def _agree(got: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """The examples' float32 tolerance (:func:`opsdk.model.within_tolerance`)."""
    from ..model import within_tolerance

    return within_tolerance(got, ref)


def run_model_bench(
    models: Sequence[str | Any],
    *,
    target: str = "x86",
    threads: int | None = None,
    repeats: int = 11,
    budget_ms: float = 50.0,
    candidates: Sequence[str] = MODEL_CANDIDATES,
    entry: str = "build_model",
    entry_args: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark whole models end to end.

    ``models`` are model files (see :func:`opsdk.model.load_model`; a Python file's
    ``DEFAULT_ARGS`` dict, when it has one, gives the entry function's arguments unless
    ``entry_args`` does) or :class:`opsdk.model.LoadedModel` objects. Returns one row per
    model: ``<candidate>_ms`` (median), ``speedup_<candidate>`` (median per-round ratio of its
    time to opsdk's), ``check_<candidate>`` (output agreement with the reference), the
    opsdk rule per kernel kind and ``errors`` for candidates that could not run.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> from opsdk.bench import run_model_bench
    >>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(x))
    ...     _ = bb.emit_func_output(y)
    >>> m = opsdk.model.LoadedModel("relu", bb.get(), bb.get(), [np.ones((8, 16), "float32")])
    >>> rows = run_model_bench([m], repeats=1, budget_ms=1, candidates=["opsdk"])
    >>> rows[0]["opsdk_ms"] > 0
    True
    """
    from ..model import LoadedModel, compile_default, compile_model, load_model
    from ..targets import target as resolve_target
    from ..targets import target_arch

    tgt = resolve_target(target)
    if tgt.kind.name != "llvm" or target_arch(tgt) != target_arch(resolve_target("x86")):
        raise ValueError(f"target {target!r} does not run on this host; use x86")
    n = setup_threads(threads)
    rows = []
    for spec in models:
        if isinstance(spec, LoadedModel):
            m = spec
        else:
            m = load_model(str(spec), entry=entry, entry_args=entry_args)
        if progress:
            progress(m.name)
        row: dict[str, Any] = {"model": m.name, "threads": n, "errors": {},
                               "inputs": [list(a.shape) for a in m.inputs]}
        timers: dict[str, _Timer] = {}
        outs: dict[str, np.ndarray] = {}
        ref = None
        if m.torch_module is not None:
            import torch

            with torch.no_grad():
                ref = _torch_out(m.torch_module(*m.torch_args))
        if "opsdk" in candidates:
            cm = compile_model(m.opsdk_mod, tgt)
            row["compile_s"] = cm.seconds
            row["rules"] = cm.rule_counts()
            timers["opsdk"], outs["opsdk"] = _vm_timed(cm.ex, m.inputs)
        if "tvm_default" in candidates:
            try:
                ex = compile_default(m.tvm_mod, tgt)  # through the compile cache
                timers["tvm_default"], outs["tvm_default"] = _vm_timed(ex, m.inputs)
            except Exception as e:
                row["errors"]["tvm_default"] = f"{type(e).__name__}: {e}".split("\n")[0]
        if "torch" in candidates and m.torch_module is not None:
            import torch

            tm, targs = m.torch_module, m.torch_args

            def run_torch(tm=tm, targs=targs):
                with torch.no_grad():
                    return tm(*targs)

            timers["torch"] = _Timer(_py_step(run_torch))
            outs["torch"] = ref
        if "onnxruntime" in candidates:
            try:
                if m.onnx is None:
                    raise RuntimeError(m.onnx_error or "no ONNX model")
                sess = ort_session(m.onnx, n)
                feed = {i.name: np.ascontiguousarray(a)
                        for i, a in zip(sess.get_inputs(), m.inputs)}
                outs["onnxruntime"] = sess.run(None, feed)[0]
                timers["onnxruntime"] = _Timer(_py_step(lambda s=sess, f=feed: s.run(None, f)))
            except ImportError:
                row["errors"]["onnxruntime"] = (
                    "onnxruntime is not installed (pip install opsdk[bench])")
            except Exception as e:
                row["errors"]["onnxruntime"] = f"{type(e).__name__}: {e}".split("\n")[0]
        base = ref if ref is not None else outs.get("onnxruntime")
        if base is not None:
            for c, o in outs.items():
                row[f"check_{c}"] = _agree(o, base)
        _interleave(timers, repeats, budget_ms / 1e3)
        for c in MODEL_CANDIDATES:
            t = timers.get(c)
            row[f"{c}_ms"] = float(np.median(t.samples)) * 1e3 if t else None
            row[f"speedup_{c}"] = _ratio(timers, c) if c != "opsdk" else None
        rows.append(row)
    return rows


def _torch_out(out: Any) -> np.ndarray:
    """The first output of a torch model: through tuples, lists, dicts and transformers'
    ``ModelOutput`` (a ``CausalLMOutput``'s logits)."""
    while not hasattr(out, "detach"):
        if hasattr(out, "to_tuple"):
            out = out.to_tuple()
        elif isinstance(out, dict):
            out = list(out.values())
        if not isinstance(out, (tuple, list)) or not out:
            raise TypeError(f"the model returned {type(out).__name__}, not tensors")
        out = out[0]
    return out.detach().cpu().numpy()


def examples_dir() -> Path:
    """The examples folder of a source checkout (``examples/`` beside the package)."""
    return Path(__file__).resolve().parents[2] / "examples"


def format_model_table(rows: Sequence[dict[str, Any]]) -> str:
    """The model bench as a text table.

    Examples
    --------
    >>> from opsdk.bench import format_model_table
    >>> format_model_table([]).split()[0]
    'model'
    """
    head = (f"{'model':<28} {'opsdk':>8} {'tvm':>9} {'torch':>8} {'ort':>8} "
            f"{'x tvm':>7} {'x torch':>7} {'x ort':>6}  checks")
    lines = [head, "-" * len(head)]
    for r in rows:
        checks = ", ".join(
            f"{c}:{'ok' if r[f'check_{c}']['ok'] else 'FAIL'}"
            for c in MODEL_CANDIDATES if f"check_{c}" in r
        )
        name = Path(str(r["model"])).stem[:28]
        lines.append(
            f"{name:<28} {_f(r.get('opsdk_ms'), '8.3f')} {_f(r.get('tvm_default_ms'), '9.3f')} "
            f"{_f(r.get('torch_ms'), '8.3f')} {_f(r.get('onnxruntime_ms'), '8.3f')} "
            f"{_f(r.get('speedup_tvm_default'), '7.1f')} {_f(r.get('speedup_torch'), '7.2f')} "
            f"{_f(r.get('speedup_onnxruntime'), '6.2f')}  {checks}"
        )
        for c, e in r.get("errors", {}).items():
            lines.append(f"  {c}: {e}")
    lines.append(
        "times: median ms per call over interleaved rounds, same thread count for all; "
        "x = the other's time / opsdk's (median of per-round ratios; > 1: opsdk faster); "
        "tvm = TVM's default pipeline (tvm.compile of TVM's own import); ort = onnxruntime "
        "CPU on torch.onnx's export; checks = outputs against torch eager"
    )
    return "\n".join(lines)


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


# ------------------------------------------------------------------------------------ GEMM
def _gemm_module(m: int, n: int, k: int, w: np.ndarray) -> Any:
    from tvm import relax

    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(w)))
        bb.emit_func_output(y)
    return bb.get()


def run_gemm_bench(
    shapes: Sequence[tuple[int, int, int]] = ((1024, 1024, 1024), (128, 3072, 768)),
    *,
    target: str = "x86",
    threads: int | None = None,
    repeats: int = 11,
    budget_ms: float = 50.0,
) -> list[dict[str, Any]]:
    """fp32 ``x[M, K] @ w[K, N]`` (``w`` a constant weight) through opsdk vs ``torch.matmul``
    on the same arrays, in GFLOPS; ``pct_torch`` is opsdk's throughput as a share of torch's
    (median of per-round ratios).

    Examples
    --------
    >>> from opsdk.bench import run_gemm_bench
    >>> rows = run_gemm_bench([(32, 48, 16)], repeats=1, budget_ms=1)
    >>> rows[0]["opsdk_gflops"] > 0
    True
    """
    import torch

    from ..model import compile_model

    n_threads = setup_threads(threads)
    rows = []
    rng = np.random.default_rng(0)
    for m, n, k in shapes:
        x = rng.standard_normal((m, k)).astype("float32")
        w = rng.standard_normal((k, n)).astype("float32")
        cm = compile_model(_gemm_module(m, n, k, w), target)
        timers: dict[str, _Timer] = {}
        timers["opsdk"], got = _vm_timed(cm.ex, [x])
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        timers["torch"] = _Timer(_py_step(lambda tx=tx, tw=tw: torch.matmul(tx, tw)))
        ref = (x.astype(np.float64) @ w.astype(np.float64))
        # float32 dot products of length K: |err| <= K u sum|x||w| (recursive summation).
        bound = k * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
        _interleave(timers, repeats, budget_ms / 1e3)
        flops = 2.0 * m * n * k
        t_o = float(np.median(timers["opsdk"].samples))
        t_t = float(np.median(timers["torch"].samples))
        rows.append({
            "shape": [m, n, k],
            "threads": n_threads,
            "rule": next(iter(cm.rule_counts()), "generic"),
            "opsdk_ms": t_o * 1e3,
            "torch_ms": t_t * 1e3,
            "opsdk_gflops": flops / t_o / 1e9,
            "torch_gflops": flops / t_t / 1e9,
            "pct_torch": 100.0 * (_ratio(timers, "torch") or 0.0),
            "within_bound": bool(np.all(np.abs(got - ref) <= bound)),
        })
    return rows


def format_gemm_table(rows: Sequence[dict[str, Any]]) -> str:
    """The GEMM bench as a text table."""
    head = (f"{'gemm MxNxK':<20} {'rule':<12} {'opsdk ms':>9} {'GFLOPS':>7} "
            f"{'torch ms':>9} {'GFLOPS':>7} {'% torch':>8}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{'x'.join(map(str, r['shape'])):<20} {r['rule']:<12} {r['opsdk_ms']:>9.3f} "
            f"{r['opsdk_gflops']:>7.0f} {r['torch_ms']:>9.3f} {r['torch_gflops']:>7.0f} "
            f"{r['pct_torch']:>8.0f}  {'ok' if r['within_bound'] else 'FAIL'}"
        )
    lines.append("% torch = opsdk throughput / torch.matmul's (median of per-round ratios); "
                 "check = every element within K u sum|x||w| of the float64 product")
    return "\n".join(lines)
