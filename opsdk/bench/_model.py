"""Whole-model and GEMM benchmarks: opsdk against TVM's default pipeline, torch eager and
onnxruntime, measured side by side in one process.

Every candidate runs with the same thread count. One round times each candidate once (a
batch of calls lasting about ``budget_ms``), with a pause after each so the previous
runtime's spinning workers go idle; the reported figures are medians of the per-round times
and of the per-round ratios (a host that slows down for a while changes both sides of a
ratio alike). Outputs are checked against torch (or onnxruntime) before timing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._quiet import fd_silenced, verbose
from .._userfile import one_line
from ._timing import Timer, calls_step, ort_session, py_step, setup_threads, vm_step

__all__ = [
    "ALL_CANDIDATES",
    "EXAMPLES",
    "MODEL_CANDIDATES",
    "PEER_INSTALL",
    "PEER_LABELS",
    "first_torch_output",
    "format_gemm_table",
    "format_model_table",
    "ort_session",
    "peer_missing",
    "run_gemm_bench",
    "run_model_bench",
]

#: The examples benchmarked by ``opsdk bench --examples`` (each defines ``DEFAULT_ARGS``).
EXAMPLES = ("transformer_block.py", "conv_net.py", "mobilenet_block.py")
#: ``opsdk bench --model``'s candidates, in table order.
MODEL_CANDIDATES = ("opsdk", "tvm_default", "torch", "onnxruntime")
#: Every candidate :func:`run_model_bench` can time (``--zoo`` adds the peers after torch).
ALL_CANDIDATES = ("opsdk", "tvm_default", "torch", "onnxruntime", "openvino", "executorch",
                  "torch_compile")
# Every runtime's workers spin after a run (TVM's, torch's OpenMP, onnxruntime's) and take
# the cores from the next candidate. Measured, MobileNetV2 interleaved with a 0.05 s pause
# after the peers only: onnxruntime 16.0 ms against 4.2 ms alone (TVM's workers still
# spinning); with 0.3 s after every candidate, 5.3 ms.
_SETTLE_S = 0.3
_PEERS = ("torch", "onnxruntime", "openvino", "executorch", "torch_compile")
_PEER_MODULE = {"torch": "torch", "torch_compile": "torch", "onnxruntime": "onnxruntime",
                "openvino": "openvino", "executorch": "executorch", "tvm_default": "tvm"}
#: Each peer's short column label (the model and zoo tables).
PEER_LABELS = {"tvm_default": "tvm", "torch": "torch", "onnxruntime": "ort", "openvino": "ov",
               "executorch": "xnnpack", "torch_compile": "t.comp"}
_MEANING = {"tvm_default": "TVM's default pipeline (tvm.compile of TVM's own import)",
            "onnxruntime": "onnxruntime CPU on torch.onnx's export",
            "openvino": "OpenVINO CPU on the same ONNX export",
            "executorch": "ExecuTorch with XNNPACK", "torch_compile": "torch.compile"}
_CONSTRAINT = "-c <(echo torch==2.13.0)"
#: How to install each peer (the ``peers`` extra keeps torch at the pinned CPU build).
PEER_INSTALL = {
    "torch": "pip install 'opsdk[torch]'",
    "torch_compile": "pip install 'opsdk[torch]' (and a C++ compiler for inductor)",
    "onnxruntime": "pip install 'opsdk[bench]'",
    "openvino": f"pip install 'opsdk[peers]' {_CONSTRAINT}",
    "executorch": f"pip install 'opsdk[peers]' {_CONSTRAINT}",
    "tvm_default": "pip install 'opsdk'",
}


def peer_missing(candidate: str) -> str | None:
    """Why ``candidate`` cannot run on this host (its package is not installed), or None.

    Examples
    --------
    >>> from opsdk.bench._model import peer_missing
    >>> peer_missing("opsdk") is None
    True
    """
    mod = _PEER_MODULE.get(candidate)
    if mod is None:
        return None
    if sys.modules.get(mod, 0) is not None and (mod in sys.modules
                                                or importlib.util.find_spec(mod) is not None):
        return None  # (a None entry in sys.modules is a package whose import is blocked)
    return f"{mod} is not installed ({PEER_INSTALL[candidate]})"


def _vm_timed(ex: Any, inputs: Sequence[np.ndarray],
              per_call: bool = False) -> tuple[Timer, list[np.ndarray]]:
    """A timer of ``ex``'s ``main`` on ``inputs`` (TVM's C++ timer loop; ``per_call``: each
    call timed from Python, as the peers are) and its outputs."""
    import tvm  # heavy: TVM
    from tvm import relax  # heavy: TVM

    from ..model import vm_outputs  # heavy: TVM

    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs]
    main = vm["main"]
    out = vm_outputs(main(*args))
    if per_call:
        return Timer(calls_step(lambda: main(*args))), out
    return Timer(vm_step(vm, args, dev)), out


def _interleave(timers: Mapping[str, Timer], repeats: int, budget_s: float) -> None:
    for t in timers.values():
        t.calibrate(budget_s)
    for _ in range(max(1, repeats)):
        for t in timers.values():
            # An untimed warm-up batch first: it wakes this runtime's workers (and the
            # virtual CPUs) after the previous candidate, whose spinning peers had a pause.
            t.step(max(1, t.number // 4))
            t.samples.append(t.step(t.number))
            t.calls.extend(getattr(t.step, "last", ()))
            time.sleep(_SETTLE_S)


def _ratio(timers: Mapping[str, Timer], c: str, base: str = "opsdk") -> float | None:
    t, b = timers.get(c), timers.get(base)
    if t is None or b is None:
        return None
    return float(np.median([x / y for x, y in zip(t.samples, b.samples) if y > 0]))


def _agree(got: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> dict[str, Any]:
    """Every output within the examples' float32 tolerance
    (:func:`opsdk.model.within_tolerance_all`)."""
    from ..model import within_tolerance_all  # heavy: TVM

    return within_tolerance_all(got, ref)


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
    details: bool = False,
    keep_going: bool = False,
    cache: Any = None,
) -> list[dict[str, Any]]:
    """Benchmark whole models end to end.

    ``models`` are model files (see :func:`opsdk.model.load_model`; a Python file's
    ``DEFAULT_ARGS`` dict, when it has one, gives the entry function's arguments unless
    ``entry_args`` does), :class:`opsdk.model.LoadedModel` objects, or zoo entries (an object
    with ``name`` and ``build()`` returning ``(torch module, example args)``:
    :class:`opsdk.bench._zoo.ZooModel`). ``candidates`` are taken from
    :data:`ALL_CANDIDATES`. Returns one row per model: ``<candidate>_ms`` (median),
    ``speedup_<candidate>`` (median per-round ratio of its time to opsdk's),
    ``check_<candidate>`` (output agreement with the reference), ``<candidate>_ready_s``
    (from the imported model to a runnable one: opsdk's compile, a peer's conversion and
    compile), the opsdk rule per kernel kind and ``errors`` for candidates that could not run.

    ``details`` adds ``import_s`` (zoo entries: torch.export and opsdk's import),
    ``peak_rss_mb`` (the process's peak resident memory over import and compile),
    ``artifact_mb`` (the exported library) and ``<candidate>_p99_ms`` (99th percentile of
    single calls, every candidate timed call by call from Python). ``keep_going``: a model
    that fails to import, compile or run through opsdk gets ``failed`` (stage and first line
    of the error) and the next model runs. ``cache``: as :func:`opsdk.model.compile_model`.

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
    from ..model import compile_default  # heavy: TVM
    from ..targets import target as resolve_target  # heavy: TVM
    from ..targets import target_arch  # heavy: TVM

    unknown = [c for c in candidates if c not in ALL_CANDIDATES]
    if unknown:
        raise ValueError(f"unknown benchmark candidate {unknown[0]!r}; choose from "
                         f"{', '.join(ALL_CANDIDATES)}")
    tgt = resolve_target(target)
    if tgt.kind.name != "llvm" or target_arch(tgt) != target_arch(resolve_target("x86")):
        raise ValueError(f"target {target!r} does not run on this host; use x86")
    n = setup_threads(threads)
    rows = []
    for spec in models:
        name = getattr(spec, "name", None) or str(spec)
        # The zoo (details) says which model it starts (its compiles take minutes); a model
        # file is named once it loaded, so that a file that fails is one error line alone.
        if progress and details:
            progress(Path(name).name)
        row: dict[str, Any] = {"model": name, "threads": n, "errors": {}}
        rows.append(row)
        try:
            m, cm = _load_and_compile(spec, row, tgt, candidates, entry, entry_args,
                                      details, cache)
        except Exception as e:
            if not keep_going:
                raise
            row["failed"] = f"{row.pop('_stage', 'import')}: {one_line(e)}"
            continue
        if progress and not details:
            progress(Path(name).name)
        row["inputs"] = [list(a.shape) for a in m.inputs]
        if progress and details and cm is not None:
            progress(f"{Path(name).name}: opsdk compiled in {cm.seconds:.1f} s")
        timers: dict[str, Timer] = {}
        outs: dict[str, list[np.ndarray]] = {}
        ref = None
        if m.torch_module is not None:
            import torch

            from ..model import torch_outputs  # heavy: TVM

            with torch.no_grad():
                ref = torch_outputs(m.torch_module(*m.torch_args))
        if cm is not None:
            try:
                timers["opsdk"], outs["opsdk"] = _vm_timed(cm.ex, m.inputs, details)
            except Exception as e:
                if not keep_going:
                    raise
                row["failed"] = f"run: {one_line(e)}"
                continue
        if "tvm_default" in candidates:
            try:
                if m.tvm_mod is None:
                    raise RuntimeError(m.tvm_error or "TVM's own import failed")
                t0 = time.perf_counter()
                ex = compile_default(m.tvm_mod, tgt)  # through the compile cache
                row["tvm_default_ready_s"] = time.perf_counter() - t0
                timers["tvm_default"], outs["tvm_default"] = _vm_timed(ex, m.inputs, details)
            except Exception as e:
                row["errors"]["tvm_default"] = one_line(e)
        step = calls_step if details else py_step
        for c in _PEERS:
            if c not in candidates:
                continue
            if c in ("torch", "torch_compile", "executorch") and m.torch_module is None:
                continue  # an ONNX model: no torch program to run
            if c == "torch":
                outs["torch"] = ref
                timers["torch"] = Timer(step(_torch_runner(m.torch_module, m.torch_args)))
                continue
            missing = peer_missing(c)
            if missing:
                row["errors"][c] = missing
                continue
            try:
                with contextlib.ExitStack() as quiet:
                    if not verbose():  # a peer's own deprecation and tracer warnings
                        quiet.enter_context(warnings.catch_warnings())
                        warnings.simplefilter("ignore")
                    if c == "executorch":  # its C++ side logs CPU probing to fd 2
                        quiet.enter_context(fd_silenced(2))
                    _PEER_IMPORT[c]()  # the import is not its compile time
                    t0 = time.perf_counter()
                    fn, outs[c] = _PEER_SETUP[c](m, n)
                    row[f"{c}_ready_s"] = time.perf_counter() - t0
                timers[c] = Timer(step(fn))
                if progress and details:
                    progress(f"{Path(name).name}: {c} ready in {row[f'{c}_ready_s']:.1f} s")
            except Exception as e:
                outs.pop(c, None)
                row["errors"][c] = one_line(e)
        base = ref if ref is not None else outs.get("onnxruntime")
        if base is not None:
            for c, o in outs.items():
                row[f"check_{c}"] = _agree(o, base)
        _interleave(timers, repeats, budget_ms / 1e3)
        for c in ALL_CANDIDATES:
            t = timers.get(c)
            row[f"{c}_ms"] = float(np.median(t.samples)) * 1e3 if t else None
            row[f"speedup_{c}"] = _ratio(timers, c) if c != "opsdk" else None
            if details:
                row[f"{c}_p99_ms"] = (float(np.percentile(t.calls, 99)) * 1e3
                                      if t and t.calls else None)
        if "torch_compile" in timers:
            import torch

            torch._dynamo.reset()  # drop its compiled graphs before the next model
    return rows


def _load_and_compile(spec: Any, row: dict[str, Any], tgt: Any, candidates: Sequence[str],
                      entry: str, entry_args: Mapping[str, Any] | None, details: bool,
                      cache: Any) -> tuple[Any, Any]:
    """Import ``spec`` and compile it with opsdk (when a candidate); fills the row's import,
    compile, memory and artifact figures. ``row["_stage"]`` names the step that was running."""
    # heavy: TVM
    from ..model import LoadedModel, _torch_to_onnx, compile_model, export_torch, load_model

    with _PeakRSS() as mem:
        row["_stage"] = "import"
        t0 = time.perf_counter()
        built = None
        if isinstance(spec, LoadedModel):
            m = spec
        elif callable(getattr(spec, "build", None)):
            built = spec.build()
            m = LoadedModel.from_torch(spec.name, built[0], tuple(built[1]), baselines=False)
        else:
            m = load_model(str(spec), entry=entry, entry_args=entry_args)
        if details:
            row["import_s"] = time.perf_counter() - t0
        cm = None
        if "opsdk" in candidates:
            row["_stage"] = "compile"
            cm = compile_model(m.opsdk_mod, tgt, cache=cache)
            row["compile_s"] = row["opsdk_ready_s"] = cm.seconds
            row["compile_cached"] = bool(getattr(cm, "cached", False))
            row["rules"] = cm.rule_counts()
    row.pop("_stage")
    if details:
        row["peak_rss_mb"], row["rss_before_mb"] = mem.peak_mb, mem.start_mb
        if cm is not None:
            row["artifact_mb"] = _artifact_mb(cm)
    if built is not None:  # the baselines from_torch skipped, outside the measured span
        model, args = built[0], tuple(built[1])
        if "tvm_default" in candidates:
            from ..model import tvm_import

            m.tvm_mod, m.tvm_error = tvm_import(export_torch(model, args))
        if {"onnxruntime", "openvino"} & set(candidates):
            with fd_silenced(1):  # a failed export logs the whole TorchScript graph to fd 1
                m.onnx, m.onnx_error = _torch_to_onnx(model, args)
    return m, cm


class _PeakRSS:
    """The process's peak resident memory over a block, in MiB (``peak_mb``). On Linux the
    high-water mark is reset first (``5`` to ``/proc/self/clear_refs``), so it is this
    block's peak; elsewhere it is the process's peak so far (``ru_maxrss``)."""

    def __enter__(self) -> _PeakRSS:
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_mb = _status_mb("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_mb = _status_mb("VmHWM")
        if self.peak_mb is None:
            import resource
            import sys

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _artifact_mb(cm: Any) -> float:
    """Size of the compiled library (the cache's file, else exported to a scratch folder)."""
    if getattr(cm, "library", None):
        return os.path.getsize(cm.library) / 2**20
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.so")
        cm.ex.export_library(path)
        return os.path.getsize(path) / 2**20


def _torch_runner(tm: Any, targs: tuple) -> Callable[[], Any]:
    import torch  # heavy: torch

    def run() -> Any:
        with torch.no_grad():
            return tm(*targs)

    return run


_Setup = tuple[Callable[[], Any], list[np.ndarray]]


def _ort_setup(m: Any, n: int) -> _Setup:
    if m.onnx is None:
        raise RuntimeError(m.onnx_error or "no ONNX model")
    sess = ort_session(m.onnx, n)
    feed = {i.name: np.ascontiguousarray(a) for i, a in zip(sess.get_inputs(), m.inputs)}
    out = [np.asarray(a) for a in sess.run(None, feed)]
    return (lambda: sess.run(None, feed)), out


def _openvino_setup(m: Any, n: int) -> _Setup:
    """OpenVINO's CPU plugin on the ONNX bytes onnxruntime gets (the same graph, no second
    trace; ``openvino.convert_model`` of the torch module when the ONNX export failed), in
    float32 (its default on CPUs with bfloat16 units is bfloat16) with ``n`` threads."""
    import openvino as ov  # heavy: openvino

    core = ov.Core()
    if m.onnx is not None:
        model = core.read_model(m.onnx)
    elif m.torch_module is not None:
        model = ov.convert_model(m.torch_module, example_input=m.torch_args)
    else:
        raise RuntimeError(m.onnx_error or "no ONNX model")
    compiled = core.compile_model(model, "CPU", {
        "INFERENCE_NUM_THREADS": n, "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32"})
    req = compiled.create_infer_request()
    feed = [np.ascontiguousarray(a) for a in m.inputs]
    req.infer(feed)
    outs = [np.array(req.get_output_tensor(i).data) for i in range(len(compiled.outputs))]
    return (lambda: req.infer(feed)), outs


def _executorch_setup(m: Any, n: int) -> _Setup:
    """ExecuTorch with every op XNNPACK takes delegated to it (``XnnpackPartitioner``), from
    torch.export of the module; its thread pool set to ``n`` threads."""
    # heavy: executorch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower  # heavy: executorch
    from executorch.extension.pybindings import portable_lib  # heavy: executorch
    from executorch.runtime import Runtime  # heavy: executorch

    from ..model import export_torch, torch_outputs  # heavy: TVM

    ep = export_torch(m.torch_module, m.torch_args)
    prog = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
    portable_lib._unsafe_reset_threadpool(n)
    buffer = prog.buffer
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    args = list(m.torch_args)

    def run(keep: Any = (buffer, program)) -> Any:  # a method outliving its program crashes
        return method.execute(args)

    return run, torch_outputs(list(run()))


def _torch_compile_setup(m: Any, n: int) -> _Setup:
    """``torch.compile`` (inductor); its compile runs in the first call, timed as ready."""
    import torch  # heavy: torch

    from ..model import torch_outputs  # heavy: TVM

    run = _torch_runner(torch.compile(m.torch_module), m.torch_args)
    return run, torch_outputs(run())


def _import_executorch() -> None:
    import executorch.backends.xnnpack.partition.xnnpack_partitioner  # heavy: executorch
    import executorch.exir  # heavy: executorch
    import executorch.runtime  # noqa: F401


_PEER_IMPORT: dict[str, Callable[[], Any]] = {
    "onnxruntime": lambda: __import__("onnxruntime"),
    "openvino": lambda: __import__("openvino"),
    "executorch": _import_executorch,
    "torch_compile": lambda: __import__("torch"),
}
_PEER_SETUP: dict[str, Callable[[Any, int], _Setup]] = {
    "onnxruntime": _ort_setup,
    "openvino": _openvino_setup,
    "executorch": _executorch_setup,
    "torch_compile": _torch_compile_setup,
}


def first_torch_output(out: Any) -> np.ndarray:
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


def format_model_table(rows: Sequence[dict[str, Any]],
                       peers: Sequence[str] = MODEL_CANDIDATES[1:]) -> str:
    """The model bench as a text table: opsdk's median time, each of ``peers``' median time
    and its ratio to opsdk's, and the output checks.

    Examples
    --------
    >>> from opsdk.bench import format_model_table
    >>> format_model_table([]).split()[:3]
    ['model', 'opsdk', 'tvm']
    >>> format_model_table([], ["onnxruntime", "openvino"]).split()[:5]
    ['model', 'opsdk', 'ort', 'ov', 'x']
    """
    labels = [PEER_LABELS.get(p, p) for p in peers]
    head = (f"{'model':<28} {'opsdk':>8}" + "".join(f" {lb:>9}" for lb in labels)
            + "".join(f" {'x ' + lb:>9}" for lb in labels) + "  checks")
    lines = [head, "-" * len(head)]
    for r in rows:
        checks = ", ".join(
            f"{c}:{'ok' if r[f'check_{c}']['ok'] else 'FAIL'}"
            for c in ("opsdk", *peers) if f"check_{c}" in r
        )
        name = Path(str(r["model"])).stem[:28]
        lines.append(
            f"{name:<28} {_f(r.get('opsdk_ms'), '8.3f')}"
            + "".join(f" {_f(r.get(f'{p}_ms'), '9.3f')}" for p in peers)
            + "".join(f" {_f(r.get(f'speedup_{p}'), '9.2f')}" for p in peers)
            + f"  {checks}"
        )
        for c in ("opsdk", *peers):
            chk = r.get(f"check_{c}")
            if chk is not None and not chk["ok"]:
                lines.append(f"  {c} differs from torch: " + (
                    chk["error"] if "error" in chk else
                    f"output {chk.get('output', 0)} of {chk.get('outputs', 1)}, max abs "
                    f"{chk['max_abs']:.2e}, max rel {chk['max_rel']:.2e}"))
        for c, e in r.get("errors", {}).items():
            lines.append(f"  {c}: {e}")
    named = "; ".join(f"{PEER_LABELS[p]} = {_MEANING[p]}" for p in peers if p in _MEANING)
    lines.append(
        "times: median ms per call over interleaved rounds, same thread count for all; "
        "x = the other's time / opsdk's (median of per-round ratios; > 1: opsdk faster)"
        + (f"; {named}" if named else "") + "; checks = outputs against torch eager"
    )
    return "\n".join(lines)


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


# ------------------------------------------------------------------------------------ GEMM
def _gemm_module(m: int, n: int, k: int, w: np.ndarray) -> Any:
    from tvm import relax  # heavy: TVM

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
    import torch  # heavy: torch

    from ..model import compile_model  # heavy: TVM

    n_threads = setup_threads(threads)
    rows = []
    rng = np.random.default_rng(0)
    for m, n, k in shapes:
        x = rng.standard_normal((m, k)).astype("float32")
        w = rng.standard_normal((k, n)).astype("float32")
        cm = compile_model(_gemm_module(m, n, k, w), target)
        timers: dict[str, Timer] = {}
        timers["opsdk"], got = _vm_timed(cm.ex, [x])
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        timers["torch"] = Timer(py_step(lambda tx=tx, tw=tw: torch.matmul(tx, tw)))
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
