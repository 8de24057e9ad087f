"""The elementwise family: injective kernels (elementwise, broadcast, transpose, concatenate,
cast) with their producers inlined, rows across the cores and the contiguous inner loops in
vectors (a concatenate as one vector loop per input; a DRAM-sized float32 output with
streaming stores, :mod:`._stream`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import tvm
from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.sym import Analyzer
from tvm.target import Target

from ._core import (
    MAX_FUSE,
    _dtype_bits,
    _fuse,
    _is_one,
    _pow2_pieces,
    _realize,
    analyze,
    extent_of,
    vector_lanes,
    vectorize_loop,
)
from ._stream import stream_lanes, stream_stores

__all__ = [
    "schedule_elementwise",
    "vectorize_segments",
]


def _is_scalar_read(r) -> bool:
    """A read of one fixed element (``scale[0]``: a per-tensor parameter), the same for every
    output element: it does not tie the loops to the output's axes."""
    return all(isinstance(rg.min, tirx.IntImm) and _is_one(rg.extent) for rg in r.region)


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


def _same_dim(a, b) -> bool:
    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return int(a.value) == int(b.value)
    return a.same_as(b)


def _contiguous_depth(sch: s_tir.Schedule, rv) -> int:
    """How many trailing output axes fuse into one contiguous run in every read: one more
    than the trailing dims each read's buffer shares with the output. A read indexed as the
    output but of a wider buffer (the first part of a split: 72 of 96 channels) is
    contiguous along its innermost axis only; fused with the pixel axis, each vector would
    gather across two pixels' rows."""
    blk = sch.get(rv)
    shape = list(blk.writes[0].source.shape)
    depth = len(shape)
    for rd in blk.reads:
        if _is_scalar_read(rd):
            continue
        src = list(rd.source.shape)
        same = 0
        while same < min(len(src), len(shape)) - 1 and _same_dim(src[-1 - same],
                                                                 shape[-1 - same]):
            same += 1
        depth = min(depth, same + 1)
    return depth


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
    kept = []
    for b in blocks:
        if b.name in outs:
            continue
        if len(sch.get_consumers(b.rv)) > 1 and _has_math(sch.get(b.rv).body):
            kept.append(b.name)  # inlined, its math would run once per consumer
            continue
        sch.compute_inline(b.rv)
    if kept:
        # A recurrence fused whole (h = tanh(h * a + x_t), stacked): each step inlined into
        # the next and into the stack ran its math once per later step, and the nested
        # polynomials kept LLVM busy for minutes at three steps. Each kept step is a loop
        # nest of its own, in order; the outputs read them from memory.
        for name in [*kept, *outs]:
            _elementwise_nest(sch, sch.get_sblock(name), target, stream_ok=False)
        return sch
    if len(outs) > 1:
        merged = _split_along_last_axis(sch.mod["main"], outs, target)
        if merged is not None:
            return merged
        # Several outputs (a split): each output its own parallel, vectorized loop nest over
        # the inlined producers (no streaming stores: they rebuild the function).
        for name in outs:
            _elementwise_nest(sch, sch.get_sblock(name), target, stream_ok=False)
        return sch
    return _elementwise_nest(sch, blocks[-1].rv, target, stream_ok=True)


def _has_math(stmt: tirx.Stmt) -> bool:
    """Whether a block's store computes something costly: a call (an intrinsic) or a
    ``Let`` (opsdk's polynomial math binds its intermediates), anywhere in its value."""
    stack, seen = [getattr(stmt, "value", None)], set()
    while stack:
        e = stack.pop()
        if e is None or isinstance(e, (tirx.IntImm, tirx.FloatImm, tirx.Var)) or \
                e.__chandle__() in seen:  # a node shared by several parents: walked once
            continue
        seen.add(e.__chandle__())
        if isinstance(e, (tirx.Let, Call)):
            return True
        if isinstance(e, TensorLoad):
            continue
        stack.extend(getattr(e, f, None) for f in
                     ("a", "b", "value", "condition", "true_value", "false_value"))
    return False


