"""The catch-all family: any plain loop nest no family rule took (split's several outputs,
pad, gather-like reductions, pooling), each block's outer loops across the cores and its
innermost output loop vectorized; and kernels written as loops rather than blocks (a
scatter: TOPI's ``te.extern`` IR), which run as written.
"""

from __future__ import annotations

import contextlib

from tvm import s_tir, tirx
from tvm.target import Target

from ._core import (
    _dtype_bits,
    _fuse,
    _loops_by_kind,
    analyze,
    extent_of,
    vector_lanes,
    vectorize_loop,
)

__all__ = [
    "PARALLEL_MIN",
    "schedule_extern",
    "schedule_fallback",
]


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
    if not _has_root(func):
        return None
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


def _has_root(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is block-structured: its body the root block over its loop nests
    (TOPI's ``te.extern`` IR is one block of written loops, named for the op)."""
    body = func.body
    return isinstance(body, s_tir.SBlockRealize) and body.block.name_hint == "root"


def schedule_extern(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A kernel written as loops, not blocks (TOPI's ``te.extern`` IR: ``index_put``,
    ``scatter_elements``), as written: the schedule primitives need blocks, and where its
    loops are parallel its author said so.

    Its body goes in one opaque block under a root block, the form TVM's
    ``SplitLayoutRewritePreproc`` expects of every function in the module (it stopped the
    build with "There should be a compute block if there is only one subtree under the
    root", or "at least a block in the subtree"), and its buffers are not marked
    layout-free (nothing here packs them). Returns None for block-structured functions
    (the other rules' business).
    """
    if _has_root(func):
        return None
    # The loops in one opaque block: that pass also wants a block in every subtree of the root.
    body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "extern", func.body))
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    func = func.with_body(root)
    if "layout_free_buffers" in (func.attrs or {}):
        func = func.without_attr("layout_free_buffers")
    return s_tir.Schedule(func)


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
