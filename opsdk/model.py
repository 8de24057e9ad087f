"""Whole models: load one, compile it with every kernel scheduled, and report every kernel.

``opsdk explain --model FILE`` and ``opsdk bench --model FILE`` are built on this module:

- :func:`load_model` imports a model file (a Python file whose entry function returns
  ``(torch module, example args)`` or an ``ExportedProgram``, or an ``.onnx`` file) both the
  opsdk way (opsdk converters + :class:`~opsdk.transform.FuseIntoOps`) and TVM's plain way;
- :func:`compile_model` (:mod:`opsdk._pipeline`, re-exported here) runs
  :func:`opsdk.pipeline` and keeps the scheduled module, so every kernel's rule can be read
  back;
- :func:`report` lists every kernel of the compiled model: its kind, the rule that scheduled
  it, structural facts of its loops (vectorized / parallel), the vector instructions in its
  own assembly (compiled alone, so a parallel helper is counted with its kernel), and on the
  host its share of the run time. Kernels left unscheduled, or serial scalar code over
  :data:`SERIAL_LIMIT` output elements, are named.

Examples
--------
>>> import numpy as np, opsdk
>>> from tvm import relax
>>> x = relax.Var("x", relax.TensorType((64, 32), "float32"))
>>> w = relax.const(np.ones((32, 48), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
...     _ = bb.emit_func_output(y)
>>> r = opsdk.model.report(bb.get(), "x86", profile=False)
>>> [(k.kind, k.rule) for k in r.kernels]
[('matmul', 'x86.matmul')]
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from . import frontend
from ._cliargs import parse_entry_args
from ._pipeline import (
    CompiledModel,
    compile_default,
    compile_model,
    kernel_facts,
    kernel_kind_rule,
    load_compiled,
    schedule_passes,
    scheduled_kernels,
)
from ._quiet import fd_silenced
from ._roofline import machine_roof
from ._timings import CompileTimings, record_phases, record_timings
from ._userfile import load_onnx_file, one_line, read_user_file
from .errors import UnloweredOpError
from .runners.local import host_arch
from .schedules import GENERIC, Kernel, rules_for, vector_lanes
from .targets import target as resolve_target
from .targets import target_arch, target_spec
from .transform import FuseIntoOps, lift_passes, lifts_weights

__all__ = [
    "ATOL",
    "FAMILY_KINDS",
    "RTOL",
    "SERIAL_LIMIT",
    "CompileTimings",
    "CompiledModel",
    "KernelReport",
    "LoadedModel",
    "ModelReport",
    "UnloweredOpError",
    "compile_default",
    "compile_model",
    "export_torch",
    "fused_module",
    "kernel_cells",
    "kernel_facts",
    "kernel_kind_rule",
    "load_compiled",
    "load_model",
    "parse_entry_args",
    "record_timings",
    "report",
    "scheduled_kernels",
    "torch_outputs",
    "tvm_import",
    "vm_outputs",
    "within_tolerance",
    "within_tolerance_all",
]

#: A kernel writing more output elements than this must not be serial scalar code.
SERIAL_LIMIT = 4096

#: A compiled model's float outputs against another run of the same float32 computation
#: (torch eager, onnxruntime, the host build on another ISA): |got - ref| <= ATOL *
#: max(1, max|ref|) + RTOL * |ref|. Both round in float32 but sum in other orders (matmul
#: and conv reductions of up to a few thousand terms, norms over the feature axis, other
#: vector widths); observed differences are ~1e-6.
ATOL, RTOL = 1e-4, 1e-4


def within_tolerance(got: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """``{"ok", "max_abs", "max_rel"}`` of float outputs ``got`` against ``ref`` under
    :data:`ATOL` / :data:`RTOL`; a NaN must be where the reference has one.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.model import within_tolerance
    >>> within_tolerance(np.float32([1.0, 2.00001]), np.float32([1.0, 2.0]))["ok"]
    True
    """
    g, r = got.astype(np.float64), ref.astype(np.float64)
    err = np.abs(g - r)
    scale = float(np.nanmax(np.abs(r), initial=0.0))
    bound = ATOL * max(1.0, scale) + RTOL * np.abs(r)
    ok = bool(np.all(np.isnan(g) == np.isnan(r)) and np.all((err <= bound) | np.isnan(r)))
    worst = float(np.nanmax(err, initial=0.0))
    return {"ok": ok, "max_abs": worst, "max_rel": worst / scale if scale else 0.0}


def within_tolerance_all(got: Sequence[np.ndarray], ref: Sequence[np.ndarray]
                         ) -> dict[str, Any]:
    """:func:`within_tolerance` over every output of a model: ``ok`` when there are as many
    outputs as the reference's and each agrees; the figures are the worst output's (its
    index ``output``), ``outputs`` their count; a count or shape that differs says so in
    ``error`` (the figures then infinite).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.model import within_tolerance_all
    >>> a, b = np.float32([1.0, 2.0]), np.float32([3.0])
    >>> within_tolerance_all([a, b], [a, b])["ok"]
    True
    >>> r = within_tolerance_all([a, b + 1], [a, b])
    >>> r["ok"], r["output"]
    (False, 1)
    >>> within_tolerance_all([a], [a, b])["error"]
    '1 output where the reference has 2'
    """
    bad = {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"), "outputs": len(got)}
    if len(got) != len(ref):
        return bad | {"error": f"{len(got)} output{'s' * (len(got) != 1)} where the "
                               f"reference has {len(ref)}"}
    worst: dict[str, Any] = {"ok": True, "max_abs": 0.0, "max_rel": 0.0, "output": 0}
    for i, (g, r) in enumerate(zip(got, ref)):
        g, r = np.asarray(g), np.asarray(r)
        if g.shape != r.shape:
            return bad | {"output": i, "error": f"output {i} has shape {list(g.shape)}, the "
                                                f"reference {list(r.shape)}"}
        one = within_tolerance(g, r)
        # the first failing output, else the largest relative error
        if (worst["ok"] and not one["ok"]) or (one["ok"] == worst["ok"]
                                               and one["max_rel"] > worst["max_rel"]):
            worst = one | {"output": i}
    return worst | {"outputs": len(got)}


def torch_outputs(value: Any) -> list[np.ndarray]:
    """A torch model's outputs as arrays, in the order torch.export flattens them (pytree
    leaves: tuples, lists, dicts such as torchvision's segmentation ``{"out": ...}``,
    transformers' ``ModelOutput``); leaves that are not tensors export to no output.

    Examples
    --------
    >>> import torch
    >>> from opsdk.model import torch_outputs
    >>> [a.shape for a in torch_outputs({"out": torch.zeros(2), "aux": (torch.ones(3),)})]
    [(2,), (3,)]
    """
    from torch.utils import _pytree  # torch.export's own flattening

    return [v.detach().cpu().numpy() for v in _pytree.tree_leaves(value)
            if hasattr(v, "detach")]


def vm_outputs(value: Any) -> list[np.ndarray]:
    """What a Relax VM function returned, as arrays: nested tuples flattened in order.

    Examples
    --------
    >>> import numpy as np, tvm
    >>> from opsdk.model import vm_outputs
    >>> t = tvm.runtime.tensor(np.zeros(2, "float32"))
    >>> [a.shape for a in vm_outputs(t)]
    [(2,)]
    """
    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Array":
        return [a for v in value for a in vm_outputs(v)]
    return [np.asarray(value)]


# ---------------------------------------------------------------------------------- loading
@dataclass
class LoadedModel:
    """A model imported for compiling and benchmarking.

    ``opsdk_mod`` is opsdk's import (opsdk converters + FuseIntoOps), ``tvm_mod`` TVM's own
    import of the same model (the baseline ``tvm.compile`` sees; None, with ``tvm_error``
    saying why, when TVM's importer fails on a model opsdk's imports), ``inputs`` example
    inputs; ``torch_module`` / ``onnx`` are there when the model came from torch (the ONNX
    bytes are exported from it for onnxruntime) or from an ``.onnx`` file.
    """

    name: str
    opsdk_mod: tvm.IRModule
    tvm_mod: tvm.IRModule | None
    inputs: list[np.ndarray]
    torch_module: Any = None
    torch_args: tuple = ()
    onnx: bytes | None = None
    onnx_error: str = ""
    tvm_error: str = ""

    @classmethod
    def from_torch(
        cls,
        name: str,
        model: Any,
        args: tuple,
        *,
        exported: Any = None,
        dynamic_batch: bool = False,
        baselines: bool = True,
    ) -> LoadedModel:
        """Both imports of a torch module (``exported``: its ExportedProgram, when made
        already), its example inputs, and its ONNX export for onnxruntime
        (``baselines=False``: opsdk's import only; ``tvm_mod`` is then that one too)."""
        import torch  # heavy: torch

        t0 = time.perf_counter()
        ep = exported if exported is not None else frontend.export_user_model(
            lambda m, a: export_torch(m, a, dynamic_batch), model, args, name)
        t1 = time.perf_counter()
        onnx_bytes, err = _torch_to_onnx(model, args) if baselines else (None, "not exported")
        inputs = [a.detach().cpu().numpy() for a in args if isinstance(a, torch.Tensor)]
        t2 = time.perf_counter()
        imported = frontend.from_torch(ep)
        t3 = time.perf_counter()
        fused = FuseIntoOps()(imported)
        record_phases({"torch.export": t1 - t0, "from_torch": t3 - t2,
                       "FuseIntoOps": time.perf_counter() - t3})
        tvm_mod, tvm_err = tvm_import(ep) if baselines else (fused, "")
        return cls(name, fused, tvm_mod, inputs, model, tuple(args), onnx_bytes, err, tvm_err)


def tvm_import(ep: Any) -> tuple[tvm.IRModule | None, str]:
    """TVM's own import of a ``torch.export`` program (the benchmarks' TVM baseline), or
    ``(None, why)``: a model opsdk imports can still fail TVM's importer (its
    ``div.Tensor_mode`` before opsdk's fix, XCiT and EdgeNeXt), which costs that one column,
    not the model."""
    try:
        return from_exported_program(ep), ""
    except Exception as e:  # any importer failure: the baseline is skipped with its reason
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return None, f"TVM's own import failed: {first.strip()[:200]}"


def _torch_to_onnx(model: Any, args: tuple) -> tuple[bytes | None, str]:
    """The model as ONNX bytes for onnxruntime: TorchScript's exporter, else (transformers'
    BERT and GPT-2 fail it: ``use_cache`` given twice, ``aten::diff``) the torch.export-based
    one when onnxscript is installed; ``(None, why)`` if neither works."""

    import torch  # heavy: torch

    buf = io.BytesIO()
    try:  # torch's C++ side prints the whole TorchScript graph to fd 2 when export fails
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(
                io.StringIO()), fd_silenced(1), fd_silenced(2), torch.no_grad():
            torch.onnx.export(model, args, buf, dynamo=False, opset_version=17)
        return buf.getvalue(), ""
    except Exception as e:  # an exporter gap must not stop the rest of the benchmark
        why = f"torch.onnx.export failed: {one_line(e)}"
    if importlib.util.find_spec("onnxscript") is None:
        return None, why + " (the dynamo exporter needs onnxscript: pip install onnxscript)"
    buf = io.BytesIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(
                io.StringIO()), fd_silenced(1), fd_silenced(2), torch.no_grad():
            torch.onnx.export(model, args, dynamo=True, opset_version=18).save(buf)
    except Exception as e:
        msg = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split("\n")[0]  # it colours its text
        return None, f"{why}; dynamo export: {type(e).__name__}: {msg}"
    return buf.getvalue(), ""


def load_model(
    spec: str,
    entry: str = "build_model",
    entry_args: Mapping[str, Any] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    dynamic_batch: bool | None = None,
    baselines: bool = True,
    called: tuple[Any, Any] | None = None,
) -> LoadedModel:
    """Import the model ``spec`` the opsdk way and TVM's way.

    Parameters
    ----------
    spec
        An ``.onnx`` file, a ``torch.export.save`` file (``.pt2``), or a Python file /
        module whose ``entry`` function returns ``(torch.nn.Module, example_args)`` or an
        ``ExportedProgram``.
    entry_args
        Keyword arguments for the entry function (e.g. ``{"channels": 32}``); None: the
        file's ``DEFAULT_ARGS`` dict (its benchmark size) if it has one.
    shapes
        Input shapes of an ONNX model with symbolic dims.
    dynamic_batch
        Export torch models with dim 0 of every input symbolic; None: the file's
        ``DYNAMIC_BATCH`` (default False).
    baselines
        Also import TVM's way and export ONNX for onnxruntime (what the benchmarks compare
        with); False imports opsdk's way only.
    called
        ``(module, entry result)`` of a Python model file whose entry the caller has run
        already with these arguments (``opsdk build``'s up-to-date check): not run again.
    """

    frontend.prepare_model_imports()  # timm / torchvision / transformers beside a CPU torch

    rng = np.random.default_rng(seed)
    shp = {k: list(v) for k, v in (shapes or {}).items()}
    if str(spec).endswith(".onnx"):
        proto = load_onnx_file(spec)
        frontend.check_shape_names(proto, shp, str(spec))
        t0 = time.perf_counter()
        opsdk_mod = frontend.from_onnx(proto, shape_dict=shp or None, fuse=True)
        record_phases({"from_onnx": time.perf_counter() - t0})
        tvm_mod = (frontend.from_onnx(proto, shape_dict=shp or None, ops=()) if baselines
                   else opsdk_mod)
        return LoadedModel(str(spec), opsdk_mod, tvm_mod,
                           frontend.random_inputs(tvm_mod["main"], shp, rng),
                           onnx=proto.SerializeToString())
    import torch  # heavy: torch

    if str(spec).endswith(".pt2"):
        ep = read_user_file(spec, lambda p: torch.export.load(str(p)),
                            "torch.export program (.pt2)")
        args = tuple(ep.example_inputs[0]) if ep.example_inputs else ()
        if not args:
            raise ValueError(f"{spec} has no example inputs; save it with torch.export.save "
                             "of a program exported from example arguments")
        return LoadedModel.from_torch(str(spec), ep.module(), args, exported=ep,
                                      baselines=baselines)

    module = frontend.import_model_module(str(spec)) if called is None else called[0]
    if entry_args is None:
        entry_args = getattr(module, "DEFAULT_ARGS", None) or {}
    if dynamic_batch is None:
        dynamic_batch = bool(getattr(module, "DYNAMIC_BATCH", False))
    built = (frontend.call_entry(module, str(spec), entry, **dict(entry_args)) if called is None
             else called[1])
    if isinstance(built, torch.export.ExportedProgram):
        return LoadedModel.from_torch(str(spec), built.module(), tuple(built.example_inputs[0]),
                                      exported=built, baselines=baselines)
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module):
        return LoadedModel.from_torch(str(spec), built[0].eval(),
                                      frontend.example_args(built, str(spec), entry),
                                      dynamic_batch=dynamic_batch, baselines=baselines)
    raise TypeError(
        f"{spec}:{entry}() returned {type(built).__name__}; expected (torch module, args) "
        "or an ExportedProgram"
    )


