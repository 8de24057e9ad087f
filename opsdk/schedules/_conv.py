"""2-D convolutions (NCHW / NHWC; 1x1, 3x3, strided, grouped, depthwise) with fused epilogues.

TVM legalizes ``conv2d`` into a padding block and one multiply-accumulate block reading the
padded input through a window (``oh * stride + kh * dilation``); FuseOps appends the
epilogue (BN-folded bias, residual add, any activation DAG). Two register-tiled schedules cover
the layouts, both matched on that structure:

- **channel vectors** (dense and grouped convs in both layouts, depthwise NHWC): the tile is
  ``MR`` output pixels of a row x ``NR`` output channels in vectors, summed over (input
  channel, kh, kw). The weights are packed ``[O / NR, ..., NR]`` (compile time for constant
  weights, like the matmul rule), each input value is broadcast once per k step. The NCHW
  write-back stores the tile transposed (pixels contiguous); its cost is one tile store per
  ``K = C * KH * KW`` FMA steps.
- **pixel vectors** (depthwise NCHW): the input channel is the output channel, so vectors run
  along the output row; ``MR`` rows x ``NR`` pixels per tile, the weight broadcast.

The padding block is a separate pass over the input (parallel, vectorized) for dense convs:
reading the padded copy keeps branches out of the inner loop. A depthwise NHWC conv and a conv
over a few input channels (a 3-channel stem) read their padding in place instead (one scalar
bounds test per pixel and tap), and a short innermost reduction (a stem's kw x c, a depthwise
window row) is unrolled.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir import Expr as PrimExpr
from tvm.ir.expr import TensorLoad
from tvm.target import Target

from ._core import _fuse, extent_of, schedule_prologue, vector_lanes
from ._gemm import (
    float32_accumulator,
    fold_epilogue,
    index_vars,
    is_layout_free,
    mac_operands,
    tile_m,
    tile_n,
    tile_writeback,
    vectorize_writeback,
)

__all__ = ["ConvInfo", "analyze_conv", "schedule_conv2d"]


@dataclass
class ConvInfo:
    """Roles of a conv block's iter vars: ``N`` batch, ``O`` output channel, ``H``/``W``
    output row/column, ``C`` input channel, ``KH``/``KW`` window, ``T`` / ``TR`` unit
    extent (spatial / reduction)."""

    main: s_tir.schedule.SBlockRV
    roles: list[str]
    x_read: int
    w_read: int
    depthwise: bool  # the input channel index uses the output channel (groups == channels)
    channels_last: bool  # the output's innermost axis is O (NHWC)
    x_pos: list[str]  # role of each index of the input access (windows as H / W)
    w_pos: list[str]  # role of each index of the weight access


def analyze_conv(sch: s_tir.Schedule, block,
                 unit_window: tuple[int, int] | None = None) -> ConvInfo | None:
    """Match a conv2d multiply-accumulate block, or None. ``unit_window``: the input's
    (row, column) dims of a 1x1 conv whose window indices ``yy + ry`` were simplified to
    ``yy`` (its padded form, :func:`_pad_channels`); they stand in for the window."""
    blk = sch.get(block)
    reads = mac_operands(blk)
    if reads is None:
        return None
    spat = [iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    red = [iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]

    def used(r) -> set:
        return set().union(*(index_vars(rg.min) for rg in r.region))

    def windows(r, other) -> list[int]:
        # A window index mixes an output pixel var (absent from the other operand, the
        # weight) with a reduction var; depthwise `ff + rc` uses the weight's ff.
        px = set(spat) - used(other)
        return [d for d, rg in enumerate(r.region)
                if index_vars(rg.min) & px and index_vars(rg.min) & set(red)]

    r0, r1 = blk.reads[reads[0]], blk.reads[reads[1]]
    wins = [windows(r0, r1), windows(r1, r0)]
    if unit_window is not None and not wins[0] and not wins[1]:
        # the input is the operand whose dims there index output pixels the other lacks
        out_vars = set().union(*(index_vars(rg.min) for rg in blk.writes[0].region))

        def pixels(r, other) -> bool:
            own = out_vars - used(other)
            return all(d < len(r.region) and index_vars(r.region[d].min) & own
                       for d in unit_window)

        if pixels(r0, r1):
            wins = [list(unit_window), []]
        elif pixels(r1, r0):
            wins = [[], list(unit_window)]
    if not wins[0] and wins[1]:
        reads = reads[::-1]
        wins = wins[::-1]
    x_read, w_read = reads
    xw = wins[0]
    if len(xw) != 2 or wins[1]:
        return None
    xr, wr = blk.reads[x_read], blk.reads[w_read]
    wvars = set().union(*(index_vars(rg.min) for rg in wr.region))
    ovars = set().union(*(index_vars(rg.min) for rg in blk.writes[0].region))
    hv = index_vars(xr.region[xw[0]].min)
    wv = index_vars(xr.region[xw[1]].min)
    roles = []
    for iv in blk.iter_vars:
        v = iv.var
        ext = iv.dom.extent
        unit = isinstance(ext, tirx.IntImm) and ext.value == 1
        if iv.iter_type == tirx.IterVar.DataPar:
            if v in hv:
                roles.append("H")
            elif v in wv:
                roles.append("W")
            elif v in wvars and v in ovars:
                roles.append("O")
            elif v in ovars and not unit:
                roles.append("N")
            else:
                roles.append("T")
        else:
            if v in hv:
                roles.append("KH")
            elif v in wv:
                roles.append("KW")
            elif unit:
                roles.append("TR")  # a unit reduction (depthwise: one input channel)
            else:
                roles.append("C")
    if roles.count("O") != 1 or roles.count("H") != 1 or roles.count("W") != 1:
        return None
    ivars = [iv.var for iv in blk.iter_vars]
    o_var = ivars[roles.index("O")]
    depthwise = any(o_var in index_vars(rg.min) for rg in xr.region)

    def positions(r) -> list[str]:
        pos = []
        for d, rg in enumerate(r.region):
            vs = index_vars(rg.min)
            if r is xr and d == xw[0]:
                pos.append("H")
            elif r is xr and d == xw[1]:
                pos.append("W")
            else:
                hit = {ro for ro, v in zip(roles, ivars) if v in vs and ro not in ("T", "TR")}
                if not hit:
                    pos.append("T")  # a unit-extent iterator or a constant index
                else:
                    pos.append(hit.pop() if len(hit) == 1 else ("O" if o_var in vs else "?"))
        return pos

    x_pos, w_pos = positions(xr), positions(wr)
    if "?" in w_pos or w_pos.count("O") != 1:
        return None
    out_pos = positions(blk.writes[0])
    return ConvInfo(block, roles, x_read, w_read, depthwise, out_pos[-1] == "O", x_pos, w_pos)


def schedule_conv2d(
    func: tirx.PrimFunc,
    target: Target,
    *,
    acc_regs: int,
    max_vecs: int = 4,
) -> s_tir.Schedule | None:
    """Register-tiled direct convolution of a fused conv2d PrimFunc, or None.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te, topi
    >>> from opsdk.schedules._conv import schedule_conv2d
    >>> x, w = te.placeholder((1, 8, 10, 10), name="x"), te.placeholder((16, 8, 3, 3), name="w")
    >>> y = topi.nn.conv2d_nchw(x, w, 1, 1, 1)
    >>> schedule_conv2d(te.create_prim_func([x, w, y]), opsdk.target("x86"), acc_regs=24) \\
    ...     is not None
    True
    """
    lanes_max = vector_lanes(target, 32)
    padded = _pad_channels(func, lanes_max)
    if padded is not None:
        out = _schedule(padded[0], target, acc_regs, max_vecs, lanes_max, padded[1])
        if out is not None:
            return out
        # (the padded form lost a unit output row or column to simplification: the
        # unpadded conv is scheduled as before)
    return _schedule(func, target, acc_regs, max_vecs, lanes_max, None)


def _schedule(func, target, acc_regs, max_vecs, lanes_max, unit_window):
    padded = unit_window is not None
    sch = s_tir.Schedule(func)
    blocks, main = _main_block(sch)
    if main is None:
        return None
    info = analyze_conv(sch, main, unit_window)
    if info is None or not float32_accumulator(sch.get(main)):
        return None
    loops = sch.get_loops(main)
    if len(loops) != len(info.roles):
        return None
    producers = blocks[: blocks.index(main)]
    w_pad = final = None
    if padded:
        # The padded weights' block packs them (at compile time for constants); the tiles
        # are written back whole to the block's padded output and the epilogue runs over
        # the real channels in a vectorized pass of its own (a tile's write-back masked to
        # 38 of 40 channels would be scalar).
        wbuf = sch.get(main).reads[info.w_read].source
        w_pad = next((p for p in producers
                      if any(w.source.same_as(wbuf) for w in sch.get(p).writes)), None)
        folded = fold_epilogue(sch, main)
        if w_pad is None or not folded:
            return None
        producers = [p for p in producers if not sch.get(p).same_as(sch.get(w_pad))]
        final = folded[0]
        epi = sch.cache_write(main, 0, "local")
    else:
        epi = tile_writeback(sch, main)
    if epi is None:
        return None
    group = _group_lanes(sch, info, loops, lanes_max) if info.channels_last else None
    in_place = False  # a producer (the padding) inlined: input loads carry bounds tests
    for p in producers:
        if _is_copy(sch, p):
            # TVM's conv makes a pad_temp stage even without padding (every 1x1 conv): read
            # in place, it costs nothing, where its own pass read and wrote the whole input
            sch.compute_inline(p)
            continue
        # Depthwise channels-last: the padding is read in place (its bounds test is one
        # scalar branch per pixel and tap, the same for every channel of the vector), which
        # saves a pass over the input that costs about as long as the conv itself (measured:
        # 3x3 on 144x56x56, one core, 0.45 ms with the pass, 0.33 ms without). A dense conv
        # reuses each padded value across its output channels: there the branches cost more
        # than the pass (64 -> 64 channels: 1.86 ms inlined, 1.14 ms with the pass).
        # A conv over a few input channels (a 3-channel stem) reuses each padded value only
        # across its few taps: a separate pass over the input costs more than the branches
        # (3 -> 16 3x3 stride 2 at 224x224, hardswish: 0.48x the time inlined).
        if (info.channels_last and info.depthwise and not group) or \
                _few_channels(sch, info, loops):
            try:
                sch.compute_inline(p)
                in_place = True
                continue
            except Exception:
                pass
        schedule_prologue(sch, p, lanes_max)
    by_role: dict[str, list] = {}
    for lp, r in zip(loops, info.roles):
        by_role.setdefault(r, []).append(lp)
    if info.depthwise and not info.channels_last:
        return _pixel_vectors(sch, func, info, by_role, epi, lanes_max, acc_regs, max_vecs)
    out = _channel_vectors(sch, func, info, by_role, epi, lanes_max, acc_regs, in_place,
                           group, w_pad)
    if out is not None and final is not None:
        schedule_prologue(out, final, lanes_max)
    return out


def _main_block(sch: s_tir.Schedule) -> tuple[list, s_tir.schedule.SBlockRV | None]:
    """The root's blocks and its one reduction block (the conv), or None beside them when
    there is not exactly one."""
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    reds = [b for b in blocks
            if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)]
    return blocks, reds[0] if len(reds) == 1 else None


def _pad_channels(func: tirx.PrimFunc,
                  lanes_max: int) -> tuple[tirx.PrimFunc, tuple[int, int]] | None:
    """``func`` with a dense channels-last conv's output channels padded to whole vectors of
    8 (4 on NEON's 4-lane registers), or of the full width where that adds at most a
    quarter, with the input's (row, column) dims (a 1x1 conv's window indices are
    simplified away on the way), or None when they need none.

    RexNet's 38 / 27 / 61 channels took one odd-sized vector (or a lane-predicated tile):
    LLVM kept the 8-pixel accumulator tile of 38-lane rows as a stack array (1249 stack
    accesses, 644 lane inserts in a 1x1 conv's code) and ran it at 7-10 GF/s where 32 or 48
    channels run 110-226. The conv block is padded like TVM's ``pad_einsum`` pads a GEMM (its
    windowed input read goes through ``reindex`` for it, then back), so the weights read
    zeros beyond the real channels and the block computes whole tiles without a predicate."""
    sch = s_tir.Schedule(func)
    _, main = _main_block(sch)
    if main is None:
        return None
    info = analyze_conv(sch, main)
    if info is None or info.depthwise or not info.channels_last:
        return None
    loops = sch.get_loops(main)
    if len(loops) != len(info.roles):
        return None
    step = 8 if lanes_max >= 8 else lanes_max
    o_ext = extent_of(sch, loops[info.roles.index("O")])
    if o_ext is not None and o_ext >= 2 * lanes_max and o_ext % lanes_max \
            and -o_ext % lanes_max <= o_ext // 4:
        # Full-width vectors where padding to them costs at most a quarter more channels:
        # RegNetX's 152 channels ran as 19 8-lane vectors at half the FMA width (a 1x1 at
        # 14 x 14: 99 GF/s; in 160 channels of 16 lanes 221, one Zen 5, 2 threads).
        step = lanes_max
    if o_ext is None or o_ext <= step or o_ext % step == 0:
        return None
    try:
        rb = sch.reindex(main, ("read", info.x_read))
        sch.pad_einsum(main, [step if r == "O" else 1 for r in info.roles])
        sch.compute_inline(rb)
    except Exception:  # a conv this does not fit keeps the odd tile (slow, still right)
        return None
    return sch.mod["main"], (info.x_pos.index("H"), info.x_pos.index("W"))


def _group_lanes(sch, info: ConvInfo, loops, lanes_max: int) -> int | None:
    """Vector lanes for a grouped conv (several input channels per group: its input channel
    index is ``o // G * Cg + c``, summed over ``Cg > 1``): the widest power of two, at
    least 4, that divides the ``G`` output channels of a group, so every lane of a vector
    reads the same input channel (one broadcast, where the depthwise path gathered 16
    lanes from 2 groups: RegNetX-200MF's 8-wide groups at 10 GF/s). None for a dense or
    depthwise conv, or a group width no such vector divides."""
    if not info.depthwise:
        return None
    c = [extent_of(sch, lp) for lp, r in zip(loops, info.roles) if r == "C"]
    if len(c) != 1 or c[0] is None or c[0] < 2:
        return None
    xr = sch.get(info.main).reads[info.x_read]
    pos = [d for d, p in enumerate(info.x_pos) if p == "O"]
    if len(pos) != 1:
        return None

    def divisor(e) -> int | None:
        if isinstance(e, tirx.FloorDiv) and isinstance(e.b, tirx.IntImm):
            return int(e.b.value)
        for k in ("a", "b"):
            sub = getattr(e, k, None)
            if isinstance(sub, PrimExpr):
                d = divisor(sub)
                if d:
                    return d
        return None

    g = divisor(xr.region[pos[0]].min)
    if g is None:
        return None
    ln = lanes_max
    while ln >= 4 and g % ln:
        ln //= 2
    return ln if ln >= 4 else None


def _is_copy(sch, block) -> bool:
    """Whether ``block`` only copies (a padding stage of zero padding: no bounds test)."""
    body = sch.get(block).body
    return isinstance(getattr(body, "value", None), TensorLoad)


def _few_channels(sch, info: ConvInfo, loops) -> bool:
    """Whether the reduction runs over fewer than :data:`_FEW_CHANNELS` input channels."""
    c = [extent_of(sch, lp) for lp, r in zip(loops, info.roles) if r == "C"]
    return len(c) == 1 and c[0] is not None and c[0] < _FEW_CHANNELS


#: Input channels below which a dense conv reads its padding in place (a 3-channel stem).
_FEW_CHANNELS = 8


def _pack_weights(sch, func, info: ConvInfo, nr: int, lanes: int, w_pad=None) -> None:
    """Weights in ``[O / nr, <other axes in their order>, nr]``: one k step loads ``nr``
    consecutive output channels. A constant weight is packed at compile time. ``w_pad``: the
    block that zero-pads the weights' channels (:func:`_pad_channels`) packs them instead of
    a copy."""
    blk = sch.get(info.main)
    wbuf = blk.reads[info.w_read].source
    pos = info.w_pos

    def pack(*idx):
        o = next(i for i, p in zip(idx, pos) if p == "O")
        rest = [i for i, p in zip(idx, pos) if p != "O"]
        return [o // nr, *rest, o % nr]

    o_ext = wbuf.shape[pos.index("O")]
    exact = isinstance(o_ext, tirx.IntImm) and o_ext.value % nr == 0
    if w_pad is not None:
        src = sch.get(w_pad).reads[0].source
        sch.transform_layout(info.main, ("read", info.w_read), pack,
                             pad_value=None if exact else 0.0)
        if is_layout_free(func, src):
            sch.annotate(w_pad, "meta_schedule.layout_rewrite_preproc", True)
        else:
            schedule_prologue(sch, w_pad, lanes)
        return
    wp = sch.cache_read(info.main, info.w_read, "global")
    # A partial last channel tile reads zeros from the padded weights (its outputs are
    # masked off in the write-back).
    sch.transform_layout(info.main, ("read", info.w_read), pack,
                         pad_value=None if exact else 0.0)
    if is_layout_free(func, wbuf):
        sch.annotate(wp, "meta_schedule.layout_rewrite_preproc", True)
    else:
        schedule_prologue(sch, wp, lanes)


def _tile(sch, info, epi, lanes, *, outer, tile, red, rows, vecs, vec, parallel=None):
    """The register tile's loop nest: ``outer``, the ``tile`` loop, the reduction, then the
    unrolled ``rows`` and ``vecs`` around the ``vec`` lanes; the write-back at the tile, the
    ``parallel`` loops (default: ``outer``) across the cores, the init hoisted."""
    sch.reorder(*outer, tile, *red, rows, vecs, vec)
    for lp in _short_inner(sch, red):
        sch.unroll(lp)
    sch.reverse_compute_at(epi, tile)
    vectorize_writeback(sch, epi, lanes, tile)
    sch.unroll(rows)
    sch.unroll(vecs)
    sch.vectorize(vec)
    sch.parallel(_fuse(sch, parallel if parallel is not None else outer))
    if red:
        sch.decompose_reduction(info.main, red[0])
    return sch


def _pixel_channel_tile(w_ext, o_ext, lanes_max, regs, depthwise, long_k=False,
                        pixels_first=False, gather=False, overlap_ok=False):
    """(lanes, channel vectors, pixels, overlapped) of a channel-vector tile.

    Depthwise: one channel vector x :data:`_DEPTHWISE_PIXELS` pixels of the row. Each FMA
    needs its own input vector, so what a tile can save is the weight loads: one weight
    vector per tap serves the tile's pixels (9 loads per 8 FMAs), where a tile of every
    channel vector at one pixel loaded a weight with every input (2 per FMA). One Zen 4
    core, 3x3 with ReLU6, us (the old all-channels tile -> 1 x 8): 144 ch 56x56 177 -> 90,
    stride 2 46 -> 37, 192 ch 28x28 60 -> 35, 576 ch 14x14 48 -> 34, 96 ch 112x112 stride 2
    117 -> 109, 32 ch 112x112 87 -> 79, 960 ch 7x7 20 -> 20; 5x5 240 ch 28x28 107 -> 95.
    Several vectors per tile did worse (3 x 8: 318 us on 144 ch at 56x56; 2 x 4 to 2 x 6
    level with 1 x 8 there but 1.1-1.6x slower on 576 ch at 14x14 and 32 ch at 112x112).

    Dense and grouped: the channel-vector count (dividing the channel vectors) and pixel count
    (dividing the row where one up to :data:`_MAX_TILE_PIXELS` does), ``MR x NV``
    accumulators plus the ``NV`` weight vectors within ``regs``.

    ``pixels_first`` (the input read from memory or a padded copy): a tile without a tail,
    then the fewest loads per FMA (``2 / MR + 1 / NV``: a weight vector counts twice an
    input broadcast), then the most pixels. With AVX-512's or NEON's 32 registers that is
    the most pixels; with AVX2's 16 it trades pixels for channel vectors (one core, Zen 3,
    NHWC 1x1 convs, GF/s: 28x28 128 -> 512 4 x 2 77, 7 x 1 60; 56x56 64 -> 64 4 x 2 68,
    8 x 1 35; 14x14 1024 -> 256 2 x 4 57, 7 x 1 45). A predicated tail tile (6 + 6 + 2
    pixels of a 14-pixel row) cost more than its extra accumulators gain (1x1 256 -> 1024 at
    14x14, one core: 6 x 4 with a tail 45 GF/s, 2 x 8 74, 7 x 2 76).
    The weight panel of a tile (``K x NR`` floats, 128 KiB at K = 1024) streams
    from L2 once per tile while each pixel's inputs stay in L1, so a tile's weight loads per
    FMA are ``1 / MR``. Measured (one core, CPU time, ResNet-50's NHWC convs): 1x1 1024 -> 256
    at 14x14 7 x 2 97 GF/s (was 6 x 4 with a tail, 52); 512 -> 2048 at 7x7 97 (59); 256 -> 128
    at 56x56 8 x 2 79 (was 2 x 8, 51); MobileNet's 80 -> 480 at 14x14 keeps 7 x 3.
    Otherwise (a few-channel stem reading its padding in place: each pixel's input load
    carries a bounds test) the most accumulators, ties to the wider tile (3 -> 64 7x7 stride
    2 at 112x112: 4 x 4 0.85x the time of 8 x 2), and with a long reduction (``long_k``: at
    least 256 products per output) a tail tile competes by its accumulators that do useful
    work.
    """
    lanes, _ = tile_n(o_ext, lanes_max, _MAX_CHANNEL_VECTORS)
    if depthwise and not gather and lanes > lanes_max:
        # No vector divides the channels (162): whole vectors and a partial last tile (see
        # _channel_vectors), where one odd vector of every channel kept its 8-pixel
        # accumulator tile on the stack (2-5 % of the roof).
        lanes = lanes_max
    if gather:
        # A depthwise multiplier reads input channel o / m: over one vector of every
        # channel (no 4-lane vector divides them) that gather took LLVM 43 s to compile
        # (31 channels x 3 = 93 lanes); full vectors with a partial last tile take 2 s.
        # (Without a multiplier the partial tile overlaps the one before it instead of
        # being predicated, which took LLVM 11 s for 97 channels: see _channel_vectors.)
        lanes = min(lanes, lanes_max)
    nvec = -(-o_ext // lanes)
    cands = [v for v in range(1, min(nvec, _MAX_CHANNEL_VECTORS) + 1) if nvec % v == 0]
    if depthwise:
        return lanes, 1, tile_m(w_ext, _DEPTHWISE_PIXELS), False
    best = over = None
    for v in cands:
        top = max(1, min(_MAX_TILE_PIXELS, (regs - v) // v))
        mr = tile_m(w_ext, top)
        exact = w_ext is None or w_ext % mr == 0
        if pixels_first:
            # Loads per FMA, a weight vector (from the panel streaming through L2) counting
            # twice an input broadcast (from L1): the most pixels where registers allow it.
            key = (exact, -(2 / mr + 1 / v), mr)
            if overlap_ok and w_ext is not None:
                # Exact tiles, and whole tiles with the last one moved back to end at the
                # row's end (_overlap_last_tile) where no tile divides the row (Inception's
                # 17 pixels: 1 x 12 vectors exactly, 2 loads per FMA; 6 + 6 + 6 overlapped
                # with 4 vectors), each costed per useful output; see below.
                mr = max(r for r in range(1, top + 1) if w_ext % r == 0)
                key = (True, -_pixel_cost(mr, v, w_ext), -(2 / mr + 1 / v), mr, False)
                if w_ext > top:
                    mo = min(range(2, top + 1),
                             key=lambda r: (_pixel_cost(r, v, w_ext), -r), default=1)
                    alt = (True, -_pixel_cost(mo, v, w_ext), -(2 / mo + 1 / v), mo, True)
                    if w_ext % mo and (over is None or alt > over[0]):
                        over = (alt, v, mo)
        else:
            if long_k and w_ext is not None and mr < top <= w_ext:
                mr = top  # a long reduction amortizes the tail tile: every register in use
                exact = w_ext % mr == 0
            # Accumulators doing useful work: a tail tile computes a whole tile (7 pixels as
            # 6 + 1 waste 5 of 12).
            useful = mr * v * (w_ext / (-(-w_ext // mr) * mr) if w_ext else 1.0)
            key = (exact or long_k, useful, v)
        if best is None or key > best[0]:
            best = (key, v, mr)
    if over is not None and -over[0][1] < -best[0][1] * _OVERLAP_GAIN:
        # the overlapped tile only where it clearly beats every exact one: the exact tiles'
        # order was measured (the docstring's numbers), the overlap's cost is modelled
        return lanes, over[1], over[2], True
    return lanes, best[1], best[2], False


#: An overlapped pixel tile (:func:`_pixel_channel_tile`) must cost this much less than the
#: best exact one (its recomputed pixels are counted in :func:`_pixel_cost` already).
_OVERLAP_GAIN = 0.85


def _pixel_cost(mr: int, v: int, w_ext: int | None) -> float:
    """A tile's time per useful output, in FMA issues: the FMAs, or the loads when they
    dominate (a weight vector counts twice an input broadcast, as in the tile choice), over
    the share of pixels that are not recomputed (a tile overlapping the one before it)."""
    useful = 1.0 if w_ext is None else w_ext / (-(-w_ext // mr) * mr)
    return max(1.0, 2 / mr + 1 / v) / useful


def _short_inner(sch, red: list) -> list:
    """The innermost reduction loops whose trip counts multiply to at most
    :data:`_UNROLL_REDUCTION` (a 3-channel stem's kw x c, a depthwise window row): unrolled,
    they leave no loop overhead between a tile's few FMAs per step."""
    out, prod = [], 1
    for lp in reversed(red):
        ext = extent_of(sch, lp)
        if ext is None or prod * ext > _UNROLL_REDUCTION:
            break
        prod *= ext
        out.append(lp)
    return out if prod > 1 else []


#: Largest fully unrolled inner reduction (products per accumulator per step).
_UNROLL_REDUCTION = 16

#: Most output pixels in one dense channel-vector tile (the matmul tile's row limit).
_MAX_TILE_PIXELS = 8

#: Output pixels of a depthwise tile (one channel vector): :func:`_pixel_channel_tile`.
_DEPTHWISE_PIXELS = 8

#: Most output-channel vectors in one channel-vector tile (12 x 16 = 192 channels).
_MAX_CHANNEL_VECTORS = 12


def _multiplier(sch, info: ConvInfo) -> bool:
    """Whether a depthwise conv has a channel multiplier: its input channel index divides
    the output channel (``o // m + rc``)."""
    if not info.depthwise:
        return False
    xr = sch.get(info.main).reads[info.x_read]
    pos = [d for d, p in enumerate(info.x_pos) if p == "O"]

    def divides(e) -> bool:
        if isinstance(e, (tirx.FloorDiv, tirx.Div)):
            return True
        return any(divides(getattr(e, k)) for k in ("a", "b")
                   if isinstance(getattr(e, k, None), PrimExpr))

    return not pos or divides(xr.region[pos[0]].min)


def _out_positions(sch, info: ConvInfo) -> list[str]:
    blk = sch.get(info.main)
    o_var = next(iv.var for iv, r in zip(blk.iter_vars, info.roles) if r == "O")
    return ["O" if o_var in index_vars(rg.min) else "-" for rg in blk.writes[0].region]


def _channel_vectors(sch, func, info, by_role, epi, lanes_max, acc_regs, in_place=False,
                     group=None, w_pad=None):
    (o,), (h,), (w,) = by_role["O"], by_role["H"], by_role["W"]
    o_ext, w_ext = extent_of(sch, o), extent_of(sch, w)
    if o_ext is None:
        return None
    # The weight vectors reused across the tile's pixels take registers too: 24 accumulators
    # + their vectors fit AVX-512's or NEON's 32 registers, 12 + theirs AVX2's 16.
    k_len = 1
    for r in ("C", "KH", "KW"):
        for lp in by_role.get(r, []):
            k_len *= extent_of(sch, lp) or 1
    lanes, nv, mr, pix_overlap = _pixel_channel_tile(
        w_ext, o_ext, group or lanes_max, acc_regs + acc_regs // 6,
        info.depthwise and not group, long_k=k_len >= 256, pixels_first=not in_place,
        gather=_multiplier(sch, info) and not group,
        overlap_ok=info.channels_last and not info.depthwise)
    nr = lanes * nv
    overlap = info.depthwise and not group and o_ext > nr and o_ext % nr != 0 \
        and info.w_pos[-1] == "O"
    if not overlap:  # (a depthwise weight row is contiguous over the channels already)
        _pack_weights(sch, func, info, nr, lanes_max, w_pad)
    if not info.channels_last:
        # The accumulator tile keeps channels innermost (contiguous vectors); only the
        # write-back reads it transposed.
        def channels_last(*idx):
            return [*(i for i, p in zip(idx, out_pos) if p != "O"),
                    next(i for i, p in zip(idx, out_pos) if p == "O")]

        out_pos = _out_positions(sch, info)
        sch.transform_layout(info.main, ("write", 0), channels_last)
    oo, oi = sch.split(o, [None, nr])
    ov, ol = sch.split(oi, [None, lanes])
    wo, wi = sch.split(w, [None, mr])
    # Reduction order follows the input's memory order (kw innermost in NCHW, c in NHWC).
    red_roles = [r for r in info.x_pos if r in ("C", "H", "W")]
    red = []
    for r in red_roles:
        key = {"C": "C", "H": "KH", "W": "KW"}[r]
        red += by_role.get(key, [])
    red += [lp for r in ("C", "KH", "KW", "TR") for lp in by_role.get(r, []) if lp not in red]
    batch = by_role.get("N", []) + by_role.get("T", [])
    if not overlap:
        wo_var = sch.get(wo).loop_var
        out = _tile(sch, info, epi, lanes, outer=[*batch, oo, h], tile=wo, red=red,
                    rows=wi, vecs=ov, vec=ol)
        # The pixel tiles of a row run in one thread (the parallel loop is outside them), so
        # a moved last tile rewrites its overlap with the same values, never concurrently.
        return _overlap_last_tile(out, wo_var, mr, w_ext) if pix_overlap else out
    # A depthwise conv whose channels no vector divides (RexNet's 162): whole vectors, the
    # last tile partial. Its lane predicate would scalarize every tile's vector loop (and
    # TVM's loop_partition crashes on this nest), so the last tile is moved back to end at
    # the last channel instead; the channel tiles run inside a parallel loop over the rows.
    oo_var = sch.get(oo).loop_var
    out = _tile(sch, info, epi, lanes, outer=[*batch, h, oo], tile=wo, red=red, rows=wi,
                vecs=ov, vec=ol, parallel=[*batch, h])
    return _overlap_last_tile(out, oo_var, nr, o_ext)


def _overlap_last_tile(sch, oo_var, nr: int, o_ext: int):
    """The last tile of the loop ``oo_var`` (``nr`` wide, over ``o_ext``) moved back to end
    at the loop's end (``min(oo * nr, o_ext - nr)``): a depthwise conv's channel tiles, a
    dense conv's pixel tiles. It recomputes a few elements of the tile before it, the same
    values, and no tile has an edge predicate left (each is proved true and dropped), so
    every tile is whole. The caller keeps the tiles of one loop in one thread, so the
    overlap is never written concurrently."""
    from tvm.ir import Range
    from tvm.sym import Analyzer
    from tvm_ffi.structural import structural_mutate, structural_walk

    last = o_ext - nr

    def mul(node, mut):
        if (node.a.same_as(oo_var) and isinstance(node.b, tirx.IntImm)
                and int(node.b.value) == nr):
            return tirx.Min(node, tirx.IntImm(node.b.ty.dtype, last))
        return mut.default_mutate(node)

    f = structural_mutate(sch.mod["main"], [(tirx.Mul, mul)])
    ana = Analyzer()

    def bind(loop) -> None:
        ana.bind(loop.loop_var, Range.from_min_extent(loop.min, loop.extent))

    structural_walk(f, [(tirx.For, bind)])

    def conjuncts(e) -> list:
        return [*conjuncts(e.a), *conjuncts(e.b)] if isinstance(e, tirx.And) else [e]

    def realize(node, mut):
        node = mut.default_mutate(node)
        keep = [c for c in conjuncts(node.predicate)
                if not (oo_var in index_vars(c) and ana.can_prove(c))]
        pred = keep[0] if keep else tirx.IntImm("bool", 1)
        for c in keep[1:]:
            pred = tirx.And(pred, c)
        return s_tir.SBlockRealize(node.iter_values, pred, node.block)

    return s_tir.Schedule(structural_mutate(f, [(s_tir.SBlockRealize, realize)]))


def _pixel_vectors(sch, func, info, by_role, epi, lanes_max, acc_regs, max_vecs):
    (o,), (h,), (w,) = by_role["O"], by_role["H"], by_role["W"]
    w_ext, h_ext = extent_of(sch, w), extent_of(sch, h)
    if w_ext is None:
        return None
    lanes, nv = tile_n(w_ext, lanes_max, max_vecs)
    if w_ext % (lanes * nv):
        # A partial last tile is predicated lane by lane, which LLVM compiled for 18 s
        # (65 pixels in 4 x 16-lane tiles, 3x3). One odd vector dividing the row instead
        # (66 pixels: 2 x 33), else the narrowest predicated tile (one vector: 4 s).
        div = [v for v in range(lanes_max, lanes_max * max_vecs + 1) if w_ext % v == 0]
        lanes, nv = (div[-1], 1) if div else (lanes, 1)
    nr = lanes * nv
    mr = tile_m(h_ext, max(1, min(4, acc_regs // nv)))
    wo, wi = sch.split(w, [None, nr])
    wv, wl = sch.split(wi, [None, lanes])
    ho, hi = sch.split(h, [None, mr])
    red = [lp for r in ("C", "KH", "KW", "TR") for lp in by_role.get(r, [])]
    batch = by_role.get("N", []) + by_role.get("T", [])
    return _tile(sch, info, epi, lanes, outer=[*batch, o, ho], tile=wo, red=red,
                 rows=hi, vecs=wv, vec=wl, parallel=[*batch, o])
