"""The rows family: norms, softmax and other reductions of a few axes, with their fused
producers and epilogue.

- :func:`schedule_rows`: the leading axes shared by every block are rows, split across the
  cores, every pass over a row while it is in cache, reductions as vector partial sums
  (:mod:`._rfactor`); side outputs of a multi-output op as nests of their own;
- :func:`schedule_whole`: a reduction over the whole tensor (no row axis, one core);
- :func:`schedule_columns`: a reduction over outer axes (channels-last mean, global average
  pooling) with output columns in vectors;
- :func:`group_norm_schedule`: group norm by layout (NCHW as rows of groups,
  :func:`schedule_channels_last_groups` for NHWC).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.ir import StringImm
from tvm.target import Target
from tvm_ffi.structural import structural_mutate

from ..targets import target_arch
from . import _stream
from ._core import (
    MAX_FUSE,
    BlockInfo,
    _at,
    _dtype_bits,
    _fuse,
    _is_one,
    _loops_by_kind,
    _prod,
    _realize,
    _same,
    _static_prod,
    analyze,
    extent_of,
    vector_lanes,
    vectorize_loop,
)
from ._fallback import _fallback_block
from ._gemm import index_vars
from ._rfactor import (
    RFactor,
    pick_width,
    restore_predicate,
    rfactor_reduction,
    vectorize_rfactor,
)

__all__ = [
    "group_norm_schedule",
    "rolled_partial_sums",
    "schedule_channels_last_groups",
    "schedule_columns",
    "schedule_rows",
    "schedule_whole",
]


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
        if not _reduces_innermost(sch, blocks[-1]):
            # Over a middle axis (ResNeSt's sum over its 2 radix splits of (1, 2, 128, 56,
            # 56)): each output is a short strided sum, and the rows' partial-sum tree over
            # it ran at 1 % of the roof (3.2 ms); vectors along the contiguous output axis,
            # the reduction outside them (the columns or the catch-all rule) take 0.06 ms.
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
    # 1b. Only middle-axis reductions (softmax over NCHW's channels): the columns after the
    # reduced axes become rows too, the innermost in tiles, so there is work for every core
    # and a tile's passes stay in L1.
    columns = None
    if middle and not rfs and not side and split_out is None:
        columns = _column_rows(sch, out, rows, [b for b in blocks if b.name in middle],
                               lanes32)
        if columns is not None:
            rows = columns
    # 2. Rows: fused, parallel; every producer computed inside the row loop.
    loops = sch.get_loops(out.rv)
    inner_loops = loops[rows:]
    dtypes = {str(sch.get(lp).loop_var.ty) for lp in loops[:rows]}

    stream = None
    if len(dtypes) == 1:
        row = _fuse(sch, loops[:rows])
        sch.parallel(row)
        # A DRAM-sized float32 output is written with streaming stores (whole rows of full
        # vectors); not with side outputs.
        row_elems = _static_prod(out_ext[rows:])
        if columns is None and not side and row_elems and row_elems % lanes32 == 0 \
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
            restore_predicate(sch, info)
        vectorize_rfactor(sch, info)
    # 4. Middle-axis reductions: reduction loops outside, the inner spatial axes vectorized.
    for name in middle:
        _vectorize_inner_spatial(sch, sch.get_sblock(name), lanes32,
                                 tiled=columns is not None)
    # 5. Injective producers with inner axes (e.g. a middle-axis mean) and the output.
    merged = {info.producer for info in rfs}
    for b in blocks[:-1]:
        if b.is_reduction or b.name in merged:
            continue
        rv = sch.get_sblock(b.name)
        below = sch.get_loops(rv)[1:]
        real = _nested_suffix(sch, [lp for lp in below if extent_of(sch, lp) != 1])
        lanes = vector_lanes(target, _dtype_bits(sch, rv))
        if real and columns is not None:
            real = _aligned_suffix(sch, real, lanes)
        if real:
            vectorize_loop(sch, _fuse(sch, real), lanes)
    out_rv = sch.get_sblock(out.name)
    if columns is not None and inner_loops:
        inner_loops = _aligned_suffix(sch, inner_loops, vector_lanes(target,
                                                                     _dtype_bits(sch, out_rv)))
    inner = _fuse(sch, inner_loops[-MAX_FUSE:]) if inner_loops else None
    if inner is not None:
        vec = vectorize_loop(sch, inner, vector_lanes(target, _dtype_bits(sch, out_rv)))
        if stream and vec is not None:
            return _stream.stream_stores(sch, out_rv, vec, stream, row, 4 * row_elems)
    if scratch is not None:
        return _scratch_in_output(sch, *scratch)
    return sch


# Up to this many bytes of input + output, a producer is merged into the partial sums that
# read it (see _merge_producer). Measured on a 2-core Xeon VM, softmax, merged / separate:
# 4096x768 (12.6 MB) and 2048x1024 (16 MB) 5-9 % faster with 1 and 2 threads; from 64 MB
# (4096x2048, 16384x1024, 8192x2048) 2-8 % slower with 2 threads, though the merged loop
# holds exactly the separate passes' instructions: there DRAM, not the loop, sets the time.
_MERGE_MAX_BYTES = 32 << 20


def _nested_suffix(sch: s_tir.Schedule, loops: list) -> list:
    """The innermost of ``loops`` that nest directly, each the parent of the next (what
    ``fuse`` takes): a unit loop or a sibling block between two breaks the chain (a
    producer of attention's with a head dim of 1 has one)."""
    out = loops[-1:]
    for lp in reversed(loops[:-1]):
        if not sch.get_sref(out[0]).parent.same_as(sch.get_sref(lp)):
            break
        out.insert(0, lp)
    return out


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


def rolled_partial_sums(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with the trip count of each serial loop that holds only a vectorized partial-
    sum update (an ``*_rf`` block: see :func:`rfactor_reduction`) hidden from LLVM, which then
    keeps the loop instead of unrolling it completely. Loops that also compute (softmax's exp
    merged into its sum) are left alone."""

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


def _vectorize_inner_spatial(sch: s_tir.Schedule, block, lanes: int, *,
                             tiled: bool = False) -> None:
    """A reduction moved under the row loop whose remaining spatial axes are innermost in
    memory (softmax over a middle axis): put its reduction loops outside, vectorize the
    spatial loops inside them, and hoist the init. ``tiled`` (column tiles,
    :func:`_column_rows`): the loops are found by the vars their bindings use (a tile's
    is ``tile * 210 + ax``), and fused only where whole vectors stay within the innermost
    axis."""
    spatial, red = _loops_by_kind(sch, block, by_use=tiled)
    spatial = [lp for lp in spatial if extent_of(sch, lp) != 1]
    if not spatial or not red:
        return
    sch.reorder(*red, *spatial)
    # a unit loop left between two spatial ones breaks the chain fuse takes (attention with
    # a head dim of 1 and one key: (1, 16, 2, 1) BSHD)
    spatial = _nested_suffix(sch, spatial)
    if tiled:
        spatial = _aligned_suffix(sch, spatial, lanes)
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
    # (a non-multiple inner extent, a column tile of 210, stays a serial loop of contiguous
    # elements for LLVM's loop vectorizer: TVM cannot vectorize a partitioned reduction's
    # block copies, and would scalarize a predicated vector loop)
    sch.decompose_reduction(block, red[0])


def _aligned_suffix(sch: s_tir.Schedule, loops: list, lanes: int) -> list:
    """The innermost of ``loops`` with each outer one whose inner extents are whole vectors:
    fusing past an axis of 2100 would let a 16-lane vector cross from one row of it into the
    next, a gather instead of a load."""
    out = loops[-1:]
    inner = extent_of(sch, loops[-1]) if loops else None
    for lp in reversed(loops[:-1]):
        ext = extent_of(sch, lp)
        if inner is None or ext is None or inner % lanes:
            break
        out.insert(0, lp)
        inner *= ext
    return out


#: A column tile of a middle-axis reduction (``_column_rows``) holds at most this many
#: elements of the innermost axis: with 16 reduced values a tile's passes then stay in L1.
_COLUMN_TILE = 256


def _column_rows(sch: s_tir.Schedule, out: BlockInfo, rows: int, middle: list[BlockInfo],
                 lanes: int) -> int | None:
    """Reorder the output's loops so its trailing column axes (those after the reduced
    axes, which every reduction keeps) lead, the innermost split into tiles: the new row
    count, or None when the reductions do not keep the same trailing columns.

    Softmax over axis 1 of (1, 16, 4, 2100) had one row on one core, and its vectors of the
    fused (4, 2100) loop crossed rows of 2100 (gathers): 0.29-0.41 ms. Its rows are now
    (1, 4, 10 tiles of 210), each a (16, 210) block whose passes vectorize along the tile."""
    n_cols = {b.n_spatial - rows for b in middle}
    n = len(out.extents)
    if len(n_cols) != 1:
        return None
    c = n_cols.pop()
    if c < 1 or rows + c >= n:
        return None
    for b in middle:
        if not all(_same(x, y) for x, y in zip(b.extents[rows:b.n_spatial], out.extents[n - c:])):
            return None
    w = out.extents[-1]
    if not isinstance(w, tirx.IntImm):
        return None
    w = int(w.value)
    tile = w
    if w > _COLUMN_TILE:
        fits = [d for d in range(lanes, _COLUMN_TILE + 1) if w % d == 0]
        tile = max(fits, default=w)
    loops = sch.get_loops(out.rv)
    mid, cols = loops[rows:n - c], loops[n - c:]
    lead = list(cols[:-1])
    if tile < w:
        o, t = sch.split(cols[-1], [None, tile])
        lead.append(o)
    else:
        t = cols[-1]
    sch.reorder(*lead, *mid, t)
    return rows + len(lead)


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


def _dividing_width(k: int, lanes: int, accumulators: int) -> int | None:
    """The widest partial-sum width (``lanes x accumulators`` down to 4) that divides ``k``;
    ``k`` itself when it fits one vector group."""
    if k <= lanes * accumulators:
        return k if k >= 4 else None
    widths = [lanes * accumulators, lanes, lanes // 2, lanes // 4]
    return next((w for w in widths if w >= 4 and k % w == 0), None)


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
    >>> from opsdk.schedules._rows import schedule_columns
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
    # Every input read walks its innermost axis with the innermost output column, or does
    # not vary along the columns at all (a per-channel factor broadcast over H and W:
    # ResNeSt's radix attention, (1, 2, C, 1, 1) against (1, 2, C, H, W)).
    for r in blk.reads:
        if r.source.same_as(out):
            continue
        dims = [rg for rg, n in zip(r.region, r.source.shape) if not _is_one(n)]
        if not dims:
            continue
        last = dims[-1]
        if isinstance(last.extent, tirx.IntImm) and int(last.extent) == 1 \
                and last.min.same_as(col):
            continue
        if any(col in index_vars(rg.min) for rg in r.region):
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
        if len(chans) not in (1, 2) or len(red) != 2:
            return None
        if len(chans) == 2:
            rc_l, g_l = chans  # block iter order (rc, n, g); channels in memory: (g, rc)
            sch.reorder(*red, g_l, rc_l)
            ch = sch.fuse(g_l, rc_l)
        else:  # one group (PoolFormer's GroupNorm(1, C)), or one channel per group
            (ch,) = chans
            sch.reorder(*red, ch)
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


def group_norm_schedule(
    func: tirx.PrimFunc, target: Target, accumulators: int
) -> s_tir.Schedule | None:
    """Group norm by layout (the x86 and NEON group-norm rules): NCHW as :func:`schedule_rows`
    of (sample, group), NHWC as :func:`schedule_channels_last_groups`; picked from the block
    shapes."""
    sch = s_tir.Schedule(func)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    if sorted(names) == ["group_norm", "mean", "mean_c", "rstd", "scale_c", "sqsum", "sum"]:
        return schedule_channels_last_groups(func, target, accumulators=accumulators)
    if names != ["sum", "mean", "sqsum", "rstd", "group_norm"]:
        return None
    stats = sch.get(sch.get_sblock("sum"))
    out = sch.get(sch.get_sblock("group_norm"))
    groups = stats.iter_vars[1].dom.extent
    ext = [iv.dom.extent for iv in out.iter_vars]
    if not all(isinstance(e, tirx.IntImm) for e in (groups, *ext[1:])):
        return None
    g = int(groups.value)
    # NCHW: the channel axis (1) of the output splits into (group, channel-in-group).
    c_nchw = int(ext[1].value)
    red = [int(iv.dom.extent.value) for iv in stats.iter_vars[2:]]
    if red[0] * g == c_nchw and red[1:] == [int(ext[2].value), int(ext[3].value)]:
        return schedule_rows(func, target, accumulators=accumulators, split_out=(1, c_nchw // g))
    return None