def export_torch(model: Any, args: tuple, dynamic_batch: bool = False) -> Any:
    """``torch.export.export``, with dim 0 of every input symbolic when ``dynamic_batch``.

    torch.export specializes a dim whose example size is 1, so a batch-1 example is traced
    with a batch-2 copy of the input.
    """
    import torch  # heavy: torch

    if not dynamic_batch:
        return torch.export.export(model, args)
    batch = torch.export.Dim("batch", min=1, max=1024)
    traced = tuple(torch.cat([a, a]) if a.shape[0] == 1 else a for a in args)
    return torch.export.export(model, traced, dynamic_shapes=tuple({0: batch} for _ in args))


# -------------------------------------------------------------------------------- compiling
#: Compile phases by pass name (the rest of the Relax lowering is "lower").
# -------------------------------------------------------------------------------- reporting
@dataclass
class KernelReport:
    """One kernel of a compiled model."""

    name: str
    kind: str
    rule: str
    calls: int = 0
    out_elements: int | None = None
    vectorized_loops: int = 0
    parallel_loops: int = 0
    vector_ops: dict[str, int] = field(default_factory=dict)
    vector_moves: int = 0
    #: Scalar math-library calls in its assembly (``expf``, ...), by name: once per element.
    math_calls: dict[str, int] = field(default_factory=dict)
    time_ms: float | None = None
    share: float | None = None
    #: Its calls timed in their place in the model (the kernels run one after another on a
    #: run's own buffers, as the VM runs them): with the caches its neighbours leave, so
    #: weights streamed from memory and inputs just written cost what they cost in a run.
    #: ``time_ms`` times each call alone, repeated, its data already in the caches.
    model_ms: float | None = None
    #: Work of one call (:func:`opsdk._asm.kernel_work`): TVM's operation count and the
    #: parameters' bytes; None where a shape is symbolic.
    flops: float | None = None
    bytes: int | None = None
    #: Achieved in the profile (per call), and the share of this machine's roof at the
    #: kernel's arithmetic intensity (:class:`opsdk._roofline.Roof`), in percent.
    gflops: float | None = None
    gbps: float | None = None
    roof_pct: float | None = None
    problems: list[str] = field(default_factory=list)
    #: Rules that raised on this kernel before another took it (``"<rule>: <error>"``).
    rule_failures: list[str] = field(default_factory=list)
    #: The verify cell that covers it (:meth:`opsdk.verify.KernelCell.as_dict`: family,
    #: layout, shape class, gaps, its own case and command; ``status`` once its case ran).
    verify: dict[str, Any] | None = None

    @property
    def scheduled(self) -> bool:
        return self.rule != GENERIC


