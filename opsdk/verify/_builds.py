"""Verify's builds: one kernel per signature (op, target, dtype, attributes, rank, inputs
present) with symbolic dims, compiled once and run on every drawn shape, cached for the run,
with the generic (unscheduled) lowering beside it as the schedule-invariance oracle.

A packed case (``Case.packed``) binds the op's weights as a model does: they are the
function's trailing parameters past ``num_input``, and the model pipeline's own passes
(LegalizeOpsDeferred, AttachAttrLayoutFreeBuffers, ScheduleKernels,
SplitLayoutRewritePreproc) give the rules constant weights to pack in a function of their
own. A model folds that function at compile time; here the VM runs it before the kernel on
every call, on the same inputs, so the packing is checked through the kernel's output."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.sym import Analyzer

from .._opdef import OpDef
from .._tir import tir_pipeline
from ..registry import builder
from ..runners.local import host_arch
from ..schedules import GENERIC, generic_only
from ..targets import target_arch
from ..transform import LegalizeOpsDeferred, LowerOps, ScheduleKernels
from ._strategies import (
    Case,
    _present_shapes,
    free_defaults,
    input_dtypes,
    static_axes,
    weight_axes,
)


@dataclass
class _Build:
    params: list[str]
    dims: list[Any]
    free: dict[str, Any]
    out_shape: list[Any]  # the first output's (the only one of most ops)
    out_dtype: str
    ex: Any
    ex_generic: Any
    prim: tirx.PrimFunc
    prim_name: str
    rule: str
    seconds: float
    mod: tvm.IRModule | None = None
    tgt: Any = None
    outs: list[tuple[list[Any], str]] = field(default_factory=list)  # every output's type

    def lower_generic(self) -> tvm.IRModule:
        with generic_only():
            return LowerOps(self.tgt)(self.mod)


_BUILDS: OrderedDict[tuple, _Build] = OrderedDict()
#: The suffix SplitLayoutRewritePreproc gives the weight-packing function it splits off.
_PREPACK = "_weight_prepack"
_MAX_BUILDS = 256


def _build_key(d: OpDef, case: Case, tgt: Any, dims: Sequence[Any],
               present: Sequence[str]) -> tuple:
    dkey = tuple(int(x) if isinstance(x, int) else "?" for x in dims)
    # Free named dims are static in a static build (the size is part of the signature).
    fkey = tuple(sorted((k, int(v) if _static_free(case) else "?")
                        for k, v in _free_sizes(d, case).items()))
    attrs = tuple(sorted((k, repr(v)) for k, v in case.attrs.items()))
    return (d.name, id(d), str(tgt), case.dtype, attrs, tuple(present), dkey, fkey,
            bool(case.packed))


def _static_free(case: Case) -> bool:
    # A model's weights have static shapes: a packed build fixes the free dims they use.
    return bool(case.static or case.packed)


def _weights(d: OpDef, case: Case, present: Sequence[str]) -> list[str]:
    """The inputs bound as constants in ``case``'s build (none unless it is packed)."""
    return [w for w in d.weights if w in present] if case.packed else []


def _relax_module(d: OpDef, shapes: Mapping[str, tuple], dtype: str,
                  attrs: Mapping[str, Any], weights: Sequence[str] = ()
                  ) -> tuple[tvm.IRModule, relax.Var]:
    """``main(inputs...)`` calling the op; with ``weights``, those are the trailing params
    past ``num_input`` (``shapes`` must list them last), as a model's bound weights are."""
    bb = relax.BlockBuilder()
    dts = input_dtypes(d, dtype, list(shapes))
    params = [relax.Var(n, relax.TensorType(list(s), dts[n])) for n, s in shapes.items()]
    fattrs = {"num_input": len(params) - len(weights)} if weights else None
    with bb.function("main", params, attrs=fattrs):
        with bb.dataflow():
            y = bb.emit(builder(d)(**dict(zip(shapes, params)), **attrs))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), y


