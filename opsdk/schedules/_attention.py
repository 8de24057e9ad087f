"""Fused attention (``opsdk.attention``): one query row of one head per task.

A task is a (batch, query, head) triple, spread over the cores. Under it, all stages run on
that row while it is in cache: the ``m`` scores (dot products over the head dim, in vector
partial sums, :func:`~tvm.s_tir.Schedule.rfactor` by the vector width), their max, the
exponentials (vectorized, opsdk's polynomial exp), their sum, and the weighted sum of the
value rows with the head dim in vector registers (keys outer, so each value row is one
contiguous read). Scores and exponentials are a row buffer of ``m`` floats: no ``n x m``
matrix is written. The key count ``m`` may be symbolic (a KV cache of any length).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from ._core import extent_of, vector_lanes, vectorize_loop

__all__ = ["schedule_attention"]

_STAGES = ("scores", "rowmax", "exp", "expsum", "pv", "attention")


def schedule_attention(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The schedule above, or None for a function that is not ``opsdk.attention``'s compute
    (its six named blocks) or whose head dim is symbolic or not a multiple of 4."""
    sch = s_tir.Schedule(func)
    try:
        blocks = {name: sch.get_sblock(name) for name in _STAGES}
    except Exception:  # another function (fused into, or a plug-in's)
        return None
    if len(sch.get_child_blocks(sch.get_sblock("root"))) != len(_STAGES):
        return None  # something fused around it: not this rule's shape
    lanes = vector_lanes(target)
    out = blocks["attention"]
    loops = sch.get_loops(out)
    d = extent_of(sch, loops[-1])
    if d is None or d % 4:
        return None
    width = lanes if d % lanes == 0 else 4

    row_loops = loops[:-1]
    if len({str(sch.get(lp).loop_var.ty.dtype) for lp in row_loops}) > 1:
        return None  # mixed int32 / int64 indices: the fused row's bindings are not affine
    # scores: the head-dim reduction split by the vector width and rfactored (while the
    # block has its own loop nest), so the partial sums sit in one vector register
    sc_loops = sch.get_loops(blocks["scores"])
    _, inner = sch.split(sc_loops[-1], [None, width])
    scores_rf = sch.rfactor(inner, factor_axis=4)

    # one task per (batch, query, head) row of the output; every stage moves under it
    row = sch.fuse(*row_loops)
    sch.parallel(row)
    vectorize_loop(sch, sch.get_loops(out)[-1], lanes)
    for blk in (blocks["pv"], blocks["expsum"], blocks["exp"], blocks["rowmax"],
                blocks["scores"], scores_rf):
        sch.compute_at(blk, row, preserve_unit_loops=False)

    # partial scores: keys outer, head-dim chunks next, the lanes innermost in a vector
    lane, j, k_o = sch.get_loops(scores_rf)[-3:]  # the rf block's loops: (lane, key, chunk)
    sch.reorder(j, k_o, lane)
    sch.vectorize(lane)  # before the init is split off, as TVM requires
    sch.decompose_reduction(scores_rf, k_o)
    # exponentials: a vector loop over the keys (symbolic: LLVM vectorizes the serial loop)
    vectorize_loop(sch, sch.get_loops(blocks["exp"])[-1], lanes)
    # values: keys outer, the head dim in vector registers
    *_, e, r = sch.get_loops(blocks["pv"])
    sch.reorder(r, e)
    vectorize_loop(sch, e, lanes)
    sch.decompose_reduction(blocks["pv"], r)
    return sch