@dataclass
class ModelReport:
    """Every kernel of a compiled model (the one story :func:`report` tells)."""

    model: str
    target: str
    kernels: list[KernelReport]
    compile_s: float = 0.0
    kernel_ms: float | None = None  # the kernels' times summed (one run)
    model_kernel_ms: float | None = None  # their in-model times summed (one run)
    threads: int | None = None  # TVM's thread pool size when the kernels were timed
    cached: bool = False  # the compiled model came from the compile cache
    cache_key: str | None = None  # its compile-cache entry (load_compiled), if it has one
    #: This machine's ceilings at ``threads`` (:class:`opsdk._roofline.Roof`), when profiled.
    roof: Any = None
    #: ``{"cases", "failed"}`` when the kernels' own cases ran (``report(verify_kernels=)``).
    verified: dict[str, int] | None = None

    @property
    def problems(self) -> list[str]:
        return [f"{k.name}: {p}" for k in self.kernels for p in k.problems]

    @property
    def weak(self) -> list[str]:
        """Kernels that take a real share of the time (:data:`WEAK_SHARE`) far below their
        roof (:data:`WEAK_ROOF_PCT`), biggest share first: where a rule leaves speed."""
        rows = [k for k in self.kernels if k.roof_pct is not None and k.share is not None
                and k.share >= WEAK_SHARE and k.roof_pct < WEAK_ROOF_PCT]
        return [f"{k.name} ({k.rule}): {k.roof_pct:.0f} % of its roof, "
                f"{100 * k.share:.1f} % of the time"
                for k in sorted(rows, key=lambda k: -(k.share or 0.0))]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = self.problems
        d["weak"] = self.weak
        return d

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def format(self) -> str:
        w = max([6, *(len(k.name) for k in self.kernels)])
        wk = max([4, *(len(k.kind) for k in self.kernels)])
        wr = max([4, *(len(k.rule) for k in self.kernels)])
        cells = any(k.verify is not None for k in self.kernels)
        wc = max([4, *(len(_cell_text(k)) for k in self.kernels)])
        lines = [
            f"model: {self.model}   target: {self.target}   kernels: {len(self.kernels)}   "
            f"compile: {self.compile_s:.1f} s" + (" (cached)" if self.cached else "")
            + (f"   kernel time: {self.kernel_ms:.3f} ms on {self.threads} threads"
               if self.kernel_ms else "")
            + (f" ({self.model_kernel_ms:.3f} ms in the model)" if self.model_kernel_ms
               else ""),
            f"{'kernel':<{w}}  {'kind':<{wk}}  {'rule':<{wr}}  {'vec':>3}  {'par':>3}  "
            f"{'vector insns':<16}  {'elements':>9}  {'ms':>8}  {'share':>6}  {'in model':>8}  "
            f"{'GF/s':>6}  "
            f"{'GB/s':>6}  {'roof':>5}"
            + (f"  {'verify cell':<{wc}}  {'class':<7}" if cells else "")
            + ("  case" if self.verified is not None else ""),
        ]
        for k in self.kernels:
            vec = ",".join(f"{a}={b}" for a, b in sorted(k.vector_ops.items()))
            if not vec:
                vec = f"moves={k.vector_moves}" if k.vector_moves else "-"
            lines.append(
                f"{k.name:<{w}}  {k.kind:<{wk}}  {k.rule:<{wr}}  {k.vectorized_loops:>3}  "
                f"{k.parallel_loops:>3}  {vec:<16}  "
                f"{k.out_elements if k.out_elements is not None else '?':>9}  "
                + (f"{k.time_ms:>8.4f}  {100 * k.share:>5.1f}%" if k.time_ms is not None
                   else f"{'-':>8}  {'-':>6}")
                + (f"  {k.model_ms:>8.4f}" if k.model_ms is not None else f"  {'-':>8}")
                + f"  {_rate(k.gflops):>6}  {_rate(k.gbps):>6}  "
                + (f"{k.roof_pct:>4.0f}%" if k.roof_pct is not None else f"{'-':>5}")
                + (f"  {_cell_text(k):<{wc}}  {_class_text(k):<7}" if cells else "")
                + (f"  {_case_text(k)}" if self.verified is not None else "")
            )
        if self.roof is not None:
            bw = ", ".join(f"{v:.0f} GB/s within {_size(n)}"
                           for n, v in sorted(self.roof.gbps.items()))
            lines.append(f"roof on {self.roof.threads} threads (opsdk's own kernels on this "
                         f"machine): GEMM {self.roof.gflops:.0f} GFLOP/s; {bw}")
        if cells:
            lines += self._format_cells()
        probs = self.problems
        lines.append("problems: " + ("none" if not probs else ""))
        lines += [f"  - {p}" for p in probs]
        if self.weak:
            lines.append("far below their roof:")
            lines += [f"  - {p}" for p in self.weak]
        return "\n".join(lines)


    def _format_cells(self) -> list[str]:
        """The verify cells' footer: kernels outside verify's classes, kernels without a
        family, and after a run the cases that failed and each distinct case's command."""
        lines: list[str] = []
        gaps = [k for k in self.kernels if k.verify and k.verify.get("gaps")]
        if gaps:
            lines.append("kernels outside what verify draws (their own cases still run with "
                         "--verify-kernels):")
            lines += [f"  - {k.name} ({_cell_text(k)}): " + "; ".join(k.verify["gaps"])
                      for k in gaps]
        none = [k for k in self.kernels if k.verify is not None and not k.verify["family"]]
        if none:
            kinds: dict[str, int] = {}
            for k in none:
                kinds[k.kind] = kinds.get(k.kind, 0) + 1
            lines.append(f"no kernel family (verified by: none): {len(none)} kernel"
                         f"{'s' if len(none) != 1 else ''} ("
                         + ", ".join(f"{n} {c}" for n, c in sorted(kinds.items())) + ")")
        if self.verified is not None:
            v = self.verified
            lines.append(f"kernel cases: {v['cases']} distinct run, {v['failed']} failed")
            seen: dict[str, list[str]] = {}
            for k in self.kernels:
                if k.verify and k.verify.get("command") and k.verify.get("status"):
                    seen.setdefault(k.verify["command"], []).append(k.name)
            for cmd, names in seen.items():
                k = next(k for k in self.kernels if k.name == names[0])
                more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
                other = k.verify.get("case_rule")
                note = (f" [the case took {other}, the model's kernel {k.rule}]"
                        if other and other != k.rule else "")
                lines.append(f"  {_case_text(k):<5} {names[0]}{more}{note}: {cmd}")
                if k.verify.get("message") and k.verify["status"] != "pass":
                    lines.append(f"        {k.verify['message']}")
        return lines


