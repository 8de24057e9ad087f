"""Relax passes and pipelines that lower a model with opsdk's schedule rules.

``pipeline(target)`` is the whole CPU compile of a model:

0. convolutions run channels-last (:func:`ChannelsLast`): NHWC inside, one transpose where
   a conv chain starts and one where it ends;
1. opsdk ops are legalized with their own compute, unscheduled, tagged ``opsdk.op``; all but
   elementwise ones are marked opaque to fusion so their kernels stay whole;
2. TVM's ops are legalized (``LegalizeOps``; eligible 3x3 convs as Winograd F(2x2, 3x3),
   :mod:`opsdk.kernels.winograd`), the kernels annotated with their fusion pattern,
   constants folded (weight transposes happen once, here);
3. ``FuseOps`` / ``FuseTIR``: elementwise epilogues (bias, activation, residual add, scale)
   join the matmul or conv that produces them;
4. :func:`ScheduleKernels`: every PrimFunc gets a rule from the one driver: an opsdk op its
   op's rules, any other kernel the rules for its classified kind (winograd, matmul, conv2d,
   pool, reduction, elementwise);
5. weight packing that a rule asked for (``meta_schedule.layout_rewrite_preproc`` blocks) is
   split into its own function and folded into the constants;
6. TVM's CPU dataflow lowering and VM finalization.
"""

from __future__ import annotations

import contextlib

import tvm
from tvm import relax, tirx
from tvm.target import Target

from ..targets import target as _resolve
from ._fold import FoldConstantsAtOnce

__all__ = [
    "LowerOps",
    "ScheduleKernels",
    "fusion_passes",
    "lowering_passes",
    "pipeline",
    "schedule_passes",
]


def LowerOps(target: str | dict | Target) -> tvm.transform.Pass:
    """Legalize every ``opsdk.*`` call in a module with the rules chosen for ``target``.

    TVM's own ops are left for the regular pipeline. Lowering also happens automatically
    inside ``tvm.compile(mod, target=...)`` (FLegalize reads the target in scope); this pass
    makes it explicit and lets you inspect the module in between.

    Examples
    --------
    >>> import opsdk
    >>> p = opsdk.transform.LowerOps("x86")
    >>> p.info.name
    'opsdk.LowerOps'
    """
    return _legalize_opsdk_ops(_resolve(target), "opsdk.LowerOps", deferred=False)


def _legalize_opsdk_ops(tgt: Target, name: str, *, deferred: bool) -> tvm.transform.Pass:
    """LegalizeOps on the ``opsdk.*`` calls only; ``deferred``: without scheduling them
    (the model pipeline's ScheduleKernels does, after fusion)."""
    from ..schedules import deferred_scheduling

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # Our FLegalize reads the target in scope; TVM's own ops are skipped here and left
        # to the regular pipeline.
        others = [n for n in tvm.ir.Op.list_op_names() if not n.startswith("opsdk.")]
        with tgt, (deferred_scheduling() if deferred else contextlib.nullcontext()):
            return relax.transform.LegalizeOps(skip_ops=others)(mod)

    return _pass


def ScheduleKernels(target: str | dict | Target) -> tvm.transform.Pass:
    """Schedule every PrimFunc of a module that is not scheduled yet, with one driver.

    A function tagged ``opsdk.op`` (an unfused opsdk kernel) gets its op's rules; any other
    kernel (TVM's legalized ops, fused groups) gets the rules for its classified kind
    (:func:`opsdk.schedules.classify`). The chosen rule is recorded on the function
    (``opsdk.rule``) and in :func:`opsdk.schedules.last_choices`.

    Examples
    --------
    >>> import opsdk
    >>> opsdk.transform.ScheduleKernels("x86").info.name
    'opsdk.ScheduleKernels'
    """
    tgt = _resolve(target)

    @tvm.transform.module_pass(opt_level=0, name="opsdk.ScheduleKernels")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        from ..registry import get_op, is_registered
        from ..schedules import apply_schedule, kernel_for

        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            attrs = func.attrs or {}
            if attrs.get("tir.is_scheduled", False) or "opsdk.rule" in attrs:
                continue
            name = attrs.get("opsdk.op")
            op = get_op(str(name)) if name is not None and is_registered(str(name)) else None
            with tgt:
                if op is not None:
                    updates[gv] = apply_schedule(op, func, tgt)
                else:
                    kernel = kernel_for(gv.name_hint, func)
                    updates[gv] = apply_schedule(kernel, func, tgt).with_attr(
                        "opsdk.kind", kernel.kind)
        if updates:
            mod = mod.clone()  # the caller's module stays as it was
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _pass


