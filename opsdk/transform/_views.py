"""Views folded into the opsdk op kernels that read them (:func:`FoldViewsIntoOps`).

A model hands an op its inputs through reshapes, transposes, slices and squeezes: timm's
attention computes ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`` before
``scaled_dot_product_attention``. TVM fuses such copies with each other but never into an
opaque kernel, so each one is a kernel of its own that writes a full tensor which the op
then reads back (in DeiT-S, 5 copy kernels per layer; in the model, where the data arrives
from the matmul in the other core's cache, 5 % of the run). Folded in, the op reads the
source tensor at the view's index instead, and writes a view of its output directly.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.sym import Analyzer
from tvm.target import Target

from ..registry import get_op, is_registered
from ..schedules import GENERIC, choose
from ..targets import target as _resolve

__all__ = ["FoldViewsIntoOps"]

#: Rounds of folding: each folds one view deep (DeiT's chain is two: slice, then reshape +
#: transpose).
_ROUNDS = 4


def FoldViewsIntoOps(target: str | dict | Target) -> tvm.transform.Pass:
    """Fold copy-only kernels (reshape, transpose, slice, squeeze: every element a load of
    one source element) into the opsdk op kernel that reads them.

    A view is folded into an argument of a kernel tagged ``opsdk.op`` when

    - the view kernel has one tensor input and only copies (no arithmetic, no padding);
    - the op's innermost axis stays contiguous in the source (a view that would make the
      kernel's vector loads strided is left a copy);
    - the op's rule for ``target`` still takes the kernel with the view inlined, and is the
      same rule that takes it without (else the copy stays: no kernel falls to a slower rule),
      and its schedule is of the folded kernel (a rule that rebuilds its kernel from the op's
      attributes, as qdense's do, would drop the view: those keep the copy).

    The view kernel stays where another kernel still reads its output. The other way round,
    a copy-only view of an op's output that nothing else reads is written by the op itself
    (its index moved into the op's output block), on the same three conditions. Runs after
    TVM's FuseOps / FuseTIR and before :func:`ScheduleKernels` (:mod:`opsdk._pipeline`).

    Examples
    --------
    >>> import opsdk
    >>> opsdk.transform.FoldViewsIntoOps("x86").info.name
    'opsdk.FoldViewsIntoOps'
    """
    tgt = _resolve(target)

    @tvm.transform.module_pass(opt_level=0, name="opsdk.FoldViewsIntoOps")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        folder = _Folder(mod, tgt)
        for _ in range(_ROUNDS):
            new = folder.round()
            if new is None:
                break
            mod = relax.transform.DeadCodeElimination()(new)
            folder = _Folder(mod, tgt, folder.cache)
        return mod

    return _pass


class _Folder:
    """One round over every Relax function of ``mod``: each opsdk-op call's arguments that
    a view kernel made are replaced by the view's source, the callee by its folded form."""

    def __init__(self, mod: tvm.IRModule, tgt: Target, cache: dict | None = None) -> None:
        self.mod, self.tgt = mod, tgt
        self.cache: dict = {} if cache is None else cache  # (consumer, arg, view) -> func
        self.views: dict[str, Any] = {}  # view callee name -> its index map or None
        self.hashes: dict[str, int] = {}  # view callee name -> its structural hash

    def round(self) -> tvm.IRModule | None:
        changed = False
        bb = relax.BlockBuilder(self.mod)
        for gv, func in list(self.mod.functions.items()):
            if not isinstance(func, relax.Function) or (func.attrs or {}).get("Primitive"):
                continue
            var2val = relax.analysis.get_var2val(func)
            mutator = _CallRewriter(self, bb, var2val, _use_counts(func))
            new = mutator.visit_expr(func)
            if mutator.changed:
                bb.update_func(gv, new)
                changed = True
        return bb.finalize() if changed else None

    # -- the view side ----------------------------------------------------------------------
    def view_source(self, arg: relax.Expr, var2val: dict) -> relax.Expr | None:
        """The source tensor of ``arg`` when a view kernel made it, else None."""
        call = var2val.get(arg) if isinstance(arg, relax.Var) else None
        if not (_is_call_tir(call) and len(call.args[1].fields) == 1):
            return None
        return call.args[1].fields[0] if self.copy_map(call) is not None else None

    def copy_map(self, call: relax.Call) -> Any:
        """The index map of ``call``'s callee if it only copies, else None (per callee)."""
        name = call.args[0].name_hint
        if name not in self.views:
            self.views[name] = _copy_map(self.mod[call.args[0]])
        return self.views[name]

    def view_hash(self, view_call: relax.Call) -> int:
        name = view_call.args[0].name_hint
        if name not in self.hashes:
            self.hashes[name] = tvm_ffi.structural_hash(self.mod[view_call.args[0]])
        return self.hashes[name]

    # -- the consumer side ------------------------------------------------------------------
    def folded(self, key: tuple, f: tirx.PrimFunc, arg_types: list, out_type: Any, i: int,
               view_call: relax.Call) -> tirx.PrimFunc | None:
        """``f`` (the consumer's function, ``key`` naming it and the folds made so far) with
        argument ``i`` read through ``view_call``'s view, or None where it does not fold."""
        key = (*key, (i, self.view_hash(view_call)))
        if key not in self.cache:
            self.cache[key] = self._fold(f, arg_types, out_type, i, view_call)
        return self.cache[key]

    def folded_out(self, op_call: relax.Call, view_call: relax.Call) -> tirx.PrimFunc | None:
        """The op's function writing its output through ``view_call``'s view, or None."""
        f = self.mod[op_call.args[0]]
        key = ("out", tvm_ffi.structural_hash(f), self.view_hash(view_call))
        if key not in self.cache:
            self.cache[key] = self._fold(
                f, [a.ty for a in op_call.args[1].fields], op_call.ty, None, view_call)
        return self.cache[key]

    def _fold(self, f: tirx.PrimFunc, arg_types: list, out_type: Any, i: int | None,
              view_call: relax.Call) -> tirx.PrimFunc | None:
        """``f`` reading argument ``i`` through the view, or (``i`` None) writing its
        output through it, where the same rule takes the result."""
        g = self.mod[view_call.args[0]]
        name = (f.attrs or {}).get("opsdk.op")
        if name is None or not is_registered(str(name)):
            return None
        op = get_op(str(name))
        if not _contiguous_inner(self.views[view_call.args[0].name_hint]):
            return None
        src = view_call.args[1].fields[0]
        try:
            fused = (_fuse_pair(f, g, i, arg_types, src.ty, out_type) if i is not None else
                     _fuse_out(f, g, arg_types, out_type, view_call.ty))
        except Exception:  # TVM could not merge or inline the two: the copy stays
            return None
        if fused is None:
            return None
        fused = _copy_attrs(fused, f)
        with self.tgt, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a rule refusing the candidate is not news
            before, after = choose(op, f, self.tgt), choose(op, fused, self.tgt)
        if after.rule == GENERIC or after.rule != before.rule or after.failures:
            return None
        if not _same_signature(after.func, fused) or tvm_ffi.structural_equal(
                after.func, before.func, map_free_vars=True):
            # the rule rebuilt the kernel from the op's attributes (qdense does), ignoring
            # the body it was given: the view would be lost
            return None
        return fused


@relax.expr_functor.mutator
class _CallRewriter(relax.PyExprMutator):
    def __init__(self, folder: _Folder, bb: relax.BlockBuilder, var2val: dict,
                 uses: dict) -> None:
        super().__init__(folder.mod)
        self.folder, self.bb, self.var2val, self.uses = folder, bb, var2val, uses
        self.changed = False
        self.added: dict[tuple, relax.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is_call_tir(call):
            return call
        f = self.folder.mod[call.args[0]]
        if not isinstance(f, tirx.PrimFunc):
            return call
        if "opsdk.op" not in (f.attrs or {}):
            return self._output_view(call)
        args = list(call.args[1].fields)
        # structurally equal consumers (one per layer) and views fold once
        key: tuple = (tvm_ffi.structural_hash(f),)
        for i, a in enumerate(args):
            if self.folder.view_source(a, self.var2val) is None:
                continue
            types = [x.ty for x in args]
            view_call = self.var2val[a]
            fused = self.folder.folded(key, f, types, call.ty, i, view_call)
            if fused is None:
                continue
            f, args[i] = fused, view_call.args[1].fields[0]
            key = (*key, (i, self.folder.view_hash(view_call)))
        if len(key) == 1:
            return call
        gv = self.added.get(key)
        if gv is None:
            gv = self.added[key] = self.bb.add_func(f, call.args[0].name_hint)
        self.changed = True
        return relax.call_tir(gv, args, call.ty)

    def _output_view(self, call: relax.Call) -> relax.Expr:
        """A view of an opsdk op's output that nothing else reads: the op writes it."""
        args = call.args[1].fields
        if len(args) != 1 or self.uses.get(args[0], 0) != 1:
            return call
        made = self.var2val.get(args[0])
        if not _is_call_tir(made) or "opsdk.op" not in (self.folder.mod[made.args[0]].attrs
                                                       or {}):
            return call
        if self.folder.copy_map(call) is None:
            return call
        fused = self.folder.folded_out(made, call)
        if fused is None:
            return call
        key = ("out", id(fused))
        gv = self.added.get(key)
        if gv is None:
            gv = self.added[key] = self.bb.add_func(fused, made.args[0].name_hint)
        self.changed = True
        return relax.call_tir(gv, list(made.args[1].fields), call.ty)


@relax.expr_functor.visitor
class _Uses(relax.PyExprVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict = {}

    def visit_var_(self, v: relax.Var) -> None:
        self.counts[v] = self.counts.get(v, 0) + 1

    def visit_dataflow_var_(self, v: relax.Var) -> None:
        self.counts[v] = self.counts.get(v, 0) + 1


def _use_counts(func: relax.Function) -> dict:
    """How many times each variable of ``func`` is read."""
    v = _Uses()
    v.visit_expr(func)
    return v.counts


def _same_signature(a: tirx.PrimFunc, b: tirx.PrimFunc) -> bool:
    """Whether two functions take buffers of the same shapes and dtypes."""
    def sig(f: tirx.PrimFunc) -> list[str]:
        return [f"{[str(d) for d in p.shape]}:{p.dtype}" for p in f.params]

    return sig(a) == sig(b)


def _is_call_tir(call: Any) -> bool:
    return (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
            and call.op.name == "relax.call_tir")


def _copy_attrs(fused: tirx.PrimFunc, f: tirx.PrimFunc) -> tirx.PrimFunc:
    for k, v in (f.attrs or {}).items():
        if k != "global_symbol":
            fused = fused.with_attr(k, v)
    return fused


def _copy_map(g: tirx.PrimFunc) -> tuple[list, list] | None:
    """``(output iter vars, source indices)`` of a kernel whose every block only copies
    (``out[v] = src[f(v)]`` after inlining the intermediate blocks), else None."""
    if not isinstance(g, tirx.PrimFunc) or len(g.params) != 2:
        return None
    try:
        sch = s_tir.Schedule(g)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        for b in blocks[:-1]:
            sch.compute_inline(b)
        (last,) = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:
        return None
    block = sch.get(last)
    store = block.body
    if (block.init is not None or block.match_buffers or block.alloc_buffers
            or not isinstance(store, tirx.BufferStore)
            or not isinstance(store.value, TensorLoad)
            or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars)):
        return None
    vars_ = [iv.var for iv in block.iter_vars]
    if [str(i) for i in store.indices] != [str(v) for v in vars_]:
        return None
    src_buf = g.params[0]  # TVM 0.27: a PrimFunc's params are its buffers
    if not store.value.source.same_as(src_buf):
        return None
    return vars_, list(store.value.indices), list(src_buf.shape), \
        [iv.dom.extent for iv in block.iter_vars]


def _contiguous_inner(view: Any) -> bool:
    """Whether stepping the view's last axis steps the source by one element (sampled at a
    few points of static extents): the consumer's vector loads along it stay contiguous."""
    vars_, idx, src_shape, extents = view
    if any(not isinstance(e, tirx.IntImm) for e in [*src_shape, *extents]):
        return False
    ext = [int(e) for e in extents]
    if ext[-1] < 2:
        return False
    strides = np.cumprod([1] + [int(s) for s in src_shape[::-1]])[:-1][::-1]
    rng = np.random.default_rng(0)

    def offset(point: list[int]) -> int:
        ana = Analyzer()
        for v, p in zip(vars_, point, strict=True):
            ana.bind(v, tirx.IntImm(v.ty.dtype if hasattr(v, "ty") else v.dtype, p))
        vals = [ana.simplify(e) for e in idx]
        return int(sum(int(v) * int(s) for v, s in zip(vals, strides, strict=True)))

    for _ in range(6):
        p = [int(rng.integers(0, e)) for e in ext]
        p[-1] = min(p[-1], ext[-1] - 2)
        q = [*p[:-1], p[-1] + 1]
        if offset(q) - offset(p) != 1:
            return False
    return True


def _fuse_tir(f: tirx.PrimFunc, g: tirx.PrimFunc, types: list, body: Any) -> Any:
    """A schedule of the one PrimFunc TVM's FuseTIR makes of a group over ``types`` whose
    dataflow ``body(bb, op, view, params)`` emits (the op's blocks unrenamed), or None."""
    bb = relax.BlockBuilder()
    gf, gg = bb.add_func(f, "op"), bb.add_func(g, "view")
    params = [relax.Var(f"a{j}", t) for j, t in enumerate(types)]
    with bb.function("group", params, attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            y = bb.emit_output(body(bb, gf, gg, params))
        bb.emit_func_output(y)
    group = bb.get().get_global_var("group")
    outer = [relax.Var(f"m{j}", t) for j, t in enumerate(types)]
    with bb.function("main", outer):
        with bb.dataflow():
            y = bb.emit_output(relax.Call(group, outer))
        bb.emit_func_output(y)
    merged = relax.transform.FuseTIR()(bb.get())
    prims = [fn for fn in merged.functions.values() if isinstance(fn, tirx.PrimFunc)]
    if len(prims) != 1 or not _block_names(f) <= _block_names(prims[0]):
        return None  # a view block took one of the op's block names: not inlined safely
    return s_tir.Schedule(prims[0])


def _view_blocks(sch: s_tir.Schedule, f: tirx.PrimFunc) -> list:
    own = _block_names(f)
    return [b for b in sch.get_child_blocks(sch.get_sblock("root"))
            if sch.get(b).name_hint not in own]


def _fuse_pair(f: tirx.PrimFunc, g: tirx.PrimFunc, i: int, arg_types: list, src_type: Any,
               out_type: Any) -> tirx.PrimFunc | None:
    """``f`` reading argument ``i`` through ``g`` (TVM's FuseTIR merges the two; the view's
    blocks are then inlined into their readers), or None where they do not inline."""
    types = list(arg_types)
    types[i] = src_type

    def body(bb, op, view, params):
        args = list(params)
        args[i] = bb.emit(relax.call_tir(view, [params[i]], arg_types[i]))
        return relax.call_tir(op, args, out_type)

    sch = _fuse_tir(f, g, types, body)
    if sch is None:
        return None
    for b in _view_blocks(sch, f)[::-1]:
        sch.compute_inline(b)
    return sch.mod["main"] if _block_names(sch.mod["main"]) == _block_names(f) else None


def _fuse_out(f: tirx.PrimFunc, g: tirx.PrimFunc, arg_types: list, out_type: Any,
              view_type: Any) -> tirx.PrimFunc | None:
    """``f`` writing its output through ``g`` (FuseTIR merges them; the view's blocks are
    inlined into the op's output block), or None where they do not inline."""

    def body(bb, op, view, params):
        return relax.call_tir(view, [bb.emit(relax.call_tir(op, params, out_type))], view_type)

    sch = _fuse_tir(f, g, arg_types, body)
    blocks = [] if sch is None else _view_blocks(sch, f)
    if not blocks:
        return None
    for b in blocks[:-1]:
        sch.compute_inline(b)
    sch.reverse_compute_inline(blocks[-1])
    return sch.mod["main"] if _block_names(sch.mod["main"]) == _block_names(f) else None


def _block_names(func: tirx.PrimFunc) -> set[str]:
    sch = s_tir.Schedule(func)
    return {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