def _cell_text(k: KernelReport) -> str:
    v = k.verify
    if v is None:
        return "-"
    if not v.get("family"):
        return "none"
    return v.get("cell") or v["family"]


def _class_text(k: KernelReport) -> str:
    v = k.verify
    if v is None or not v.get("family"):
        return "-"
    if v.get("covered") is None:
        return "op"
    return "covered" if v["covered"] else "gap"


def _case_text(k: KernelReport) -> str:
    v = k.verify
    if v is None or v.get("status") is None:
        return "-"
    if v["status"] != "pass":
        return v["status"].upper()
    rule = v.get("case_rule")
    return "pass" if not rule or rule == k.rule else "pass*"  # * another rule took the case


#: A kernel is listed as far below its roof (:attr:`ModelReport.weak`) from this share of the
#: kernel time, under this percent of its roof.
WEAK_SHARE = 0.02
WEAK_ROOF_PCT = 25.0


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 10 else f"{v:.0f}"


def _size(n: int) -> str:
    return f"{n // 1024**2} MB" if n >= 1024**2 else f"{n // 1024} KB"


def report(
    model: Any,
    target: Any = "x86",
    *,
    inputs: Sequence[np.ndarray] | None = None,
    profile: bool = True,
    asm: bool = True,
    name: str = "",
    cache: Any = None,
    cells: bool = False,
    verify_kernels: bool = False,
    source: tvm.IRModule | None = None,
) -> ModelReport:
    """Compile ``model`` (an IRModule or :class:`LoadedModel`; a :class:`CompiledModel` is
    reported as it is) and report every kernel.

    With ``profile`` (host targets only) every kernel call of one run is timed on its own
    arguments and its share of the summed kernel time reported. ``cache`` is
    :func:`compile_model`'s (None: the environment decides).

    ``cells``: link every kernel to the verify cell that covers it (:func:`kernel_cells`,
    ``KernelReport.verify``: the model's fusion passes run once more, 1-4 s, kept with the
    compile-cache entry). It needs the model's module: ``model`` itself, or ``source`` with
    a :class:`CompiledModel` (else the cells the compile cache kept; ValueError when there
    are none). ``verify_kernels`` (implies ``cells``): also run each distinct kernel's own
    case (:func:`opsdk.verify.verify_cells`; ``ModelReport.verified``).

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((8, 32), "float32"))
    >>> w = relax.const(np.ones((32, 24), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
    ...     _ = bb.emit_func_output(y)
    >>> r = opsdk.model.report(bb.get(), "x86", profile=False, asm=False, cells=True)
    >>> [(k.verify["cell"], k.verify["covered"]) for k in r.kernels]
    [('tvm_matmul/kn', True)]
    """
    tgt = resolve_target(target)
    mod = source
    if isinstance(model, CompiledModel):  # compiled already (e.g. read back: load_compiled)
        cm = model
    else:
        if isinstance(model, LoadedModel):
            mod, inputs, name = model.opsdk_mod, inputs or model.inputs, name or model.name
        else:
            mod = model
        # Read from the compile cache when the model was compiled before: the facts are the
        # same a fresh compile states (the cache stores exactly these).
        cm = compile_model(mod, tgt, cache=cache)
    vec = cm.asm_facts() if asm else {}
    rows = []
    for f in cm.kernels:
        k = KernelReport(**f)
        if asm:
            k.vector_ops = dict(vec[k.name]["vector_ops"])
            k.vector_moves = int(vec[k.name]["vector_moves"])
            k.math_calls = dict(vec[k.name].get("math_calls", {}))
        rows.append(k)
    rep = ModelReport(name or "model", str(target), rows, compile_s=cm.seconds,
                      cached=cm.cached)
    rep.cache_key = cm._entry.key if cm._entry is not None else None

    if profile and inputs is not None and target_arch(tgt) == host_arch():
        _profile(cm.ex, list(inputs), rep, tgt)
    for k in rows:
        _judge(k, asm=asm)
    if cells or verify_kernels:
        found = _report_cells(cm, mod, target, tgt, rows)
        if verify_kernels:
            from .verify import verify_cells

            rep.verified = verify_cells(found)
        for k, c in zip(rows, found):
            k.verify = c.as_dict()
    return rep


