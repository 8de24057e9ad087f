"""The compile pipeline of a model, in order, named once.

``opsdk.compile``, :func:`opsdk.model.compile_model` (``opsdk build``, ``opsdk quantize``,
``opsdk bench`` / ``explain --model``) and :func:`opsdk.pipeline` run these steps; each is
named here once, and the passes of each step live in :mod:`opsdk.transform`:

1. **import** (:func:`opsdk.model.load_model`, :func:`opsdk.frontend.from_torch` /
   :func:`~opsdk.frontend.from_onnx`): each op's own torch / ONNX mapping makes opsdk ops;
2. **fuse** (:class:`~opsdk.transform.FuseIntoOps`): decomposed subgraphs (LayerNorm chains,
   bias + GELU, conv + BatchNorm) become fused ops, by each op's fusion patterns;
3. **layout** (:func:`~opsdk.transform.ChannelsLast`): convolutions run NHWC inside, one
   transpose where a conv chain starts and one where it ends;
4. **legalize** (:func:`~opsdk.transform.LegalizeOpsDeferred`, TVM's ``LegalizeOps``
   (through :func:`~opsdk.transform.LegalizeOpsOnce`) with
   eligible 3x3 convs as Winograd F(2x2, 3x3), :mod:`opsdk.kernels.winograd`): opsdk ops with
   their own compute, TVM's ops with TVM's, every kernel annotated with its fusion pattern and
   constants folded (weight transposes happen once, here);
5. **kernel fusion** (``FuseOps`` / ``FuseTIR``): elementwise epilogues (bias, activation,
   residual add, scale) join the matmul or conv that produces them; copy-only views
   (reshape, transpose, slice) that feed an opsdk op are read through in its kernel
   (:func:`~opsdk.transform.FoldViewsIntoOps`);
6. **schedule** (:func:`~opsdk.transform.ScheduleKernels`): every PrimFunc gets a rule from
   the one driver: an opsdk op its op's rules, any other kernel the rules for its kind;
7. **pack weights**: weight packing a rule asked for is split out and folded into the
   constants (or, for a deployable artifact, lifted into a transform run once at load);
8. **build**: TVM's CPU dataflow lowering and VM finalization, then code generation of every
   kernel with opsdk's TIR pipeline (:func:`opsdk.transform.tir_pipeline`), through the
   kernel cache (:mod:`opsdk._kernelcache`) and the whole-model compile cache
   (:mod:`opsdk._modelcache`).

Examples
--------
>>> import opsdk
>>> [name for name, _ in opsdk._pipeline.STEPS]
['import', 'fuse', 'layout', 'legalize', 'kernel fusion', 'schedule', 'pack weights', 'build']
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu
from tvm.target import Target

from ._asm import (
    asm_of,
    kernel_math_calls,
    kernel_vector_moves,
    kernel_vector_ops,
    kernel_work,
    loop_kinds,
)
from ._kernelcache import kernel_builder, open_kernel_cache
from ._modelcache import open_cache, runs_on_host
from ._timings import record_phases
from ._tir import GuardIntegerDivision, tir_pipeline
from ._walk import calls_of, relax_exprs
from .errors import UnloweredOpError
from .frontend import bind_params
from .kernels.resize import legalize_resize2d
from .kernels.winograd import legalize_conv2d
from .registry import load_builtin_ops
from .schedules import GENERIC, classify, nothing_decided, rule_failures, tuned_rules
from .targets import LINK_OPTIONS, target_arch
from .targets import target as resolve_target
from .transform import (
    MISSING_LEGALIZATIONS,
    ChannelsLast,
    ConvLiveTaps,
    FoldConstantsAtOnce,
    FoldViewsIntoOps,
    InjectiveWhenShapesChange,
    KernelFormWeights,
    LegalizeOpsDeferred,
    LegalizeOpsOnce,
    LowerOps,
    ScheduleKernels,
    constants_as_params,
    fold_cache,
    lift_passes,
    lifts_weights,
)

__all__ = [
    "STEPS",
    "CompiledModel",
    "compile_default",
    "compile_model",
    "compile_module",
    "fusion_passes",
    "kernel_facts",
    "kernel_kind_rule",
    "load_compiled",
    "lowering_passes",
    "pipeline",
    "schedule_passes",
    "scheduled_kernels",
]

# Raised inside the pipeline pass, it crosses TVM's FFI; registered, it comes out as itself
# rather than a RuntimeError carrying its message.
tvm_ffi.register_error(UnloweredOpError)

#: The steps, in order: (name, where its passes come from).
STEPS: tuple[tuple[str, str], ...] = (
    ("import", "opsdk.model.load_model / opsdk.frontend.from_torch, from_onnx"),
    ("fuse", "opsdk.transform.FuseIntoOps"),
    ("layout", "opsdk.transform.ChannelsLast, ConvLiveTaps"),
    ("legalize", "opsdk.transform.LegalizeOpsDeferred, LegalizeOpsOnce, "
                 "FoldConstantsAtOnce"),
    ("kernel fusion", "AnnotateTIROpPattern, FuseOps, FuseTIR, opsdk.transform.FoldViewsIntoOps"),
    ("schedule", "opsdk.transform.ScheduleKernels"),
    ("pack weights", "SplitLayoutRewritePreproc, FoldConstantsAtOnce (or lift_passes)"),
    ("build", "TVM's CPU lowering, opsdk.transform.tir_pipeline, the kernel cache"),
)


# ------------------------------------------------------------------------------ the passes
def fusion_passes(*, winograd: bool = False) -> list[tvm.transform.Pass]:
    """TVM's legalization, constant folding and fusion (what its CPU pipelines run before
    codegen, and steps 4-5 of :data:`STEPS` after the opsdk ops). ``winograd``: eligible
    3x3 convs legalize to the Winograd kernel (:mod:`opsdk.kernels.winograd`) instead of
    TVM's direct convolution. A bilinear upsampling legalizes to two passes
    (:mod:`opsdk.kernels.resize`)."""
    custom = dict(MISSING_LEGALIZATIONS)
    custom["relax.image.resize2d"] = legalize_resize2d  # bilinear upsampling in two passes
    if winograd:
        custom["relax.nn.conv2d"] = legalize_conv2d
    return [
        LegalizeOpsOnce(custom),
        GuardIntegerDivision,  # before any build of a kernel: the folds run them too
        relax.transform.AnnotateTIROpPattern(),
        InjectiveWhenShapesChange(),  # a pad is no conv epilogue
        FoldConstantsAtOnce(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def schedule_passes(
    target: str | dict | Target, *, channels_last: bool = True, winograd: bool = True
) -> list[tvm.transform.Pass]:
    """Steps 3-7 of :data:`STEPS`: layout, legalize, fold, fuse, schedule every kernel,
    pack weights."""
    tgt = resolve_target(target)
    return [ChannelsLast()] * channels_last + [
        ConvLiveTaps(),
        LegalizeOpsDeferred(tgt),
        *fusion_passes(winograd=winograd),
        FoldViewsIntoOps(tgt),
        relax.transform.AttachAttrLayoutFreeBuffers(),
        ScheduleKernels(tgt),
        relax.transform.SplitLayoutRewritePreproc(),
        FoldConstantsAtOnce(),
        relax.transform.FoldConstant(),
        relax.transform.DeadCodeElimination(),
    ]


def lowering_passes(target: str | dict | Target) -> list[tvm.transform.Pass]:
    """Step 8 of :data:`STEPS`: TVM's CPU dataflow lowering and VM finalization."""
    tgt = resolve_target(target)
    return cpu.dataflow_lower_passes(tgt) + cpu.finalize_passes(tgt)


