"""Relax passes that lower opsdk ops and schedule a model's kernels with opsdk's rules:
:func:`LowerOps` (legalize the opsdk ops, scheduled by their rules), :func:`LegalizeOpsDeferred`
(legalize them unscheduled, for the model pipeline to schedule after fusion),
:func:`LegalizeOpsOnce` (TVM's LegalizeOps, each distinct call legalized once),
:func:`ScheduleKernels` (every kernel of a module through the one driver) and
:data:`MISSING_LEGALIZATIONS` (ops TVM 0.27's frontends emit without a legalization). The
order the model pipeline runs them in is :mod:`opsdk._pipeline`'s."""

from __future__ import annotations

import contextlib
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi
from tvm.target import Target

from .._walk import with_functions
from ..registry import get_op, is_registered
from ..schedules import apply_schedule, deferred_scheduling, kernel_for, rebuild_memo, remember
from ..targets import target as _resolve
from ._rewrite import op_counts
from ._sort import SORT_LEGALIZATIONS

__all__ = ["MISSING_LEGALIZATIONS", "LegalizeOpsDeferred", "LegalizeOpsOnce", "LowerOps",
           "ScheduleKernels"]


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


def LegalizeOpsDeferred(target: str | dict | Target) -> tvm.transform.Pass:
    """Legalize every ``opsdk.*`` call with its own compute, unscheduled and tagged
    ``opsdk.op`` (all but elementwise ops marked opaque to fusion, so their kernels stay
    whole): the model pipeline schedules every kernel after fusion (:func:`ScheduleKernels`).

    Examples
    --------
    >>> import opsdk
    >>> opsdk.transform.LegalizeOpsDeferred("x86").info.name
    'opsdk.LegalizeOpsDeferred'
    """
    return _legalize_opsdk_ops(_resolve(target), "opsdk.LegalizeOpsDeferred", deferred=True)


def _legalize_opsdk_ops(tgt: Target, name: str, *, deferred: bool) -> tvm.transform.Pass:
    """LegalizeOps on the ``opsdk.*`` calls only; ``deferred``: without scheduling them
    (the model pipeline's ScheduleKernels does, after fusion)."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # Our FLegalize reads the target in scope; TVM's own ops are skipped here and left
        # to the regular pipeline.
        others = [n for n in tvm.ir.Op.list_op_names() if not n.startswith("opsdk.")]
        with tgt, (deferred_scheduling() if deferred else contextlib.nullcontext()):
            return relax.transform.LegalizeOps(skip_ops=others)(mod)

    return _pass


#: Ops whose legalization reads only the shapes and dtypes of a constant argument, never its
#: values: a call with a constant weight shares its kernel with every other call of the same
#: shapes. Elsewhere a constant argument may be read (a scalar folded into the kernel).
_VALUE_BLIND_OPS = frozenset({"relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv2d_transpose",
                              "relax.matmul", "relax.permute_dims"})


def LegalizeOpsOnce(customize: dict[str, Any] | None = None) -> tvm.transform.Pass:
    """TVM's ``LegalizeOps`` (``customize``: its ``customize_legalize_map``), with every
    distinct call legalized once: a call with the same op, attributes, argument types and
    result type as one legalized before reuses that kernel, without building its TE compute
    again. The module is the one ``LegalizeOps`` gives (TVM keeps one copy of identical
    kernels either way); only the time differs (ResNet-50's 13 Winograd convs are 4 kernels,
    each about 90 ms to build).

    A call is reused only where its legalization was a single ``call_tir`` of the call's own
    arguments, in order; and a call with a constant argument only for ops whose legalization
    reads a constant's type, never its values (conv, matmul, transpose).

    Examples
    --------
    >>> import opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit(relax.op.exp(x))
    ...         z = bb.emit_output(relax.op.exp(y))
    ...     _ = bb.emit_func_output(z)
    >>> mod = opsdk.transform.LegalizeOpsOnce()(bb.get())
    >>> len([g for g in mod.functions if g.name_hint != "main"])
    1
    """
    custom = dict(customize or {})

    @tvm.transform.module_pass(opt_level=0, name="opsdk.LegalizeOpsOnce")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        seen: dict[Any, list[tuple[Any, Any]]] = {}
        memo = {}
        for n in op_counts(mod):
            fn = custom.get(n) or tvm.ir.Op.get(n).get_attr("FLegalize")
            if fn is not None:
                memo[n] = _once(fn, n, seen)
        return relax.transform.LegalizeOps(customize_legalize_map={**custom, **memo})(mod)

    return _pass


def _once(fn: Any, op: str, seen: dict[Any, list[tuple[Any, Any]]]) -> Any:
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        args = list(call.args)
        shape = (op, tuple(isinstance(a, tvm.ir.expr.Constant) for a in args))
        if not all(isinstance(a, (relax.Var, tvm.ir.expr.Constant)) for a in args) or (
                any(shape[1]) and op not in _VALUE_BLIND_OPS):
            return fn(bb, call)
        # The types and attributes, compared in full below: the hash only picks the bucket.
        facts = (call.attrs, [a.ty for a in args], call.ty, list(call.ty_args))
        key = (shape, tvm_ffi.structural_hash(facts))
        for old, first in seen.get(key, ()):
            if tvm_ffi.structural_equal(old, facts):
                return _same_kernel(first, first.args[0], args)
        # An earlier build's (inside reused_decisions): its kernel added to this module.
        earlier = rebuild_memo("legalize")
        across = (key, fn, str(Target.current(allow_none=True)))
        for old, first, kernel in (earlier or {}).get(across, ()):
            if tvm_ffi.structural_equal(old, facts):
                out = _same_kernel(first, bb.add_func(kernel, first.args[0].name_hint), args)
                seen.setdefault(key, []).append((facts, out))
                return out
        out = fn(bb, call)
        if isinstance(out, relax.Call) and out.op.same_as(call_tir) and len(out.args) == 2 \
                and isinstance(out.args[1], relax.Tuple) \
                and len(out.args[1].fields) == len(args) \
                and all(a.same_as(b) for a, b in zip(out.args[1].fields, args, strict=True)):
            seen.setdefault(key, []).append((facts, out))
            if earlier is not None:
                remember(earlier, across, [*earlier.get(across, ()),
                                           (facts, out, bb.get()[out.args[0]])])
        return out

    return legalize


def _same_kernel(first: relax.Call, kernel: tvm.ir.GlobalVar, args: list[Any]
                 ) -> relax.Call:
    """``first``'s ``call_tir`` of ``kernel`` with ``args``."""
    return relax.Call(first.op, [kernel, relax.Tuple(args)], first.attrs, list(first.ty_args))


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
        return with_functions(mod, updates)

    return _pass