def _verify_target(target: Any, tgt: Any) -> str:
    """The verify target name of a model's target (``host`` is ``x86`` or ``arm``)."""
    if isinstance(target, str):
        try:
            return target_spec(target).name
        except ValueError:
            pass
    return "x86" if target_arch(tgt) == "x86_64" else "arm"


#: The compile-cache memo of the verify cells; its number changes when what the cells state
#: does (a cache entry keeps the cells its first report read).
_CELLS_MEMO = "verify-cells-1"


def _report_cells(cm: CompiledModel, mod: tvm.IRModule | None, target: Any, tgt: Any,
                  rows: Sequence[KernelReport]) -> list[Any]:
    """The cells of ``rows`` (in their order), kept with the compile-cache entry; ValueError
    when neither the module nor a kept copy is there."""
    from .verify import KernelCell

    def compute() -> list[dict[str, Any]]:
        if mod is None:
            raise LookupError("no module")
        facts = {_fused_name(k.name): (k.kind, k.rule) for k in rows}
        return [c.as_dict() for c in kernel_cells(mod, target, kinds=facts)]

    try:
        got = [KernelCell.from_dict(r) for r in cm.memo(_CELLS_MEMO, compute)]
    except LookupError:
        raise ValueError("report(cells=True): the verify cells need the model's module; pass "
                         "the IRModule or LoadedModel, or source=<its IRModule> with a "
                         "CompiledModel") from None
    except Exception as e:  # the cells are an addition to the report, never its failure
        why = f"the kernels were not read back ({one_line(e)})"
        got = []
        for k in rows:
            c = _no_cell(k, target, tgt)
            c.message = why
            got.append(c)
    by_name = {c.kernel: c for c in got}
    out = []
    for k in rows:
        c = by_name.get(_fused_name(k.name))
        if c is None:
            c = _no_cell(k, target, tgt)
        c.kernel = k.name
        out.append(c)
    return out