def _split_along_last_axis(func: tirx.PrimFunc, outs: Sequence[str], target: Target
                           ) -> s_tir.Schedule | None:
    """Outputs that differ in their innermost axis only (a split along it: InceptionNeXt's
    72 + 8 + 8 + 8 channels): one parallel loop over the shared outer positions, each
    output's piece of the row vectorized inside it, so the input is read in one pass (a
    loop nest per output read it once per output, 8 channels of each 96-channel row at a
    time). ``func``: the producers inlined already. None when the outputs' outer dims
    differ or TVM refuses the merge (``func`` is left as it was for the other path)."""
    sch = s_tir.Schedule(func)
    blocks = [sch.get_sblock(n) for n in outs]
    shapes = [list(sch.get(b).writes[0].source.shape) for b in blocks]
    if len({len(sh) for sh in shapes}) != 1 or len(shapes[0]) < 2:
        return None
    if not all(_same_dim(a, b) for sh in shapes[1:] for a, b in zip(sh[:-1], shapes[0][:-1])):
        return None
    if any(not isinstance(sh[-1], tirx.IntImm) for sh in shapes) or \
            any(not isinstance(d, tirx.IntImm) for d in shapes[0][:-1]):
        return None
    if not all(_contiguous_along(sch, b, sch.get_loops(b)[-1]) for b in blocks):
        return None  # a transposing read: each output through the transpose paths
    lanes = vector_lanes(target, _dtype_bits(sch, blocks[0]))
    try:
        outer = [_fuse(sch, sch.get_loops(b)[:-1]) for b in blocks]
        row = sch.merge(*outer)
    except Exception:  # blocks TVM will not merge: one nest per output instead
        return None
    sch.parallel(row)
    for b in blocks:
        vectorize_loop(sch, sch.get_loops(b)[-1], lanes)
    return sch


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
    n_inner = min(n_inner, MAX_FUSE if aligned else 1, _contiguous_depth(sch, last))
    cuts = _select_cuts(sch, last, loops[-1]) if n_inner == 1 else []
    whole = bool(cuts) and all(c % lanes == 0
                               for c in [*cuts, extent_of(sch, loops[-1]) or 1])
    if cuts and len(loops) > 1 and (whole or _contiguous_along(sch, last, loops[-1])):
        # A concatenate along the innermost axis selects its input by index: one vector
        # loop per input range (the select folds away in each), not a select per lane;
        # ranges of any width when each input is read contiguously (InceptionNeXt's
        # 72 + 8 + 8 + 8 channels; a transposed concat goes through a tile below).
        sch.parallel(_fuse(sch, loops[:-1]))
        if whole:
            vectorize_segments(sch, loops[-1], lanes, cuts)
        else:
            vectorize_ranges(sch, loops[-1], lanes, cuts)
        return sch
    if not aligned and n_inner == 1 and len(loops) >= 2 \
            and _transpose_through_tile(sch, last, loops, lanes):
        return sch
    if not aligned and n_inner == 1 and len(loops) >= 2 \
            and _blocked_transpose(sch, last, loops, lanes):
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


#: Positions per L1 tile of :func:`_transpose_through_tile`: the divisor of the axis nearest
#: this (20 positions x 16 channels: 166 us against 209-290 us for 16, 28, 84 or 100).
_TILE_POSITIONS = 20


