"""Weight-only quantized dense kernels (``dense_w8``, ``dense_q4``) for CPUs: float32
activations, int8 or ggml q4_0 weights unpacked in vector registers.

A rule rebuilds the op from the attributes its definition records on the output block
(:func:`rebuild_wdense`), in one of two shapes:

- **GEMV** (a few rows, a static M < 16: an LLM's decode step). Memory-bound on the
  weights, so every weight byte is read once per call and unpacked in registers. The
  weights are repacked ``(N / lanes, K / 2, lanes)`` bytes for q4 (``(N / lanes, K, lanes)``
  for int8; the q4 group scales ``(N / lanes, K / 32, lanes)`` in their dtype, float16 for
  q4_0, widened in registers), so one vector load reads ``lanes`` consecutive output
  channels at the same k; the nibble unpack (shift, and, zero-extend, subtract 8, convert)
  and the multiply-add run on those vectors with ``x``
  broadcast. q4 sums each 32-weight group in a vector of partial sums (``part``) and
  multiplies it by the group's scales once (``acc += part * d``); int8 sums all of K and
  scales once in the write-back. Tiles of ``rows x nv`` vectors run in parallel over output
  channels (and row tiles).
- **GEMM** (M >= 16, or a symbolic M: an LLM's prefill; its short prompts pay the panel for
  a few rows, its long ones would otherwise unpack per row: GPT-2's prefill of 64 tokens
  280 -> 122 ms with int8 weights). Unpacking per row would repeat the work M times, so each
  parallel task dequantizes its N-tile of weights for all of K into a float32 panel
  (``wd``, ``(nv, K, lanes)``, computed at the N-tile loop, so it stays in L2) and runs the
  register-tiled float32 micro-kernel of :mod:`._gemm` (``MR x nv`` vectors of accumulators,
  ``tile_m`` rows) over all M rows against it; a symbolic M runs whole row tiles (the padded
  rows read the last row again), so the tile has no row predicate.

The weight packing reads only the weight (and the q4 scales), so for a constant weight the
rule marks it ``meta_schedule.layout_rewrite_preproc`` (:func:`._qgemm.pack_at_compile_time`'s
mechanism): the model pipeline splits it out and folds it at compile time. With a runtime
weight it runs in the kernel, in parallel, first.

N is padded to whole tiles in the packed weights; when N is not a multiple of the tile, the
tiles are written whole to a padded buffer and the epilogue (scale, bias, activation) runs over
the real columns in its own vectorized pass (a vector loop under a lane predicate would be
scalarized); otherwise it is the tile's write-back. M is not padded (a predicated row tile).
"""

from __future__ import annotations

from typing import Any

from tvm import s_tir, te, tirx
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from ..ops.dense_q4 import ATTRS_KEY as Q4_KEY
from ..ops.dense_q4 import GROUP
from ..ops.dense_w8 import ATTRS_KEY as W8_KEY
from ..ops.dense_w8 import activation_te
from ._core import extent_of, schedule_prologue, vector_lanes
from ._gemm import is_layout_free, tile_m, vectorize_writeback
from ._qgemm import block_attrs, op_buffers, recompute

__all__ = [
    "GEMM_ROWS",
    "gemv_vectors",
    "loops_after",
    "pack_weights",
    "rebuild_wdense",
    "schedule_wdense",
    "take_wpacked",
    "wdense_attrs",
    "wdense_match",
    "wdense_packed",
]

#: From this many (static) rows a dense layer runs as a GEMM over a dequantized panel.
GEMM_ROWS = 16

_TYPES = (("activation", str), ("has_bias", bool), ("activations", str))


def wdense_attrs(func: tirx.PrimFunc) -> tuple[str, dict[str, Any]] | None:
    """``(op name, attributes)`` of a legalized ``dense_w8`` / ``dense_q4``, or None."""
    for name, key in (("dense_w8", W8_KEY), ("dense_q4", Q4_KEY)):
        attrs = block_attrs(func, name, key, _TYPES)
        if attrs is not None:
            return name, attrs
    return None