def _scan_te(x, axis: int | None, dtype: str | None, exclusive: bool, product: bool):
    """Inclusive / exclusive cumulative sum or product along ``axis`` (None: the flattened
    input) as one reduction with a condition, ``out[.., i, ..] = sum_{j <= i} x[.., j, ..]``:
    a block-structured kernel the rules schedule (TOPI's scan is an opaque extern that
    SplitLayoutRewritePreproc and the rules refuse). Quadratic in the axis length, which is
    a sequence length at most (a GPT-2's position ids)."""
    from tvm import te, topi

    if axis is None:
        size = x.shape[0]
        for d in x.shape[1:]:
            size = size * d
        x = topi.reshape(x, (size,))
        axis = 0
    axis = axis % len(x.shape)
    out_dt = dtype or x.dtype
    # Sums of bools count in int64 (as torch's cumsum does), then narrow to the output type.
    dt = "int64" if out_dt == "bool" else out_dt
    n = x.shape[axis]
    j = te.reduce_axis((0, n), name="j")
    reducer = (te.comm_reducer(lambda a, b: a * b, lambda t: tirx.const(1, t), name="prod")
               if product else te.sum)

    def body(*i):
        src = [*i[:axis], j, *i[axis + 1:]]
        cond = j < i[axis] if exclusive else j <= i[axis]
        # A Select, not te.sum's where=: create_prim_func drops that condition.
        return reducer(tirx.Select(cond, x(*src).astype(dt), tirx.const(int(product), dt)),
                       axis=j)

    y = te.compute(x.shape, body, name="cumprod" if product else "cumsum")
    if dt != out_dt:
        y = te.compute(x.shape, lambda *i: y(*i) != tirx.const(0, dt), name="nonzero")
    return y


def _legalize_scan(product: bool):
    """Legalize ``relax.cumsum`` / ``relax.cumprod``: TVM 0.27 registers no legalization for
    them, so they reached VM codegen unlowered (a GPT-2's position ids are a cumsum of its
    attention mask); a constant one is folded at compile time."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        a = call.attrs
        axis = None if a.axis is None else int(a.axis)
        dtype = None if a.dtype is None or str(a.dtype) in ("", "void") else str(a.dtype)
        return bb.call_te(_scan_te, call.args[0], axis, dtype, bool(a.exclusive), product,
                          primfunc_name_hint="cumprod" if product else "cumsum")

    return legalize


#: Legalizations TVM 0.27 lacks for ops its frontends emit.
_LEGALIZE_MISSING = {"relax.cumsum": _legalize_scan(False),
                     "relax.cumprod": _legalize_scan(True)}


def fusion_passes(*, winograd: bool = False) -> list[tvm.transform.Pass]:
    """TVM's legalization, constant folding and fusion (what its CPU pipelines run before
    codegen, and steps 2-3 of :func:`pipeline` after the opsdk ops). ``winograd``: eligible
    3x3 convs legalize to the Winograd kernel (:mod:`opsdk.kernels.winograd`) instead of
    TVM's direct convolution."""
    custom = dict(_LEGALIZE_MISSING)
    if winograd:
        from ..kernels.winograd import legalize_conv2d

        custom["relax.nn.conv2d"] = legalize_conv2d
    return [
        relax.transform.LegalizeOps(customize_legalize_map=custom),
        relax.transform.AnnotateTIROpPattern(),
        FoldConstantsAtOnce(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def schedule_passes(
    target: str | dict | Target, *, channels_last: bool = True, winograd: bool = True
) -> list[tvm.transform.Pass]:
    """Steps 0-5 of :func:`pipeline`: layout, legalize, fold, fuse, schedule every kernel,
    pack weights."""
    from ._layout import ChannelsLast

    tgt = _resolve(target)
    return [ChannelsLast()] * channels_last + [
        _legalize_opsdk_ops(tgt, "opsdk.LegalizeOpsDeferred", deferred=True),
        *fusion_passes(winograd=winograd),
        relax.transform.AttachAttrLayoutFreeBuffers(),
        ScheduleKernels(tgt),
        relax.transform.SplitLayoutRewritePreproc(),
        FoldConstantsAtOnce(),
        relax.transform.FoldConstant(),
        relax.transform.DeadCodeElimination(),
    ]


def lowering_passes(target: str | dict | Target) -> list[tvm.transform.Pass]:
    """Step 6 of :func:`pipeline`: TVM's CPU dataflow lowering and VM finalization."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    tgt = _resolve(target)
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
    tgt = _resolve(target)
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
            return seq(mod)

    return _pipeline
