"""The TIR pipeline opsdk's kernels are compiled with: TVM's ``s_tir`` pipeline, then every
small ``local`` buffer (a register tile's accumulators) kept on the stack. And
:func:`GuardIntegerDivision`, which the model pipeline runs on every kernel once legalized.

TVM's ``LowerTVMBuiltin`` turns an allocation over 1 KB into a ``TVMBackendAllocWorkspace``
call: a register tile of more than 16 AVX-512 vectors (8 pixels x 3 vectors is 1.5 KB) then
lives in heap memory that LLVM cannot promote to registers, and is allocated, zeroed
(``memset``) and freed once per tile. Marked ``disable_lower_builtin``, the buffer is an
``alloca`` that LLVM keeps in registers. One Zen 4 core: a 1x1 conv 16 -> 96 at 112x112
476 -> 395 us, a depthwise 3x3 144 ch at 56x56 89 -> 76 us, larger-K convs and matmuls level.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.tirx import compilation_pipeline

from ._walk import with_functions

__all__ = ["DIVISION_BY_ZERO", "MAX_STACK_BYTES", "GuardIntegerDivision", "StackLocalTiles",
           "tir_pipeline"]

#: Largest ``local`` buffer kept on the stack (a worker thread's stack can be small: musl's
#: default is 128 KB); a register tile is at most 32 vectors (2 KB of AVX-512).
MAX_STACK_BYTES = 16 * 1024

_NAME = "opsdk"


def _stack_sized(buf: tirx.Buffer) -> bool:
    if buf.scope() != "local":
        return False
    if not all(isinstance(d, tirx.IntImm) for d in buf.shape):
        return False
    dt = tvm.DataType(str(buf.dtype))
    size = math.prod(int(d.value) for d in buf.shape) * max(1, dt.bits * dt.lanes // 8)
    return size <= MAX_STACK_BYTES


@tirx.transform.prim_func_pass(opt_level=0, name="opsdk.StackLocalTiles")
def StackLocalTiles(func: tirx.PrimFunc, mod: tvm.IRModule, ctx: tvm.transform.PassContext
                    ) -> tirx.PrimFunc:
    """Mark each ``local`` allocation of at most :data:`MAX_STACK_BYTES` of a CPU function
    ``disable_lower_builtin`` (a stack ``alloca``, not a workspace call).

    Examples
    --------
    >>> import tvm
    >>> from tvm import te
    >>> from opsdk._tir import StackLocalTiles
    >>> a = te.placeholder((8,), name="a")
    >>> f = te.create_prim_func([a, te.compute((8,), lambda i: a[i] * 2)])
    >>> StackLocalTiles(tvm.IRModule({"main": f}))["main"].same_as(f)  # nothing local
    True
    """
    from tvm_ffi.structural import structural_mutate  # heavy: TVM

    target = (func.attrs or {}).get("target")
    if target is not None and target.kind.name not in ("llvm", "c"):
        return func  # a GPU's local scope is its registers already

    def alloc(node: tirx.AllocBuffer, mut) -> tirx.AllocBuffer:
        node = mut.default_mutate(node)
        if not _stack_sized(node.buffer) or "disable_lower_builtin" in (node.annotations or {}):
            return node
        ann = dict(node.annotations or {})
        ann["disable_lower_builtin"] = tirx.IntImm("int32", 1)
        return tirx.AllocBuffer(node.buffer, ann, node.span)

    body = structural_mutate(func.body, [(tirx.AllocBuffer, alloc)])
    return func if body.same_as(func.body) else func.with_body(body)


_DIVISIONS = (tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod)
#: How :func:`GuardIntegerDivision`'s failure message starts (the folds recognize it).
DIVISION_BY_ZERO = "integer division by zero"


def _reads_memory(e: tirx.PrimExpr) -> bool:
    from tvm_ffi.structural import structural_walk  # heavy: TVM

    found: list[int] = []
    # a load is a tvm.ir.TensorLoad (tirx.BufferLoad is its constructor function)
    structural_walk(e, [(tvm.ir.expr.TensorLoad, lambda _n: found.append(1))])
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="opsdk.GuardIntegerDivision")
def GuardIntegerDivision(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Put an assertion before every store whose value divides integers by a value read from
    a tensor (``floor_divide``, ``remainder`` of int tensors): the x86 ``idiv`` of a zero
    divisor traps (SIGFPE), which killed the process that compiled a model (a constant
    divided at compile time) or ran it. The kernel now fails with an error the VM raises,
    as torch raises ``ZeroDivisionError`` (a constant's: at compile time, when it is
    folded). Divisors that are constants or index arithmetic are left alone; such a
    kernel's loop runs scalar anyway (no vector ``idiv``). Run once per kernel, right after
    legalization (:func:`opsdk._pipeline.fusion_passes`), so every build of it, the
    constant folds' included, carries the check.

    Examples
    --------
    >>> import tvm
    >>> from tvm import te
    >>> from opsdk._tir import GuardIntegerDivision
    >>> a = te.placeholder((8,), "int32", name="a")
    >>> b = te.placeholder((8,), "int32", name="b")
    >>> f = te.create_prim_func([a, b, te.compute((8,), lambda i: a[i] // b[i])])
    >>> "assert" in GuardIntegerDivision(tvm.IRModule({"main": f}))["main"].script()
    True
    """
    updates = {gv: _guarded(f, gv.name_hint) for gv, f in mod.functions.items()
               if isinstance(f, tirx.PrimFunc)}
    return with_functions(mod, {gv: f for gv, f in updates.items() if not f.same_as(mod[gv])})


