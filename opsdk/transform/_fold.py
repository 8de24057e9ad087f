"""Constant folding of a whole model in one build: every ``call_tir`` whose arguments are all
constants (a weight's layout change, a batch norm folded into it, the packing a schedule rule
asked for) is computed at compile time.

TVM's ``FoldConstant`` does the same, but builds every folded kernel as a library of its own:
a MobileNetV2 has 158 of them, 12 s of a 30 s compile on a 2-core machine. Here the kernels
met in one round are compiled together in one module (one LLVM run), evaluated on the host,
and the round repeats for chains (a transpose feeding a packing) until nothing is left. TVM's
pass runs after it for whatever is not a plain ``call_tir`` of constants.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

__all__ = ["FoldConstantsAtOnce", "fold_constants"]

#: Rounds of folding (a chain of constant kernels folds one link per round).
_MAX_ROUNDS = 8


def _is_tensor_const(e: Any) -> bool:
    # GenericConst also wraps dtypes and strings: tensors only
    return isinstance(e, tvm.ir.expr.GenericConst) and isinstance(e.value, tvm.runtime.Tensor)


def _foldable(call: relax.Call, mod: tvm.IRModule) -> bool:
    if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.call_tir"):
        return False
    if len(call.args) != 2:  # tir_vars: a symbolic shape, not a constant
        return False
    gv, args = call.args
    if not isinstance(gv, relax.GlobalVar) or not isinstance(mod[gv], tirx.PrimFunc):
        return False
    if not isinstance(args, relax.Tuple) or not all(_is_tensor_const(a) for a in args.fields):
        return False
    outs = call.ty_args[0]
    outs = outs.fields if isinstance(outs, relax.TupleType) else [outs]
    return all(isinstance(o, relax.TensorType) and o.shape is not None
               and all(isinstance(d, tirx.IntImm) for d in o.shape.values) for o in outs)


def _calls(mod: tvm.IRModule) -> list[relax.Call]:
    found: list[relax.Call] = []
    for _, f in mod.functions.items():
        if isinstance(f, relax.Function):
            relax.analysis.post_order_visit(
                f.body, lambda e: found.append(e) if _foldable(e, mod) else None)
    return found


@mutator
class _Replace(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, values: dict) -> None:
        super().__init__(mod)
        self.values = values

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        key = call.__chandle__()
        if key in self.values:
            return self.values[key]
        return super().visit_call_(call)


def fold_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every ``call_tir`` of constants replaced by its value (see the module).

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import relax
    >>> from opsdk.transform._fold import fold_constants
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         w = relax.const(np.arange(6, dtype="float32").reshape(3, 2))
    ...         y = bb.emit_output(relax.op.add(x, relax.op.permute_dims(w)))
    ...     _ = bb.emit_func_output(y)
    >>> mod = fold_constants(relax.transform.LegalizeOps()(bb.get()))
    >>> "transpose" in mod["main"].script()  # the weight's permute was computed
    False
    """
    host = tvm.target.Target("llvm")
    failed: set[str] = set()
    for _ in range(_MAX_ROUNDS):
        calls = [c for c in _calls(mod) if c.args[0].name_hint not in failed]
        if not calls:
            break
        names = sorted({c.args[0].name_hint for c in calls})
        kernels = tvm.IRModule({n: mod[n].with_attr("global_symbol", n) for n in names})
        try:
            with tvm.transform.PassContext(opt_level=3):
                lib = tvm.tirx.build(kernels, target=host)
        except Exception:  # a kernel the host build refuses: TVM's FoldConstant decides
            return mod
        dev = tvm.cpu()
        values: dict[Any, relax.Expr] = {}
        for c in calls:
            outs = c.ty_args[0]
            many = isinstance(outs, relax.TupleType)
            specs = outs.fields if many else [outs]
            args = [a.value for a in c.args[1].fields]
            res = [tvm.runtime.empty([int(d) for d in o.shape.values], o.dtype, dev)
                   for o in specs]
            try:
                lib[c.args[0].name_hint](*args, *res)
            except Exception:  # left in place, as TVM's FoldConstant leaves what fails
                failed.add(c.args[0].name_hint)
                continue
            consts = [relax.const(r.numpy() if r.ndim else np.asarray(r.numpy()), o.dtype)
                      for r, o in zip(res, specs)]
            values[c.__chandle__()] = relax.Tuple(consts) if many else consts[0]
        if not values:
            break
        rep = _Replace(mod, values)
        for gv, f in list(mod.functions.items()):
            if isinstance(f, relax.Function):
                rep.builder_.update_func(gv, rep.visit_expr(f))
        mod = rep.builder_.get()
    return mod


@tvm.transform.module_pass(opt_level=0, name="opsdk.FoldConstantsAtOnce")
class FoldConstantsAtOnce:
    """:func:`fold_constants` as a pass (TVM's ``FoldConstant`` still runs after it)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        return fold_constants(mod)
