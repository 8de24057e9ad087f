"""Matmul kernels (dense, matmul, batch_matmul) with fused epilogues, for CPUs.

A fused PrimFunc from TVM's legalization is matched on its loop and buffer structure, not on
op names: exactly one reduction block ``C[S, I, J] += A[S, I, K] * B[S, J, K]`` (any index
order, optional casts), injective producers (transposes, reshapes) that are inlined into it,
and a chain of elementwise consumers (bias, activation, residual add, scale) that becomes the
tile's write-back. The schedule is the classic register-blocked GEMM:

- ``B`` is read from a packed layout ``[S, N / NR, K, NR]`` so one k step loads ``NR``
  contiguous floats. A constant ``B`` (a weight: the PrimFunc's ``layout_free_buffers``) is
  packed by a separate block annotated ``meta_schedule.layout_rewrite_preproc``, which
  ``relax.transform.SplitLayoutRewritePreproc`` turns into its own function and FoldConstant
  then evaluates at compile time; an activation ``B`` that is not contiguous along ``N``
  (``Q @ K^T``) is packed on every call, an activation contiguous along ``N`` is read in place.
- ``MR x NR`` accumulators stay in vector registers: the reduction block writes a ``local``
  buffer the size of one tile (the ``k`` loop outside the unrolled ``MR`` rows and ``NR / lanes``
  vectors), and the epilogue writes the tile out once, vectorized.
- Tiles divide the extents where possible (``MR`` in ``[1, mr_max]``, ``NR`` a multiple of the
  lanes that divides ``N``, narrower vectors for channel counts like 24). A static ``M`` or
  ``N`` that no tile divides (ViT's 197 tokens) is padded to whole tiles (``pad_einsum``):
  ``A``'s padded rows read its last row again in place (their results are never written),
  ``B``'s columns are zero-padded into its packed layout, so the ``k`` loop has no predicate.
  With ``N`` padded, the tiles are written whole to a padded buffer and the epilogue runs
  over the real columns in its own vectorized pass (TVM scalarizes a vector loop under a
  lane predicate). A symbolic extent keeps a
  predicated last tile (correct, slower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars
from tvm.tirx.stmt import BufferStore

from ._core import _fuse, extent_of, schedule_prologue, vector_lanes, vectorize_loop

__all__ = [
    "GemmInfo",
    "analyze_gemm",
    "float32_accumulator",
    "fold_epilogue",
    "index_vars",
    "inline_producers",
    "is_layout_free",
    "mac_operands",
    "schedule_matmul",
    "tile_m",
    "tile_mn",
    "tile_n",
    "tile_writeback",
    "vectorize_writeback",
]


@dataclass
class GemmInfo:
    """What :func:`analyze_gemm` found: the reduction block and the role of each iter var."""

    main: s_tir.schedule.SBlockRV
    kinds: list[str]  # one of S (batch), I (rows), J (columns), K (reduction) per iter var
    a_read: int  # index of A in the block's reads
    b_read: int  # index of B
    b_pos: list[str]  # the role of each index of B's access (S / J / K)


def index_vars(expr: tirx.PrimExpr) -> set:
    """The variables an index expression uses."""
    return set(undefined_vars(expr))


def _point_axes(region) -> set | None:
    """The variables a point access uses, or None when it reads a range (not a point)."""
    out: set = set()
    for r in region:
        if not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1):
            return None
        out |= index_vars(r.min)
    return out


def _is_multiply_accumulate(blk: s_tir.SBlock) -> bool:
    """``C[...] = C[...] + a * b`` with ``a``/``b`` loads (possibly cast)."""
    body = blk.body
    if not isinstance(body, BufferStore):
        return False
    v = body.value
    if not isinstance(v, tirx.Add):
        return False
    acc, prod = (v.a, v.b) if isinstance(v.a, TensorLoad) else (v.b, v.a)
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(body.buffer)):
        return False
    while isinstance(prod, tirx.Cast):
        prod = prod.value
    return isinstance(prod, tirx.Mul)


def mac_operands(blk: s_tir.SBlock) -> list[int] | None:
    """Indices (into ``blk.reads``) of the two operands of a multiply-accumulate block
    ``C += a * b``, or None when the block is not one."""
    if len(blk.writes) != 1 or not _is_multiply_accumulate(blk):
        return None
    out = blk.writes[0].source
    reads = [i for i, r in enumerate(blk.reads) if not r.source.same_as(out)]
    return reads if len(reads) == 2 else None


def analyze_gemm(sch: s_tir.Schedule, block) -> GemmInfo | None:
    """Match ``block`` against ``C[S, I, J] += A[S, I, K] * B[S, J, K]``.

    Returns None for anything else (a conv reads a window ``oh + kh``, a reduction has one
    operand). A GEMV (no ``I`` axis) matches with ``A`` the operand without ``J``.
    """
    blk = sch.get(block)
    reads = mac_operands(blk)
    if reads is None:
        return None
    w = _point_axes(blk.writes[0].region)
    ra = _point_axes(blk.reads[reads[0]].region)
    rb = _point_axes(blk.reads[reads[1]].region)
    if w is None or ra is None or rb is None:
        return None
    # Every index of an operand must be a single iter var (a window `oh + kh` is a conv).
    for r in (blk.reads[reads[0]], blk.reads[reads[1]]):
        for rg in r.region:
            if len(index_vars(rg.min)) > 1:
                return None
    ivars = [iv.var for iv in blk.iter_vars]
    kinds = []
    for iv in blk.iter_vars:
        v = iv.var
        ext = iv.dom.extent
        if iv.iter_type == tirx.IterVar.DataPar:
            if v in ra and v in rb and v in w:
                kinds.append("S")
            elif v in ra and v in w:
                kinds.append("I")
            elif v in rb and v in w:
                kinds.append("J")
            elif v in w and isinstance(ext, tirx.IntImm) and ext.value == 1:
                kinds.append("S")
            else:
                return None
        elif iv.iter_type == tirx.IterVar.CommReduce:
            if v in ra and v in rb and v not in w:
                kinds.append("K")
            else:
                return None
        else:
            return None
    if "K" not in kinds:
        return None
    a_read, b_read = reads
    if "J" not in kinds:  # the roles of A and B are decided by which operand carries J
        if "I" not in kinds:
            return None
        a_read, b_read = b_read, a_read
        kinds = ["J" if k == "I" else k for k in kinds]
    # A carries I (if any), B carries J.
    jv = {v for v, k in zip(ivars, kinds) if k == "J"}
    if not (jv & _point_axes(blk.reads[b_read].region)):
        a_read, b_read = b_read, a_read
    kv = {v for v, k in zip(ivars, kinds) if k == "K"}
    b_pos = []
    for rg in blk.reads[b_read].region:
        vs = index_vars(rg.min)
        b_pos.append("J" if vs & jv else "K" if vs & kv else "S")
    if b_pos.count("J") != 1 or b_pos.count("K") != 1:
        return None
    return GemmInfo(block, kinds, a_read, b_read, b_pos)


def float32_accumulator(blk: s_tir.SBlock) -> bool:
    """Whether the block accumulates in float32 (the register tiles are float32 vectors)."""
    dt = blk.writes[0].source.dtype
    return dt.bits == 32 and dt.type_code == 2 and dt.lanes == 1


def inline_producers(sch: s_tir.Schedule, blocks, main) -> bool:
    """Inline every block before ``main`` into its consumers; False if one refuses."""
    for b in blocks:
        if b == main:
            return True
        try:
            sch.compute_inline(b)
        except Exception:
            return False
    return True


def fold_epilogue(sch: s_tir.Schedule, main) -> list | None:
    """Fold the blocks downstream of ``main`` (the epilogue FuseOps appended: bias, residual,
    activation, and DAGs like SiLU's ``y * sigmoid(y)`` that read ``y`` twice) into one:
    every one but the last is inlined into its consumers. Returns ``[]`` when nothing follows
    ``main``, ``[last]`` when folded, None when a block refuses (or a second output stays)."""
    down, todo = [], [main]
    while todo:
        for c in sch.get_consumers(todo.pop()):
            if not any(sch.get(c).same_as(sch.get(d)) for d in down):
                down.append(c)
                todo.append(c)
    if not down:
        return []
    order = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]

    def position(b) -> int:
        blk = sch.get(b)
        return next((i for i, o in enumerate(order) if o.same_as(blk)), len(order))

    down.sort(key=position)
    for b in down[:-1]:
        try:
            sch.compute_inline(b)
        except Exception:
            return None
    return down[-1:]


def tile_writeback(sch: s_tir.Schedule, main):
    """Fold the epilogue of ``main`` into one block (:func:`fold_epilogue`) and give ``main``
    a ``local`` output (one tile once the write-back is computed at the tile loop); returns
    the write-back block, or None if an epilogue block cannot be inlined."""
    folded = fold_epilogue(sch, main)
    if folded is None:
        return None
    if folded:
        sch.set_scope(main, 0, "local")
        return folded[0]
    return sch.cache_write(main, 0, "local")


def vectorize_writeback(sch: s_tir.Schedule, epi, lanes: int, anchor=None) -> None:
    """Vectorize the write-back's innermost loop over the tile (in ``lanes``-wide vectors
    when it is several); a loop whose extent is not static (a symbolic tile edge) or is one
    stays as it is.

    With ``anchor`` (the tile loop the write-back was computed at), the write-back's other
    loops inside the tile are unrolled too, so that every access to the accumulator tile
    has a constant index: LLVM then keeps the whole tile in registers. A write-back loop
    left rolled indexes the tile by its counter, so the tile stayed a stack array that the
    init zeroed with a ``memset`` call per tile (1.5 KB for 8 x 48, the cost of about 100
    FMAs: a quarter of a 1x1 conv's tile work at 16 input channels).

    A scalar write-back (``lanes`` 1: N = 1 or 2) stays rolled: eight unrolled scalar
    copies of a polynomial tanh under the tile's row predicate took LLVM 13.7 s to compile
    (1.9 s rolled; a batched matmul with a symbolic row count, N = 1).
    """
    inner = sch.get_loops(epi)[-1]
    ext = extent_of(sch, inner)
    if ext is None or ext <= 1 or lanes <= 1:
        return
    if ext > lanes and ext % lanes == 0:
        _, inner = sch.split(inner, [None, lanes])
    sch.vectorize(inner)
    if anchor is None:
        return
    loops = sch.get_loops(epi)
    at = next((i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(anchor))), None)
    if at is None:
        return
    inside = [(lp, extent_of(sch, lp)) for lp in loops[at + 1:-1]]
    if any(e is None for _, e in inside) or math.prod(e for _, e in inside) > _MAX_UNROLLED_STORES:
        return  # not a register tile (a write-back that covers a whole row or image)
    for lp, e in inside:
        if e > 1:
            sch.unroll(lp)


#: Most vector stores :func:`vectorize_writeback` unrolls: a register tile has at most 32
#: accumulators; a write-back computed at a tile loop that still spans whole rows (a
#: 1x1-pixel squeeze-excite conv whose fused epilogue multiplies its sigmoid into the whole
#: 120 x 120 x 32 feature map, EfficientNet-B1) took 83 s of LLVM codegen unrolled, 0.03 s
#: rolled.
_MAX_UNROLLED_STORES = 64


def _reduction_blocks(sch: s_tir.Schedule, blocks) -> list:
    return [
        b for b in blocks
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)
    ]


def tile_n(n: int | None, lanes: int, max_vecs: int) -> tuple[int, int]:
    """(vector lanes, vectors per tile row) for N: the widest vectors that divide N."""
    if n is None:
        return lanes, 1
    for ln in (lanes, lanes // 2, lanes // 4):
        if ln >= 4 and n % ln == 0:
            nvec = n // ln
            for v in range(min(max_vecs, nvec), 0, -1):
                if nvec % v == 0:
                    return ln, v
    if n <= lanes * max_vecs:
        return n, 1  # one odd-sized vector (LLVM splits it into full and partial registers)
    return lanes, max(1, min(max_vecs, n // lanes))  # the last tile is partial (padded)


def tile_mn(
    m: int | None, n: int | None, lanes: int, max_vecs: int, mr_max: int, acc_regs: int
) -> tuple[int, int, int]:
    """(vector lanes, vectors per tile row, rows per tile) for an M x N output: among the
    tile widths that divide N, the one whose row count (:func:`tile_m`) fills the most
    accumulator registers without a partial row tile; ties go to the fewer loads per FMA,
    then the wider tile. M = 128, N = 768 gets 8 x 48 (24 registers) instead of 4 x 64 (16)
    with 16 lanes and 24 accumulators, and 4 x 24 instead of 3 x 32 with 8 lanes and 12."""
    ln, nv = tile_n(n, lanes, max_vecs)
    best = None
    if n is not None and n % (ln * nv) == 0:
        nvec = n // ln
        for v in range(nv, 0, -1):
            if nvec % v:
                continue
            top = max(1, min(mr_max, acc_regs // v))
            mr = tile_m(m, top)
            exact = m is None or m % mr == 0
            # Ties in accumulators go to the fewest loads per FMA, a B vector (from the
            # packed panel streaming through L2) counting twice an A broadcast, then to the
            # wider tile. One Zen 3 core, 12 accumulators: 128x768x768 4 x 3 67 GF/s, 3 x 4
            # 51; 197x384x1536 58 and 52.
            key = (exact, mr * v, -(2 / mr + 1 / v), v)
            if best is None or key > best[0]:
                best = (key, v, mr)
    if best is None:
        return ln, nv, tile_m(m, max(1, min(mr_max, acc_regs // nv)))
    return ln, best[1], best[2]


def tile_m(m: int | None, mr_max: int) -> int:
    """Rows per tile for M: the largest divisor of M up to ``mr_max`` when it is more than
    half of ``mr_max``, else ``mr_max`` (the last tile partial); ``mr_max`` for a symbolic M."""
    if m is None:
        return mr_max
    if m <= mr_max:
        return m
    best = max(r for r in range(1, mr_max + 1) if m % r == 0)
    return best if best * 2 > mr_max else mr_max


def is_layout_free(func: tirx.PrimFunc, buf) -> bool:
    """Whether ``buf`` is a parameter that AttachAttrLayoutFreeBuffers marked as bound to a
    constant (a weight): a rule may then give it any layout, computed at compile time."""
    free = {int(i) for i in (func.attrs or {}).get("layout_free_buffers", [])}
    # TVM 0.27: a PrimFunc's params are its buffers.
    return any(i in free and p.same_as(buf) for i, p in enumerate(func.params))


#: Fewest accumulator vectors a tile keeps in flight before N is padded to wider tiles
#: instead (FMA latency 4 cycles: one chain runs at a quarter of a pipe).
_MIN_CHAINS = 3


def schedule_matmul(
    func: tirx.PrimFunc,
    target: Target,
    *,
    acc_regs: int,
    max_vecs: int = 4,
    mr_max: int = 8,
    pack_bytes: int = 1 << 20,
) -> s_tir.Schedule | None:
    """Register-blocked GEMM schedule of a fused matmul PrimFunc, or None if it is not one.

    Parameters
    ----------
    acc_regs
        Vector registers given to the accumulators (``MR * NR / lanes`` at most).
    max_vecs
        Most vectors per tile row (``NR / lanes``).
    mr_max
        Most rows per tile.
    pack_bytes
        An activation ``B`` contiguous along ``N`` is read in place when it is at most this
        big (it stays in L2); larger ones are packed like transposed ones.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.schedules._gemm import schedule_matmul
    >>> a, b = te.placeholder((64, 32), name="a"), te.placeholder((32, 48), name="b")
    >>> k = te.reduce_axis((0, 32), name="k")
    >>> c = te.compute((64, 48), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    >>> sch = schedule_matmul(te.create_prim_func([a, b, c]), opsdk.target("x86"), acc_regs=24)
    >>> sch is not None
    True
    """
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    red = _reduction_blocks(sch, blocks)
    if len(red) != 1:
        return None
    main = red[0]
    # Producers (transposes, reshapes, broadcasts) read straight from their sources.
    if not inline_producers(sch, blocks, main):
        return None
    info = analyze_gemm(sch, main)
    if info is None:
        return None
    blk = sch.get(main)
    if len(sch.get_loops(main)) != len(info.kinds) or not float32_accumulator(blk):
        return None
    lanes_max = vector_lanes(target, 32)
    # Only the innermost I and J axes are tiled; outer ones (a (batch, seq) activation's
    # batch) become outer loops like S. A tile of a fused (batch * seq) axis would straddle
    # two batch rows, and the write-back, which indexes the unfused output, would cover the
    # bounding box of both: rows no tile of this block computed (caught by verify).
    ext = [_static(iv.dom.extent) for iv in blk.iter_vars]
    i_last = max((p for p, kd in enumerate(info.kinds) if kd == "I"), default=None)
    j_last = max(p for p, kd in enumerate(info.kinds) if kd == "J")
    m_ext = ext[i_last] if i_last is not None else 1
    n_ext = ext[j_last]
    lanes, nv, mr = tile_mn(m_ext, n_ext, lanes_max, max_vecs, mr_max, acc_regs)
    # No tile width divides N (a sequence of 197 tokens), or only one odd vector wider than
    # a register does (Swin's 49-token windows: a 49-lane accumulator row that LLVM keeps on
    # the stack, 10 GFLOP/s): pad N to whole tiles.
    pad_n = n_ext is not None and (n_ext % (lanes * nv) != 0 or lanes > lanes_max)
    if pad_n:
        lanes, nv, mr = _padded_tile(m_ext, n_ext, lanes_max, max_vecs, mr_max, acc_regs)
    elif n_ext is not None and mr * nv < _MIN_CHAINS and n_ext >= _MIN_CHAINS * lanes_max \
            and max_vecs >= _MIN_CHAINS:
        # A GEMV whose N only narrow tiles divide (a classifier's 1000 = 125 x 8) would run
        # one 8-lane accumulator, its FMA latency exposed: 30 GB/s of weights per Zen 4
        # core. N is padded to full-width tiles of at least 3 vectors instead (1000 -> 1008
        # in 3 x 16 lanes, 3 x 8 on AVX2): 0.086 -> 0.029 ms, MobileNetV3's head, 2 threads.
        pad_n = True
        lanes, nv, mr = _padded_tile(m_ext, n_ext, lanes_max, max_vecs, mr_max, acc_regs,
                                     min_vecs=_MIN_CHAINS)
    elif n_ext is not None and lanes < lanes_max and n_ext >= 2 * lanes_max:
        # Only half-width vectors divide N (RegNetX's 152 channels: 19 x 8 lanes, one 8-lane
        # vector a tile row, half the FMA width: 97 GF/s where 160 columns in 16 lanes ran
        # at 219, one Zen 5, 2 threads): N is padded to full-width tiles.
        pad_n = True
        lanes, nv, mr = _padded_tile(m_ext, n_ext, lanes_max, max_vecs, mr_max, acc_regs)
    nr = lanes * nv
    # Rows are padded where the waste is small (under a quarter: 197 rows in 6-row tiles
    # compute 198; 7 rows keep the predicated last tile) and the copy of a row tile serves
    # several column tiles: with one (P @ V's 64 columns) the copy cost more than the
    # predicate (measured 6 %).
    pad_m = (i_last is not None and (n_ext is None or n_ext > nr)
             and (m_ext is None or (m_ext % mr != 0 and m_ext >= 4 * mr)))
    a_pad = b_pad = final = None
    if pad_n or pad_m:
        # The block computes whole tiles of zero-padded A and B (copies), so no predicate is
        # left in the k loop (a row predicate there made 197-row GEMMs 1.2-1.7x slower).
        padding = [1] * len(info.kinds)
        if pad_m:
            padding[i_last] = mr
        if pad_n:
            padding[j_last] = nr
        try:
            sch.pad_einsum(main, padding)
        except Exception:  # a block pad_einsum refuses keeps the predicated tiles
            pad_n = pad_m = False
        else:
            info = analyze_gemm(sch, main)
            if info is None:
                return None
            blk = sch.get(main)
            a_pad = _producer_of(sch, main, blk.reads[info.a_read].source) if pad_m else None
            b_pad = _producer_of(sch, main, blk.reads[info.b_read].source) if pad_n else None
            if (pad_m and a_pad is None) or (pad_n and b_pad is None):
                return None
            # A's padded rows read its last row in place (no copy of A at all): fc2 of
            # DeiT-S (197 x 1536 x 384) 1.05x warm, 1.04x cold, against one copy pass.
            if a_pad is not None and _clamp_rows(sch, a_pad):
                a_pad = None
                info = analyze_gemm(sch, main)
                if info is None:
                    return None
                blk = sch.get(main)
    if pad_n:
        # The tiles are written back whole to the padded output of the block; the epilogue
        # then runs over the real columns in its own vectorized pass (a masked write-back in
        # the tile would be scalar: TVM scalarizes a vector loop under a lane predicate).
        folded = fold_epilogue(sch, main)
        if not folded:
            return None
        final = folded[0]
        epi = sch.cache_write(main, 0, "local")
    else:
        epi = tile_writeback(sch, main)
    if epi is None:
        return None
    loops = sch.get_loops(main)
    groups = {k: [lp for lp, kk in zip(loops, info.kinds) if kk == k] for k in "SIJK"}
    outer = groups["S"] + groups["I"][:-1] + groups["J"][:-1]
    sch.reorder(*outer, *groups["I"][-1:], *groups["J"][-1:], *groups["K"])
    s = _fuse(sch, outer)
    m = groups["I"][-1] if groups["I"] else None
    n = groups["J"][-1]
    k = _fuse(sch, groups["K"])
    # B in a packed layout [S..., N / NR, K, NR].
    bbuf = blk.reads[info.b_read].source
    if b_pad is not None:  # B is the padding block's output: pack that, not a copy of it
        bbuf = sch.get(b_pad).reads[0].source
    b_const = is_layout_free(func, bbuf)
    b_contig = info.b_pos[-1] == "J"
    b_bytes = 4
    for e in bbuf.shape:  # a symbolic dim counts as large: such a B is packed
        b_bytes *= int(e.value) if isinstance(e, tirx.IntImm) else 1 << 16
    if pad_n or b_const or not b_contig or b_bytes > pack_bytes:
        pos = info.b_pos

        def pack(*idx):
            batch = [i for i, p in zip(idx, pos) if p == "S"]
            j = next(i for i, p in zip(idx, pos) if p == "J")
            kk = next(i for i, p in zip(idx, pos) if p == "K")
            return [*batch, j // nr, kk, j % nr]

        bp = b_pad if b_pad is not None else sch.cache_read(main, info.b_read, "global")
        padded = n_ext is None or n_ext % nr != 0
        sch.transform_layout(main, ("read", info.b_read), pack,
                             pad_value=0.0 if padded and not pad_n else None)
        if b_const:
            sch.annotate(bp, "meta_schedule.layout_rewrite_preproc", True)
        else:
            schedule_prologue(sch, bp, lanes_max)
    # Tiles.
    no, ni = sch.split(n, [None, nr])
    nvl, nl = sch.split(ni, [None, lanes])
    a_first = b_bytes <= pack_bytes  # B stays in cache: stream A once
    if m is not None:
        mo, mi = sch.split(m, [None, mr])
        tile_outer, tile_inner = (mo, no) if a_first else (no, mo)
        sch.reorder(tile_outer, tile_inner, k, mi, nvl, nl)
        anchor = tile_inner
        sch.unroll(mi)
    else:
        sch.reorder(no, k, nvl, nl)
        tile_outer, anchor = no, no
    sch.reverse_compute_at(epi, anchor)
    vectorize_writeback(sch, epi, lanes, anchor)
    sch.unroll(nvl)
    sch.vectorize(nl)
    par = _fuse(sch, [x for x in (s, tile_outer) if x is not None])
    sch.parallel(par)
    if a_pad is not None:
        if a_first and m is not None:  # A's padded rows are copied per row tile, in cache
            sch.compute_at(a_pad, par)
            vectorize_loop(sch, sch.get_loops(a_pad)[-1], lanes_max)
        else:
            # Column panels outer: a copy per tile would copy A once per panel, each time
            # from L3 or memory. One parallel pass before the kernel copies it once (197-row
            # DeiT GEMMs with cold caches, one Zen 4, 2 threads: 1.07x).
            schedule_prologue(sch, a_pad, lanes_max)
    sch.decompose_reduction(main, k)
    if final is not None:
        schedule_prologue(sch, final, lanes_max)
    return sch


def _clamp_rows(sch: s_tir.Schedule, pad) -> bool:
    """Turn the zero-padding copy of A's rows into a read of the last real row for the
    padded rows (``A[min(i, M - 1), k]``) and inline it: the padded rows' accumulators hold
    a copy of the last row's, which the predicated write-back drops. False (nothing done)
    when the copy is not ``A_pad[..] = if_then_else(cond, A[..], 0)`` over one padded axis."""
    blk = sch.get(pad)
    store = blk.body
    if not isinstance(store, BufferStore):
        return False
    value = store.value
    if not (isinstance(value, Call)
            and getattr(value.op, "name", "") in ("tirx.if_then_else", "prim.if_then_else")):
        return False
    load = value.args[1]
    if not isinstance(load, TensorLoad):
        return False
    src, dst = load.source, store.buffer
    if len(src.shape) != len(dst.shape):
        return False
    idx = list(load.indices)
    diff = [d for d, (a, b) in enumerate(zip(src.shape, dst.shape)) if not a.same_as(b)
            and not (isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm)
                     and int(a.value) == int(b.value))]
    if len(diff) != 1 or not isinstance(src.shape[diff[0]], tirx.IntImm):
        return False
    d = diff[0]
    last = tirx.IntImm(str(src.shape[d].ty.dtype), int(src.shape[d].value) - 1)
    idx[d] = tirx.Min(idx[d], last)
    new = s_tir.SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint,
                       BufferStore(dst, tirx.BufferLoad(src, idx), store.indices), None,
                       blk.alloc_buffers, blk.match_buffers, blk.annotations)
    sch.state.replace(sch.get_sref(pad), new, {blk: new})
    try:
        sch.compute_inline(pad)
    except Exception:  # the clamped copy stays a copy: still right, and scheduled as one
        return False
    return True


def _producer_of(sch: s_tir.Schedule, block, buf):
    """The block before ``block`` that writes ``buf`` (a padding copy), or None."""
    for p in sch.get_producers(block):
        if any(w.source.same_as(buf) for w in sch.get(p).writes):
            return p
    return None


def _static(e: tirx.PrimExpr) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def _padded_tile(
    m: int | None, n: int, lanes: int, max_vecs: int, mr_max: int, acc_regs: int,
    min_vecs: int = 1,
) -> tuple[int, int, int]:
    """(vector lanes, vectors per tile row, rows per tile) for an N padded to whole tiles.

    Among ``min_vecs`` to ``max_vecs`` vectors, the widths that compute at most
    :data:`_PAD_SLACK` of N more columns than the least wasteful one; of those, the tile
    with the most accumulators, then the fewest loads per FMA (as :func:`tile_mn`), then
    the wider; rows as :func:`tile_m`. N = 197 gets 16-wide tiles (208 columns computed,
    not 224 or 256); a 50257-word vocabulary gets 8 x 48 (24 accumulators; 16 in 8 x 32
    computed 48 fewer columns: 198 -> 218 GF/s, 64 x 512 x 50257, one Zen 4, 2 threads)."""
    cands = range(min(min_vecs, max_vecs), max_vecs + 1)
    cols = {v: -(-n // (lanes * v)) * lanes * v for v in cands}
    least = min(cols.values())

    def key(v: int) -> tuple:
        mr = tile_m(m, max(1, min(mr_max, acc_regs // v)))
        return (mr * v, -(2 / mr + 1 / v), v)

    nv = max((v for v in cands if cols[v] - least <= _PAD_SLACK * n), key=key)
    return lanes, nv, tile_m(m, max(1, min(mr_max, acc_regs // nv)))


#: Extra padded columns, as a fraction of N, that :func:`_padded_tile` spends for a tile
#: with more accumulators.
_PAD_SLACK = 0.01
