"""Vector partial sums for reductions (rows and whole-tensor norms, softmax).

Two facts of TVM 0.27 shape them:

- **Reductions stay in vector registers through rfactor.** A reduction loop is split by
  ``width`` (vector lanes x independent accumulators) and the lane loop is rfactored, so the
  partial sums live in a ``width``-element buffer that LLVM keeps in registers; the partials are
  then summed by a tree of further rfactors (64 -> 32 -> ... -> 2 lanes) instead of one scalar
  chain. rfactor needs the reduction block to be alone under its loops, so it runs while each
  block still has its own loop nest, before the blocks are moved under the row loop.
- **compute_at drops block predicates.** Moving an rfactored block whose split does not divide
  the extent regenerates its loops from the block's iteration domain and loses the
  ``ko * width + ki < extent`` predicate, which then reads past the row. The predicate is put
  back (:func:`restore_predicate`) after the move; the last, partial vector is then split off
  with ``loop_partition`` so the full vectors run without a mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx

from ._core import (
    MAX_FUSE,
    _fuse,
    _realize,
    extent_of,
)

__all__ = [
    "RFactor",
    "pick_width",
    "restore_predicate",
    "rfactor_reduction",
    "vectorize_rfactor",
]


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


def restore_predicate(sch: s_tir.Schedule, info: RFactor) -> None:
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


def vectorize_rfactor(sch: s_tir.Schedule, info: RFactor) -> None:
    """Vectorize the partial-sum blocks of :func:`rfactor_reduction` where they now sit (the
    rf block, with its partial last vector split off, and every block of the tree)."""
    _vectorize_partials(sch, info.rf, info.lane_iter, info.red_iter, info)
    for rv, _, lane, red in info.tree:
        _vectorize_partials(sch, rv, lane, red)