def _scan_te(x, axis: int | None, dtype: str | None, exclusive: bool, product: bool):
    """Inclusive / exclusive cumulative sum or product along ``axis`` (None: the flattened
    input) as one reduction with a condition, ``out[.., i, ..] = sum_{j <= i} x[.., j, ..]``:
    a block-structured kernel the rules schedule (TOPI's scan is an opaque extern that
    SplitLayoutRewritePreproc and the rules refuse). Quadratic in the axis length, which is
    a sequence length at most (a GPT-2's position ids)."""

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


def _log_probabilities_te(x, axis: int):
    """``x - max - log(sum(exp(x - max)))`` along ``axis``, the reductions keeping their
    axis (extent 1), so every block indexes its buffers with the input's rank."""
    axis = axis % len(x.shape)
    kept = [1 if i == axis else d for i, d in enumerate(x.shape)]

    def along(k, i):
        return [*i[:axis], k, *i[axis + 1:]]

    k1 = te.reduce_axis((0, x.shape[axis]), name="k1")
    mx = te.compute(kept, lambda *i: te.max(x(*along(k1, i)), axis=k1), name="maxelem")
    k2 = te.reduce_axis((0, x.shape[axis]), name="k2")

    def at(t, i):  # the reduced tensor's element for output position i
        return t(*[0 if j == axis else v for j, v in enumerate(i)])

    s = te.compute(kept, lambda *i: te.sum(te.exp(x(*along(k2, i)) - at(mx, i)), axis=k2),
                   name="expsum")
    return te.compute(x.shape, lambda *i: x(*i) - at(mx, i) - te.log(at(s, i)),
                      name="log_softmax")


def _legalize_log_probabilities(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``relax.nn.log_softmax``: TOPI's compute gave a function that neither the rules nor
    the fallback could schedule above two dimensions ("Buffer rank and region dimension
    mismatch (2 vs. 3)", a CRNN's log_softmax over its classes), so it ran unscheduled."""
    return bb.call_te(_log_probabilities_te, call.args[0], int(call.attrs.axis),
                      primfunc_name_hint="log_softmax")


def _legalize_division(op: str, te_func: Any):
    """``relax.divide`` / ``floor_divide`` / ``mod`` / ``floor_mod`` by a scalar constant 0:
    TVM's legalization turns a scalar constant into an immediate of the kernel's expression,
    where its constant folder stops the build with "Check failed: fb->value != 0 : Divide by
    zero" (``x / (n - n)`` of a shape). A float zero stays a tensor the kernel reads, so the
    division is IEEE's at run time (``inf``, ``-inf``, NaN, as torch gives); an integer one
    is refused in words. Any other divisor takes TVM's own legalization."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        b = call.args[1]
        value = b.value.numpy() if isinstance(b, tvm.ir.expr.GenericConst) and \
            isinstance(b.value, tvm.runtime.Tensor) and len(b.value.shape) == 0 else None
        if value is None or value != 0:
            return tvm.ir.Op.get(op).get_attr("FLegalize")(bb, call)
        if value.dtype.kind != "f":
            raise ValueError(f"{op}: the model divides integers by the constant 0 (torch "
                             "raises ZeroDivisionError there); make the divisor nonzero")
        return bb.call_te(te_func, call.args[0], b)

    return legalize


#: Legalizations TVM 0.27 lacks (or gets wrong) for ops its frontends emit.
MISSING_LEGALIZATIONS = {"relax.cumsum": _legalize_scan(False),
                         "relax.cumprod": _legalize_scan(True),
                         "relax.nn.log_softmax": _legalize_log_probabilities,
                         **{f"relax.{name}": _legalize_division(f"relax.{name}",
                                                                getattr(topi, name))
                            for name in ("divide", "floor_divide", "mod", "floor_mod")},
                         **SORT_LEGALIZATIONS}