def pipeline(
    target: str | dict | Target, base: str = "opsdk", *, channels_last: bool = True,
    winograd: bool = True,
) -> tvm.transform.Pass:
    """The Relax pipeline compiling a model for ``target`` with every kernel scheduled.

    ``base="opsdk"`` (the default) is the whole model pipeline described in this module;
    any other name is a TVM pipeline (``relax.get_pipeline(base)``, e.g. ``"default"``) with
    only the opsdk ops lowered by their rules in front, TVM's kernels left as TVM leaves them.
    ``channels_last=False`` keeps convolutions in the model's own layout (NCHW convs are all
    direct); ``winograd=False`` computes every conv directly (by default 3x3 stride-1 convs
    with 16+ channels run Winograd F(2x2, 3x3), :mod:`opsdk.kernels.winograd`).

    Examples
    --------
    >>> import opsdk, tvm
    >>> isinstance(opsdk.pipeline("x86"), tvm.transform.Pass)
    True
    """
    tgt = resolve_target(target)
    if base != "opsdk":
        return tvm.transform.Sequential(
            [LowerOps(tgt), relax.get_pipeline(base)], name="opsdk"
        )

    @tvm.transform.module_pass(opt_level=0, name="opsdk")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with tgt:
            seq = tvm.transform.Sequential(
                schedule_passes(tgt, channels_last=channels_last, winograd=winograd)
                + lowering_passes(tgt)
            )
            out = seq(mod)
        _refuse_unlowered(out, tgt)  # in words, before VM codegen's internal error
        return out

    return _pipeline

