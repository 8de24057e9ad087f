"""Streaming (non-temporal) stores for outputs larger than the caches, on x86.

A kernel whose output does not fit in the last-level cache writes every line to memory anyway;
with ordinary stores each line is first read from memory (read-for-ownership), so a norm over
a 64 MB tensor moves 192 MB. ``vmovntps`` writes whole lines without reading them, and keeps
them out of the caches the next rows need. Measured (rms_norm 16384x1024, Zen 4, 2 threads):
4.5 -> 3.9 ms, 1 thread 7.2 -> 4.3 ms; a plain C loop with and without shows the same 1.5x.

TVM 0.27 has no non-temporal store (LLVM dropped the ``movnt`` intrinsics; a store carries
``!nontemporal`` metadata instead), so the rule routes the vector store through a one-line
LLVM function imported into the kernel (``pragma_import_llvm``; ``alwaysinline`` makes it the
plain ``vmovntps``): the output block computes each vector into a register-sized buffer and
a blockized copy hands it to that function. Streaming stores are weakly ordered, so each
parallel task ends with ``sfence`` before TVM's join publishes the result: the tasks are made
large (:data:`TASK_BYTES` of output) so that one fence per task costs nothing (one per 4 KB
row cost 1.3x).

Only float32 outputs of at least :data:`STREAM_MIN_BYTES` (row kernels:
:data:`ROWS_STREAM_MIN_BYTES`) whose vector loop has no tail stream; everything smaller keeps
ordinary stores (its consumer reads it from the cache).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.ir import StringImm
from tvm.target import Target
from tvm_ffi.structural import structural_mutate

from ..targets import target_arch
from ._core import replace_block_body

__all__ = ["ROWS_STREAM_MIN_BYTES", "STREAM_MIN_BYTES", "TASK_BYTES", "stream_lanes",
           "stream_stores"]

#: Outputs at least this large are written with streaming stores (no LLC of the CPUs opsdk
#: targets holds them: 32 MB is a whole Zen 4 CCD's L3; edge SoCs have 2-8 MB).
STREAM_MIN_BYTES = 32 << 20
#: Row kernels (norms, softmax) stream from a quarter of that: a 12 MB output (4096x768) does
#: not stay in a 32 MB L3 that other cores (or other tenants of a cloud host) share, and these
#: kernels, which read each row twice and reduce between the passes, gain from it at both
#: thread counts. Measured on Zen 5 (interleaved, fixed buffers, 3 runs each): rms_norm
#: 4096x768 1.27-2.02x at 1 thread, 1.09-1.20x at 2; layer_norm 1.57-1.94x / 1.29-1.52x;
#: softmax 0.98-1.46x / 1.12-1.37x. Elementwise kernels keep the 32 MB threshold: gelu
#: 4096x768 streamed was 0.46-0.52x (its input and output stayed in L3 between calls).
ROWS_STREAM_MIN_BYTES = 8 << 20
#: Output bytes per parallel task when streaming (each task ends with one ``sfence``).
TASK_BYTES = 256 << 10

_LL = """
define linkonce_odr void @{name}(ptr %p, <{lanes} x float> %v) #0 {{
  store <{lanes} x float> %v, ptr %p, align {align}, !nontemporal !0
  ret void
}}
attributes #0 = {{ alwaysinline nounwind }}
!0 = !{{i32 1}}
"""


def stream_lanes(sch: s_tir.Schedule, block, target: Target, lanes: int,
                 min_bytes: int | None = None) -> int | None:
    """``lanes`` when ``block`` writes a static float32 output of at least ``min_bytes``
    (default :data:`STREAM_MIN_BYTES`) on an x86 target with 8- or 16-lane vectors, else
    None."""
    if target.kind.name != "llvm" or target_arch(target) != "x86_64" or lanes not in (8, 16):
        return None
    buf = sch.get(block).writes[0].source
    if str(buf.dtype) != "float32" or not all(isinstance(d, tirx.IntImm) for d in buf.shape):
        return None
    n = 4
    for d in buf.shape:
        n *= int(d.value)
    return lanes if n >= (STREAM_MIN_BYTES if min_bytes is None else min_bytes) else None


def stream_stores(sch: s_tir.Schedule, block, vec_outer, lanes: int,
                  parallel, unit_bytes: int) -> s_tir.Schedule:
    """Write ``block``'s output with streaming stores; returns the new schedule.

    ``vec_outer`` is the loop directly around the block's vectorized loop of exactly
    ``lanes``; ``parallel`` the kernel's parallel loop, each iteration writing ``unit_bytes``
    of output. That loop is regrouped into tasks of about :data:`TASK_BYTES` (a divisor of
    its extent), each ending with an ``sfence``.
    """
    name = f"opsdk_stream_f32x{lanes}"
    tmp = sch.cache_write(block, 0, "global")  # one vector, a register once compacted
    sch.reverse_compute_at(tmp, vec_outer)
    copy = sch.blockize(sch.get_loops(tmp)[-1])
    blk = sch.get(copy)
    src, dst = blk.reads[0], blk.writes[0]
    s0 = [r.min for r in src.region]
    vec = tirx.BufferLoad(src.source, [*s0[:-1], tirx.Ramp(s0[-1], 1, lanes)])
    addr = tirx.address_of(tirx.BufferLoad(dst.source, [r.min for r in dst.region]))
    replace_block_body(sch, copy, [tirx.Evaluate(tirx.call_extern("void", name, addr, vec))])
    llvm = StringImm(_LL.format(name=name, lanes=lanes, align=lanes * 4))
    return s_tir.Schedule(_tasks_with_fence(sch.mod["main"], sch.get(parallel), unit_bytes,
                                            llvm))


def _tasks_with_fence(func: tirx.PrimFunc, loop: tirx.For, unit_bytes: int,
                      llvm: StringImm) -> tirx.PrimFunc:
    """``for i in parallel(n): body(i)`` -> ``for t in parallel(n / k): (for i in range(t * k,
    t * k + k): body(i)); sfence``, with the streaming store's LLVM imported there."""
    n = int(loop.extent.value)
    want = max(1, TASK_BYTES // max(unit_bytes, 1))
    k = max(d for d in range(1, min(n, want) + 1) if n % d == 0)
    var = loop.loop_var
    t = tirx.Var("task", var.ty)
    fence = s_tir.SBlockRealize([], tirx.const(True, "bool"), s_tir.SBlock(
        [], [], [], "stream_fence",
        tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.x86.sse.sfence"))))
    # the old loop var runs over the task's rows: the body stays as it is
    inner = tirx.For(var, t * k, tirx.const(k, var.ty), tirx.ForKind.SERIAL, loop.body)
    tasks = tirx.For(t, tirx.const(0, var.ty), tirx.const(n // k, var.ty),
                     tirx.ForKind.PARALLEL, tirx.SeqStmt([inner, fence]), None,
                     {**loop.annotations, "pragma_import_llvm": llvm})

    def swap(node: tirx.For, mut) -> tirx.For:
        return tasks if node.same_as(loop) else mut.default_mutate(node)

    return structural_mutate(func, [(tirx.For, swap)])