def _transpose_through_tile(sch: s_tir.Schedule, last, loops: Sequence, lanes: int) -> bool:
    """A reshaping transpose (channels-last scales flattened and transposed to (C, H * W),
    YOLOv8's head): the output's innermost index reaches the read through div / mod, so each
    lane of a vector along it is a gather with its own index arithmetic (540 us for the
    head's 302400 elements). When the read is contiguous along the next output loop instead
    (whole vectors of it), the block computes tiles of positions x channels into a local
    buffer laid out position-major, vectors along the input's channels, and a copy writes
    them out along the positions: the transpose in L1 (166 us). False (nothing changed)
    otherwise."""
    inner, outer = loops[-1], loops[-2]
    ext_s, ext_c = extent_of(sch, inner), extent_of(sch, outer)
    if not ext_s or not ext_c or ext_c % lanes or ext_s < 2 * _TILE_POSITIONS:
        return False
    var, cvar = _bound_var(sch, last, inner), _bound_var(sch, last, outer)
    blk = sch.get(last)
    reads = [r for r in blk.reads if not _is_scalar_read(r)]
    if var is None or cvar is None or not reads:
        return False
    # every read walks its innermost axis with the channel loop (the reshapes leave it as
    # ``(s // 1600 + c) % 144``: the same element steps, which the analyzer cannot prove),
    # and reaches the positions through div / mod
    if not all(any(v.same_as(cvar) for v in tirx.analysis.undefined_vars(r.region[-1].min))
               for r in reads):
        return False
    if not any(_under_div_mod(rg.min, var) for r in reads for rg in r.region):
        return False
    tile = min((d for d in range(8, 4 * _TILE_POSITIONS) if ext_s % d == 0),
               key=lambda d: abs(d - _TILE_POSITIONS), default=None)
    if tile is None:
        return False
    so, si = sch.split(inner, [None, tile])
    co, ci = sch.split(outer, [None, lanes])
    rest = list(loops[:-2])
    sch.reorder(*rest, so, co, si, ci)
    sch.parallel(_fuse(sch, [*rest, so]))
    loc = sch.cache_write(last, 0, "local")
    sch.reverse_compute_at(loc, co)
    sch.transform_layout(last, ("write", 0), lambda *idx: (*idx[:-2], idx[-1], idx[-2]))
    sch.vectorize(ci)
    sch.vectorize(sch.get_loops(loc)[-1])
    return True


def _blocked_transpose(sch: s_tir.Schedule, last, loops: Sequence, lanes: int) -> bool:
    """A transpose whose input is contiguous along another output axis than the output's
    innermost (NCHW <-> NHWC): vectors along the output's innermost axis gather one element
    per input row, and the rows of one vector are ``H * W`` elements apart, so at 48
    channels they share a cache set and evict each other (NCHW -> NHWC of (48, 64, 64),
    259 us, 6 GB/s). Instead both axes are cut into ``lanes``-wide tiles; each tile is read
    in vectors along the input's contiguous axis into a local buffer laid out that way, and
    written out in vectors along the output's innermost axis (its reads of the tile stay in
    L1): 30-37 us. Both axes must be whole multiples of ``lanes`` and every read of the
    block transposed alike; False (nothing changed) otherwise."""
    inner = loops[-1]
    alt = _input_contiguous_loop(sch, last, loops)
    if alt is None or alt == inner:
        return False
    ext_i, ext_a = extent_of(sch, inner), extent_of(sch, alt)
    if not ext_i or not ext_a or ext_i % lanes or ext_a % lanes:
        return False
    avar, ivar = _bound_var(sch, last, alt), _bound_var(sch, last, inner)
    blk = sch.get(last)
    widx = [r.min for r in blk.writes[0].region]
    axis = next((k for k, e in enumerate(widx) if avar is not None and e.same_as(avar)), None)
    if axis is None or ivar is None or not widx[-1].same_as(ivar):
        return False
    if not all(r.region[-1].min.same_as(avar) for r in blk.reads if not _is_scalar_read(r)):
        return False
    ao, ai = sch.split(alt, [None, lanes])
    io, ii = sch.split(inner, [None, lanes])
    rest = [lp for lp in loops if lp not in (alt, inner)]
    sch.reorder(*rest, ao, io, ai, ii)
    sch.parallel(_fuse(sch, [*rest, ao]))
    loc = sch.cache_write(last, 0, "local")
    sch.reverse_compute_at(loc, io)

    def input_order(*idx):  # the tile laid out with the input's contiguous axis last
        idx = list(idx)
        idx[axis], idx[-1] = idx[-1], idx[axis]
        return tuple(idx)

    sch.transform_layout(last, ("write", 0), input_order)
    sch.reorder(ii, ai)
    sch.vectorize(ai)
    sch.vectorize(sch.get_loops(loc)[-1])
    return True