def compile_module(mod: tvm.IRModule, target: Any = "x86", *, params: Any = None,
                   winograd: bool = True, **kwargs: Any) -> Any:
    """``tvm.compile`` with :func:`pipeline` and opsdk's TIR pipeline: what
    :func:`opsdk.compile` runs (documented there)."""
    load_builtin_ops()
    t = resolve_target(target)
    if params is not None and params is not False:
        mod = bind_params(mod, None if params is True else params)
    kwargs.setdefault("tir_pipeline", tir_pipeline())
    return tvm.compile(mod, target=t, relax_pipeline=pipeline(t, winograd=winograd), **kwargs)


# ------------------------------------------------------------------------- compiling a model
class CompiledModel:
    """An executable and the scheduled IRModule it was built from (before VM lowering).

    ``kernels`` lists every kernel's facts (:func:`kernel_facts`). A model from the compile
    cache (``cached``) has ``ex`` loaded back from the cached library (``library``, the file
    to copy where an exported library is wanted: a loaded one cannot be exported again);
    TVM 0.27 cannot serialize IRModules (``save_json`` segfaults), so its ``scheduled`` and
    ``planned`` modules are recomputed on first use: the schedule passes, no code generation.
    """

    def __init__(self, ex: Any, scheduled: tvm.IRModule | None, target: Any, seconds: float,
                 planned: tvm.IRModule | None = None, *,
                 kernels: list[dict[str, Any]] | None = None, library: Any = None,
                 cached: bool = False, rebuild: Any = None, entry: Any = None,
                 timings: dict[str, float] | None = None, kernel_build: Any = None) -> None:
        self.ex, self.target, self.seconds = ex, target, seconds
        self._scheduled, self._planned, self._rebuild = scheduled, planned, rebuild
        self._kernels, self.library, self.cached, self._entry = kernels, library, cached, entry
        #: Seconds per compile phase, in the order the phases ran.
        self.timings: dict[str, float] = dict(timings or {})
        #: The kernel cache's record (:class:`opsdk._kernelcache.KernelBuild`: kernels
        #: reused and compiled), None when the kernel cache was not used.
        self.kernel_build = kernel_build
        #: Folded constants read back and computed (:class:`opsdk.transform._fold.FoldStats`),
        #: None for a model from the compile cache.
        self.fold_stats: Any = None
        #: The weights kept out of the library (``compile_model(weights_apart=True)``):
        #: a :class:`opsdk.transform.KernelFormWeights`; None when the library holds them.
        self.weights: KernelFormWeights | None = None

    def _ensure_modules(self) -> None:
        if self._scheduled is None and self._rebuild is not None:
            self._scheduled, self._planned = self._rebuild()
            self._rebuild = None

    @property
    def scheduled(self) -> tvm.IRModule:
        self._ensure_modules()
        return self._scheduled

    @property
    def planned(self) -> tvm.IRModule | None:  # after memory planning (StaticPlanBlockMemory)
        self._ensure_modules()
        return self._planned

    @property
    def kernels(self) -> list[dict[str, Any]]:
        if self._kernels is None:
            self._kernels = kernel_facts(self.scheduled)
        return self._kernels

    def rule_counts(self) -> dict[str, int]:
        """How many kernels each rule scheduled, by rule name."""
        counts: dict[str, int] = {}
        for k in self.kernels:
            counts[k["rule"]] = counts.get(k["rule"], 0) + 1
        return dict(sorted(counts.items()))

    def memo(self, name: str, compute: Any) -> Any:
        """``compute()``, JSON data about the compiled modules, kept with the compile-cache
        entry as ``name`` (letters, digits, ``-``): a model loaded back from the cache then
        answers without recomputing its modules (the schedule passes: 1-3 s a model).

        Examples
        --------
        >>> import opsdk
        >>> from tvm import relax
        >>> x = relax.Var("x", relax.TensorType((8,), "float32"))
        >>> bb = relax.BlockBuilder()
        >>> with bb.function("main", [x]):
        ...     with bb.dataflow():
        ...         y = bb.emit_output(relax.op.nn.relu(x))
        ...     _ = bb.emit_func_output(y)
        >>> cm = opsdk.model.compile_model(bb.get(), "x86", cache=False)
        >>> cm.memo("kernel-count", lambda: {"n": len(cm.kernels)})
        {'n': 1}
        """
        if not re.fullmatch(r"[A-Za-z0-9-]+", name):
            raise ValueError(f"memo name {name!r}: letters, digits and '-' only")
        if self._entry is not None:
            got = self._entry.read_extra(name)
            if got is not None:
                return got
        value = json.loads(json.dumps(compute()))  # what a cached copy reads back, exactly
        if self._entry is not None:
            self._entry.write_extra(name, value)
        return value

    def asm_facts(self) -> dict[str, dict[str, Any]]:
        """``{kernel: {"vector_ops", "vector_moves", "math_calls"}}``: the vector instructions
        and scalar math-library calls in each kernel's own assembly (each kernel compiled
        alone), kept with the cache entry."""
        if self._entry is not None:
            got = self._entry.read_extra("asm")
            if got is not None and set(got) == {k["name"] for k in self.kernels}:
                return got
        funcs = _kernels(self.scheduled)
        out = {k["name"]: _asm_facts(k["name"], funcs[k["name"]], self.target)
               for k in self.kernels}
        out = json.loads(json.dumps(out))  # what a cached copy reads back, exactly
        if self._entry is not None:
            self._entry.write_extra("asm", out)
        return out


