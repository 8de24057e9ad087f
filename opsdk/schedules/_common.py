"""Schedule building blocks shared by the CPU rules (x86 and NEON differ only in parameters).

The rules are written with ``s_tir.Schedule`` primitives; three facts of TVM 0.27 shape them:

- **Reductions stay in vector registers through rfactor.** A reduction loop is split by
  ``width`` (vector lanes x independent accumulators) and the lane loop is rfactored, so the
  partial sums live in a ``width``-element buffer that LLVM keeps in registers; the partials are
  then summed by a tree of further rfactors (64 -> 32 -> ... -> 2 lanes) instead of one scalar
  chain. rfactor needs the reduction block to be alone under its loops, so it runs while each
  block still has its own loop nest, before the blocks are moved under the row loop.
- **compute_at drops block predicates.** Moving an rfactored block whose split does not divide
  the extent regenerates its loops from the block's iteration domain and loses the
  ``ko * width + ki < extent`` predicate, which then reads past the row. The predicate is put
  back (:func:`_restore_predicate`) after the move; the last, partial vector is then split off
  with ``loop_partition`` so the full vectors run without a mask.
- **A vectorized loop with a predicate is scalarized** (and LLVM turns that into gathers), so
  loops whose extent is not a multiple of the vector width are partitioned into a vectorized
  main part and a short tail (``loop_partition`` needs static extents; with a symbolic inner
  extent the loop is left to LLVM's own loop vectorizer).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from ..targets import target_arch, vector_bits, vector_registers

__all__ = [
    "MAX_FUSE",
    "BlockInfo",
    "RFactor",
    "analyze",
    "bool_compares_as_int8",
    "extent_of",
    "pick_width",
    "replace_block_body",
    "rfactor_reduction",
    "schedule_channels_last_groups",
    "schedule_columns",
    "schedule_elementwise",
    "schedule_fallback",
    "schedule_prologue",
    "schedule_rows",
    "schedule_whole",
    "vector_lanes",
    "vectorize_loop",
    "vectorize_rfactor",
]


#: At most this many contiguous trailing loops are fused into one vector loop. Fusing three
#: (e.g. group norm's C/G x H x W) gives nested div/mod indices that TVM's vectorizer cannot
#: prove contiguous: it then builds every vector lane by lane (measured 16 ms vs 0.4 ms).
MAX_FUSE = 2


def vector_lanes(target: Target, dtype_bits: int = 32) -> int:
    """Lanes of ``dtype_bits`` in one vector register of ``target`` (at least 4), from
    :func:`opsdk.targets.vector_bits` (TVM's own query says 512 bits on every x86 CPU).

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.schedules._common import vector_lanes
    >>> vector_lanes(opsdk.target("arm"))
    4
    """
    return max(vector_bits(target) // dtype_bits, 4)


def accumulator_registers(target: Target) -> int:
    """Vector registers a register-blocked tile (matmul, conv, Winograd) gives to its
    accumulators: three quarters of the register file (24 of AVX-512's or aarch64's 32, 12
    of AVX2's 16), the rest holding the operand vectors and the broadcast. A 24-accumulator
    tile on AVX2 spills every step.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.schedules._common import accumulator_registers
    >>> accumulator_registers(opsdk.target("arm"))
    24
    """
    return vector_registers(target) * 3 // 4


@dataclass
class BlockInfo:
    """A block of a TE-made PrimFunc: its handle, iter kinds and loop extents."""

    rv: s_tir.schedule.SBlockRV
    name: str
    kinds: str  # one letter per iter var: S (spatial) or R (reduction)
    extents: list

    @property
    def is_reduction(self) -> bool:
        return "R" in self.kinds

    @property
    def n_spatial(self) -> int:
        return self.kinds.count("S")


def analyze(sch: s_tir.Schedule) -> list[BlockInfo] | None:
    """Blocks under the root in order, or None if the function is not a simple loop nest."""
    out = []
    for rv in sch.get_child_blocks(sch.get_sblock("root")):
        blk = sch.get(rv)
        kinds = ""
        for iv in blk.iter_vars:
            if iv.iter_type == tirx.IterVar.DataPar:
                kinds += "S"
            elif iv.iter_type == tirx.IterVar.CommReduce:
                kinds += "R"
            else:
                return None
        # Only plain nests: spatial vars first, then reduction vars, one loop per var.
        if "RS" in kinds or len(sch.get_loops(rv)) != len(kinds):
            return None
        out.append(BlockInfo(rv, blk.name_hint, kinds, [iv.dom.extent for iv in blk.iter_vars]))
    return out


def extent_of(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> int | None:
    """Static extent of a loop, or None when it is symbolic."""
    ext = sch.get(loop).extent
    return int(ext.value) if isinstance(ext, tirx.IntImm) else None


def _same(a, b) -> bool:
    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return a.value == b.value
    return a.same_as(b) or str(a) == str(b)


def _dtype_bits(sch: s_tir.Schedule, rv) -> int:
    blk = sch.get(rv)
    return blk.writes[0].source.dtype.bits if blk.writes else 32


def _fuse(sch: s_tir.Schedule, loops: Sequence) -> s_tir.schedule.LoopRV | None:
    """The loops fused into one (the loop itself when alone; None when there is none)."""
    if not loops:
        return None
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


def replace_block_body(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV,
                       body: list[tirx.Stmt]) -> None:
    """Replace a (blockized) block's body, keeping its iteration vars and regions."""
    blk = sch.get(block)
    new = s_tir.SBlock(
        blk.iter_vars,
        blk.reads,
        blk.writes,
        blk.name_hint,
        tirx.SeqStmt(body) if len(body) > 1 else body[0],
        None,
        blk.alloc_buffers,
        blk.match_buffers,
        blk.annotations,
    )
    sch.state.replace(sch.get_sref(block), new, {blk: new})


def schedule_prologue(sch: s_tir.Schedule, block, lanes: int) -> None:
    """A root-level copy before a kernel (a conv's padding, a runtime weight packing): its
    innermost loop vectorized (with a partitioned tail), the others fused across the cores."""
    loops = sch.get_loops(block)
    if not loops:
        return
    vectorize_loop(sch, loops[-1], lanes)
    if len(loops) > 1:
        sch.parallel(_fuse(sch, loops[:-1]))


# ----------------------------------------------------------------------------- spatial loops
def vectorize_loop(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV,
                   lanes: int) -> s_tir.schedule.LoopRV | None:
    """Vectorize a contiguous spatial loop by ``lanes``, handling any static extent.

    A multiple of ``lanes`` is split and vectorized; otherwise the loop is partitioned into a
    vectorized main part and a tail vectorized as power-of-two vectors. A symbolic extent is left
    serial for LLVM's loop vectorizer (TVM cannot partition it and would scalarize a predicated
    vector loop). Returns the loop over the main part's whole vectors (a caller may run it
    across the cores), or None when there is no such part.
    """
    ext = extent_of(sch, loop)
    if ext is None or ext <= 1:
        return None
    # LLVM's aarch64 back end miscompiles some odd-width vectors (requantize's int64
    # arithmetic in a <3 x i64> tail returned -128 for 127; found by verify's static
    # residues, tails of 5 and 7 were right), so a tail is vectorized as power-of-two pieces
    # (3 = 2 + 1), legal vector types on every target. One loop_partition makes all the
    # pieces: TVM 0.27 mis-sizes a partition of a loop that does not start at 0.
    main = ext - ext % lanes if ext > lanes else 0
    pieces = _pow2_pieces(ext - main)
    factors = ([main] if main and pieces else []) + pieces[:-1]
    parts = sch.loop_partition(loop, factors) if factors else [loop]
    outer = None
    if main:
        outer, vec = sch.split(parts[0], [None, lanes])
        sch.vectorize(vec)
        parts = parts[1:]
    for part, n in zip(parts, pieces):
        if n > 1:
            sch.vectorize(part)
    return outer


def vectorize_segments(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, lanes: int,
                       cuts: Sequence[int]) -> None:
    """Vectorize a static loop cut at ``cuts`` (offsets in it, multiples of ``lanes``, as is
    its extent): split by ``lanes``, the vector loop's outer loop partitioned at the cuts
    (one ``loop_partition``: TVM 0.27 splits no loop that does not start at 0)."""
    ext = extent_of(sch, loop)
    assert ext is not None and ext % lanes == 0 and all(c % lanes == 0 for c in cuts)
    outer, inner = sch.split(loop, [None, lanes])
    bounds = [0, *(c // lanes for c in cuts), ext // lanes]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if len(lengths) == 1:
        sch.vectorize(inner)
        return
    for part in sch.loop_partition(outer, lengths[:-1]):
        leaf = sch.get_child_blocks(part)[0]
        while sch.get_child_blocks(leaf):  # a partition is a block scope of its own
            leaf = sch.get_child_blocks(leaf)[0]
        sch.vectorize(sch.get_loops(leaf)[-1])


def _select_cuts(sch: s_tir.Schedule, rv, loop: s_tir.schedule.LoopRV) -> list[int]:
    """Where an ``if_then_else`` of the block (a concatenate) switches on the index bound
    to ``loop`` alone: the constant offsets inside the loop's static range, sorted."""
    ext = extent_of(sch, loop)
    var = sch.get(loop).loop_var
    blk = sch.get(rv)
    bound = [iv.var for iv, v in zip(blk.iter_vars, _realize(sch, rv).iter_values)
             if v.same_as(var)]
    if ext is None or not bound:
        return []
    v = bound[0]
    cuts: set[int] = set()

    def visit(e) -> None:
        for sub in _children(e):
            visit(sub)
        if isinstance(e, tvm.ir.Call) and str(getattr(e.op, "name", "")).endswith("if_then_else"):
            c = e.args[0]
            for cls, off in ((tirx.LT, 0), (tirx.GE, 0), (tirx.LE, 1), (tirx.GT, 1)):
                if isinstance(c, cls):
                    a, b = c.a, c.b
                    if a.same_as(v) and isinstance(b, tirx.IntImm):
                        cuts.add(int(b.value) + off)
                    elif b.same_as(v) and isinstance(a, tirx.IntImm):
                        cuts.add(int(a.value) + 1 - off)

    if isinstance(blk.body, tirx.BufferStore):
        visit(blk.body.value)
    return sorted(c for c in cuts if 0 < c < ext)


def _children(e) -> list:
    """The operands of an expression node (calls, arithmetic, casts, selects, lets)."""
    if isinstance(e, tvm.ir.Call):
        return list(e.args)
    if isinstance(e, tirx.Select):
        return [e.condition, e.true_value, e.false_value]
    if isinstance(e, tirx.Let):
        return [e.value, e.body]
    return [getattr(e, k) for k in ("a", "b", "value") if isinstance(getattr(e, k, None),
                                                                   tvm.ir.expr.Expr)]


def _pow2_pieces(n: int) -> list[int]:
    """``n`` as decreasing powers of two: 7 -> [4, 2, 1]; 0 -> []."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


# ----------------------------------------------------------------------------- reductions
@dataclass
class RFactor:
    """One vectorized reduction: the rfactored block and how its reduction loop was split."""

    rf: s_tir.schedule.SBlockRV  # the block holding ``width`` partial results
    width: int
    extent: tirx.PrimExpr  # the fused reduction extent (static or symbolic)
    lane_iter: int  # index of the lane iter var among the rf block's iter vars
    red_iter: int  # index of the (outer) reduce iter var
    # blocks of the partial-sum tree: (block, width, lane iter index, reduce iter index); rfactor
    # names them all ``<name>_rf``, so they are kept by handle
    tree: list[tuple[s_tir.schedule.SBlockRV, int, int, int]] = field(default_factory=list)
    # an injective block whose output only this reduction and the output block read, in the
    # reduction's order (softmax's ``exp``): its loop is merged into the partial sums' loop
    producer: str | None = None

    @property
    def exact(self) -> bool:
        return isinstance(self.extent, tirx.IntImm) and self.extent.value % self.width == 0


def pick_width(extent: tirx.PrimExpr, lanes: int, accumulators: int) -> int | None:
    """Partial-sum width for a reduction of ``extent``: ``lanes x accumulators`` when it fits,
    the whole extent when that is a single short vector, None for a scalar reduction."""
    if isinstance(extent, tirx.IntImm):
        k = int(extent.value)
        if k < 4:
            return None
        if k <= lanes * accumulators:
            return k  # one (possibly odd-sized) vector: no tail at all
        for acc in range(accumulators, 0, -1):  # prefer a width that divides the extent
            if k % (lanes * acc) == 0 and k >= 2 * lanes * acc:
                return lanes * acc
        return lanes * accumulators
    return lanes * accumulators


def _realize(sch: s_tir.Schedule, block) -> s_tir.SBlockRealize:
    loops = sch.get_loops(block)
    body = sch.get(loops[-1]).body
    if not isinstance(body, s_tir.SBlockRealize):
        raise ValueError(f"block {sch.get(block).name_hint} is not directly under a loop")
    return body


def rfactor_reduction(sch: s_tir.Schedule, block, n_outer: int, width: int) -> RFactor:
    """Vectorizable partial reduction of a root-level reduction block (before compute_at).

    The block's loops are ``n_outer`` spatial loops and then its reduction loops (fused here).
    The fused loop is split by ``width`` and the lane loop rfactored into a ``width``-wide
    buffer; the write-back is then reduced by a tree of rfactors halving the width.
    """
    loops = sch.get_loops(block)
    red = _fuse(sch, loops[max(n_outer, len(loops) - MAX_FUSE) :])
    extent = sch.get(red).extent
    ko, ki = sch.split(red, [None, width])
    name, lane, redi = _rfactor_lanes(sch, ko, ki, n_outer)
    info = RFactor(name, width, extent, lane, redi)
    # Tree: `block` now sums `width` partials; halve while the width stays even, so the
    # partials are combined by log2(width) vector adds instead of a chain of scalar adds.
    w = width
    while w > 2 and w % 2 == 0:
        two, half = sch.split(sch.get_loops(block)[-1], [2, w // 2])
        w //= 2
        name, lane, red = _rfactor_lanes(sch, two, half, n_outer)
        info.tree.append((name, w, lane, red))
    return info


def _rfactor_lanes(
    sch: s_tir.Schedule, ko, ki, n_outer: int
) -> tuple[s_tir.schedule.SBlockRV, int, int]:
    """rfactor ``ki`` (innermost, ``ko`` just outside); return the rf block name and the
    indices of its iter vars bound to the lane and the reduce loop."""
    rf = sch.rfactor(ki, n_outer)
    # The rf block gets a copy of the loop nest (new loop vars, same order).
    loops = sch.get_loops(rf)
    vals = list(_realize(sch, rf).iter_values)
    ki_var, ko_var = sch.get(loops[-1]).loop_var, sch.get(loops[-2]).loop_var
    lane = next(i for i, v in enumerate(vals) if v.same_as(ki_var))
    red = next(i for i, v in enumerate(vals) if v.same_as(ko_var))
    return rf, lane, red


def _restore_predicate(sch: s_tir.Schedule, info: RFactor) -> None:
    """Put back ``ko * width + ki < extent`` on a moved rf block (compute_at dropped it)."""
    loops = sch.get_loops(info.rf)
    inner = sch.get(loops[-1])
    realize = inner.body
    vals = list(realize.iter_values)
    need = vals[info.red_iter] * info.width + vals[info.lane_iter] < info.extent
    pred = realize.predicate
    if not (isinstance(pred, tirx.IntImm) and pred.value == 1):
        need = tirx.And(pred, need)
    new_realize = s_tir.SBlockRealize(vals, need, realize.block)
    new_loop = tirx.For(
        inner.loop_var,
        inner.min,
        inner.extent,
        inner.kind,
        new_realize,
        inner.thread_binding,
        inner.annotations,
        inner.step,
    )
    sch.state.replace(sch.get_sref(loops[-1]), new_loop)


def _vectorize_partials(
    sch: s_tir.Schedule,
    block: s_tir.schedule.SBlockRV,
    lane: int,
    red: int,
    tail: RFactor | None = None,
) -> None:
    """Order a moved partial-result block as (reduce, lanes), vectorize the lanes, hoist the
    init and, for ``tail``, split off the partial last vector."""
    vals = _realize(sch, block).iter_values
    by_var = {sch.get(lp).loop_var: lp for lp in sch.get_loops(block)}
    lane_loop = next((lp for v, lp in by_var.items() if vals[lane].same_as(v)), None)
    red_loop = next((lp for v, lp in by_var.items() if vals[red].same_as(v)), None)
    if lane_loop is None or red_loop is None:  # a unit loop was folded away
        return
    sch.reorder(red_loop, lane_loop)
    if tail is not None and tail.producer is not None:
        red_loop = _merge_producer(sch, tail, block, red_loop)
    sch.vectorize(lane_loop)
    sch.decompose_reduction(block, red_loop)
    if tail is not None and not tail.exact and isinstance(tail.extent, tirx.IntImm):
        full = int(tail.extent.value) // tail.width
        if 0 < full < (extent_of(sch, red_loop) or 0):
            sch.loop_partition(red_loop, [full])


def _merge_producer(
    sch: s_tir.Schedule, info: RFactor, block, red_loop
) -> s_tir.schedule.LoopRV:
    """One pass instead of two: the producer's element loop (below the row loop) is split by
    the partial-sum width and merged with the partial sums' reduce loop, so each chunk is
    computed, stored and summed while it is in registers (softmax 4096x768: the exp pass and
    the sum pass become one). Returns the merged loop; on a loop nest ``merge`` refuses,
    ``info.producer`` is cleared and the passes stay apart."""
    prod = sch.get_sblock(info.producer)
    # the loops both share (the row loop) are those above the reduce loop
    depth = [sch.get(lp).same_as(sch.get(red_loop)) for lp in sch.get_loops(block)].index(True)
    below = sch.get_loops(prod)[depth:]
    try:
        outer, inner = sch.split(_fuse(sch, below), [None, info.width])
        merged = sch.merge(outer, red_loop)
    except (s_tir.ScheduleError, tvm.error.TVMError):
        info.producer = None
        return red_loop
    sch.vectorize(inner)
    return merged


# Up to this many bytes of input + output, a producer is merged into the partial sums that
# read it (see _merge_producer). Measured on a 2-core Xeon VM, softmax, merged / separate:
# 4096x768 (12.6 MB) and 2048x1024 (16 MB) 5-9 % faster with 1 and 2 threads; from 64 MB
# (4096x2048, 16384x1024, 8192x2048) 2-8 % slower with 2 threads, though the merged loop
# holds exactly the separate passes' instructions: there DRAM, not the loop, sets the time.
_MERGE_MAX_BYTES = 32 << 20


def _static_bytes(func: tirx.PrimFunc) -> float:
    """Bytes of the function's buffer parameters (inf when a shape is symbolic)."""
    total = 0
    for buf in func.params:
        if not isinstance(buf, tirx.Buffer):
            continue
        n = _prod(buf.shape)
        if not isinstance(n, tirx.IntImm):
            return float("inf")
        total += int(n.value) * tvm.runtime.DataType(buf.dtype).bits // 8
    return total


def _feeds_in_order(sch: s_tir.Schedule, prod: BlockInfo, red: BlockInfo) -> bool:
    """``prod`` is injective with static extents and ``red`` reads its buffer at exactly
    (row vars..., reduce vars...) in the order ``prod`` writes it, so ``prod``'s fused element
    index is ``red``'s fused reduce index and a chunk of one is the same chunk of the other."""
    if prod.is_reduction or prod.n_spatial != red.n_spatial + red.kinds.count("R"):
        return False
    if not all(isinstance(e, tirx.IntImm) for e in prod.extents):
        return False
    pb, rb = sch.get(prod.rv), sch.get(red.rv)
    buf = pb.writes[0].source
    reads = [r for r in rb.reads if r.source.same_as(buf)]
    if len(reads) != 1 or len(rb.iter_vars) != len(reads[0].region):
        return False
    ivs = [iv.var for iv in rb.iter_vars]
    if not all(_at(rg, v) for rg, v in zip(reads[0].region, ivs)):
        return False
    pivs = [iv.var for iv in pb.iter_vars]
    return all(_at(rg, v) for rg, v in zip(pb.writes[0].region, pivs))


def vectorize_rfactor(sch: s_tir.Schedule, info: RFactor) -> None:
    """Vectorize the partial-sum blocks of :func:`rfactor_reduction` where they now sit (the
    rf block, with its partial last vector split off, and every block of the tree)."""
    _vectorize_partials(sch, info.rf, info.lane_iter, info.red_iter, info)
    for rv, _, lane, red in info.tree:
        _vectorize_partials(sch, rv, lane, red)


# LLVM unrolls a constant-trip partial-sum loop completely (rms_norm over 1024: 64 loads and
# FMAs in a row). On one Zen 5 core that ran 1.15-1.19x slower than the same loop kept rolled
# (rms_norm 16384x1024, interleaved, fixed buffers; a plain C loop showed the same gap with
# `#pragma GCC unroll 32`); norms at 4096x768 1.40-1.48x, layer_norm 16384x1024 1.65x,
# softmax, whose exp dominates, 0.99-1.06x. TVM 0.27 emits no loop metadata, so the trip
# count goes through an empty inline asm (a register, no instruction): LLVM then unrolls the
# loop by a runtime factor of 8 instead of completely.
_OPAQUE_LL = """
define linkonce_odr i32 @opsdk_opaque_i32(i32 %x) #0 {
  %r = call i32 asm "", "=r,0"(i32 %x)
  ret i32 %r
}
define linkonce_odr i64 @opsdk_opaque_i64(i64 %x) #0 {
  %r = call i64 asm "", "=r,0"(i64 %x)
  ret i64 %r
}
attributes #0 = { alwaysinline nounwind }
"""


def bool_compares_as_int8(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every ``==`` / ``!=`` between bool operands compared as int8: TVM 0.27's
    LLVM codegen emits a float compare (``fcmp``) for a vector of bools, which LLVM's
    verifier rejects (a GPT-2's causal mask: ``mask[i] == mask[j]``, vectorized)."""
    from tvm_ffi.structural import structural_mutate

    def compare(node, mut):
        node = mut.default_mutate(node)
        if str(node.a.ty) != "bool":
            return node
        return type(node)(tirx.Cast("int8", node.a), tirx.Cast("int8", node.b))

    body = structural_mutate(func.body, [(tirx.EQ, compare), (tirx.NE, compare)])
    return func if body.same_as(func.body) else func.with_body(body)


def rolled_partial_sums(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with the trip count of each serial loop that holds only a vectorized partial-
    sum update (an ``*_rf`` block: see :func:`rfactor_reduction`) hidden from LLVM, which then
    keeps the loop instead of unrolling it completely. Loops that also compute (softmax's exp
    merged into its sum) are left alone."""
    from tvm.ir import StringImm
    from tvm_ffi.structural import structural_mutate

    def only_rf_update(body: tirx.Stmt) -> bool:
        if not (isinstance(body, tirx.For) and body.kind == tirx.ForKind.VECTORIZED):
            return False
        while isinstance(body, tirx.For):
            body = body.body
        name = body.block.name_hint if isinstance(body, s_tir.SBlockRealize) else ""
        return "_rf" in name and "init" not in name and body.block.init is None

    def swap(node: tirx.For, mut) -> tirx.For:
        node = mut.default_mutate(node)
        inner = node.body
        while isinstance(inner, tirx.For) and inner.kind == tirx.ForKind.SERIAL \
                and _is_one(inner.extent):
            inner = inner.body
        if node.kind != tirx.ForKind.SERIAL or not isinstance(node.extent, tirx.IntImm) \
                or node.extent.value < 4 or not only_rf_update(inner):
            return node
        ty = str(node.loop_var.ty)
        ext = tirx.call_extern(ty, "opsdk_opaque_" + ("i64" if ty == "int64" else "i32"),
                               node.extent)
        ann = {**node.annotations, "pragma_import_llvm": StringImm(_OPAQUE_LL)}
        return tirx.For(node.loop_var, node.min, ext, node.kind, node.body, None, ann)

    body = structural_mutate(func.body, [(tirx.For, swap)])
    return func if body.same_as(func.body) else func.with_body(body)


# ----------------------------------------------------------------------------- rules
def _is_scalar_read(r) -> bool:
    """A read of one fixed element (``scale[0]``: a per-tensor parameter), the same for every
    output element: it does not tie the loops to the output's axes."""
    return all(isinstance(rg.min, tirx.IntImm) and _is_one(rg.extent) for rg in r.region)


def _is_one(e) -> bool:
    return isinstance(e, tirx.IntImm) and e.value == 1


def _is_broadcast_free(sch: s_tir.Schedule, rv) -> bool:
    """True when every buffer the block reads has the output's rank (no broadcast operand),
    fixed single elements aside."""
    blk = sch.get(rv)
    ndim = len(blk.writes[0].source.shape)
    return all(len(r.source.shape) == ndim for r in blk.reads if not _is_scalar_read(r))


def _input_contiguous_loop(sch: s_tir.Schedule, rv, loops: Sequence):
    """The loop whose variable alone indexes the innermost axis of the block's largest read."""
    blk = sch.get(rv)
    if not blk.reads:
        return None
    big = max(blk.reads, key=lambda r: len(r.region))
    inner = big.region[-1].min
    # Through the block's bindings: folded unit axes leave fewer loops than iter vars.
    bindings = _realize(sch, rv).iter_values
    for iv, bound in zip(blk.iter_vars, bindings):
        if inner.same_as(iv.var):
            return next((lp for lp in loops if sch.get(lp).loop_var.same_as(bound)), None)
    return None


def _reads_aligned(sch: s_tir.Schedule, rv) -> bool:
    """True when every read indexes its buffer exactly as the block writes its output."""
    blk = sch.get(rv)
    out = [str(r.min) for r in blk.writes[0].region]
    return all([str(r.min) for r in rd.region] == out for rd in blk.reads
               if not _is_scalar_read(rd))


def schedule_elementwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Injective blocks: producers inlined; the leading loops fused and split across the cores;
    the trailing static loops (at most ``MAX_FUSE``, contiguous in memory) fused and vectorized
    with a partitioned tail. A fully static output of rank <= ``MAX_FUSE`` is flattened and
    split into a parallel outer and a vector inner loop.
    """
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks or any(b.is_reduction for b in blocks):
        return None
    outs = [b.name for b in blocks if not sch.get_consumers(b.rv)]
    for b in blocks:
        if b.name not in outs:
            sch.compute_inline(b.rv)
    if len(outs) > 1:
        # Several outputs (a split): each output its own parallel, vectorized loop nest over
        # the inlined producers (no streaming stores: they rebuild the function).
        for name in outs:
            _elementwise_nest(sch, sch.get_sblock(name), target, stream_ok=False)
        return sch
    return _elementwise_nest(sch, blocks[-1].rv, target, stream_ok=True)


def _elementwise_nest(sch: s_tir.Schedule, last: s_tir.schedule.SBlockRV, target: Target,
                      *, stream_ok: bool) -> s_tir.Schedule:
    """:func:`schedule_elementwise` of one output block whose producers are inlined."""
    loops = sch.get_loops(last)
    # Leading unit axes (a batch of 1) fold into the next axis: they count for nothing, and
    # left alone the "rows" to split across the cores would be that one row.
    while len(loops) > 1 and extent_of(sch, loops[0]) == 1:
        loops = [sch.fuse(loops[0], loops[1]), *loops[2:]]
    lanes = vector_lanes(target, _dtype_bits(sch, last))
    n_inner = 0
    for lp in reversed(loops):
        if extent_of(sch, lp) is None:
            break
        n_inner += 1
    # A broadcast operand (bias) keeps the last axis alone so its index stays a loop variable;
    # fusing more than MAX_FUSE axes gives nested div/mod indices TVM cannot vectorize.
    # A read whose index is not the output's (a transpose, a slice) keeps the loops apart
    # too: fused, its index would be div/mod of the flat loop, gathered lane by lane
    # (measured: NCHW -> NHWC of 24x56x56, 90 us fused, 10 us with the channel loop alone).
    aligned = _is_broadcast_free(sch, last) and _reads_aligned(sch, last)
    n_inner = min(n_inner, MAX_FUSE if aligned else 1)
    cuts = _select_cuts(sch, last, loops[-1]) if n_inner == 1 else []
    if cuts and len(loops) > 1 and all(c % lanes == 0 for c in
                                       [*cuts, extent_of(sch, loops[-1]) or 1]):
        # A concatenate along the innermost axis selects its input by index: one vector
        # loop per input range (the select folds away in each), not a select per lane.
        sch.parallel(_fuse(sch, loops[:-1]))
        vectorize_segments(sch, loops[-1], lanes, cuts)
        return sch
    if not aligned and n_inner == 1 and (extent_of(sch, loops[-1]) or 0) < lanes:
        # A transpose into a short innermost axis (NCHW -> NHWC with 3 channels): vectors
        # along the input's contiguous axis instead, stored strided.
        alt = _input_contiguous_loop(sch, last, loops)
        if alt is not None and (extent_of(sch, alt) or 0) >= lanes:
            rest = [lp for lp in loops if lp != alt]
            sch.reorder(*rest, alt)
            if len(rest) > 0:
                sch.parallel(_fuse(sch, rest[:-1]) if len(rest) > 1 else rest[0])
            vectorize_loop(sch, alt, lanes)
            return sch
    if n_inner == 0:  # symbolic innermost extent: parallel rows, LLVM vectorizes the rest
        if len(loops) > 1:
            sch.parallel(_fuse(sch, loops[:-1]))
        return sch
    from ._stream import stream_lanes, stream_stores  # (it imports this module)

    # A DRAM-sized float32 output is written with streaming stores (full vectors only).
    stream = stream_lanes(sch, last, target, lanes) if stream_ok else None
    if n_inner == len(loops):
        flat = _fuse(sch, loops)
        total = extent_of(sch, flat) or 0
        # too small to split across cores (counted in 32-bit vectors: an int8 output has 4x
        # the lanes, not 4x the work)
        if total <= vector_lanes(target, 32) * 64:
            vectorize_loop(sch, flat, lanes)
            return sch
        vec = vectorize_loop(sch, flat, lanes)  # (total > lanes: a main part)
        sch.parallel(vec)
        if stream and total % lanes == 0:
            return stream_stores(sch, last, vec, lanes, vec, 4 * lanes)
        return sch
    rows = _fuse(sch, loops[: len(loops) - n_inner])
    sch.parallel(rows)
    inner = _fuse(sch, loops[len(loops) - n_inner :])
    inner_ext = extent_of(sch, inner) or 0
    vec = vectorize_loop(sch, inner, lanes)
    if stream and vec is not None and inner_ext % lanes == 0:
        return stream_stores(sch, last, vec, lanes, rows, 4 * inner_ext)
    return sch


def _row_axes(blocks: list[BlockInfo], out: BlockInfo) -> int:
    """Number of leading axes every block shares with the output block (same extents)."""
    rows = min(b.n_spatial for b in blocks[:-1])
    for b in blocks[:-1]:
        k = 0
        while k < rows and _same(b.extents[k], out.extents[k]):
            k += 1
        rows = k
    return rows


def _indexed_rows(sch: s_tir.Schedule, blocks: list[BlockInfo]) -> int:
    """Leading output axes by which the output block indexes the per-row results it reads
    (mean, rstd, ...). Equal extents alone mistake a middle axis for a row axis: softmax over
    axis 1 of 7x8x8x8 reads ``rsum[n, h, w]``, whose (n, h) match (n, c) by extent only."""
    out = sch.get(blocks[-1].rv)
    ivs = [iv.var for iv in out.iter_vars]
    made = [sch.get(b.rv).writes[0].source for b in blocks[:-1]]
    rows = len(ivs)
    for r in out.reads:
        if len(r.region) >= len(ivs) or not any(r.source.same_as(m) for m in made):
            continue
        k = 0
        while k < len(r.region) and r.region[k].min.same_as(ivs[k]):
            k += 1
        rows = min(rows, k)
    return rows


def schedule_rows(
    func: tirx.PrimFunc,
    target: Target,
    *,
    accumulators: int = 4,
    split_out: tuple[int, int] | None = None,
) -> s_tir.Schedule | None:
    """Row-wise reductions: norms and softmax over trailing axes (or a middle axis).

    The leading axes shared by every block are the rows: fused, split across the cores, and
    every producer is computed inside the row loop, so a row is read from memory once and
    stays in L1/L2 for the later passes. Reductions over the trailing (contiguous) axes keep
    ``lanes x accumulators`` partial results in vector registers (see :func:`rfactor_reduction`);
    reductions over a middle axis vectorize the spatial axes inside them. The output is
    vectorized with a partitioned tail. On x86 the partial-sum loops stay loops
    (:func:`rolled_partial_sums`).

    ``split_out=(axis, factor)`` first splits that output axis (group norm in NCHW: channel =
    group x channels-per-group) so the groups become row axes.
    """
    sch = _schedule_rows(func, target, accumulators=accumulators, split_out=split_out)
    if sch is None or target_arch(target) != "x86_64":
        return sch
    rolled = rolled_partial_sums(sch.mod["main"])
    if rolled.same_as(sch.mod["main"]):
        return sch
    # Let bindings inlined twice (a main loop and its tail) must be renamed first, as the
    # driver does for every rule's result: a new Schedule checks the function is well-formed.
    rolled = tirx.transform.ConvertSSA()(tvm.IRModule({"main": rolled}))["main"]
    try:
        return s_tir.Schedule(rolled)
    except (ValueError, tvm.error.InternalError):  # loop_partition's block copies
        return sch


def _schedule_rows(
    func: tirx.PrimFunc,
    target: Target,
    *,
    accumulators: int,
    split_out: tuple[int, int] | None,
) -> s_tir.Schedule | None:
    """:func:`schedule_rows` before the partial-sum loops are kept rolled."""
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks or not any(b.is_reduction for b in blocks):
        return None
    if blocks[-1].is_reduction:
        # A plain reduction writes the output (a max / sum over the last axis, nothing after
        # it): a copy of each row's result into the output is the epilogue the rows end in.
        if split_out is not None:
            return None
        sch.cache_write(blocks[-1].rv, 0, "global")
        blocks = analyze(sch)
        if not blocks:
            return None
    out = blocks[-1]
    # Side outputs of a multi-output op (a residual add + norm also returning the sum): TVM
    # cannot compute an output block inside the row loop, so each is a parallel, vectorized
    # loop nest of its own (one more pass over its inputs).
    side = [b for b in blocks[:-1] if _is_side_output(sch, b, out)]
    if side:
        if split_out is not None:
            return None
        blocks = [b for b in blocks if b not in side]
    out_ext = list(out.extents)
    if split_out is not None:
        axis, factor = split_out
        loops = sch.get_loops(out.rv)
        sch.split(loops[axis], [None, factor])
        e = out_ext[axis]
        out_ext[axis : axis + 1] = [tirx.IntImm("int64", int(e.value) // factor), factor]
    rows = _row_axes(blocks, BlockInfo(out.rv, out.name, "S" * len(out_ext), out_ext))
    if split_out is None:
        rows = min(rows, _indexed_rows(sch, blocks))
    if rows == 0 or rows > len(out_ext):
        return None
    if rows == len(out_ext) and not all(_reduces_innermost(sch, b) for b in blocks
                                        if b.is_reduction):
        return None  # one value per row, but not along memory: schedule_columns' case
    scratch = _elementwise_scratch(sch, blocks, rows)
    lanes32 = vector_lanes(target, 32)
    # 1. Reductions, while each block still has its own loop nest.
    rfs: list[RFactor] = []
    middle: list[str] = []
    for k, b in enumerate(blocks[:-1]):
        if not b.is_reduction:
            continue
        # Reduces over the trailing axes (after unit axes that keepdims leaves in place).
        if b.n_spatial >= rows and all(_is_one(e) for e in b.extents[rows:b.n_spatial]):
            red_ext = _prod(b.extents[b.n_spatial:])
            width = pick_width(red_ext, lanes32, accumulators)
            if (width is not None and isinstance(red_ext, tirx.IntImm)
                    and red_ext.value % width and "int" in str(sch.get(b.rv).writes[0]
                                                               .source.dtype)):
                # An integer reduction is exact in any order: LLVM vectorizes its plain loop,
                # while predicated partial sums for the tail run scalar (DeiT's mask check,
                # int8 max over 197: 12 us against 64 us).
                width = None
            if width is not None:
                # checked on the block before rfactor rewrites its reads
                feeds = k > 0 and _feeds_in_order(sch, blocks[k - 1], b)
                rfs.append(rfactor_reduction(sch, b.rv, b.n_spatial, width))
                if feeds and rfs[-1].exact and _static_bytes(func) <= _MERGE_MAX_BYTES:
                    rfs[-1].producer = blocks[k - 1].name
        else:
            middle.append(b.name)
    # 2. Rows: fused, parallel; every producer computed inside the row loop.
    loops = sch.get_loops(out.rv)
    inner_loops = loops[rows:]
    dtypes = {str(sch.get(lp).loop_var.ty) for lp in loops[:rows]}
    from . import _stream  # (it imports this module)

    stream = None
    if len(dtypes) == 1:
        row = _fuse(sch, loops[:rows])
        sch.parallel(row)
        # A DRAM-sized float32 output is written with streaming stores (whole rows of full
        # vectors); not with side outputs.
        row_elems = _static_prod(out_ext[rows:])
        if not side and row_elems and row_elems % lanes32 == 0 \
                and len(inner_loops) <= MAX_FUSE:
            stream = _stream.stream_lanes(sch, out.rv, target, lanes32,
                                          _stream.ROWS_STREAM_MIN_BYTES)
            if stream and scratch is not None:
                # Scratch in the output would read every output line from memory before
                # writing it (softmax's exp pass): keep it in a row buffer instead (one
                # workspace per streaming task, reused row after row) and stream the output.
                # Measured, softmax 16384x1024: 1.17-1.36x at 1 and 2 threads ("local"; the
                # same buffer in "global" scope kept the max partials in memory, 1.0-1.08x).
                sch.set_scope(sch.get_sblock(_writer_of(sch, blocks, scratch[0])), 0, "local")
                scratch = None
    else:
        # Fusing int32 and int64 loops casts the bindings, which makes them non-affine and
        # blocks vectorization: parallelize the outer row loop, anchor at the inner one.
        sch.parallel(loops[0])
        row = loops[rows - 1]
    side_names = {b.name for b in side}
    producers = [rv for rv in sch.get_child_blocks(sch.get_sblock("root"))[:-1]
                 if sch.get(rv).name_hint not in side_names]
    for rv in reversed(producers):
        sch.compute_at(rv, row, preserve_unit_loops=True)
    for b in side:
        _schedule_side_output(sch, sch.get_sblock(b.name), rows, target)
    # 3. Partial sums: predicate back, (reduce, lanes) order, vector lanes, hoisted init.
    for info in rfs:
        if not info.exact:
            _restore_predicate(sch, info)
        vectorize_rfactor(sch, info)
    # 4. Middle-axis reductions: reduction loops outside, the inner spatial axes vectorized.
    for name in middle:
        _vectorize_inner_spatial(sch, sch.get_sblock(name), lanes32)
    # 5. Injective producers with inner axes (e.g. a middle-axis mean) and the output.
    merged = {info.producer for info in rfs}
    for b in blocks[:-1]:
        if b.is_reduction or b.name in merged:
            continue
        rv = sch.get_sblock(b.name)
        below = sch.get_loops(rv)[1:]
        real = [lp for lp in below if extent_of(sch, lp) != 1]
        if real:
            vectorize_loop(sch, _fuse(sch, real), vector_lanes(target, _dtype_bits(sch, rv)))
    out_rv = sch.get_sblock(out.name)
    inner = _fuse(sch, inner_loops[-MAX_FUSE:]) if inner_loops else None
    if inner is not None:
        vec = vectorize_loop(sch, inner, vector_lanes(target, _dtype_bits(sch, out_rv)))
        if stream and vec is not None:
            return _stream.stream_stores(sch, out_rv, vec, stream, row, 4 * row_elems)
    if scratch is not None:
        return _scratch_in_output(sch, *scratch)
    return sch


def _reduces_innermost(sch: s_tir.Schedule, b: BlockInfo) -> bool:
    """Every input the reduction reads walks its innermost non-unit axis with a reduction
    var (an input of unit axes only has nothing to walk)."""
    blk = sch.get(b.rv)
    red = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    if all(_is_one(iv.dom.extent) for iv in blk.iter_vars
           if iv.iter_type == tirx.IterVar.CommReduce):
        return True  # over unit axes: one element per row, a copy
    out = blk.writes[0].source
    reads = [r for r in blk.reads if not r.source.same_as(out)]
    if not reads:
        return False
    for r in reads:
        dims = [rg for rg, n in zip(r.region, r.source.shape) if not _is_one(n)]
        if dims and not any(dims[-1].min.same_as(v) for v in red):
            return False
    return True


def _is_side_output(sch: s_tir.Schedule, b: BlockInfo,
                    out: BlockInfo) -> bool:
    """A spatial block, not the last, that writes one of the function's output buffers with
    the last block's extents and feeds no other block."""
    blk = sch.get(b.rv)
    if b.is_reduction or len(blk.writes) != 1 or sch.get_consumers(b.rv):
        return False
    buf = blk.writes[0].source
    root = sch.get(sch.get_sblock("root"))
    if any(buf.same_as(a) for a in root.alloc_buffers):  # scratch, not a function output
        return False
    return len(b.extents) == len(out.extents) and all(
        _same(x, y) for x, y in zip(b.extents, out.extents))


def _schedule_side_output(sch: s_tir.Schedule, rv, rows: int, target: Target) -> None:
    loops = sch.get_loops(rv)
    sch.parallel(_fuse(sch, loops[:rows]))
    inner = loops[rows:]
    if inner:
        vectorize_loop(sch, _fuse(sch, inner[-MAX_FUSE:]),
                       vector_lanes(target, _dtype_bits(sch, rv)))


def schedule_whole(
    func: tirx.PrimFunc, target: Target, *, accumulators: int = 4
) -> s_tir.Schedule | None:
    """Norms and softmax over the whole tensor (layer norm of a 2-D input over both axes):
    every reduction yields one scalar, so there is no row axis to split across the cores.

    Each reduction keeps up to ``lanes x accumulators`` vector partial sums combined by a
    vector tree (:func:`rfactor_reduction`), with a width that divides its length (TVM 0.27's
    rfactor fails on a predicated split of a scalar reduction; a length with no such width
    keeps a scalar loop); producers and the output are vectorized with a partitioned tail; it
    runs on one core. Static shapes only: with a symbolic length the partial sums would need a
    predicated vector loop, which TVM scalarizes.
    """
    sch = s_tir.Schedule(func)
    reds, others = [], []
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    for rv in blocks:
        blk = sch.get(rv)
        ivs = list(blk.iter_vars)
        if not all(isinstance(iv.dom.extent, tirx.IntImm) for iv in ivs):
            return None
        red = [iv for iv in ivs if iv.iter_type == tirx.IterVar.CommReduce]
        if red:
            # a scalar result: reduction vars only (one loop each), or unit spatial vars
            if len(red) != len(ivs) or len(sch.get_loops(rv)) != len(red):
                return None
            reds.append((rv, [iv.dom.extent for iv in red]))
        elif any(iv.iter_type != tirx.IterVar.DataPar for iv in ivs):
            return None
        else:
            others.append(rv)
    if not reds or not others or others[-1] is not blocks[-1]:  # the output: not a reduction
        return None
    for rv in others:
        if not sch.get_loops(rv):  # a scalar block (mean, rstd): rfactor fails beside a
            sch.add_unit_loop(rv)  # block realized without a loop (a TVM 0.27 check)
    lanes32 = vector_lanes(target, 32)
    for rv, exts in reds:
        width = _dividing_width(int(_prod(exts).value), lanes32, accumulators)
        if width is None:  # left a scalar loop: rfactor of a predicated split fails here
            continue
        vectorize_rfactor(sch, rfactor_reduction(sch, rv, 0, width))
    for rv in others:
        loops = [lp for lp in sch.get_loops(rv) if extent_of(sch, lp) != 1]
        if loops:
            inner = _fuse(sch, loops[-MAX_FUSE:])
            vectorize_loop(sch, inner, vector_lanes(target, _dtype_bits(sch, rv)))
    return sch


def schedule_columns(
    func: tirx.PrimFunc, target: Target, *, accumulators: int = 4
) -> s_tir.Schedule | None:
    """A reduction over outer axes whose innermost output axis is the input's innermost axis
    (a channels-last mean over H and W, global average pooling, a sum over a batch): the
    output columns in full vectors, the reduction loops outside them, chunks of columns (and
    the outer output axes) across the cores.

    Each chunk holds up to ``accumulators`` vectors of partial sums; the chunk is narrowed
    (down to one vector) until there are at least 4 chunks for the cores. A column count that
    is not a multiple of the vector width keeps its tail in a partitioned loop of its own.
    Spatial producers are inlined into the reduction; consumers (mean's divide) are
    vectorized on their own. Returns None for anything else (the reduced axis innermost is
    :func:`schedule_rows`' case) and for a symbolic column count.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te, tirx
    >>> from opsdk.schedules._common import schedule_columns
    >>> x = te.placeholder((1, 7, 7, 64), name="x")
    >>> h, w = te.reduce_axis((0, 7), "h"), te.reduce_axis((0, 7), "w")
    >>> y = te.compute((1, 64), lambda n, c: te.sum(x[n, h, w, c], axis=[h, w]), name="y")
    >>> sch = schedule_columns(te.create_prim_func([x, y]), opsdk.target("x86"))
    >>> sch is not None
    True
    """
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks:
        return None
    reds = [b for b in blocks if b.is_reduction]
    if len(reds) != 1:
        return None
    red = reds[0]
    for b in blocks[: blocks.index(red)]:
        try:
            sch.compute_inline(b.rv)
        except Exception:  # a producer TVM cannot inline: not this rule's case
            return None
    blk = sch.get(red.rv)
    spatial_ivs = [iv for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    live = [iv for iv in spatial_ivs if not _is_one(iv.dom.extent)]  # the batch: symbolic
    if not live:
        return None
    col = live[-1].var
    out = blk.writes[0].source
    # Every input read walks its innermost axis with the innermost output column.
    for r in blk.reads:
        if r.source.same_as(out):
            continue
        last = r.region[-1]
        if not (isinstance(last.extent, tirx.IntImm) and int(last.extent) == 1
                and last.min.same_as(col)):
            return None
    loops = sch.get_loops(red.rv)
    realize = _realize(sch, red.rv)
    spatial, rloops = [], []
    for lp, iv, val in zip(loops, realize.block.iter_vars, realize.iter_values):
        if not val.same_as(sch.get(lp).loop_var):
            return None
        (rloops if iv.iter_type == tirx.IterVar.CommReduce else spatial).append(lp)
    spatial = [lp for lp in spatial if extent_of(sch, lp) != 1]
    inner, outer = spatial[-1], spatial[:-1]
    lanes = vector_lanes(target, _dtype_bits(sch, red.rv))
    ext = extent_of(sch, inner)
    if ext is None:
        return None
    n_outer = 1
    for lp in outer:  # a symbolic axis (the batch) counts as plenty of work
        n_outer *= extent_of(sch, lp) or 64
    if ext < lanes:  # fewer columns than lanes: one short vector
        main, width = ext, ext
    else:
        main = ext - ext % lanes
        k = max(1, min(accumulators, main // lanes))
        while k > 1 and (main % (lanes * k) or n_outer * (main // (lanes * k)) < 4):
            k -= 1
        width = lanes * k
    sch.reorder(*outer, inner, *rloops)
    if outer and n_outer > 1:
        sch.parallel(_fuse(sch, outer))
    parts = [inner] if main == ext else list(sch.loop_partition(inner, [main]))
    for i, part in enumerate(parts):
        # A partition is a block scope of its own: find its leaf (the reduction) below it.
        chunk, vec = sch.split(part, [None, width]) if i == 0 else (None, part)
        leaf = sch.get_child_blocks(vec)[0]
        while sch.get_child_blocks(leaf):
            leaf = sch.get_child_blocks(leaf)[0]
        r_here = sch.get_loops(leaf)[-len(rloops):]
        sch.reorder(*r_here, vec)
        if chunk is not None:
            sch.reorder(chunk, *r_here)
            if not (outer and n_outer > 1) and main // width > 1:
                sch.parallel(chunk)
        sch.vectorize(vec)
        init = sch.decompose_reduction(leaf, r_here[0])
        sch.vectorize(sch.get_loops(init)[-1])
    for rv in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(rv).name_hint != blk.name_hint and not any(
                iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(rv).iter_vars):
            _fallback_block(sch, rv, target)
    return sch


def _dividing_width(k: int, lanes: int, accumulators: int) -> int | None:
    """The widest partial-sum width (``lanes x accumulators`` down to 4) that divides ``k``;
    ``k`` itself when it fits one vector group."""
    if k <= lanes * accumulators:
        return k if k >= 4 else None
    widths = [lanes * accumulators, lanes, lanes // 2, lanes // 4]
    return next((w for w in widths if w >= 4 and k % w == 0), None)


def _writer_of(sch: s_tir.Schedule, blocks: list[BlockInfo], buf_name: str) -> str:
    """Name of the block that writes the buffer ``buf_name``."""
    return next(b.name for b in blocks if sch.get(b.rv).writes[0].source.name == buf_name)


def _elementwise_scratch(
    sch: s_tir.Schedule, blocks: list[BlockInfo], rows: int
) -> tuple[str, str] | None:
    """Name of a producer buffer the output could hold instead (see :func:`_scratch_in_output`):
    same static shape and dtype as the output, read by the output block only at the element
    it writes (softmax's ``exp``), written by one injective block, and read by the other
    blocks only within their own row (no row reads another row's scratch, which would then
    race with that row's output pass). Returns the names of that buffer and of the output
    buffer."""
    out = sch.get(blocks[-1].rv)
    ob = out.writes[0].source
    if not all(isinstance(d, tirx.IntImm) for d in ob.shape):
        return None
    for b in blocks[:-1]:
        blk = sch.get(b.rv)
        buf = blk.writes[0].source
        if b.is_reduction or buf.dtype != ob.dtype or len(buf.shape) != len(ob.shape):
            continue
        if not all(_same(a, c) for a, c in zip(buf.shape, ob.shape)):
            continue
        reads = [r for r in out.reads if r.source.same_as(buf)]
        if len(reads) != 1 or not _same_point(reads[0], out.writes[0]):
            continue
        if all(_reads_own_row(sch.get(o.rv), buf, rows) for o in blocks[:-1]):
            return buf.name, ob.name
    return None


def _at(rg, index) -> bool:
    """The range is the single index ``index`` (the same expression object)."""
    return rg.min.same_as(index) and _same(rg.extent, tirx.IntImm("int32", 1))


def _reads_own_row(blk: s_tir.SBlock, buf, rows: int) -> bool:
    """Every read of ``buf`` by ``blk`` is at the block's own row (its first ``rows`` iter
    vars, one index each)."""
    ivs = [iv.var for iv in blk.iter_vars]
    return all(
        len(ivs) >= rows and all(_at(rg, ivs[k]) for k, rg in enumerate(r.region[:rows]))
        for r in blk.reads
        if r.source.same_as(buf)
    )


def _same_point(a, b) -> bool:
    """Both regions are the single element at the same indices."""
    return len(a.region) == len(b.region) and all(
        _at(ra, rb.min) and _at(rb, rb.min) for ra, rb in zip(a.region, b.region)
    )


def _scratch_in_output(sch: s_tir.Schedule, scratch: str, out_name: str) -> s_tir.Schedule:
    """Keep a row-sized scratch buffer in the output buffer itself (a scheduled rows func).

    Scratch computed inside a parallel row loop is allocated per row, and TVM lowers a buffer
    over 1 KB to a ``TVMBackendAllocWorkspace`` / ``Free`` call pair per row (measured: softmax
    4096x768 float32 takes 20-30 % less time without them). When the output block reads the scratch
    only at the element it writes, the scratch can live in the output: each element is
    written, reduced over, then overwritten in place by the same row's output pass. s_tir has
    no primitive that merges two buffers, so the root block declares the scratch as a
    ``match_buffer`` of the whole output and ``LowerMatchBuffer`` rewrites every access.
    """
    func = sch.mod["main"]
    root = func.body.block
    bufs = [b for b in root.alloc_buffers if b.name == scratch]
    outs = [p for p in func.params if p.name == out_name]
    if len(bufs) != 1 or len(outs) != 1 or root.match_buffers:
        return sch
    whole = [tvm.ir.Range.from_min_extent(0, d) for d in outs[0].shape]
    new_root = s_tir.SBlock(
        root.iter_vars,
        root.reads,
        root.writes,
        root.name_hint,
        root.body,
        root.init,
        [b for b in root.alloc_buffers if not b.same_as(bufs[0])],
        [s_tir.MatchBufferRegion(bufs[0], tirx.BufferRegion(outs[0], whole))],
        root.annotations,
    )
    realize = func.body
    func = func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, new_root))
    mod = s_tir.transform.LowerMatchBuffer()(tvm.IRModule({"main": func}))
    try:
        return s_tir.Schedule(mod["main"])
    except (ValueError, tvm.error.InternalError):
        # The block copies ``loop_partition`` leaves share their iter vars; TVM lowers them,
        # but a new Schedule (enable_check or not) rejects them as ill-formed: keep the
        # scratch there.
        return sch


def rv_name(sch: s_tir.Schedule, rv) -> str:
    """Name of a block."""
    return sch.get(rv).name_hint


def _static_prod(exts: Sequence) -> int | None:
    """The product of static extents (None when one is symbolic)."""
    out = 1
    for e in exts:
        if not isinstance(e, tirx.IntImm):
            return None
        out *= int(e.value)
    return out


def _prod(exts: Sequence) -> tirx.PrimExpr:
    """Product of extents: an int64 IntImm when all are static."""
    if all(isinstance(e, tirx.IntImm) for e in exts):
        p = 1
        for e in exts:
            p *= int(e.value)
        return tirx.IntImm("int64", p)
    p = exts[0]
    for e in exts[1:]:
        p = p * e
    return p


def _loops_by_kind(sch: s_tir.Schedule, block) -> tuple[list, list]:
    """The loops below the row loop that bind the block's spatial and reduction iter vars."""
    realize = _realize(sch, block)
    spatial, red = [], []
    for lp in sch.get_loops(block)[1:]:
        var = sch.get(lp).loop_var
        for iv, val in zip(realize.block.iter_vars, realize.iter_values):
            if val.same_as(var):
                (red if iv.iter_type == tirx.IterVar.CommReduce else spatial).append(lp)
    return spatial, red


def _vectorize_inner_spatial(sch: s_tir.Schedule, block, lanes: int) -> None:
    """A reduction moved under the row loop whose remaining spatial axes are innermost in
    memory (softmax over a middle axis): put its reduction loops outside, vectorize the
    fused spatial loops inside them, and hoist the init."""
    spatial, red = _loops_by_kind(sch, block)
    spatial = [lp for lp in spatial if extent_of(sch, lp) != 1]
    if not spatial or not red:
        return
    sch.reorder(*red, *spatial)
    fused = _fuse(sch, spatial)
    ext = extent_of(sch, fused)
    if ext is None:
        sch.decompose_reduction(block, red[0])
        return
    if ext <= lanes:
        sch.vectorize(fused)
    elif ext % lanes == 0:
        _, vec = sch.split(fused, [None, lanes])
        sch.vectorize(vec)
    # (a non-multiple inner extent stays serial: partitioning a loop that carries the init
    # would duplicate it)
    sch.decompose_reduction(block, red[0])


def schedule_channels_last_groups(
    func: tirx.PrimFunc, target: Target, *, accumulators: int = 4
) -> s_tir.Schedule | None:
    """Group norm in NHWC: statistics per (sample, group) over (channels of the group, H, W).

    The channels of a group are strided by the pixel, so each statistic is first rfactored over
    the channel-in-group axis: one pass over a sample accumulates a vector of per-channel
    partial sums (all C channels, contiguous in memory), then the group sums are formed from
    those. Samples are the parallel rows; the output runs over pixels with the channels in
    vectors (per-channel mean/scale vectors come from the compute's ``mean_c``/``scale_c``).
    """
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks or blocks[-1].is_reduction:
        return None
    out = blocks[-1]
    reds = [b for b in blocks[:-1] if b.is_reduction]
    # Expected: reductions (n, g | rc, rh, rw) and an output (n, h, w, c).
    if not reds or any(b.kinds != "SSRRR" for b in reds) or len(out.extents) != 4:
        return None
    lanes32 = vector_lanes(target, 32)
    rfs = []
    for b in reds:
        loops = sch.get_loops(b.rv)
        rfs.append(sch.rfactor(loops[2], 2))  # per-channel partials: (n, g, rc | rh, rw)
    loops = sch.get_loops(out.rv)
    row = loops[0]
    sch.parallel(row)
    producers = sch.get_child_blocks(sch.get_sblock("root"))[:-1]
    for rv in reversed(producers):
        sch.compute_at(rv, row, preserve_unit_loops=True)
    for block in rfs:
        spatial, red = _loops_by_kind(sch, block)
        chans = [lp for lp in spatial if extent_of(sch, lp) != 1]
        if len(chans) != 2 or len(red) != 2:
            return None
        rc_l, g_l = chans  # block iter order (rc, n, g); memory order of channels is (g, rc)
        sch.reorder(*red, g_l, rc_l)
        ch = sch.fuse(g_l, rc_l)
        c = extent_of(sch, ch)
        if c is not None and c % lanes32 == 0:
            outer, vec = sch.split(ch, [None, lanes32])
            sch.vectorize(vec)
            if c // lanes32 <= 8:  # unrolled: the partial sums stay in registers
                sch.unroll(outer)
        elif c is not None and c <= lanes32 * accumulators:
            sch.vectorize(ch)
        sch.decompose_reduction(block, red[0])
    out_rv = sch.get_sblock(out.name)
    c = sch.get_loops(out_rv)[-1]
    vectorize_loop(sch, c, vector_lanes(target, _dtype_bits(sch, out_rv)))
    return sch


#: A kernel below this many output elements runs on one core (waking the pool costs more).
PARALLEL_MIN = 4096


def schedule_fallback(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Any plain loop nest (split's several outputs, concat, pad, gather-like reductions):
    intermediate spatial blocks inlined where TVM allows it, then each remaining block on its
    own: the leading spatial loops fused and split across the cores (when the block writes
    at least :data:`PARALLEL_MIN` elements), the innermost spatial loop vectorized (a
    reduction's reduction loops moved outside it, so the vector runs over outputs).

    Returns None for functions that are not plain loop nests (opaque blocks, nested blocks).
    """
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks:
        return None
    for b in blocks[:-1]:
        if b.is_reduction or not sch.get_consumers(b.rv):
            continue
        with contextlib.suppress(Exception):  # e.g. an output block, or a reduction consumer
            sch.compute_inline(b.rv)
    for rv in sch.get_child_blocks(sch.get_sblock("root")):
        _fallback_block(sch, rv, target)
    return sch


def _fallback_block(sch: s_tir.Schedule, rv, target: Target) -> None:
    spatial, red = _loops_by_kind(sch, rv)
    if not spatial:
        return
    lanes = vector_lanes(target, _dtype_bits(sch, rv))
    total = 1
    for lp in spatial:
        e = extent_of(sch, lp)
        total = total * e if e is not None and total is not None else None
    inner = spatial[-1]
    outer = spatial[:-1]
    if red:
        sch.reorder(*outer, *red, inner)
    ext = extent_of(sch, inner)
    if outer and (total is None or total >= PARALLEL_MIN):
        sch.parallel(_fuse(sch, outer))
    if ext is None or ext <= 1:
        if red:
            sch.decompose_reduction(rv, red[0])
        return
    if not red:
        vectorize_loop(sch, inner, lanes)
        return
    # A reduction: the output loop, innermost below the reduction loops, in full vectors.
    # A tail is partitioned off: each part is then a block of its own, alone under its loop,
    # and keeps its init inside (it runs on the first reduction step; decompose_reduction
    # needs a loop above the reduction loops, which the partition's scope hides).
    if ext % lanes == 0 or ext < lanes:
        if ext > lanes:
            _, inner = sch.split(inner, [None, lanes])
        sch.vectorize(inner)
        sch.decompose_reduction(rv, red[0])
        return
    for part in sch.loop_partition(inner, [ext - ext % lanes]):
        n = extent_of(sch, part)
        if n is not None and n > lanes:
            _, part = sch.split(part, [None, lanes])
        sch.vectorize(part)
