"""Fused attention (``opsdk.attention``): two schedules, picked by the query count.

**Decode** (fewer than :data:`MANY_QUERIES` static queries): one query row of one head per
task. A task is a (batch, query, head) triple, spread over the cores. Under it, all stages
run on that row while it is in cache: the ``m`` scores (dot products over the head dim, in
vector partial sums, :func:`~tvm.s_tir.Schedule.rfactor` by the vector width, K read in
place), their max, the exponentials (vectorized, opsdk's polynomial exp), their sum, and the
weighted sum of the value rows with the head dim in vector registers (keys outer, so each
value row is one contiguous read). Scores and exponentials are a row buffer of ``m`` floats:
no ``n x m`` matrix is written. The key count ``m`` may be symbolic (a KV cache of any length).

**Many queries** (an encoder's or a prefill's ``n x m``; ``n`` static >= 16 or symbolic): a
task is a block of ``R`` query rows of one head, and every stage is a small GEMM-like tile
loop over that block, like :mod:`._gemm`'s matmul. K is transposed once per key head
(``kt``, its own parallel pass: ``D x m`` with the keys contiguous), so the scores tile is
``R`` rows x 16 keys of accumulators in registers, each step one vector load of ``kt`` and
``R`` broadcast FMAs; the row max and the exponentials' sum are vector partial reductions
(rfactor) over the block's score rows, the exponentials one vector pass; ``P V`` is ``R``
rows x up to 4 vectors of the head dim in registers, keys outer (one value row load feeds
``R`` FMAs per vector). K and V are read once per block instead of once per query row.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from ._core import extent_of, vector_lanes, vectorize_loop

__all__ = ["MANY_QUERIES", "schedule_attention"]

_STAGES = ("kt", "scores", "rowmax", "exp", "expsum", "pv", "attention")

#: Fewest static queries the many-query schedule takes (fewer: the decode schedule).
MANY_QUERIES = 16
#: Vector accumulators a register tile uses at most (of 32 on AVX-512 and NEON).
_TILE_REGS = 24
#: Keys per score tile: the op's key padding (``attention.KEY_PAD``).
_KEY_TILE = 16


def schedule_attention(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The decode or the many-query schedule above, or None for a function that is not
    ``opsdk.attention``'s compute (its named blocks) or whose head dim is symbolic or not a
    multiple of 4."""
    sch = s_tir.Schedule(func)
    try:
        blocks = {name: sch.get_sblock(name) for name in _STAGES}
    except Exception:  # another function (fused into, or a plug-in's)
        return None
    if len(sch.get_child_blocks(sch.get_sblock("root"))) != len(_STAGES):
        return None  # something fused around it: not this rule's shape
    loops = sch.get_loops(blocks["attention"])
    d = extent_of(sch, loops[-1])
    if d is None or d % 4:
        return None
    n = extent_of(sch, sch.get_loops(blocks["rowmax"])[2])
    if n is None or n >= MANY_QUERIES:
        return _many_queries(sch, blocks, target, d)
    if len({str(sch.get(lp).loop_var.ty.dtype) for lp in loops[:-1]}) > 1:
        return None  # mixed int32 / int64 indices: the fused row's bindings are not affine
    return _decode(sch, blocks, target, d)


def _decode(sch: s_tir.Schedule, blocks: dict, target: Target, d: int) -> s_tir.Schedule:
    lanes = vector_lanes(target)
    width = lanes if d % lanes == 0 else 4
    sch.compute_inline(blocks["kt"])  # K read in place
    out = blocks["attention"]
    row_loops = sch.get_loops(out)[:-1]
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


def _rfactor_lanes(sch: s_tir.Schedule, block, lanes: int):
    """Split ``block``'s reduction over the (padded) keys by ``lanes`` and rfactor the lanes:
    (the partial-reduction block, the final block)."""
    red = sch.get_loops(block)[-1]
    _, lane = sch.split(red, [None, lanes])
    return sch.rfactor(lane, factor_axis=3)