_PHASE_OF = {"opsdk.ChannelsLast": "layout", "opsdk.ConvLiveTaps": "layout",
             "opsdk.LegalizeOpsDeferred": "legalize",
             "opsdk.LegalizeOpsOnce": "legalize", "FoldConstant": "fold constants",
             "opsdk.FoldConstantsAtOnce": "fold constants",
             "AnnotateTIROpPattern": "fuse", "FuseOps": "fuse", "FuseTIR": "fuse",
             "DeadCodeElimination": "fuse", "opsdk.FoldViewsIntoOps": "fuse",
             "AttachAttrLayoutFreeBuffers": "schedule",
             "opsdk.ScheduleKernels": "schedule", "SplitLayoutRewritePreproc": "pack weights"}


def _run_timed(passes: Sequence[Any], mod: tvm.IRModule,
               seconds: dict[str, float] | None) -> tvm.IRModule:
    """``Sequential(passes)(mod)``, one pass at a time so each phase's seconds add up in
    ``seconds`` (each in a Sequential of its own: the pass context's opt level and disabled
    passes still apply)."""
    if seconds is None:
        return tvm.transform.Sequential(list(passes))(mod)
    for p in passes:
        t0 = time.perf_counter()
        mod = tvm.transform.Sequential([p])(mod)
        phase = _PHASE_OF.get(p.info.name, "lower")
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
    return mod


