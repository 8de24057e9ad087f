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
task is a block of 8 query rows of one head (the compute pads the query rows of its inner
stages to a multiple of 8, ``attention.QUERY_PAD``, so no block is ragged: a row predicate
inside the tile loops kept LLVM from holding those rows' accumulators in registers, 2x
slower at 128 tokens), and every stage is a small GEMM-like tile loop over that block, like
:mod:`._gemm`'s matmul. K is transposed once per key head (``kt``, its own parallel pass:
``D x m`` with the keys contiguous, padded to 16), so the scores tile is 8 rows x 16 keys of
accumulators in registers, each step one vector load of ``kt`` and 8 broadcast FMAs; the
row max and the exponentials' sum are vector partial reductions (rfactor) over the block's
score rows, the exponentials one vector pass; ``P V`` is 8 rows x 2 vectors of the head dim
in registers per chunk, keys outer (one value row load feeds 8 FMAs per vector). K and V
are read once per block of 8 queries instead of once per query row.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from ..ops.attention import QUERY_PAD
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
    # the query count: the output axis that is not the heads (pv is (B, H, rows, D))
    heads = extent_of(sch, sch.get_loops(blocks["pv"])[1])
    a1, a2 = (extent_of(sch, lp) for lp in loops[1:3])
    n = a2 if a1 == heads else a1
    if n is None or n >= MANY_QUERIES:
        return _many_queries(sch, blocks, target, d)
    if len({str(sch.get(lp).loop_var.ty.dtype) for lp in loops[:-1]}) > 1:
        return None  # mixed int32 / int64 indices: the fused row's bindings are not affine
    return _decode(sch, blocks, target, d)