def _many_queries(sch: s_tir.Schedule, blocks: dict, target: Target,
                  d: int) -> s_tir.Schedule | None:
    lanes = vector_lanes(target)
    w = lanes if d % lanes == 0 else 4
    if _KEY_TILE % w:
        return None
    vd = min(d // w, 4)           # head-dim vectors per P V tile row
    rows = max(1, min(8, _TILE_REGS // vd, _TILE_REGS // (_KEY_TILE // w)))
    out = blocks["attention"]
    bl, a1, a2, _ = sch.get_loops(out)
    bshd = sch.get(blocks["pv"]).iter_vars[1].dom.extent.same_as(
        sch.get(blocks["rowmax"]).iter_vars[2].dom.extent)
    # K transposed: its own pass per (batch, key head); 16 keys at a time (in L1) across the
    # head dim, each step one gathered vector of 16 keys written contiguously
    kb, kh, ke, kj = sch.get_loops(blocks["kt"])
    sch.parallel(sch.fuse(kb, kh))
    kjo, kji = sch.split(kj, [None, _KEY_TILE])
    sch.reorder(kjo, ke, kji)
    sch.vectorize(kji)

    # partial row max / exp sum: rfactored over the lanes at the root, moved under the task
    mx_rf = _rfactor_lanes(sch, blocks["rowmax"], w)
    sum_rf = _rfactor_lanes(sch, blocks["expsum"], w)
    pv_w = sch.cache_write(blocks["pv"], 0, "local")
    sc_w = sch.cache_write(blocks["scores"], 0, "local")

    il, hl = (a1, a2) if bshd else (a2, a1)
    sch.reorder(bl, hl, il)
    io, _ = sch.split(il, [None, rows])
    # one task per block of query rows of one head (a symbolic query count with static
    # batch and heads has int32 and int64 loops, which do not fuse: the heads are the tasks)
    outer = [bl, hl, io]
    while len({str(sch.get(lp).loop_var.ty.dtype) for lp in outer}) > 1:
        outer.pop()
    par = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(par)
    task = par if len(outer) == 3 else io
    for blk in (pv_w, blocks["pv"], blocks["expsum"], sum_rf, blocks["exp"],
                blocks["rowmax"], mx_rf, sc_w, blocks["scores"]):
        sch.compute_at(blk, task, preserve_unit_loops=False)

    # scores: per 16-key tile, rows x 16 accumulators; head dim outer
    ii, j, rd = sch.get_loops(blocks["scores"])[-3:]
    jo, jv, jl = sch.split(j, [None, _KEY_TILE // w, w])
    sch.reorder(jo, rd, ii, jv, jl)
    sch.reverse_compute_at(sc_w, jo, preserve_unit_loops=False)
    _unrolled_tile(sch, sc_w, w)
    sch.unroll(ii)
    sch.unroll(jv)
    sch.vectorize(jl)
    sch.decompose_reduction(blocks["scores"], rd)

    # row max and exp sum: vector partial reductions per row, then the lanes
    for rf in (mx_rf, sum_rf):
        lane, ii, r = sch.get_loops(rf)[-3:]  # after compute_at: (lane, row, key chunk)
        sch.reorder(ii, r, lane)
        sch.vectorize(lane)
        sch.decompose_reduction(rf, r)
    # exponentials: whole vectors over the padded keys
    _, jl = sch.split(sch.get_loops(blocks["exp"])[-1], [None, w])
    sch.vectorize(jl)

    # P V: per chunk of up to 4 head-dim vectors, rows x chunk accumulators; keys outer
    ii, e, rv = sch.get_loops(blocks["pv"])[-3:]
    ec, ev, el = sch.split(e, [None, vd, w])
    sch.reorder(ec, rv, ii, ev, el)
    sch.reverse_compute_at(pv_w, ec, preserve_unit_loops=False)
    _unrolled_tile(sch, pv_w, w)
    sch.unroll(ii)
    sch.unroll(ev)
    sch.vectorize(el)
    sch.decompose_reduction(blocks["pv"], rv)
    # the normalized output rows
    _, el = sch.split(sch.get_loops(out)[-1], [None, w])
    sch.vectorize(el)
    return sch


def _unrolled_tile(sch: s_tir.Schedule, block, w: int) -> None:
    """A register tile's write-back: vectors of ``w``, the rest unrolled, so every access
    to the tile has a constant index (LLVM keeps it in registers)."""
    *outer, last = sch.get_loops(block)[-2:]
    lo, li = sch.split(last, [None, w])
    sch.vectorize(li)
    sch.unroll(lo)
    for lp in outer:
        sch.unroll(lp)