def _schedule_and_plan(mod: tvm.IRModule, tgt: Any, winograd: bool,
                       seconds: dict[str, float] | None = None, weights_apart: bool = False
                       ) -> tuple[Any, Any, Any, KernelFormWeights | None]:
    passes = lowering_passes(tgt)
    # Keep the module right after memory planning: what the VM will allocate is read there.
    cut = next((i + 1 for i, p in enumerate(passes)
                if p.info.name == "StaticPlanBlockMemory"), len(passes))
    with tgt:
        front = schedule_passes(tgt, winograd=winograd)
        if lifts_weights(mod):  # weight transforms run once at load (opsdk.transform._lift)
            front = lift_passes(front)
        scheduled = _run_timed(front, mod, seconds)
        weights = None
        if weights_apart:  # after the folding: the constants are what the kernels read
            t0 = time.perf_counter()
            scheduled, weights = constants_as_params(scheduled)
            if seconds is not None:
                seconds["pack weights"] = (seconds.get("pack weights", 0.0)
                                           + time.perf_counter() - t0)
        planned = _run_timed(passes[:cut], scheduled, seconds)
    return scheduled, planned, passes[cut:], weights


def _replan(mod: tvm.IRModule, tgt: Any, winograd: bool, folds: Any,
            tuning: Sequence[Any] = ()) -> tuple[Any, Any]:
    """The scheduled and planned modules of a model read from the compile cache, folding
    through ``folds`` (the kernel cache's folded constants, or None)."""
    with fold_cache(folds), tuned_rules(tuning):
        return _schedule_and_plan(mod, tgt, winograd)[:2]


def compile_model(mod: tvm.IRModule, target: Any = "x86", *, winograd: bool = True,
                  cache: Any = None, weights_apart: bool = False,
                  tuning: Sequence[Any] = ()) -> CompiledModel:
    """Compile ``mod`` with :func:`opsdk.pipeline`, keeping the scheduled module
    (``winograd=False``: every conv direct, as ``opsdk.pipeline(target, winograd=False)``).

    ``weights_apart``: the library holds no weights. Every constant of 1 KiB or more, in
    the form the kernels read (packed, folded), becomes a trailing parameter of each function
    using it (:func:`opsdk.transform.constants_as_params`); ``cm.weights`` has the tensors,
    each once, and which function takes which. Such a compile is not cached (the cache
    keeps libraries, not weights).

    The result is kept in the on-disk compile cache (:mod:`opsdk._modelcache`), keyed by the
    module's content, the target, the options and the code versions; a second compile of an
    unchanged module loads the library back instead. ``cache``: None follows the
    environment (``OPSDK_NO_CACHE=1`` turns it off, ``OPSDK_CACHE_DIR`` moves it), False
    compiles afresh, True uses the default folder, a path that folder.

    ``tuning``: verified tuning records (:class:`opsdk.schedules.TunedRecord`, e.g.
    ``opsdk.tune.TuningDB(folder).records(target)``); each schedules its own kernel ahead
    of the hand rules (:func:`opsdk.schedules.tuned_rules`) and is part of the cache key.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(x))
    ...     _ = bb.emit_func_output(y)
    >>> cm = opsdk.model.compile_model(bb.get(), "x86", cache=False)
    >>> cm.rule_counts()
    {'x86.elementwise': 1}
    """
    tgt = resolve_target(target)
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    store = None if weights_apart else open_cache(cache, tgt)
    kcache = open_kernel_cache(cache, tgt)
    folds = kcache.folds if kcache is not None else None
    key = None
    if store is not None:
        with contextlib.suppress(Exception):  # a module the printer refuses: not cached
            opts: dict[str, Any] = {"pipeline": "opsdk", "winograd": bool(winograd)}
            if tuning:  # a tuned compile is another entry than the hand rules' one
                opts["tuning"] = sorted([r.workload, json.dumps(r.trace)] for r in tuning)
            key = store.key(mod, tgt, opts)
    # Inside reused_decisions with nothing decided yet (``--watch``'s first build) the model
    # is compiled, its kernels from the kernel cache, rather than loaded whole: the first
    # edit then finds every kernel's legalization and schedule in the memos (ResNet-50: 0.9 s).
    entry = store.load(key) if key and not nothing_decided() else None
    if entry is not None:
        try:
            ex = entry.load_module()
        except Exception:  # never trust an entry that does not load: rebuild it
            store.discard(key)
        else:
            seconds["model cache"] = time.perf_counter() - t0
            record_phases(seconds)
            return CompiledModel(
                ex, None, tgt, time.perf_counter() - t0, kernels=entry.meta["kernels"],
                library=entry.library, cached=True, entry=entry, timings=seconds,
                rebuild=lambda: _replan(mod, tgt, winograd, folds, tuning))
    if key:
        seconds["model cache"] = time.perf_counter() - t0
    with fold_cache(folds) as fold_stats, tuned_rules(tuning):
        scheduled, planned, rest, weights = _schedule_and_plan(mod, tgt, winograd, seconds,
                                                               weights_apart)
    with tgt:
        lowered = _run_timed(rest, planned, seconds)
    _refuse_unlowered(lowered, tgt)
    built, kernel_build = _build(lowered, tgt, kcache, seconds)
    ex, library = built
    cm = CompiledModel(ex, scheduled, tgt, time.perf_counter() - t0, planned,
                       library=library, timings=seconds, kernel_build=kernel_build)
    cm.weights = weights
    if library is not None:  # its folder goes with the compiled model (the library is
        # mapped once loaded; the file is what an artifact copies)
        weakref.finalize(cm, shutil.rmtree, str(library.parent), True)
    if key:
        t1 = time.perf_counter()
        kernels = json.loads(json.dumps(cm.kernels))  # as a cached copy reads them back
        cm._kernels = kernels
        export = (lambda path: ex.export_library(path, options=list(LINK_OPTIONS))) \
            if library is None else (lambda path: shutil.copyfile(library, path))
        cm._entry = store.store(key, export, {"kernels": kernels, "compile_s": cm.seconds})
        if cm._entry is not None:  # a file to copy that outlives this process's temp dir
            cm.library = cm._entry.library
        seconds["model cache"] += time.perf_counter() - t1
        cm.seconds = time.perf_counter() - t0
    cm.fold_stats = fold_stats
    record_phases(seconds, kernel_build, fold_stats)
    return cm