def _guarded(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    from tvm_ffi.structural import structural_mutate, structural_walk  # heavy: TVM

    def store(node: tirx.BufferStore, mut) -> tirx.Stmt:
        node = mut.default_mutate(node)
        divisors: list[tirx.PrimExpr] = []

        def division(e) -> None:
            if str(e.ty).startswith(("int", "uint")) and not isinstance(e.b, tirx.IntImm) \
                    and _reads_memory(e.b):
                divisors.append(e.b)

        structural_walk(node.value, [(_DIVISIONS, division)])
        if not divisors:
            return node
        cond = divisors[0] != 0
        for d in divisors[1:]:
            cond = tirx.And(cond, d != 0)
        where = f" in {name}" if name else ""
        # (TVM 0.27's Python wrapper documents (kind, condition); its constructor takes
        # (condition, kind))
        check = tirx.AssertStmt(cond, tvm.ir.StringImm("RuntimeError"), [tvm.ir.StringImm(
            f"{DIVISION_BY_ZERO}{where}: a divisor read from a tensor is 0 (torch "
            "raises ZeroDivisionError here too); make the divisor nonzero")])
        return tirx.SeqStmt([check, node])

    body = structural_mutate(func.body, [(tirx.BufferStore, store)])
    return func if body.same_as(func.body) else func.with_body(body)


def _factory() -> tuple:
    base, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir")
    return (tvm.transform.Sequential([base, StackLocalTiles], name="opsdk.tir_pipeline"),
            finalize_host, finalize_device)


def tir_pipeline() -> str:
    """The name of opsdk's TIR pipeline, registered with TVM on first use: pass it as
    ``tvm.compile(..., tir_pipeline=...)`` or ``tvm.tirx.build(..., pipeline=...)``.

    Examples
    --------
    >>> import tvm, opsdk
    >>> from tvm import te
    >>> from opsdk.transform import tir_pipeline
    >>> a = te.placeholder((8,), name="a")
    >>> f = te.create_prim_func([a, te.compute((8,), lambda i: a[i] * 2)])
    >>> lib = tvm.tirx.build(tvm.IRModule({"k": f.with_attr("global_symbol", "k")}),
    ...                      target=opsdk.target("x86"), pipeline=tir_pipeline())
    >>> "k" in lib.inspect_source("asm")
    True
    """

    if _NAME not in compilation_pipeline.PIPELINE_MAP:
        compilation_pipeline.register_tir_pipeline(_NAME, _factory)
    return _NAME