def _decode(sch: s_tir.Schedule, blocks: dict, target: Target, d: int) -> s_tir.Schedule | None:
    lanes = vector_lanes(target)
    # the scores' partial sums: at least two chunks of the head dim (one chunk leaves a unit
    # loop that compute_at drops, and the loop nest below would not be the one it expects):
    # a 16-wide head on AVX-512 takes 8-lane vectors
    width = next((w for w in (lanes, lanes // 2, 4) if w >= 4 and d % w == 0 and d // w >= 2),
                 None)
    if width is None:
        return None  # a head dim of 4: the generic lowering
    if extent_of(sch, sch.get_loops(blocks["pv"])[-1]) == 1:
        # one static key: compute_at drops P V's unit key loop and the loop nest below is
        # not the one it expects (a decode step's cache length is symbolic, never this)
        return None
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
    # values: keys outer, the head dim in vector registers, by a width that divides it (a
    # partitioned tail would replace the block that decompose_reduction names: found by
    # verify with a head dim of 1000)
    *_, e, r = sch.get_loops(blocks["pv"])
    sch.reorder(r, e)
    vectorize_loop(sch, e, lanes if d % lanes == 0 else width)
    sch.decompose_reduction(blocks["pv"], r)
    # the output row last: a head dim that is not a multiple of the lanes is partitioned
    # into blocks that compute_at does not see as the consumer (it put the producers after
    # them: found by verify with a head dim of 1000)
    vectorize_loop(sch, sch.get_loops(out)[-1], lanes)
    return sch


def _rfactor_lanes(sch: s_tir.Schedule, block, lanes: int):
    """Split ``block``'s reduction over the (padded) keys by ``lanes`` and rfactor the lanes:
    (the partial-reduction block, the final block)."""
    red = sch.get_loops(block)[-1]
    _, lane = sch.split(red, [None, lanes])
    return sch.rfactor(lane, factor_axis=3)


def _unit_reduction(sch: s_tir.Schedule, block) -> bool:
    """Whether every reduction axis of ``block`` has a static extent of 1 (one key, one key
    chunk): ``compute_at`` without unit loops then leaves it no loop."""
    ivs = [iv for iv in sch.get(block).iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    return bool(ivs) and all(isinstance(iv.dom.extent, tirx.IntImm) and
                             int(iv.dom.extent) == 1 for iv in ivs)


def _many_queries(sch: s_tir.Schedule, blocks: dict, target: Target,
                  d: int) -> s_tir.Schedule | None:
    lanes = vector_lanes(target)
    w = lanes if d % lanes == 0 else 4
    if _KEY_TILE % w:
        return None
    rows = QUERY_PAD                       # a block: the compute's padding, never ragged
    vd = 2 if (d // w) % 2 == 0 else 1     # head-dim vectors per P V tile row (16 acc.)
    kv = min(_KEY_TILE // w, 2)            # key vectors per score tile row (8 or 16 acc.)
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
    pv = blocks["pv"]
    pv_w = sch.cache_write(pv, 0, "local")
    sc_w = sch.cache_write(blocks["scores"], 0, "local")

    # the task: a block of query rows of one head (the scores' loops, whole blocks of the
    # padded rows); every later stage is moved under it in order
    sc = blocks["scores"]
    sb, sh, si, j, rd = sch.get_loops(sc)
    io, ii = sch.split(si, [None, rows])
    # (a symbolic query count with static batch and heads has int32 and int64 loops, which
    # do not fuse: then the heads are the tasks)
    outer = [sb, sh, io]
    while len({str(sch.get(lp).loop_var.ty.dtype) for lp in outer}) > 1:
        outer.pop()
    par = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(par)
    task = par if len(outer) == 3 else io
    # scores: per tile of keys, rows x tile accumulators; head dim outer
    jo, jv, jl = sch.split(j, [None, kv, w])
    sch.reorder(jo, rd, ii, jv, jl)
    sch.reverse_compute_at(sc_w, jo, preserve_unit_loops=False)
    _unrolled_tile(sch, sc_w, w)
    sch.unroll(ii)
    sch.unroll(jv)
    sch.vectorize(jl)
    sch.decompose_reduction(sc, rd)
    for blk in (mx_rf, blocks["rowmax"], blocks["exp"], sum_rf, blocks["expsum"], pv):
        sch.reverse_compute_at(blk, task, preserve_unit_loops=False)
    # P V: per chunk of head-dim vectors, rows x chunk accumulators; keys outer
    if _unit_reduction(sch, pv):  # one key: its unit loop was dropped (found by verify)
        ii, e = sch.get_loops(pv)[-2:]
        rv = None
    else:
        ii, e, rv = sch.get_loops(pv)[-3:]
    ec, ev, el = sch.split(e, [None, vd, w])
    sch.reorder(ec, *([rv] if rv is not None else []), ii, ev, el)
    sch.reverse_compute_at(pv_w, ec, preserve_unit_loops=False)
    _unrolled_tile(sch, pv_w, w)
    sch.unroll(ii)
    sch.unroll(ev)
    sch.vectorize(el)
    sch.decompose_reduction(pv, rv if rv is not None else ii)
    sch.reverse_compute_at(blocks["attention"], task, preserve_unit_loops=False)

    # row max and exp sum: vector partial reductions per row, then the lanes. (With a
    # symbolic key count TVM cannot prove the lane loop whole (``(mp - 1) % 16 + 1``): it
    # stays serial, for LLVM's loop vectorizer.)
    for rf in (mx_rf, sum_rf):
        if _unit_reduction(sch, rf):  # one key chunk: its unit loop was dropped
            lane, ii = sch.get_loops(rf)[-2:]
            sch.reorder(ii, lane)
            r = ii
        else:
            lane, ii, r = sch.get_loops(rf)[-3:]  # after compute_at: (lane, row, key chunk)
            sch.reorder(ii, r, lane)
        if extent_of(sch, lane) == w:
            sch.vectorize(lane)
        sch.decompose_reduction(rf, r)
    # exponentials: whole vectors over the padded keys
    vectorize_loop(sch, sch.get_loops(blocks["exp"])[-1], w)
    # the normalized output rows (the block's real ones)
    vectorize_loop(sch, sch.get_loops(blocks["attention"])[-1], lanes)
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