def _fused_name(name: str) -> str:
    """A scheduled kernel's name before ``SplitLayoutRewritePreproc`` renamed a kernel whose
    weights it packs (``<name>_prepacked``)."""
    return name.removesuffix("_prepacked")


def _no_cell(k: KernelReport, target: Any, tgt: Any) -> Any:
    from .verify import KernelCell

    return KernelCell(k.name, k.kind, _verify_target(target, tgt), rule=k.rule)


def fused_module(mod: tvm.IRModule, target: Any = "x86") -> tvm.IRModule:
    """``mod`` through the model pipeline up to the schedule: every kernel fused
    (legalized, constants folded, epilogues joined) but not yet scheduled, with the names
    :func:`compile_model`'s kernels have.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    >>> w = relax.const(np.ones((16, 24), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
    ...     _ = bb.emit_func_output(y)
    >>> [gv.name_hint.startswith("fused_matmul_relu") for gv, f
    ...  in fused_module(bb.get()).functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    [True]
    """
    tgt = resolve_target(target)
    passes = schedule_passes(tgt)
    if lifts_weights(mod):
        passes = lift_passes(passes)
    cut = [p.info.name for p in passes].index("opsdk.ScheduleKernels")
    with tgt:
        return tvm.transform.Sequential(passes[:cut])(mod)


