"""``InjectiveWhenShapesChange``: TVM's fusion pattern of a kernel that changes its
input's shape is injective, not elementwise.

``AnnotateTIROpPattern`` calls a kernel elementwise when each output element reads its
inputs at its own index. A constant pad reads ``x[i]`` under ``if_then_else`` and so passes,
although its output is larger than ``x``. FuseOps then fuses the pad into a preceding
convolution's epilogue, and the conv rules, which compute the conv's own output tiles and
inline the epilogue into their write-back, never write the padded border (it held whatever
the memory did: HGNetV2's stem, once its pads ran channels-last between two convs). An
elementwise or broadcast kernel's inputs of the output's rank match it in every dimension
(or are 1 there, broadcast); one that does not is re-annotated injective, which FuseOps does
not fuse into a conv or matmul epilogue.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from .._walk import with_functions

__all__ = ["InjectiveWhenShapesChange"]

_ELEMWISE, _BROADCAST, _INJECTIVE = 0, 1, 2


def _shape_changes(func: tirx.PrimFunc) -> bool:
    shapes = []
    for p in func.params:  # (0.27: a buffer parameter is a Var of a BufferType)
        try:
            shapes.append(list(p.shape))
        except AttributeError:  # a scalar parameter (a symbolic shape's value)
            continue
    if len(shapes) < 2:
        return False
    out, ins = shapes[-1], shapes[:-1]

    def dim(d):
        return int(d.value) if isinstance(d, tirx.IntImm) else d

    for b in ins:
        if len(b) != len(out):
            continue
        for di, do in zip(b, out):
            a, o = dim(di), dim(do)
            if isinstance(a, int) and isinstance(o, int) and a not in (1, o):
                return True
    return False


def InjectiveWhenShapesChange() -> tvm.transform.Pass:
    """Re-annotate elementwise / broadcast kernels whose output shape is not their inputs'
    (a pad) as injective; run after ``relax.transform.AnnotateTIROpPattern``.

    Examples
    --------
    >>> import opsdk, tvm
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.pad(x, [0, 0, 0, 1, 0, 1, 0, 0]))
    ...     _ = bb.emit_func_output(y)
    >>> mod = relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(bb.get()))
    >>> mod = opsdk.transform.InjectiveWhenShapesChange()(mod)
    >>> [int(f.attrs["op_pattern"]) for _, f in mod.functions_items()
    ...  if isinstance(f, tvm.tirx.PrimFunc)]
    [2]
    """

    @tvm.transform.module_pass(opt_level=0, name="opsdk.InjectiveWhenShapesChange")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, f in mod.functions_items():
            if not isinstance(f, tirx.PrimFunc) or f.attrs is None:
                continue
            pattern = f.attrs.get("op_pattern")
            if pattern is not None and int(pattern) in (_ELEMWISE, _BROADCAST) \
                    and _shape_changes(f):
                updates[gv] = f.with_attr("op_pattern", _INJECTIVE)
        return with_functions(mod, updates)

    return _pass


