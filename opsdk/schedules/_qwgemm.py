"""Integer kernels of the weight-only dense ops with ``activations="q8_0"`` (llama.cpp's
``q4_0 x q8_0`` / ``q8_0 x q8_0`` path): ``dense_q4`` and ``dense_w8`` on dot-product
instructions (x86 ``vpdpbusd``, ARM ``sdot``). The target files (``cpu/vnni.py``,
``arm_cpu/dotprod.py``) only register rules with their :class:`QKernel`.

A rule rebuilds the op from the attributes on its output block (:func:`qwdense_packed`, the
same integers and the same float32 operations per block as the definition):

- ``xamax`` / ``xid`` / ``xq`` / ``xd`` quantize ``x`` per (row, 32-block) exactly as
  :func:`~opsdk.ops.dense_w8.q8_0_te` (so the same bits), rows zero padded to whole row
  tiles (a symbolic M: the prefill of an LLM); ``xsum`` the per-(row, block) sum of ``xq``;
- ``wp``: the weights packed ``(Np / C, bytes / 4, C * 4)`` (``C = nv * L`` the tile's channels,
  so a tile reads one contiguous stream: the LM head GEMV 1730 -> 460 us): one vector load is
  ``L`` output channels x 4 bytes of K, what one ``vpdpbusd`` (L = 16, 64 bytes) or ``sdot`` (L
  = 4) multiplies with one broadcast 32-bit word of ``xq``. q4: those 4 bytes hold 8 weights, 4
  in the low nibbles (k = 32 g + 4 q + i) and 4 in the high ones (k + 16), so one load feeds two
  instructions after an ``and`` / a shift. The nibbles enter as unsigned 0..15 (``vpdpbusd``
  takes u8 x s8; on ``sdot`` they are valid s8), and the identity ``sum_j (nib_j - 8) xq_j =
  dot(nib, xq) - 8 * xsum`` makes the block sum exact: the kernel starts each block's int32
  accumulator at ``-8 * xsum``. w8 on ``vpdpbusd``: the weights are stored as ``w + 128`` (u8)
  and the accumulator starts at ``-128 * xsum``; on ``sdot`` (s8 x s8) the weights go as they
  are. The packing reads only the weight, so a constant weight's packing is folded at compile
  time (``layout_rewrite_preproc``, as :func:`._qgemm.pack_at_compile_time`); ``dp`` the q4
  block scales ``(Np / C, K / 32, C)`` in their own dtype (float16 stays 2 bytes per block);
  ``sp`` / ``bp`` the w8 scales and the bias padded to ``Np`` (folded too when constant);
- ``acc``: the register tile (:func:`tile_kernel`, written as TIR with
  ``call_llvm_pure_intrin``: ``sch.tensorize`` crashes in this TVM build, see
  :mod:`._qgemm`): ``rows x nv`` vectors of int32 block sums, per block converted once and
  scaled into float32 accumulators (``acc += float(isum) * (d_w * dx16)``; w8:
  ``acc += float(isum) * dx16``, ``w_scale`` in the epilogue);
- ``ytile`` the epilogue (w8 scale, bias, activation) on whole tiles, ``dense_*`` the copy
  of the ``(M, N)`` part.

Tiles: a decode GEMV (static M <= 2) takes ``M`` rows x 4 vectors of channels (one row:
two int32 chains per vector, the low and the high nibbles, to hide the instruction's latency);
otherwise 3 rows x 4 vectors (12 int32 + 12 float32 accumulators; the unpacked weights shared
by the rows). Both use 4-vector channel tiles, so a model's decode step (M = 1) and its
prefill (M symbolic) pack a weight identically and hold it once (the pipeline's folding
shares equal constants): GPT-2 int4 keeps one packed copy instead of two, for 4.5 % of
prefill speed (4 x 2 tiles: 286-313 GFLOP/s, 3 x 4: 273-298, one Zen 4, 2 threads); the
other way round, decode with 2-vector tiles, cost 2-7 %. Tiles ``(row tile, channel tile)``
run fused in one parallel loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm import s_tir, te, tirx
from tvm.target import Target

from ..ops.dense_w8 import QBLOCK, activation_te
from ..ops.take_q4 import ATTRS_KEY as TAKE_KEY
from ..ops.take_w8 import ATTRS_KEY as TAKE_W8_KEY
from ._core import replace_block_body, vector_lanes, vectorize_loop
from ._gemm import is_layout_free
from ._qgemm import block_attrs, recompute, region, schedule_tile_epilogue
from ._wgemm import gemv_vectors, loops_after, take_wpacked, wdense_match

__all__ = ["Q4_ZERO", "QKernel", "channel_vectors", "pack_weights", "qwdense_packed",
           "rebuild_qwdense", "schedule_qwdense", "schedule_take_q4", "schedule_take_w8",
           "take_q4_packed", "take_w8_packed", "tile_kernel"]

#: The q4_0 nibbles' zero point: a weight is ``nibble - Q4_ZERO``; the kernels multiply the
#: nibbles and start each block's sum at ``-Q4_ZERO * sum(xq)``.
Q4_ZERO = 8


@dataclass(frozen=True)
class QKernel:
    """A dot-product instruction for the q8_0 kernels: ``fn(acc, w, xword)`` returns
    ``acc[L] + sum_4 w[L, 4] * xq[4]`` (int32), ``w`` the ``4 L`` weight bytes as
    ``wdtype`` (``uint8``: ``vpdpbusd``'s unsigned operand; ``int8``: ``sdot``), ``xword``
    one row's 4 activation bytes (int8x4). ``w8_offset``: what dense_w8's packing adds to
    the int8 weights to make them ``wdtype`` (128 or 0)."""

    name: str
    lanes: int
    wdtype: str
    w8_offset: int
    fn: Callable[[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def channel_vectors(n: int, lanes: int) -> int:
    """Vectors of ``lanes`` output channels per tile, the packing's ``C = nv * lanes``: 4
    for every M (see the module), fewer for a narrower N. :func:`take_q4_packed` packs a
    table with it too, so a table that is also a weight is packed once."""
    return max(1, min(4, _cdiv(n, lanes)))


def _tile(m: int | None, n: int, lanes: int) -> tuple[int, int]:
    """(rows, vectors) of the register tile (see the module)."""
    rows = m if m is not None and m <= 2 else 3
    return rows, channel_vectors(n, lanes)


def pack_weights(op: str, w: te.Tensor, scale: te.Tensor, *, kernel: QKernel, nv: int,
                 idx: str) -> tuple[te.Tensor, te.Tensor | None]:
    """``(wp, dp)``: the weight bytes ``(Np / C, bytes / 4, C * 4)`` and the q4 block scales
    ``(Np / C, K / 32, C)`` (None for w8) as the kernels read them (``C = nv * lanes``; see
    the module). One compute for :func:`qwdense_packed` and :func:`take_q4_packed`: a table
    packed by both folds to the same bytes, which the pipeline keeps once. ``idx``: the
    dtype of the shape's dims."""
    n, nbytes = (int(v) for v in w.shape)
    q4 = op == "dense_q4"
    cols = kernel.lanes * nv
    np_ = _cdiv(n, cols) * cols

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    off = 0 if q4 else kernel.w8_offset
    wdt = "uint8" if q4 else kernel.wdtype

    def wp_f(t, kq, e):
        nn, kk = t * cols + e // 4, kq * 4 + e % 4
        v = w[nn, kk] if off == 0 else (w[nn, kk].astype("int32") + off)
        return tirx.if_then_else(nn < n, v.astype(wdt), tirx.const(0, wdt))

    wp = te.compute((dim(np_ // cols), dim(nbytes // 4), dim(cols * 4)), wp_f, name="wp")
    if not q4:
        return wp, None
    dp = te.compute(
        (dim(np_ // cols), dim(nbytes * 2 // QBLOCK), dim(cols)),
        lambda t, g, c: tirx.if_then_else(t * cols + c < n, scale[t * cols + c, g],
                                          tirx.const(0, scale.dtype)),
        name="dp")
    return wp, dp


def qwdense_packed(
    op: str, x: te.Tensor, w: te.Tensor, scale: te.Tensor, bias: te.Tensor | None, *,
    kernel: QKernel, rows: int, nv: int, activation: str = "none",
) -> te.Tensor:
    """``dense_q4`` / ``dense_w8`` with ``activations="q8_0"`` in packed form (see the
    module for the blocks). The block sums are the definition's integers; per block the same
    float32 scale product; only the order of the float sum over blocks may differ."""
    m, k_dim = x.shape
    n_dim = w.shape[0]
    if not isinstance(k_dim, tirx.IntImm) or not isinstance(n_dim, tirx.IntImm):
        raise ValueError(f"{op}: K and N must be static for the packed kernel")
    k, n = int(k_dim), int(n_dim)
    if k % QBLOCK:
        raise ValueError(f"{op}: K = {k} is not a multiple of {QBLOCK}")
    idx = str(m.ty.dtype)
    f32 = "float32"
    lanes = kernel.lanes
    q4 = op == "dense_q4"
    groups = k // QBLOCK

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    cols = lanes * nv
    np_ = _cdiv(n, cols) * cols
    mp = tirx.floordiv(m + (rows - 1), rows) * rows

    # Activation quantization (the same float32 operations as q8_0_te; padded rows are 0).
    def xat(i, kk):
        return tirx.if_then_else(i < m, x[i, kk], tirx.const(0.0, f32))

    rj = te.reduce_axis((dim(0), dim(QBLOCK)), name="jq")
    amax = te.compute((mp, dim(groups)),
                      lambda i, b: te.max(tirx.abs(xat(i, b * QBLOCK + rj)), axis=rj),
                      name="xamax")

    def inv(i, b):
        dx = amax[i, b] / tirx.const(127.0, f32)
        return tirx.if_then_else(dx != tirx.const(0.0, f32), tirx.const(1.0, f32) / dx,
                                 tirx.const(0.0, f32))

    xid = te.compute((mp, dim(groups)), inv, name="xid")
    xq = te.compute((mp, dim(k)), lambda i, kk: tirx.round(xat(i, kk) * xid[i, kk // QBLOCK])
                    .astype("int8"), name="xq")
    xd = te.compute((mp, dim(groups)),
                    lambda i, b: (amax[i, b] / tirx.const(127.0, f32)).astype("float16")
                    .astype(f32), name="xd")
    rs = te.reduce_axis((dim(0), dim(QBLOCK)), name="js")
    xsum = te.compute((mp, dim(groups)),
                      lambda i, b: te.sum(xq[i, b * QBLOCK + rs].astype("int32"), axis=rs),
                      name="xsum")

    # Weights: (Np / C, bytes / 4, C * 4), zero padded channels.
    wp, dp = pack_weights(op, w, scale, kernel=kernel, nv=nv, idx=idx)
    corr = Q4_ZERO if q4 else kernel.w8_offset  # the accumulator starts at -corr * xsum

    def wval(j, kk):  # the unsigned / signed weight the instruction multiplies, as int32
        t, c = j // cols, j % cols
        if q4:
            g, e = kk // QBLOCK, kk % QBLOCK
            byte = g * 16 + e % 16
            b = wp[t, byte // 4, c * 4 + byte % 4]
            sh = (e // 16 * 4).astype("uint8")
            return tirx.bitwise_and(tirx.shift_right(b, sh), tirx.const(15, "uint8")).astype(
                "int32")
        return wp[t, kk // 4, c * 4 + kk % 4].astype("int32")

    rk = te.reduce_axis((dim(0), dim(k)), name="k")

    def acc_f(i, j):
        g = rk // QBLOCK
        prod = xq[i, rk].astype("int32") * wval(j, rk)
        if corr:
            prod = prod - tirx.if_then_else(rk % QBLOCK == 0, xsum[i, g] * corr,
                                            tirx.const(0, "int32"))
        s = xd[i, g]
        if q4:
            s = dp[j // cols, g, j % cols].astype(f32) * s
        return te.sum(prod.astype(f32) * s, axis=rk)

    acc = te.compute((mp, dim(np_)), acc_f, name="acc")

    def padded(v: te.Tensor, name: str) -> te.Tensor:
        return te.compute((dim(np_),), lambda j: tirx.if_then_else(
            j < n, v[j], tirx.const(0.0, f32)), name=name)

    sp = None if q4 else padded(scale, "sp")
    bp = None if bias is None else padded(bias, "bp")

    def body(i, j):
        v = acc[i, j]
        if sp is not None:
            v = v * sp[j]
        if bp is not None:
            v = v + bp[j]
        return activation_te(v, activation)

    tile = te.compute((mp, dim(np_)), body, name="ytile")
    return te.compute((m, dim(n)), lambda i, j: tile[i, j], name=op)


def rebuild_qwdense(func: tirx.PrimFunc, kernel: QKernel) -> tirx.PrimFunc | None:
    """``func`` (a legalized dense_q4 / dense_w8 with ``activations="q8_0"``) recomputed as
    :func:`qwdense_packed`, same signature; None when it is not one or K / N are symbolic."""
    found = wdense_match(func, "q8_0")
    if found is None:
        return None
    op, attrs, bufs = found
    has_bias = attrs["has_bias"]
    x, w = bufs[0], bufs[1]
    if int(x.shape[1]) % QBLOCK:
        return None
    mdim = x.shape[0]
    m = int(mdim.value) if isinstance(mdim, tirx.IntImm) else None
    rows, nv = _tile(m, int(w.shape[0]), kernel.lanes)
    new = recompute(func, bufs, has_bias, lambda *ins: qwdense_packed(
        op, *ins, kernel=kernel, rows=rows, nv=nv, activation=attrs["activation"]))
    return new.with_attr("opsdk.qwdense_tile", [rows, nv]).with_attr("opsdk.wdense_op", op)


def tile_kernel(sch: s_tir.Schedule, block: Any, kernel: QKernel, q4: bool) -> None:
    """Replace the blockized ``rows x cols`` tile of ``acc`` (all of K) by the register
    kernel: per 32-block, int32 accumulators started at ``-corr * xsum``, one ``kernel``
    instruction per (row, vector, 4 bytes of weights) (q4: two per load, the low and the
    high nibbles), then one convert and one multiply-add into the float32 accumulators."""
    blk = sch.get(block)
    c, xqr, wr = region(blk, "acc"), region(blk, "xq"), region(blk, "wp")
    (r_rng, c_rng) = c.region
    rows, cols = int(r_rng.extent), int(c_rng.extent)
    lanes = kernel.lanes
    nv = cols // lanes
    row0, col0, t0 = r_rng.min, c_rng.min, wr.region[0].min
    idx = str(row0.ty.dtype) if hasattr(row0, "ty") else "int32"
    k = int(xqr.region[1].extent)
    groups = k // QBLOCK
    xq_buf, wp_buf = xqr.source, wr.source
    xd_buf = region(blk, "xd").source
    names = {r.source.name for r in blk.reads}
    xsum_buf = region(blk, "xsum").source if "xsum" in names else None
    dp_buf = region(blk, "dp").source if q4 else None
    corr = Q4_ZERO if q4 else kernel.w8_offset
    chains = 2 if rows == 1 else 1
    f32v = f"float32x{lanes}"
    wbytes = f"{kernel.wdtype}x{lanes * 4}"
    quads = 4 if q4 else QBLOCK // 4  # weight loads per 32-block per vector

    def c_(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    def vec(v: int) -> tirx.Ramp:
        return tirx.Ramp(c_(v * lanes), 1, lanes)

    facc = [tirx.decl_buffer((cols,), "float32", name=f"facc_r{r}") for r in range(rows)]
    iacc = [[tirx.decl_buffer((cols,), "int32", name=f"iacc_r{r}_{h}") for h in range(chains)]
            for r in range(rows)]
    g = tirx.Var("g", idx)

    def xword(r: int, kk: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.BufferLoad(xq_buf, [row0 + r, tirx.Ramp(kk, 1, 4)])

    def dot(r: int, h: int, v: int, wv: tirx.PrimExpr, kk: tirx.PrimExpr) -> tirx.Stmt:
        cur = tirx.BufferLoad(iacc[r][h], [vec(v)])
        return tirx.BufferStore(iacc[r][h], kernel.fn(cur, wv, xword(r, kk)), [vec(v)])

    per_g: list[tirx.Stmt] = []
    for r in range(rows):  # start each block's sums at the compensation
        for h in range(chains):
            if h == 0 and xsum_buf is not None:
                start = tirx.Broadcast(
                    tirx.BufferLoad(xsum_buf, [row0 + r, g]) * tirx.IntImm("int32", -corr),
                    lanes)
            else:
                start = tirx.Broadcast(tirx.IntImm("int32", 0), lanes)
            for v in range(nv):
                per_g.append(tirx.BufferStore(iacc[r][h], start, [vec(v)]))
    for q in range(quads):
        wvars = [tirx.Var(f"w{v}", wbytes if not q4 else f"uint8x{lanes * 4}")
                 for v in range(nv)]
        steps: list[tirx.Stmt] = []
        lets: list[tuple[tirx.Var, tirx.PrimExpr]] = []
        for v in range(nv):
            load = tirx.BufferLoad(wp_buf, [t0, g * quads + q,
                                            tirx.Ramp(c_(v * lanes * 4), 1, lanes * 4)])
            lets.append((wvars[v], load))
            if q4:
                lo = tirx.Var(f"lo{v}", wbytes)
                hi = tirx.Var(f"hi{v}", wbytes)
                lo_v = tirx.bitwise_and(wvars[v], tirx.Broadcast(tirx.IntImm("uint8", 15),
                                                                 lanes * 4))
                hi_v = tirx.shift_right(wvars[v], tirx.Broadcast(tirx.IntImm("uint8", 4),
                                                                 lanes * 4))
                if kernel.wdtype != "uint8":
                    lo_v, hi_v = tirx.reinterpret(wbytes, lo_v), tirx.reinterpret(wbytes, hi_v)
                lets += [(lo, lo_v), (hi, hi_v)]
        for r in range(rows):
            for v in range(nv):
                if q4:
                    lo, hi = lets[3 * v + 1][0], lets[3 * v + 2][0]
                    steps.append(dot(r, 0, v, lo, g * QBLOCK + 4 * q))
                    steps.append(dot(r, chains - 1, v, hi, g * QBLOCK + 16 + 4 * q))
                else:
                    steps.append(dot(r, q % chains, v, wvars[v], g * QBLOCK + 4 * q))
        # TVM 0.27's Bind (LetStmt) has no body: the value is visible to what follows it.
        per_g.append(tirx.SeqStmt([*(tirx.Bind(var, val) for var, val in lets), *steps]))
    for v in range(nv):  # once per block: convert, scale, accumulate in float32
        dsc = None
        if dp_buf is not None:
            dsc = tirx.BufferLoad(dp_buf, [t0, g, vec(v)]).astype(f32v)
        for r in range(rows):
            isum: tirx.PrimExpr = tirx.BufferLoad(iacc[r][0], [vec(v)])
            if chains == 2:
                isum = isum + tirx.BufferLoad(iacc[r][1], [vec(v)])
            xs = tirx.Broadcast(tirx.BufferLoad(xd_buf, [row0 + r, g]), lanes)
            s = xs if dsc is None else dsc * xs
            new = tirx.BufferLoad(facc[r], [vec(v)]) + isum.astype(f32v) * s
            per_g.append(tirx.BufferStore(facc[r], new, [vec(v)]))
    loop = tirx.For(g, c_(0), c_(groups), tirx.ForKind.SERIAL, tirx.SeqStmt(per_g))
    zero = tirx.Broadcast(tirx.FloatImm("float32", 0.0), lanes)
    tiles = [(r, v) for r in range(rows) for v in range(nv)]
    body = [
        *(tirx.AllocBuffer(b) for b in facc),
        *(tirx.AllocBuffer(b) for row in iacc for b in row),
        *(tirx.BufferStore(facc[r], zero, [vec(v)]) for r, v in tiles),
        loop,
        *(tirx.BufferStore(c.source, tirx.BufferLoad(facc[r], [vec(v)]),
                           [row0 + r, tirx.Ramp(col0 + v * lanes, 1, lanes)]) for r, v in tiles),
    ]
    replace_block_body(sch, block, body)


def schedule_qwdense(func: tirx.PrimFunc, target: Target, kernel: QKernel
                     ) -> s_tir.Schedule | None:
    """A q8_0 rule's body: :func:`rebuild_qwdense`, then the tiles in parallel around
    :func:`tile_kernel`; None when ``func`` is not a q8_0 dense_q4 / dense_w8 with static K
    and N."""
    packed = rebuild_qwdense(func, kernel)
    if packed is None:
        return None
    rows, nv = (int(v) for v in packed.attrs["opsdk.qwdense_tile"])
    op = str(packed.attrs["opsdk.wdense_op"])
    q4 = op == "dense_q4"
    lanes = kernel.lanes
    cols = nv * lanes
    sch = s_tir.Schedule(packed)
    out = sch.get_sblock("ytile")
    i, j = sch.get_loops(out)
    mo, mi = sch.split(i, [None, rows])
    no, nj = sch.split(j, [None, cols])
    sch.reorder(mo, no, mi, nj)
    tile = sch.fuse(mo, no)
    sch.parallel(tile)
    acc = sch.get_sblock("acc")
    sch.compute_at(acc, tile)
    # The tile's rows, channels and K (a one-row tile's unit row loop is left out).
    tile_kernel(sch, sch.blockize(loops_after(sch, acc, tile)[0]), kernel, q4)
    schedule_tile_epilogue(sch, tile, mi, nj, cols, lanes * 32, op)

    # The activation quantization: one pass per row (its block maxima, inverses, int8 values,
    # scales and sums), rows across the cores unless it is a decode step's few rows.
    row = sch.get_loops(sch.get_sblock("xamax"))[0]
    for name in ("xid", "xd", "xq", "xsum"):
        if name == "xsum" and not _has_block(sch, name):
            continue
        sch.reverse_compute_at(sch.get_sblock(name), row)
    _, kl = sch.split(sch.get_loops(sch.get_sblock("xq"))[-1], [None, QBLOCK])
    sch.vectorize(kl)
    m = packed.params[0].shape[0]
    if not (isinstance(m, tirx.IntImm) and int(m) <= 2):
        sch.parallel(row)
    names = ["wp", "dp"] if q4 else ["wp", "sp"]
    names.append("bp")
    for name in names:
        if not _has_block(sch, name):  # no bias
            continue
        blk = sch.get_sblock(name)
        src = {"wp": 1, "dp": 2, "sp": 2, "bp": 3}[name]
        if is_layout_free(packed, packed.params[src]):
            sch.annotate(blk, "meta_schedule.layout_rewrite_preproc", True)
        elif name == "wp":
            sch.parallel(sch.get_loops(blk)[0])
    return sch


def _has_block(sch: s_tir.Schedule, name: str) -> bool:
    return any(sch.get(b).name_hint == name
               for b in sch.get_child_blocks(sch.get_sblock("root")))


# ------------------------------------------------------------- take_q4: rows of a q4_0 table
#: Output elements below which a gather runs on one core (a decode step's one row: a parallel
#: launch would cost more than the copy).
_TAKE_SERIAL = 1 << 14


def take_q4_packed(qs: te.Tensor, d: te.Tensor, indices: te.Tensor, *, kernel: QKernel
                   ) -> te.Tensor:
    """``take_q4`` gathering from the q8_0 kernels' packing of the table (:func:`pack_weights`
    with ``dense_q4``'s channel tile): row ``r`` is channel ``e = r % C`` of tile
    ``t = r // C``; group ``g``'s 16 bytes are ``wp[t, 4 g + q, 4 e + i]`` (``q, i < 4``, byte
    ``4 q + i`` of the group), its scale ``dp[t, g, e]``. The same nibbles and scales, so the
    same (exact) values as the definition."""
    n_dim, half_dim = qs.shape
    if not isinstance(n_dim, tirx.IntImm) or not isinstance(half_dim, tirx.IntImm):
        raise ValueError("take_q4: the table's shape must be static for the packed gather")
    n, half = int(n_dim), int(half_dim)
    idx = str(n_dim.ty.dtype)
    nv = channel_vectors(n, kernel.lanes)
    cols = nv * kernel.lanes
    wp, dp = pack_weights("dense_q4", qs, d, kernel=kernel, nv=nv, idx=idx)

    def body(i, c):
        r = tirx.max(tirx.min(indices[i].astype(idx), tirx.IntImm(idx, n - 1)),
                     tirx.IntImm(idx, 0))
        t, e = r // cols, r % cols
        g, j = c // QBLOCK, c % QBLOCK
        byte = wp[t, g * 4 + j % 16 // 4, e * 4 + j % 4]
        nib = tirx.bitwise_and(tirx.shift_right(byte, (j // 16 * 4).astype("uint8")),
                               tirx.const(15, "uint8"))
        return dp[t, g, e].astype("float32") * (nib.astype("int32") - Q4_ZERO).astype("float32")

    return te.compute((indices.shape[0], tirx.IntImm(idx, half * 2)), body, name="take_q4")


def _take_q4_params(func: tirx.PrimFunc) -> list[int] | None:
    """The positions of ``qs``, ``d`` and ``indices`` among the parameters of a legalized
    ``take_q4`` (q4_0 format; any order: a legalized call keeps the op's, a function made
    from placeholders may not), or None."""
    attrs = block_attrs(func, "take_q4", TAKE_KEY, (("format", str),))
    if attrs is None or attrs["format"] != "q4_0":
        return None
    params = list(func.params)  # TVM 0.27: a PrimFunc's params are its buffers
    if len(params) != 4 or not all(hasattr(p, "shape") for p in params):
        return None
    sch = s_tir.Schedule(func)
    out = sch.get(sch.get_sblock("take_q4")).writes[0].source
    ins = [i for i, p in enumerate(params) if not p.same_as(out)]
    table = [i for i in ins if len(params[i].shape) == 2]
    index = [i for i in ins if len(params[i].shape) == 1]
    if len(ins) != 3 or len(table) != 2 or len(index) != 1:
        return None
    qs = next((i for i in table if str(params[i].dtype) == "uint8"), None)
    if qs is None:
        return None
    return [qs, next(i for i in table if i != qs), index[0]]


def _rebuilt(func: tirx.PrimFunc, roles: list[int], compute: Callable) -> tirx.PrimFunc:
    """``func`` made again from ``compute`` of its inputs in the op's order (``roles``), with
    the same signature (placeholders in the function's own parameter order) and attributes."""
    phs = [te.placeholder(b.shape, b.dtype, name=b.name) for b in func.params[:-1]]
    new = te.create_prim_func([*phs, compute(*(phs[i] for i in roles))])
    for key, value in (func.attrs or {}).items():
        new = new.with_attr(key, value)
    return new


def _take_activations(func: tirx.PrimFunc, name: str) -> str | None:
    """The ``activations`` attribute of a legalized ``take_q4`` / ``take_w8`` (``name``): the
    numerics of the dense layers whose packing its table shares; None when ``func`` is not
    that op."""
    key = TAKE_KEY if name == "take_q4" else TAKE_W8_KEY
    attrs = block_attrs(func, name, key, (("activations", str),))
    return None if attrs is None else attrs["activations"]


def _float_packing(func: tirx.PrimFunc, name: str, roles: list[int], target: Target,
                   acc_regs: int | None) -> tirx.PrimFunc | None:
    """``func`` rebuilt to gather from the float32-activation rules' GEMV packing
    (:func:`._wgemm.take_wpacked`), where the op says its table is such a layer's weight and
    the table's shape is static; else None."""
    table = func.params[roles[0]]
    if acc_regs is None or _take_activations(func, name) != "float32" \
            or not all(isinstance(v, tirx.IntImm) for v in table.shape):
        return None
    op = "dense_q4" if name == "take_q4" else "dense_w8"
    lanes = vector_lanes(target, 32)
    nv = gemv_vectors(op, int(table.shape[0]), target, acc_regs)
    return _rebuilt(func, roles, lambda *t: take_wpacked(op, *t, lanes=lanes, nv=nv))


def _pack_at_compile_time(sch: s_tir.Schedule, func: tirx.PrimFunc, blocks) -> None:
    """Each packing block (``(name, source parameter)``) folded at compile time for a
    constant source; a runtime one packs in the kernel, the weights in parallel."""
    for name, src in blocks:
        pre = sch.get_sblock(name)
        if is_layout_free(func, func.params[src]):
            sch.annotate(pre, "meta_schedule.layout_rewrite_preproc", True)
        elif name == "wp":
            sch.parallel(sch.get_loops(pre)[0])


def schedule_take_q4(func: tirx.PrimFunc, target: Target, kernel: QKernel | None, *,
                     acc_regs: int | None = None) -> s_tir.Schedule | None:
    """A ``take_q4`` rule's body. With ``kernel``: the op rebuilt as :func:`take_q4_packed`
    (the table packed as the q8_0 ``dense_q4`` kernels on ``kernel`` pack it: folded at
    compile time for a constant table, which a tied LM head then shares; a runtime table is
    packed in the kernel, in parallel, every call), None when the table's shape is symbolic
    or the op's ``activations`` is not ``"q8_0"``. Without, for ``activations="float32"``
    and a static table, given the float rules' ``acc_regs``: gathering from their GEMV
    packing (:func:`._wgemm.take_wpacked`); otherwise the definition, gathering from ``qs``
    / ``d`` as they are. Either way each output row is one task (on one core for a few
    rows), its groups unrolled halves of vectors: 16 bytes of ``qs`` (q8_0 packing: 4 per
    vector, a tile's channel stride apart; float packing: one byte per lane, gathered)."""
    roles = _take_q4_params(func)
    if roles is None:
        return None
    packed = kernel is not None
    if packed:
        if not all(isinstance(v, tirx.IntImm) for v in func.params[roles[0]].shape) \
                or _take_activations(func, "take_q4") != "q8_0":
            return None
        func = _rebuilt(func, roles, lambda *t: take_q4_packed(*t, kernel=kernel))
    else:
        func = _float_packing(func, "take_q4", roles, target, acc_regs) or func
    qs, _, indices = (func.params[i] for i in roles)
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("take_q4")
    i, c = sch.get_loops(blk)
    rows, half = indices.shape[0], qs.shape[1]
    # (group, half, 16 bytes) or, packed, (group, half, 4 words of 4 bytes); K is static
    # and whole groups (the op checks), so no lane is predicated.
    inner = sch.split(c, [None, 2, 4, 4] if packed else [None, 2, 16])
    sch.vectorize(inner[-1])
    for lp in inner[1:-1]:
        sch.unroll(lp)
    static = isinstance(rows, tirx.IntImm) and isinstance(half, tirx.IntImm)
    if not (static and int(rows) * int(half) * 2 < _TAKE_SERIAL):
        sch.parallel(i)
    if _has_block(sch, "wp"):
        _pack_at_compile_time(sch, func, (("wp", roles[0]), ("dp", roles[1])))
    return sch


# ------------------------------------------------------ take_w8: rows of a per-channel int8 table
def take_w8_packed(w: te.Tensor, w_scale: te.Tensor, indices: te.Tensor, *,
                   kernel: QKernel) -> te.Tensor:
    """``take_w8`` gathering from the q8_0 kernels' packing of the table (:func:`pack_weights`
    with ``dense_w8``'s channel tile): row ``r`` is channel ``e = r % C`` of tile
    ``t = r // C``; its weight ``k`` is ``wp[t, k // 4, 4 e + k % 4] - w8_offset`` (the
    ``vpdpbusd`` packing stores ``w + 128``). The same integers, so the same (exact) values
    as the definition."""
    n_dim, k_dim = w.shape
    if not isinstance(n_dim, tirx.IntImm) or not isinstance(k_dim, tirx.IntImm) \
            or int(k_dim) % 4:
        raise ValueError("take_w8: the table's shape must be static, its width whole 4-byte "
                         "words, for the packed gather")
    n = int(n_dim)
    idx = str(n_dim.ty.dtype)
    nv = channel_vectors(n, kernel.lanes)
    cols = nv * kernel.lanes
    wp, _ = pack_weights("dense_w8", w, w_scale, kernel=kernel, nv=nv, idx=idx)

    def body(i, c):
        r = tirx.max(tirx.min(indices[i].astype(idx), tirx.IntImm(idx, n - 1)),
                     tirx.IntImm(idx, 0))
        t, e = r // cols, r % cols
        q = wp[t, c // 4, e * 4 + c % 4].astype("int32")
        if kernel.w8_offset:
            q = q - kernel.w8_offset
        return w_scale[r] * q.astype("float32")

    return te.compute((indices.shape[0], k_dim), body, name="take_w8")


def _take_w8_params(func: tirx.PrimFunc) -> list[int] | None:
    """The positions of ``w``, ``w_scale`` and ``indices`` among the parameters of a
    legalized ``take_w8`` (any order), or None."""
    if block_attrs(func, "take_w8", TAKE_W8_KEY, (("format", str),)) is None:
        return None
    params = list(func.params)
    if len(params) != 4 or not all(hasattr(p, "shape") for p in params):
        return None
    ins = params[:-1]
    table = [i for i, p in enumerate(ins) if len(p.shape) == 2 and str(p.dtype) == "int8"]
    scale = [i for i, p in enumerate(ins) if len(p.shape) == 1 and "float" in str(p.dtype)]
    index = [i for i, p in enumerate(ins) if len(p.shape) == 1 and "int" in str(p.dtype)]
    if len(table) != 1 or len(scale) != 1 or len(index) != 1:
        return None
    return [table[0], scale[0], index[0]]


def schedule_take_w8(func: tirx.PrimFunc, target: Target, kernel: QKernel | None, *,
                     acc_regs: int | None = None) -> s_tir.Schedule | None:
    """A ``take_w8`` rule's body. With ``kernel``: the op rebuilt as :func:`take_w8_packed`
    (the table packed as the q8_0 ``dense_w8`` kernels on ``kernel`` pack it: folded at
    compile time for a constant table, which a tied LM head then shares; a runtime table is
    packed in the kernel every call), None when the table's shape is symbolic or its width
    not whole words. Without: the definition, gathering from ``w`` as it is. Either way each
    output row is one task (on one core for a few rows), its elements in full vectors
    (packed: one vector per 4-byte word, the words a tile's channel stride apart)."""
    roles = _take_w8_params(func)
    if roles is None:
        return None
    if kernel is not None:
        if not all(isinstance(v, tirx.IntImm) for v in func.params[roles[0]].shape) \
                or int(func.params[roles[0]].shape[1]) % 4 \
                or _take_activations(func, "take_w8") != "q8_0":
            return None
        func = _rebuilt(func, roles, lambda *t: take_w8_packed(*t, kernel=kernel))
    else:
        func = _float_packing(func, "take_w8", roles, target, acc_regs) or func
    w, _, indices = (func.params[i] for i in roles)
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("take_w8")
    i, c = sch.get_loops(blk)
    if kernel is not None:
        _, word = sch.split(c, [None, 4])  # one packed word's 4 bytes: contiguous
        sch.vectorize(word)
    else:
        vectorize_loop(sch, c, vector_lanes(target, 32))
    rows, k = indices.shape[0], w.shape[1]
    static = isinstance(rows, tirx.IntImm) and isinstance(k, tirx.IntImm)
    if not (static and int(rows) * int(k) < _TAKE_SERIAL):
        sch.parallel(i)
    if _has_block(sch, "wp"):
        _pack_at_compile_time(sch, func, (("wp", roles[0]),))
    return sch
