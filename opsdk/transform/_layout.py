"""``ChannelsLast``: run a model's convolutions in NHWC inside, whatever layout it came in.

torch and ONNX models are NCHW. On a CPU the conv kernels vectorize best over channels:
in NHWC the channel axis is contiguous in the input, the weights and the output, so a tile of
output channels is loaded, accumulated and stored in whole vectors, and a depthwise conv
reads its input in vectors too. (In NCHW the output tile must be stored transposed and a
strided depthwise conv gathers.) TVM's ``ConvertLayout`` rewrites every ``conv2d`` to NHWC /
HWIO and carries the layout through the elementwise ops, pools and reductions that follow,
so a chain of convs pays one transpose where it enters and one where it leaves.

An opsdk op stops it too (ConvertLayout knows TVM's ops only): a group norm between convs
would sit between two transposes, so ``to_nhwc(group_norm_nchw(to_nchw(x)))`` becomes
``group_norm_nhwc(x)`` (opsdk's group norm has an NHWC kernel).

``relax.clip`` (ReLU6) stops ``ConvertLayout`` (its layout inference refuses the bound
arguments), so constant clips are first spelled ``minimum(maximum(x, lo), hi)``: the same
values, and elementwise ops it carries the layout through.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ._rewrite import op_counts

__all__ = ["ChannelsLast"]

#: conv2d layouts ``ChannelsLast`` asks ConvertLayout for: data / weight.
LAYOUTS = {"relax.nn.conv2d": ["NHWC", "HWIO"]}


def _bound(e: relax.Expr) -> float | None:
    """A clip bound's value: an immediate (``FloatImm`` / ``IntImm``) or a one-element
    constant; None when it is computed."""
    if isinstance(e, (tvm.tirx.FloatImm, tvm.tirx.IntImm)):
        return float(e.value)
    v = getattr(e, "value", None)  # a PrimValue wrapping an immediate
    if isinstance(v, (tvm.tirx.FloatImm, tvm.tirx.IntImm)):
        return float(v.value)
    if isinstance(e, tvm.ir.expr.GenericConst) and e.value.numpy().size == 1:
        return float(e.value.numpy().reshape(()))
    return None


@relax.expr_functor.mutator
class _ClipAsMinMax(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.clip"):
            return call
        ty = call.args[0].ty
        if not isinstance(ty, relax.TensorType) or not str(ty.dtype).startswith(("float", "bf")):
            return call
        lo, hi = _bound(call.args[1]), _bound(call.args[2])
        if lo is None or hi is None:
            return call
        dt = str(ty.dtype)
        x = relax.op.maximum(call.args[0], relax.const(lo, dt))
        return relax.op.minimum(self.builder_.normalize(x), relax.const(hi, dt))


_TO_NCHW, _TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def _axes(call) -> list[int] | None:
    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
            and call.op.name == "relax.permute_dims"):
        return None
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


@relax.expr_functor.mutator
class _GroupNormChannelsLast(relax.PyExprMutator):
    """``to_nhwc(group_norm_nchw(to_nchw(x)))`` -> ``group_norm_nhwc(x)``: ConvertLayout
    leaves the transposes around an opsdk op (it knows TVM's ops only); opsdk's group norm
    has an NHWC kernel of its own."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _axes(call) != _TO_NHWC or not isinstance(call.args[0], relax.Var):
            return call
        gn = self.lookup_binding(call.args[0])
        if not (isinstance(gn, relax.Call) and isinstance(gn.op, tvm.ir.Op)
                and gn.op.name == "opsdk.group_norm"):
            return call
        from ..registry import decode_call

        _, ins, attrs = decode_call(gn)
        if attrs.get("layout", "NCHW") != "NCHW" or not isinstance(ins["x"], relax.Var):
            return call
        inner = self.lookup_binding(ins["x"])
        if _axes(inner) != _TO_NCHW:
            return call
        from .. import relax as ops

        extra = {k: v for k, v in ins.items() if k != "x"}
        return ops.group_norm(inner.args[0], **extra, **{**attrs, "layout": "NHWC"})


def ChannelsLast() -> tvm.transform.Pass:
    """Convolutions in NHWC / HWIO, the layout carried through what follows them.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    >>> w = relax.const(np.ones((8, 8, 3, 3), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
    ...         y = bb.emit_output(relax.op.clip(y, 0.0, 6.0))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.ChannelsLast()(bb.get())
    >>> opsdk.transform.op_counts(mod)["relax.permute_dims"]  # in, weight, out
    3
    """

    @tvm.transform.module_pass(opt_level=0, name="opsdk.ChannelsLast")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not op_counts(mod, "relax.nn.conv2d"):
            return mod
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                updates[gv] = _ClipAsMinMax().visit_expr(func)
        for gv, func in updates.items():
            mod[gv] = func
        mod = relax.transform.ConvertLayout(LAYOUTS)(mod)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gv] = _GroupNormChannelsLast().visit_expr(func)
        return relax.transform.DeadCodeElimination()(mod)

    return _pass