def _lower_packed(mod: tvm.IRModule, tgt: Any) -> tvm.IRModule:
    """The model pipeline's own steps from legalization to the split of the weight packing
    (:func:`opsdk._pipeline.schedule_passes`, without fusion and folding: one kernel, and
    weights that stay parameters)."""
    with tgt:
        return tvm.transform.Sequential([
            LegalizeOpsDeferred(tgt),
            relax.transform.AttachAttrLayoutFreeBuffers(),
            ScheduleKernels(tgt),
            relax.transform.SplitLayoutRewritePreproc(),
        ])(mod)


def _prim_of(mod: tvm.IRModule, op_name: str) -> tuple[str, tirx.PrimFunc]:
    for gv, f in mod.functions.items():
        # SplitLayoutRewritePreproc copies the kernel's attributes to the weight packing it
        # splits off (a packed build): the kernel is the other function.
        if (isinstance(f, tirx.PrimFunc) and f.attrs and f.attrs.get("opsdk.op") == op_name
                and not gv.name_hint.endswith(_PREPACK)):
            return gv.name_hint, f
    raise RuntimeError(f"opsdk.{op_name}: lowering produced no PrimFunc")


def _signature(d: OpDef, case: Case, tgt: Any) -> tuple[tuple, list[Any], list[str]]:
    present = [p.name for p in d.tensor_params if not p.optional or p.name in case.present]
    rank = len(case.shape)
    if case.static:
        fixed: Iterable[int] = range(rank)
    else:
        fixed = static_axes(d, case.shape, case.dtype, case.attrs, case.present)
    dims = [case.shape[i] if i in fixed else tirx.Var(f"d{i}", "int64") for i in range(rank)]
    if case.packed and d.weights:
        # A weight's shape is static in a model: the primary's dims it uses are fixed too.
        used = weight_axes(d, case.shape, case.attrs, case.present)
        dims = [case.shape[i] if i in used else v for i, v in enumerate(dims)]
    return _build_key(d, case, tgt, dims, present), dims, present


def _free_sizes(d: OpDef, case: Case) -> dict[str, Any]:
    """The case's free named dims: its own sizes, else the op's defaults for its shape."""
    return {**free_defaults(d, case.shape, case.attrs), **case.free}


def _free_dims(d: OpDef, case: Case) -> dict[str, Any]:
    """Free named dims of the build: static sizes in a static build, else symbolic."""
    sizes = _free_sizes(d, case)
    if _static_free(case):
        return sizes
    return {k: tirx.Var(f"free_{k}", "int64") for k in sizes}


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    # TVM's compile and LLVM's JIT release the GIL: two builds run side by side.
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2)),
                                   thread_name_prefix="opsdk-verify-build")
    return _POOL


def _compile(mod: tvm.IRModule, tgt: Any, warm: bool) -> Any:
    ex = tvm.compile(mod, target=tgt, tir_pipeline=tir_pipeline())
    if warm:  # LLVM code is generated lazily, at first load: do it here, in parallel
        relax.VirtualMachine(ex, tvm.cpu())
    return ex


def _oracle_target(tgt: Any) -> Any:
    # The generic lowering is an oracle, not a product: LLVM -O0 compiles it ~5x faster
    # (IEEE semantics are the same at every level; fast-math stays off).
    if tgt.kind.name != "llvm":
        return tgt
    return tvm.target.Target({**dict(tgt.export()), "opt-level": 0})