def _refuse_unlowered(lowered: tvm.IRModule, tgt: Any) -> None:
    """Raise :class:`UnloweredOpError` naming every high-level Relax op (one with a
    legalization registered) left in ``lowered``: TVM leaves a call whose form its
    legalization does not take (an NHWC transposed conv, say) in place."""
    left: dict[str, str] = {}
    for _, f in lowered.functions.items():
        if not isinstance(f, relax.Function):
            continue
        for e in calls_of(f):
            if e.op.name not in left and (e.op.get_attr("FLegalize") is not None
                                          or e.op.name in _NO_LOWERING):
                attrs = " ".join(str(e.attrs).split()) if e.attrs is not None else ""
                left[e.op.name] = attrs if len(attrs) <= 160 else attrs[:157] + "..."
    if left:
        what = "; ".join(f"{op}({a})" if a else op for op, a in left.items())
        hints = sorted({_NO_LOWERING[op] for op in left if op in _NO_LOWERING})
        raise UnloweredOpError(
            f"the model uses {what}, which no lowering handles for target {tgt.kind.name} "
            f"({', '.join(map(str, tgt.keys))}) in this form; opsdk cannot compile it. "
            + "".join(f"{h}. " for h in hints)
            + "Rewrite that layer with supported ops, or register the op with opsdk.op and a "
            "torch/ONNX mapping (docs/authoring.md)")


#: Relax ops that opsdk's legalization leaves in place in some forms (TVM's own pipelines
#: hand them to ``libtvm_runtime_extra``, which the deployed runtime does not have); each
#: with what to do instead.
_NO_LOWERING = dict.fromkeys(
    ("relax.sort", "relax.argsort", "relax.topk"),
    "opsdk's sort kernel (torch.sort, argsort, topk; ONNX TopK) needs a static shape and "
    "this input has a symbolic dimension: export the model with static shapes, or rank the "
    "model's outputs after it runs")