def wdense_match(func: tirx.PrimFunc, activations: str
                 ) -> tuple[str, dict[str, Any], list[Any]] | None:
    """``(op name, attributes, buffers)`` of a legalized ``dense_w8`` / ``dense_q4`` with the
    given ``activations`` numerics and static K and N, or None (what both weight-only rule
    families, float here and integer in ``_qwgemm``, start from)."""
    found = wdense_attrs(func)
    if found is None or found[1]["activations"] != activations:
        return None
    bufs = op_buffers(func, found[1]["has_bias"], rank=2)
    if bufs is None:
        return None
    x, w = bufs[0], bufs[1]
    if not all(isinstance(e, tirx.IntImm) for e in (x.shape[1], w.shape[0])):
        return None
    return found[0], found[1], bufs


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def wdense_packed(
    op: str, x: te.Tensor, w: te.Tensor, scale: te.Tensor, bias: te.Tensor | None, *,
    lanes: int, nv: int, gemm: bool, activation: str = "none", rows: int = 1,
) -> te.Tensor:
    """``dense_w8`` (``w``: int8 ``(N, K)``, ``scale``: ``(N,)``) or ``dense_q4`` (``w``: the
    ``qs`` bytes ``(N, K / 2)``, ``scale``: ``d`` ``(N, K / 32)``) computed in packed form:
    the same value up to the order of the float32 sums (within the ops' error models).

    Blocks: ``wp`` the weights ``(Np / lanes, K or K / 2, lanes)`` (``Np``: N rounded up to
    ``lanes * nv``, zero padded), ``dp`` (q4) the group scales ``(Np / lanes, K / 32, lanes)``
    in ``scale``'s dtype (widened where used); GEMV: ``part`` (q4) the per-group sums and
    ``acc`` ``(M, Np)``; GEMM: ``wd`` the dequantized float32 weights ``(Np / lanes, K,
    lanes)`` and ``acc``; then the output ``dense_w8`` / ``dense_q4`` ``(M, N)`` with the
    scale (int8), bias and activation.

    GEMM with a symbolic M: ``acc`` has whole tiles of ``rows`` rows, the padded rows reading
    ``x``'s last row again in place (their sums are never written), so the register tile has
    no row predicate (with one, TVM kept the accumulators of all M rows in memory: 37
    against 110 GFLOP/s for an LLM's prefill).
    """
    m, k_dim = x.shape
    n_dim = w.shape[0]
    if not isinstance(k_dim, tirx.IntImm) or not isinstance(n_dim, tirx.IntImm):
        raise ValueError(f"{op}: K and N must be static for the packed kernel")
    k, n = int(k_dim), int(n_dim)
    idx = str(m.ty.dtype)

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    nb = _cdiv(n, lanes * nv) * nv
    q4 = op == "dense_q4"
    wp, dp = pack_weights(op, w, scale, lanes=lanes, nv=nv, idx=idx)
    f32 = "float32"
    if q4:
        groups = k // GROUP

        def nibble_at(b, byte_k, high, l_):  # one int4 weight as float32(q - 8)
            # In the byte domain (a 16-byte vector per `lanes` channels): the shift, mask and
            # -8 on bytes, then one widening and one convert per vector of weights.
            q = _nibble(wp[b, byte_k, l_], high)
            return (q.astype("int8") - tirx.const(8, "int8")).astype(f32)

        def nibble(b, kk, l_):  # weight kk of packed row (b, l_)
            e = kk % GROUP
            return nibble_at(b, (kk // GROUP) * 16 + e % 16, e // 16, l_)

    if gemm:
        if q4:
            wd = te.compute((dim(nb), dim(k), dim(lanes)),
                            lambda b, kk, l_: nibble(b, kk, l_)
                            * dp[b, kk // GROUP, l_].astype(f32),
                            name="wd")
        else:
            wd = te.compute((dim(nb), dim(k), dim(lanes)),
                            lambda b, kk, l_: wp[b, kk, l_].astype(f32), name="wd")
        rk = te.reduce_axis((dim(0), dim(k)), name="k")
        rows_m, last = m, None
        if rows > 1 and not isinstance(m, tirx.IntImm):
            rows_m, last = (m + dim(rows - 1)) // dim(rows) * dim(rows), m - dim(1)

        def xrow(i, kk):  # a padded row reads the last one again
            return x[i if last is None else tirx.min(i, last), kk]

        acc = te.compute(
            (rows_m, dim(nb * lanes)),
            lambda i, j: te.sum(xrow(i, rk) * wd[j // lanes, rk, j % lanes], axis=rk),
            name="acc",
        )
    elif q4:
        # Byte j of a group holds weights j (low nibble) and j + 16 (high): one load each.
        rj = te.reduce_axis((dim(0), dim(16)), name="j")
        rh = te.reduce_axis((dim(0), dim(2)), name="h")
        part = te.compute(
            (m, dim(nb * lanes), dim(groups)),
            lambda i, j, g: te.sum(
                x[i, g * GROUP + rh * 16 + rj]
                * nibble_at(j // lanes, g * 16 + rj, rh, j % lanes), axis=[rj, rh]),
            name="part",
        )
        rg = te.reduce_axis((dim(0), dim(groups)), name="g")
        acc = te.compute(
            (m, dim(nb * lanes)),
            lambda i, j: te.sum(part[i, j, rg] * dp[j // lanes, rg, j % lanes].astype(f32),
                                axis=rg),
            name="acc",
        )
    else:
        rk = te.reduce_axis((dim(0), dim(k)), name="k")
        acc = te.compute(
            (m, dim(nb * lanes)),
            lambda i, j: te.sum(x[i, rk] * wp[j // lanes, rk, j % lanes].astype(f32), axis=rk),
            name="acc",
        )

    def body(i, j):
        v = acc[i, j] if q4 else acc[i, j] * scale[j]
        if bias is not None:
            v = v + bias[j]
        return activation_te(v, activation)

    return te.compute((m, dim(n)), body, name=op)


def _nibble(byte: Any, high: Any) -> Any:
    """Weight ``high`` (0: the low nibble, 1: the high) of a q4_0 byte, as uint8 0-15."""
    return tirx.bitwise_and(tirx.shift_right(byte, (high * 4).astype("uint8")),
                            tirx.const(15, "uint8"))


def pack_weights(op: str, w: te.Tensor, scale: te.Tensor, *, lanes: int, nv: int, idx: str
                 ) -> tuple[te.Tensor, te.Tensor | None]:
    """The packed weights ``wp`` ``(Np / lanes, K or K / 2, lanes)`` and, for ``dense_q4``,
    the group scales ``dp`` ``(Np / lanes, K / 32, lanes)`` in their own dtype (None for
    ``dense_w8``), ``Np`` being N rounded up to ``lanes * nv`` (zero padded): what
    :func:`wdense_packed` reads, and the ``take_*`` gathers of a table it shares (one
    compute, so equal folded values)."""
    n, kw = (int(v) for v in w.shape)

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    nb = _cdiv(n, lanes * nv) * nv

    def inside(b, l_):
        return b * lanes + l_ < n

    zero = tirx.const(0, w.dtype)
    wp = te.compute(
        (dim(nb), dim(kw), dim(lanes)),
        lambda b, kk, l_: tirx.if_then_else(inside(b, l_), w[b * lanes + l_, kk], zero),
        name="wp",
    )
    if op != "dense_q4":
        return wp, None
    # The scales keep their dtype (a q4_0 table's float16: half the bytes a decode step
    # streams for them; the kernels widen each vector, exactly).
    dp = te.compute(
        (dim(nb), dim(int(scale.shape[1])), dim(lanes)),
        lambda b, g, l_: tirx.if_then_else(
            inside(b, l_), scale[b * lanes + l_, g], tirx.const(0.0, scale.dtype)),
        name="dp",
    )
    return wp, dp


def gemv_vectors(op: str, n: int, target: Target, acc_regs: int) -> int:
    """The channel vectors per tile (``nv``) of the one-row GEMV kernel of an ``op`` layer with
    ``n`` output channels on ``target``: with :func:`pack_weights`, the packing of an LLM
    head (it runs on the last token's row) that a tied embedding gathers from."""
    return _tile(1, n, vector_lanes(target, 32), acc_regs, False, op == "dense_q4")[1]


def take_wpacked(op: str, table: te.Tensor, scale: te.Tensor, indices: te.Tensor, *,
                 lanes: int, nv: int) -> te.Tensor:
    """``take_q4`` (``op="dense_q4"``: ``table`` the ``qs`` bytes, ``scale`` ``d``) or
    ``take_w8`` (``"dense_w8"``: the int8 ``w``, per-row ``w_scale``) gathering from
    :func:`pack_weights`'s packing of the table: row ``r`` is lane ``r % lanes`` of block
    ``r // lanes``, one byte per lane at each k. The same nibbles / integers and scales
    (float16 widened exactly), so the same exact values as the definitions."""
    n_dim, kw_dim = table.shape
    if not isinstance(n_dim, tirx.IntImm) or not isinstance(kw_dim, tirx.IntImm):
        raise ValueError(f"take ({op}): the table's shape must be static for the packed gather")
    n, kw = int(n_dim), int(kw_dim)
    idx = str(n_dim.ty.dtype)
    wp, dp = pack_weights(op, table, scale, lanes=lanes, nv=nv, idx=idx)
    q4 = op == "dense_q4"

    def body(i, c):
        r = tirx.max(tirx.min(indices[i].astype(idx), tirx.IntImm(idx, n - 1)),
                     tirx.IntImm(idx, 0))
        b, l_ = r // lanes, r % lanes
        if not q4:
            return scale[r] * wp[b, c, l_].astype("float32")
        g, j = c // GROUP, c % GROUP
        nib = _nibble(wp[b, g * 16 + j % 16, l_], j // 16)
        return dp[b, g, l_].astype("float32") * (nib.astype("int32") - 8).astype("float32")

    name = "take_q4" if q4 else "take_w8"
    return te.compute((indices.shape[0], tirx.IntImm(idx, kw * 2 if q4 else kw)), body,
                      name=name)


def _tile(m: int | None, n: int, lanes: int, acc_regs: int, gemm: bool,
          q4: bool) -> tuple[int, int]:
    """(rows, vectors) of a register tile.

    GEMV: up to 8 vectors of channels per row, holding the accumulators (and q4's group
    partial sums, as many again): a one-row GEMV has one dependent FMA chain per vector, so
    it needs several to hide the FMA latency (2 chains held the tied LM head, N = 50257, at
    half the rate of 4). GEMM: :func:`._gemm.tile_m` rows of up to 4 vectors. Tiles that
    divide N's vectors, or pad them by at most 1/16, come first; a GEMV keeps at least 8
    tiles for the cores while it can.
    """
    nvec = _cdiv(n, lanes)
    best = None
    # A symbolic M (a prefill of any length) keeps room for several rows.
    for nv in range(min(4 if gemm or m is None else 8, nvec), 0, -1):
        per_row = nv * (2 if (q4 and not gemm) else 1)
        if per_row > acc_regs and nv > 1:
            continue
        top = max(1, min(8, acc_regs // per_row))
        mr = tile_m(m, top) if m is not None else top
        tiles = _cdiv(nvec, nv)
        little_waste = (tiles * nv - nvec) * 16 <= nvec
        # Ties: the fewest loads per FMA (a weight vector counting twice a broadcast of x).
        key = (little_waste, gemm or tiles >= 8 or nv == 1, mr * nv, -(2 / mr + 1 / nv), nv)
        if best is None or key > best[0]:
            best = (key, mr, nv)
    assert best is not None
    return best[1], best[2]


def rebuild_wdense(func: tirx.PrimFunc, target: Target, acc_regs: int) -> tirx.PrimFunc | None:
    """``func`` (a legalized dense_w8 / dense_q4) recomputed as :func:`wdense_packed`, same
    signature, with the tile recorded; None when it is not one or K / N are symbolic."""
    found = wdense_match(func, "float32")  # q8_0 activations: the integer rules (_qwgemm)
    if found is None:
        return None
    op, attrs, bufs = found
    has_bias = attrs["has_bias"]
    x, w = bufs[0], bufs[1]
    mdim = x.shape[0]
    m = int(mdim.value) if isinstance(mdim, tirx.IntImm) else None
    gemm = m is None or m >= GEMM_ROWS
    lanes = vector_lanes(target, 32)
    n = int(w.shape[0])
    mr, nv = _tile(m, n, lanes, acc_regs, gemm, op == "dense_q4")
    if m is not None and not gemm:
        mr = min(mr, m)
    new = recompute(func, bufs, has_bias, lambda *ins: wdense_packed(
        op, *ins, lanes=lanes, nv=nv, gemm=gemm, activation=attrs["activation"], rows=mr))
    return (new.with_attr("opsdk.wdense_tile", [mr, nv, lanes, int(gemm)])
            .with_attr("opsdk.wdense_op", op))


def loops_after(sch: s_tir.Schedule, block: Any, anchor: Any) -> list:
    """``block``'s loops below ``anchor`` (one of its loops)."""
    loops = sch.get_loops(block)
    at = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(anchor)))
    return loops[at + 1:]


def _loops_by_iter(sch: s_tir.Schedule, block: Any, loops: list) -> dict[int, Any]:
    """Which of ``loops`` binds each iter var of ``block`` (by index; unit loops that
    compute_at left out are absent)."""
    realize = sch.get(loops[-1]).body
    while not isinstance(realize, s_tir.SBlockRealize):
        realize = realize.body if hasattr(realize, "body") else realize.seq[0]
    out = {}
    for lp in loops:
        var = sch.get(lp).loop_var
        for k, val in enumerate(realize.iter_values):
            if any(v.same_as(var) for v in undefined_vars(val)):
                out.setdefault(k, lp)
    return out


def schedule_wdense(func: tirx.PrimFunc, target: Target, *, acc_regs: int
                    ) -> s_tir.Schedule | None:
    """A weight-only dense rule's body: :func:`rebuild_wdense`, then the GEMV or the GEMM
    schedule; None when ``func`` is not such an op with static K and N."""
    packed = rebuild_wdense(func, target, acc_regs)
    if packed is None:
        return None
    mr, nv, lanes, gemm = (int(v) for v in packed.attrs["opsdk.wdense_tile"])
    op = str(packed.attrs["opsdk.wdense_op"])
    sch = s_tir.Schedule(packed)
    q4 = op == "dense_q4"
    blocks = {sch.get(b).name_hint: b for b in sch.get_child_blocks(sch.get_sblock("root"))}
    out = blocks[op]
    acc = blocks["acc"]
    n = int(packed.params[1].shape[0])
    padded = n % (lanes * nv) != 0
    if padded:  # whole tiles to a padded buffer; the epilogue in its own pass
        epi = sch.cache_write(acc, 0, "local")  # `acc` now writes the local tile
    else:
        sch.set_scope(acc, 0, "local")
        epi = out
    i, j, r = sch.get_loops(acc)
    mo, mi = sch.split(i, [None, mr])
    no, nvl, nl = sch.split(j, [None, nv, lanes])
    if gemm:
        # One parallel task per N-tile: its panel is dequantized once, for every row tile.
        sch.reorder(no, mo, r, mi, nvl, nl)
        sch.parallel(no)
        anchor = mo
        wd = blocks["wd"]
        sch.compute_at(wd, no)
        sch.vectorize(loops_after(sch, wd, no)[-1])
    else:
        sch.reorder(mo, no, r, mi, nvl, nl)
        anchor = tile = sch.fuse(mo, no)
        sch.parallel(tile)
        if q4:
            part = blocks["part"]
            sch.compute_at(part, r)
            sch.set_scope(part, 0, "local")
            by_var = _loops_by_iter(sch, part, loops_after(sch, part, r))
            pi, pj, pr, ph = by_var.get(0), by_var[1], by_var[3], by_var[4]
            pv, pl = sch.split(pj, [None, lanes])
            sch.reorder(*[lp for lp in (pr, ph, pi, pv, pl) if lp is not None])
            for lp in (ph, pi, pv):
                if lp is not None:
                    sch.unroll(lp)
            sch.vectorize(pl)
            sch.decompose_reduction(part, pr)
    sch.unroll(mi)
    sch.unroll(nvl)
    sch.vectorize(nl)
    sch.reverse_compute_at(epi, anchor)
    vectorize_writeback(sch, epi, lanes, anchor)
    sch.decompose_reduction(acc, r)
    if padded:
        schedule_prologue(sch, out, lanes)
    for name in ("wp", "dp"):
        if name not in blocks:
            continue
        src = packed.params[1 if name == "wp" else 2]
        if is_layout_free(packed, src):
            sch.annotate(blocks[name], "meta_schedule.layout_rewrite_preproc", True)
        else:
            _schedule_pack(sch, blocks[name], lanes)
    return sch


def _schedule_pack(sch: s_tir.Schedule, block: Any, lanes: int) -> None:
    """A runtime weight packing ``(blocks, k, lanes)``: blocks across the cores, the lanes
    in one vector (a gather of ``lanes`` rows: per call, but only for a non-constant
    weight)."""
    b, _, ln = sch.get_loops(block)
    sch.parallel(b)
    if extent_of(sch, ln) == lanes:
        sch.vectorize(ln)