def _get_builds(d: OpDef, cases: Sequence[Case], tgt: Any, *,
                generic: bool | Callable[[Case], bool] = True) -> list[_Build]:
    """Builds for ``cases`` (cached); missing ones are compiled side by side. With
    ``generic`` (for a case) the generic lowering is built too (else when first needed)."""

    warm = tgt.kind.name == "llvm" and target_arch(tgt) == host_arch()
    jobs: dict[tuple, tuple] = {}
    keys = []
    for case in cases:
        key, dims, present = _signature(d, case, tgt)
        keys.append(key)
        want_generic = generic(case) if callable(generic) else generic
        if key in jobs:
            b, fut, fut_g = jobs[key]
            if want_generic and fut_g is None and b.rule != GENERIC:
                fut_g = _pool().submit(_compile, b.lower_generic(), _oracle_target(tgt), warm)
                jobs[key] = (b, fut, fut_g)
            continue
        hit = _BUILDS.get(key)
        if hit is not None:
            if want_generic and hit.ex_generic is None:
                fut_g = _pool().submit(_compile, hit.lower_generic(), _oracle_target(tgt), warm)
                jobs[key] = (hit, None, fut_g)
            continue
        t0 = time.perf_counter()
        free = _free_dims(d, case)
        shapes = _present_shapes(d, dims, case.attrs, case.present, free)
        weights = _weights(d, case, present)
        if weights:  # the runner passes inputs in this order (b.params)
            shapes = {**{k: v for k, v in shapes.items() if k not in weights},
                      **{k: shapes[k] for k in weights}}
        mod, y = _relax_module(d, shapes, case.dtype, case.attrs, weights)
        lowered = _lower_packed(mod, tgt) if weights else LowerOps(tgt)(mod)
        prim_name, prim = _prim_of(lowered, d.name)
        tys = list(y.ty.fields) if isinstance(y.ty, relax.TupleType) else [y.ty]
        outs = [(list(t.shape.values) if t.shape is not None else [], str(t.dtype))
                for t in tys]
        b = _Build(
            params=list(shapes),
            dims=dims,
            free={k: v for k, v in free.items() if isinstance(v, tirx.Var)},
            out_shape=outs[0][0],
            out_dtype=outs[0][1],
            outs=outs,
            ex=None,
            ex_generic=None,
            prim=prim,
            prim_name=prim_name,
            rule=str(prim.attrs.get("opsdk.rule", GENERIC)),
            seconds=0.0,
            mod=mod,
            tgt=tgt,
        )
        fut = _pool().submit(_compile, lowered, tgt, warm)
        # A generic rule means the generic lowering is this very function.
        fut_g = None
        if want_generic and b.rule != GENERIC:
            fut_g = _pool().submit(_compile, b.lower_generic(), _oracle_target(tgt), warm)
        b.seconds = -t0
        jobs[key] = (b, fut, fut_g)
    for key, (b, fut, fut_g) in jobs.items():
        if fut is not None:
            b.ex = fut.result()
            if b.rule == GENERIC:
                b.ex_generic = b.ex
        if fut_g is not None:
            b.ex_generic = fut_g.result()
        if b.seconds < 0:
            b.seconds += time.perf_counter()
        _BUILDS[key] = b
    out = [_BUILDS[k] for k in keys]
    for k in keys:
        _BUILDS.move_to_end(k)
    while len(_BUILDS) > _MAX_BUILDS:
        _BUILDS.popitem(last=False)
    return out


def _get_build(d: OpDef, case: Case, tgt: Any, *, generic: bool = True) -> _Build:
    return _get_builds(d, [case], tgt, generic=generic)[0]


def _eval_shape(b: _Build, shape: Sequence[int], free: Mapping[str, int],
                out_shape: Sequence[Any] | None = None) -> tuple[int, ...]:
    """An output's shape (the first output's by default) for concrete input dims."""

    an = Analyzer()
    for v, n in zip(b.dims, shape):
        if isinstance(v, tirx.Var):
            an.bind(v, tirx.const(int(n), "int64"))
    for k, v in b.free.items():
        an.bind(v, tirx.const(int(free[k]), "int64"))
    out = []
    for e in (b.out_shape if out_shape is None else out_shape):
        s = an.simplify(e) if not isinstance(e, int) else e
        if isinstance(s, tirx.IntImm):
            s = s.value
        if not isinstance(s, int):
            raise ValueError(f"inferred output dim {e} is not determined by the input dims")
        out.append(int(s))
    return tuple(out)