#: Constants (weights held in the module) up to which a compile for this machine without the
#: kernel cache still builds its kernels apart: that build links a library holding them,
#: about 13 ms a MB (BERT-small's 109 MB: 1.2-1.4 s to link and 0.15 s to load, where one
#: ``tvm.compile`` of its few large kernels took 0.7 s), while the kernels of a net with
#: small weights and many kernels gain (YOLOv8n, 18 MB: codegen 6.6-7.2 -> 4.3-4.6 s).
#: For another machine the library is exported anyway: always apart.
_LINK_BYTES = 32 * 1024**2


def _constant_bytes(mod: tvm.IRModule) -> int:
    """Bytes of the tensor constants in ``mod``'s Relax functions (each counted once)."""
    seen: dict[Any, int] = {}
    for _, f in mod.functions.items():
        if isinstance(f, relax.Function):
            for e in relax_exprs(f):
                if isinstance(e, tvm.ir.expr.GenericConst) and \
                        isinstance(e.value, tvm.runtime.Tensor):
                    t = e.value
                    seen[t.__chandle__()] = math.prod(int(d) for d in t.shape) * \
                        tvm.runtime.DataType(str(t.dtype)).bits // 8
    return sum(seen.values())


def _build(lowered: tvm.IRModule, tgt: Any, kcache: Any, seconds: dict[str, float]
           ) -> tuple[tuple[Any, Any], Any]:
    """((executable, library file or None), the kernel cache's record or None): through the
    kernel cache when there is one, else its build keeping nothing (kernels compiled in
    parallel; for another machine, the library linked with its cross compiler), else
    ``tvm.compile`` (kept in memory)."""
    if kcache is None and (not runs_on_host(tgt) or _constant_bytes(lowered) <= _LINK_BYTES):
        kcache = kernel_builder(tgt)
    if kcache is not None:
        work = Path(tempfile.mkdtemp(prefix="opsdk-model-"))
        try:
            got = kcache.build(lowered, tgt, work)
        except Exception:  # the cache must never fail a compile: the ordinary way
            got = None
        if got is not None:
            ex, lib, rec = got
            for k, v in rec.seconds.items():
                seconds[k] = seconds.get(k, 0.0) + v
            return (ex, lib), rec
        shutil.rmtree(work, ignore_errors=True)

    t0 = time.perf_counter()
    ex = tvm.compile(lowered, target=tgt, relax_pipeline=None, tir_pipeline=tir_pipeline())
    seconds["codegen"] = seconds.get("codegen", 0.0) + time.perf_counter() - t0
    return (ex, None), None


def load_compiled(key: str, target: Any = "x86") -> CompiledModel | None:
    """The compiled model stored in the compile cache under ``key`` (``ModelReport.cache_key``
    of an earlier report), or None when it is absent or fails a check. Its kernel facts and
    library are the entry's; its IRModules are not there (``scheduled`` is None).

    Examples
    --------
    >>> from opsdk.model import load_compiled
    >>> load_compiled("0" * 64, "x86") is None
    True
    """
    tgt = resolve_target(target)
    store = open_cache(None, tgt)
    entry = store.load(key) if store is not None else None
    if entry is None:
        return None
    try:
        ex = entry.load_module()
    except Exception:  # never trust an entry that does not load
        store.discard(key)
        return None
    return CompiledModel(ex, None, tgt, 0.0, kernels=entry.meta["kernels"],
                         library=entry.library, cached=True, entry=entry)


def compile_default(mod: tvm.IRModule, target: Any = "x86", *, cache: Any = None) -> Any:
    """``tvm.compile(mod, target=target)`` (TVM's default pipeline, the benchmarks'
    baseline) through the compile cache of :func:`compile_model`: the executable, or the
    library loaded back from the cache.

    Examples
    --------
    >>> import numpy as np, opsdk, tvm
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.relu(x))
    ...     _ = bb.emit_func_output(y)
    >>> ex = opsdk.model.compile_default(bb.get(), "x86", cache=False)
    >>> vm = relax.VirtualMachine(ex, tvm.cpu())
    >>> float(vm["main"](tvm.runtime.tensor(-np.ones((8, 16), "f4"))).numpy().max())
    0.0
    """
    tgt = resolve_target(target)
    store = open_cache(cache, tgt)
    key = None
    if store is not None:
        with contextlib.suppress(Exception):
            key = store.key(mod, tgt, {"pipeline": "tvm-default"})
    entry = store.load(key) if key else None
    if entry is not None:
        try:
            return entry.load_module()
        except Exception:
            store.discard(key)
    ex = tvm.compile(mod, target=tgt)
    if key:
        store.store(key, ex.export_library, {"kernels": []})
    return ex