def kernel_cells(model: Any, target: Any = "x86", *,
                 kinds: Mapping[str, tuple[str, str]] | None = None) -> list[Any]:
    """The verify cell of every kernel of ``model`` (an IRModule or :class:`LoadedModel`)
    compiled for ``target``, sorted by kernel name (:class:`opsdk.verify.KernelCell`: the
    kernel family or op, layout, shape class, what of it verify never draws, and the case
    of the kernel's own shapes with its command).

    ``kinds``: each kernel's (kind, rule) as the scheduled model has them (the report's);
    None classifies the fused kernels here.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    >>> w = relax.const(np.ones((16, 24), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
    ...     _ = bb.emit_func_output(y)
    >>> [(c.family, c.layout, c.covered) for c in kernel_cells(bb.get(), "x86")]
    [('tvm_matmul', 'kn', True)]
    """
    from .verify import kernel_cell

    mod = model.opsdk_mod if isinstance(model, LoadedModel) else model
    tgt = resolve_target(target)
    vt = _verify_target(target, tgt)
    lanes = vector_lanes(tgt, 32)
    fused = fused_module(mod, tgt)
    out = []
    for gv, f in sorted(fused.functions.items(), key=lambda kv: kv[0].name_hint):
        if not isinstance(f, tvm.tirx.PrimFunc):
            continue
        kind, rule = (kinds or {}).get(gv.name_hint, (None, None))
        if kind is None:
            kind = kernel_kind_rule(f)[0]
        out.append(kernel_cell(gv.name_hint, f, vt, lanes=lanes, kind=kind, rule=rule))
    return out