def _bound_var(sch: s_tir.Schedule, rv, loop):
    """The block iter var bound to ``loop`` alone, or None."""
    var = sch.get(loop).loop_var
    blk = sch.get(rv)
    return next((iv.var for iv, v in zip(blk.iter_vars, _realize(sch, rv).iter_values)
                 if v.same_as(var)), None)


def _contiguous_along(sch: s_tir.Schedule, rv, loop) -> bool:
    """Whether every read of the block indexes its innermost axis with ``loop``'s variable
    (plus a constant) and no other axis with it: each input range is a contiguous run (a
    concatenate along the channels), not a gather (a detector head's concat transposed)."""
    v = _bound_var(sch, rv, loop)
    if v is None:
        return False
    analyzer = Analyzer()
    blk = sch.get(rv)
    for iv in blk.iter_vars:  # an inlined reshape's div / mod fold within the ranges
        analyzer.bind(iv.var, iv.dom)
    for rd in blk.reads:
        if _is_scalar_read(rd):
            continue
        *outer, inner = [analyzer.simplify(r.min) for r in rd.region]
        if any(_uses(e, v) for e in outer):
            return False
        if _uses(analyzer.simplify(inner - v), v):  # not v plus something without v
            return False
    return True


def _uses(e, v) -> bool:
    return any(x.same_as(v) for x in tirx.analysis.undefined_vars(e))


def _under_div_mod(e, var) -> bool:
    """Whether ``var`` appears inside a floordiv / floormod of expression ``e``."""
    if isinstance(e, (tirx.FloorDiv, tirx.FloorMod)):
        return any(v.same_as(var) for v in tirx.analysis.undefined_vars(e))
    return any(_under_div_mod(sub, var) for sub in _children(e))


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


def vectorize_ranges(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, lanes: int,
                     cuts: Sequence[int]) -> None:
    """Vectorize a static loop cut at ``cuts`` (offsets of any value): each range as whole
    ``lanes`` vectors and a tail of power-of-two vectors, all the pieces made by one
    ``loop_partition`` of the loop (TVM 0.27 mis-sizes a partition of a loop that does not
    start at 0, and splits none: so no piece is partitioned again, and only the one at 0 is
    split into vectors; a later range's vectors are pieces of their own)."""
    ext = extent_of(sch, loop)
    assert ext is not None
    bounds = [0, *cuts, ext]
    pieces: list[int] = []
    for a, b in itertools.pairwise(bounds):
        n = b - a
        main = n - n % lanes
        whole = [main] if a == 0 or main == lanes else [lanes] * (main // lanes)
        pieces += (whole if main else []) + _pow2_pieces(n - main)
    parts = sch.loop_partition(loop, pieces[:-1]) if len(pieces) > 1 else [loop]
    for part, n in zip(parts, pieces):
        if n > lanes:
            _, vec = sch.split(part, [None, lanes])
            sch.vectorize(vec)
        elif n > 1:
            sch.vectorize(part)


def _select_cuts(sch: s_tir.Schedule, rv, loop: s_tir.schedule.LoopRV) -> list[int]:
    """Where an ``if_then_else`` of the block (a concatenate) switches on the index bound
    to ``loop`` alone: the constant offsets inside the loop's static range, sorted."""
    ext = extent_of(sch, loop)
    blk = sch.get(rv)
    v = _bound_var(sch, rv, loop)
    if ext is None or v is None:
        return []
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