def kernel_kind_rule(func: tirx.PrimFunc) -> tuple[str, str]:
    """(kind, rule) of a scheduled kernel: ``opsdk.<op>`` for an opsdk op, else the kind
    the driver classified (matmul, conv2d, ...); the rule that scheduled it, or ``generic``."""
    attrs = func.attrs or {}
    op = attrs.get("opsdk.op")
    kind = f"opsdk.{op}" if op is not None else str(attrs.get("opsdk.kind", classify(func)))
    return kind, str(attrs.get("opsdk.rule", GENERIC))


def kernel_facts(mod: tvm.IRModule) -> list[dict[str, Any]]:
    """Every kernel of a scheduled module, sorted by name: ``{"name", "kind", "rule",
    "out_elements", "flops", "bytes", "vectorized_loops", "parallel_loops"}`` (what
    :func:`report` states of a kernel before timing it and reading its assembly; kept in
    the compile cache).

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    >>> w = relax.const(np.ones((32, 48), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.matmul(x, w))
    ...     _ = bb.emit_func_output(y)
    >>> cm = opsdk.model.compile_model(bb.get(), "x86", cache=False)
    >>> [(k["kind"], k["rule"], k["out_elements"]) for k in kernel_facts(cm.scheduled)]
    [('matmul', 'x86.matmul', 3072)]
    """
    rows = []
    for name, f in sorted(_kernels(mod).items()):
        loops = loop_kinds(f)
        kind, rule = kernel_kind_rule(f)
        flops, nbytes = kernel_work(f)
        rows.append({"name": name, "kind": kind, "rule": rule,
                     "out_elements": _static_elements(f), "flops": flops, "bytes": nbytes,
                     "vectorized_loops": int(loops.get("VECTORIZED", 0)),
                     "parallel_loops": int(loops.get("PARALLEL", 0)),
                     "rule_failures": rule_failures(f)})
    return rows


def scheduled_kernels(mod: tvm.IRModule) -> list[dict[str, str]]:
    """Every kernel of a scheduled module: ``{"name", "kind", "rule"}``, sorted by name."""
    rows = []
    for name, f in sorted(_kernels(mod).items()):
        kind, rule = kernel_kind_rule(f)
        rows.append({"name": name, "kind": kind, "rule": rule})
    return rows


def _kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {
        gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)
    }


def _static_elements(func: tirx.PrimFunc) -> int | None:
    out = func.params[-1]
    n = 1
    for d in out.shape:
        if not isinstance(d, tirx.IntImm):
            return None
        n *= int(d.value)
    return n


def _asm_facts(name: str, func: tirx.PrimFunc, tgt: Any) -> dict[str, Any]:
    """Vector arithmetic (by register class), full-width vector loads/stores and scalar
    math-library calls in the kernel's assembly, compiled alone (its parallel lambdas are
    then its own)."""

    facts: dict[str, Any] = {"vector_ops": {}, "vector_moves": 0, "math_calls": {}}
    if tgt.kind.name != "llvm":
        return facts

    f = func.with_attr("global_symbol", name)
    try:
        ex = tvm.compile(tvm.IRModule({name: f}), target=tgt, tir_pipeline=tir_pipeline())
    except Exception:
        return facts
    asm, arch = asm_of(ex), target_arch(tgt)
    return {"vector_ops": kernel_vector_ops(asm, arch, name),
            "vector_moves": kernel_vector_moves(asm, arch, name),
            "math_calls": kernel_math_calls(asm, name)}