#: Kernel kinds with rules of their own: one of these on a catch-all rule (``kind:any``, e.g.
#: ``x86.fallback``) ran without its family's tiling, however vectorized it looks.
FAMILY_KINDS = ("matmul", "conv2d", "winograd", "pool")


def _catch_all(rule: str, kind: str) -> bool:
    return any(r.name == rule and "any" in r.kinds for r in rules_for(Kernel("", kind)))


def _judge(k: KernelReport, *, asm: bool) -> None:
    big = k.out_elements is None or k.out_elements > SERIAL_LIMIT
    if not k.scheduled:
        k.problems.append("unscheduled (generic lowering)")
    # A rule that raised is a bug in the rule, even when the next one (or generic) took it.
    k.problems += [f"schedule rule failed: {f}" for f in k.rule_failures]
    if k.scheduled and k.kind in FAMILY_KINDS and _catch_all(k.rule, k.kind):
        k.problems.append(f"a {k.kind} kernel on the catch-all rule {k.rule}: no {k.kind} rule "
                          "took it, so it runs without its family's register tiling")
    if big and not k.vectorized_loops and not k.parallel_loops:
        k.problems.append(f"serial scalar loops over {k.out_elements or 'a symbolic number of'} "
                          "output elements")
    elif (big and asm and not sum(k.vector_ops.values()) and k.kind != "opaque"
          and (k.kind != "elementwise" or not k.vector_moves)):  # a copy only moves data
        k.problems.append("no vector instructions in its assembly")
    if k.math_calls:
        k.problems.append("scalar math-library calls per element: " + ", ".join(
            f"{n} x{c}" for n, c in k.math_calls.items()))


def _profile(ex: Any, inputs: list[np.ndarray], rep: ModelReport, target: Any = "x86",
             rounds: int = 20) -> None:
    """Time each kernel call of one VM run on the arguments it was called with."""
    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs]
    calls: list[tuple[str, Any, list]] = []

    def instrument(func, sym, before, ret, *a):
        if before and not str(sym).startswith("vm."):
            calls.append((str(sym), func, list(a)))
        return 0

    vm.set_instrument(instrument)
    vm["main"](*args)
    by_name = {k.name: k for k in rep.kernels}
    times: dict[str, float] = {}
    for sym, func, a in calls:
        for _ in range(2):
            func(*a)
        best = float("inf")
        for _ in range(5):  # min of 5 batches: robust to a preempted batch
            t0 = time.perf_counter()
            for _ in range(rounds):
                func(*a)
            best = min(best, (time.perf_counter() - t0) / rounds)
        times[sym] = times.get(sym, 0.0) + best * 1e3
        k = by_name.get(sym)
        if k is not None:
            k.calls += 1
            if k.out_elements is None and a:
                k.out_elements = int(np.prod(a[-1].shape))
    # In their place: the calls one after another on the run's own buffers, each timed, the
    # median of rounds (the times above find a kernel's data in the caches; in a run its
    # weights come from memory and its input is what its neighbour just wrote).
    per_call: list[list[float]] = [[] for _ in calls]
    for r in range(2 + rounds):
        for i, (_, func, a) in enumerate(calls):
            t0 = time.perf_counter()
            func(*a)
            if r >= 2:
                per_call[i].append(time.perf_counter() - t0)
    in_model: dict[str, float] = {}
    for (sym, _, _), ts in zip(calls, per_call):
        in_model[sym] = in_model.get(sym, 0.0) + float(np.median(ts)) * 1e3
    rep.model_kernel_ms = sum(in_model.values())
    total = sum(times.values())
    rep.kernel_ms = total
    rep.threads = int(tvm.get_global_func("runtime.NumThreads")())
    roof = None
    if any(k.bytes for k in rep.kernels):
        try:
            roof = machine_roof(target, rep.threads)
        except Exception:  # the ceilings could not be measured: rates without a roof
            roof = None
    rep.roof = roof
    for name, t in times.items():
        k = by_name.get(name)
        if k is None:
            continue
        k.time_ms, k.share = t, (t / total if total else 0.0)
        k.model_ms = in_model.get(name)
        per_call = t / 1e3 / max(1, k.calls)
        if per_call > 0 and k.bytes:
            k.gbps = k.bytes / per_call / 1e9
            k.gflops = (k.flops or 0.0) / per_call / 1e9
            if roof is not None:
                k.roof_pct = roof.percent(k.flops or 0.0, k.bytes, per_call)
