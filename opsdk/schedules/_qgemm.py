"""The int8 GEMM core of the ``qdense`` rules (x86 VNNI / AVX2, ARM ``sdot`` / NEON), and the
register tile the ``qconv2d`` rules (:mod:`._qconv`) share.

A rule is a strategy, as Relay's were: it rebuilds the op as :func:`~opsdk.ops.qdense.
qdense_packed` (activations moved to uint8, weights packed as 16 channels x 4 bytes, the zero
point folded into a per-channel compensation; the same integers, so the same outputs) from the
attributes the definition records on its output block, then tiles it:

- each parallel task owns a ``rows x cols`` output tile (VNNI's 6 x 64: 24 zmm accumulators;
  with 4 weight vectors and the activation broadcasts 29 of the 32 registers) and runs the whole K
  loop on it in registers, then the epilogue (compensation, requantize / dequantize) runs on
  the tile while it is in L1;
- each step of that loop is one :class:`Microkernel` instruction (``vpdpbusd`` per 16
  channels x 4 bytes of K, ``sdot`` per 4). TVM 0.27's
  ``sch.tensorize`` crashes in this build (it copies the intrinsic through
  ``tvm.ir.save_json``, which segfaults on any node with a dtype field), and its shipped VNNI
  intrinsic passes ``<16 x i32>`` where LLVM 22's ``llvm.x86.avx512.vpdpbusd.512`` takes
  ``<64 x i8>``; so the schedule blockizes the tile's loop nest and writes the register kernel
  itself (:func:`replace_with_tile_kernel`), keeping the block's read/write regions;
- tiles are ``(row tile, channel tile)`` pairs fused into one parallel loop, so a batch of one
  row still splits across the cores by channels and a symbolic batch by rows.

The target rules (``cpu/vnni.py``, ``cpu/avx2.py``, ``arm_cpu/dotprod.py``) differ only in the
activation dtype, the tile and the micro-kernel they pass to :func:`schedule_qdense`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm import s_tir, te, tirx
from tvm.target import Target

from ..ops.qdense import ATTRS_KEY, BLOCK, KGROUP, qdense_packed
from ..targets import vector_bits
from ._core import replace_block_body
from ._gemm import is_layout_free

__all__ = [
    "Microkernel",
    "block_attrs",
    "op_buffers",
    "pack_at_compile_time",
    "qdense_attrs",
    "rebuild_packed",
    "recompute",
    "region",
    "register_tile",
    "replace_with_tile_kernel",
    "schedule_qdense",
    "schedule_qdense_packed",
    "schedule_tile_epilogue",
    "schedule_weight_sums",
    "splat4",
    "vectorize_contiguous",
]


@dataclass(frozen=True)
class Microkernel:
    """One dot-product instruction: ``acc[lanes] += sum_4 a[4] * b[lanes, 4]`` (int32 += 8-bit).

    ``fn(acc, a, load_b)`` returns the new ``int32 x lanes`` accumulator from the old one, the
    4 activation bytes of one row (an ``x4`` vector) and ``load_b(offset, n)``, which loads
    ``n`` bytes of the ``lanes x 4`` packed weight group starting at byte ``offset``.
    """

    name: str
    lanes: int
    fn: Callable[[tirx.PrimExpr, tirx.PrimExpr, Callable[[int, int], tirx.PrimExpr]], Any]


def splat4(a: tirx.PrimExpr, dtype: str, copies: int) -> tirx.PrimExpr:
    """The 4 activation bytes ``a`` as one 32-bit word repeated ``copies`` times, as ``dtype``."""
    return tirx.reinterpret(dtype, tirx.Broadcast(tirx.reinterpret("int32", a), copies))


def region(blk: Any, name: str) -> Any:
    """The read or write region of ``blk`` on the buffer called ``name``."""
    for r in (*blk.reads, *blk.writes):
        if r.source.name == name:
            return r
    raise ValueError(f"block {blk.name_hint} does not access {name}")


def replace_with_tile_kernel(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, kernel: Microkernel
) -> None:
    """Replace a blockized ``rows x cols`` accumulator tile (all of K) by a register kernel.

    This is ``sch.tensorize`` at tile granularity (``tensorize`` itself crashes in this TVM
    build: it copies the intrinsic through ``tvm.ir.save_json``, which segfaults on any node with
    a dtype). The new body keeps the block's iteration vars and read/write regions:

    - the accumulators live in one buffer per row, zeroed first: TVM 0.27 keeps a "global"
      allocation under 1 KiB as a stack array, which LLVM promotes to registers, but turns a
      larger one (or any "local" one) into a ``TVMBackendAllocWorkspace`` buffer that LLVM must
      store to after every instruction (measured 2.5x slower); StorageRewrite drops the
      ``disable_lower_builtin`` annotation that would otherwise opt out;
    - ``for k/4:`` one ``kernel`` per (row, lane group), fully unrolled, reading the row's 4
      activation bytes from ``xa`` and the packed weights from ``wp``;
    - the tile is written to ``acc`` once, for the epilogue.

    Examples
    --------
    >>> from opsdk.schedules.cpu.vnni import VNNI
    >>> VNNI.name, VNNI.lanes
    ('vpdpbusd', 16)
    """
    blk = sch.get(block)
    c, a, b = region(blk, "acc"), region(blk, "xa"), region(blk, "wp")
    (r_rng, c_rng), (kb_rng, b_rng) = c.region, b.region[1:]
    rows, cols, kb = (int(e.extent) for e in (r_rng, c_rng, kb_rng))
    if cols % kernel.lanes or b_rng.extent.value != BLOCK * KGROUP:
        raise ValueError(f"tile of {cols} channels does not fit {kernel.name} x {kernel.lanes}")
    row0, col0, blk0 = r_rng.min, c_rng.min, b.region[0].min
    idx = str(row0.ty.dtype) if hasattr(row0, "ty") else "int32"
    ko = tirx.Var("ko", idx)

    def b_load(ch: int, offset: int, n: int) -> tirx.BufferLoad:
        byte = (ch % BLOCK) * KGROUP + offset
        return tirx.BufferLoad(
            b.source, [blk0 + ch // BLOCK, ko, tirx.Ramp(tirx.IntImm(idx, byte), 1, n)]
        )

    body = register_tile(
        kernel, rows, cols, idx, [(ko, kb)],
        a_word=lambda r: tirx.BufferLoad(a.source, [row0 + r, tirx.Ramp(ko * KGROUP, 1, KGROUP)]),
        b_load=b_load,
        c_index=lambda r, col: [row0 + r, tirx.Ramp(col0 + col, 1, kernel.lanes)],
        c_buffer=c.source,
    )
    replace_block_body(sch, block, body)


def register_tile(
    kernel: Microkernel,
    rows: int,
    cols: int,
    idx: str,
    k_loops: list[tuple[tirx.Var, int]],
    *,
    a_word: Callable[[int], tirx.PrimExpr],
    b_load: Callable[[int, int, int], tirx.PrimExpr],
    c_index: Callable[[int, int], list[tirx.PrimExpr]],
    c_buffer: tirx.Buffer,
) -> list[tirx.Stmt]:
    """The statements of a ``rows x cols`` int32 register tile summed over ``k_loops``.

    ``a_word(r)`` is row ``r``'s 4 activation bytes at the current k step, ``b_load(ch,
    offset, n)`` loads ``n`` bytes of the packed weight group of tile channel ``ch``,
    ``c_index(r, col)`` is where the vector of row ``r`` starting at tile channel ``col`` is
    stored in ``c_buffer``. The accumulators live in one small buffer per row (see
    :func:`replace_with_tile_kernel`); every k step is fully unrolled over the tile.
    """
    lanes, groups = kernel.lanes, cols // kernel.lanes
    regs = [tirx.decl_buffer((cols,), "int32", name=f"acc_r{r}") for r in range(rows)]

    def vec(g: int) -> tirx.Ramp:
        return tirx.Ramp(tirx.IntImm(idx, g * lanes), 1, lanes)

    steps = []
    for r in range(rows):
        a4 = a_word(r)
        for g in range(groups):
            ch = g * lanes  # first channel of the group within the tile

            def load(offset: int, n: int, ch: int = ch) -> tirx.PrimExpr:
                return b_load(ch, offset, n)

            val = kernel.fn(tirx.BufferLoad(regs[r], [vec(g)]), a4, load)
            steps.append(tirx.BufferStore(regs[r], val, [vec(g)]))
    # One step (a 1-pixel x 16-channel tile: a squeeze-excite conv on its pooled map) is the
    # loop body itself: TVM refuses a SeqStmt of length 1.
    loop: tirx.Stmt = tirx.SeqStmt(steps) if len(steps) > 1 else steps[0]
    for var, extent in reversed(k_loops):
        loop = tirx.For(var, tirx.IntImm(idx, 0), tirx.IntImm(idx, extent), tirx.ForKind.SERIAL,
                        loop)
    zero = tirx.Broadcast(tirx.IntImm("int32", 0), lanes)
    tiles = [(r, g) for r in range(rows) for g in range(groups)]
    return [
        *(tirx.AllocBuffer(reg) for reg in regs),
        *(tirx.BufferStore(regs[r], zero, [vec(g)]) for r, g in tiles),
        loop,
        *(tirx.BufferStore(c_buffer, tirx.BufferLoad(regs[r], [vec(g)]), c_index(r, g * lanes))
          for r, g in tiles),
    ]


def qdense_attrs(func: tirx.PrimFunc) -> dict[str, Any] | None:
    """The qdense attributes recorded on ``func``'s output block, or None.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.ops.qdense import qdense
    >>> from opsdk.schedules._qgemm import qdense_attrs
    >>> x = te.placeholder((2, 8), "int8", name="x")
    >>> w = te.placeholder((4, 8), "int8", name="w")
    >>> s = te.placeholder((4,), "float32", name="w_scale")
    >>> y = qdense.call_compute([x, w, s, None], qdense.default_attrs())
    >>> qdense_attrs(te.create_prim_func([x, w, s, y]))["out_dtype"]
    'int8'
    """
    return block_attrs(func, "qdense", ATTRS_KEY, QUANT_ATTR_TYPES)


#: The quantization attributes qdense and qconv2d share, with their types, as the ops record
#: them on their output block.
QUANT_ATTR_TYPES = (
    ("x_scale", float), ("x_zero_point", int), ("out_dtype", str), ("out_scale", float),
    ("out_zero_point", int), ("per_channel", bool), ("has_bias", bool),
)


def block_attrs(func: tirx.PrimFunc, block_name: str, key: str,
                types: tuple[tuple[str, type], ...]) -> dict[str, Any] | None:
    """The op attributes a definition recorded under ``key`` on ``func``'s block
    ``block_name``, converted to ``types``; None when ``func`` has no such block (it is not
    that op's function) or the block no annotation."""
    try:
        sch = s_tir.Schedule(func)
        block = sch.get(sch.get_sblock(block_name))
    except Exception:  # no (single) block of that name
        return None
    raw = block.annotations.get(key)
    if raw is None:
        return None
    plain = {k: v.value if isinstance(v, (tirx.IntImm, tirx.FloatImm)) else v
             for k, v in raw.items()}
    return {name: conv(plain[name]) for name, conv in types}


def op_buffers(func: tirx.PrimFunc, has_bias: bool, rank: int) -> list[Any] | None:
    """The input buffers ``(x, w, w_scale[, bias])`` of an int8 op's legalized function, or
    None when its parameters are not that signature (``x`` of ``rank``, ``w`` too for a conv)
    (TVM 0.27: tensor params carry their shape and dtype)."""
    bufs = list(func.params)
    if len(bufs) != (5 if has_bias else 4) or not all(hasattr(b, "shape") for b in bufs):
        return None
    if len(bufs[0].shape) != rank or len(bufs[1].shape) != (4 if rank == 4 else 2):
        return None
    return bufs[:-1]


def recompute(func: tirx.PrimFunc, bufs: list[Any], has_bias: bool,
              build: Callable[..., te.Tensor]) -> tirx.PrimFunc:
    """``func`` with its body rebuilt as ``build(x, w, w_scale, bias_or_None)`` on
    placeholders of the same buffers, keeping the signature and the function attributes."""
    names = ["x", "w", "w_scale", "bias"][: len(bufs)]
    phs = [te.placeholder(b.shape, b.dtype, name=nm) for b, nm in zip(bufs, names)]
    out = build(*phs[:3], phs[3] if has_bias else None)
    new = te.create_prim_func([*phs, out])
    for key, value in (func.attrs or {}).items():
        new = new.with_attr(key, value)
    return new


def rebuild_packed(
    func: tirx.PrimFunc, *, act_dtype: str, rows: int, cols: int
) -> tirx.PrimFunc | None:
    """``func`` (a legalized ``qdense``) recomputed as :func:`qdense_packed`, same signature.

    Returns None when ``func`` is not a qdense PrimFunc or K / N are symbolic. ``cols`` shrinks
    to N rounded up to 16 for narrow layers, so little of the tile is padding.
    """
    attrs = qdense_attrs(func)
    if attrs is None:
        return None
    has_bias = attrs.pop("has_bias")
    bufs = op_buffers(func, has_bias, rank=2)
    if bufs is None:
        return None
    x, w = bufs[0], bufs[1]
    if not all(isinstance(d, tirx.IntImm) for d in (x.shape[1], w.shape[0])):
        return None
    n = int(w.shape[0])
    cols = min(cols, -(-n // BLOCK) * BLOCK)
    new = recompute(func, bufs, has_bias, lambda *ins: qdense_packed(
        *ins, act_dtype=act_dtype, rows=rows, cols=cols, **attrs))  # type: ignore[arg-type]
    return new.with_attr("opsdk.qdense_tile", [rows, cols])


def _tile(func: tirx.PrimFunc) -> tuple[int, int]:
    rows, cols = func.attrs["opsdk.qdense_tile"]
    return int(rows), int(cols)


def vectorize_contiguous(sch: s_tir.Schedule, loop: Any, width: int) -> None:
    """Vectorize a static inner loop by the largest power of two <= ``width`` dividing it."""
    ext = sch.get(loop).extent
    if not isinstance(ext, tirx.IntImm):
        return
    v = width
    while v > 1 and ext.value % v:
        v //= 2
    if v >= 4:
        _, inner = sch.split(loop, [None, v])
        sch.vectorize(inner)


def schedule_qdense_packed(
    func: tirx.PrimFunc, target: Target, kernel: Microkernel
) -> s_tir.Schedule:
    """Tile, parallelize and vectorize a :func:`rebuild_packed` function around ``kernel``.

    Loop nest: ``parallel (row tile, channel tile)`` -> the register kernel of
    :func:`replace_with_tile_kernel` over all of K -> vectorized epilogue on the tile -> copy of
    its in-bounds part to the output. The pre-passes (activation shift, weight packing,
    compensation, output scales) run in parallel first.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.ops.qdense import qdense
    >>> from opsdk.schedules._qgemm import rebuild_packed, schedule_qdense_packed
    >>> from opsdk.schedules.cpu.vnni import VNNI
    >>> x = te.placeholder((7, 20), "int8", name="x")
    >>> w = te.placeholder((33, 20), "int8", name="w")
    >>> s = te.placeholder((33,), "float32", name="w_scale")
    >>> y = qdense.call_compute([x, w, s, None], qdense.default_attrs())
    >>> f = rebuild_packed(te.create_prim_func([x, w, s, y]), act_dtype="uint8", rows=6, cols=64)
    >>> sch = schedule_qdense_packed(f, opsdk.target("x86"), VNNI)
    >>> [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    ['xa', 'wp', 'wsum_lanes', 'wsum', 'comp', 'oscale', 'acc_o', 'qtile', 'qdense']
    """
    rows, cols = _tile(func)
    bits = vector_bits(target)
    sch = s_tir.Schedule(func)
    out = sch.get_sblock("qtile")
    i, j = sch.get_loops(out)
    mo, mi = sch.split(i, [None, rows])
    no, nj = sch.split(j, [None, cols])
    sch.reorder(mo, no, mi, nj)
    # Row-tile-major (channel-major measured no faster at 1024^3): a one-row batch still splits
    # across the cores by channel tiles. The fused index divides by the static channel-tile
    # count, so the bindings stay affine for a symbolic M (qdense_packed keeps all extents in
    # M's index type: an int32/int64 mix would fuse with casts, which later primitives reject).
    tile = sch.fuse(mo, no)
    sch.parallel(tile)

    acc = sch.get_sblock("acc")
    sch.compute_at(acc, tile)
    replace_with_tile_kernel(sch, sch.blockize(sch.get_loops(acc)[-3]), kernel)

    # Epilogue on the tile: whole vectors of int32 lanes, unrolled.
    schedule_tile_epilogue(sch, tile, mi, nj, cols, bits, "qdense")

    blocks = {sch.get(b).name_hint: b for b in sch.get_child_blocks(sch.get_sblock("root"))}
    xa_row, xa_k = sch.get_loops(blocks["xa"])
    sch.parallel(xa_row)
    if _static_k_unpadded(func):
        vectorize_contiguous(sch, xa_k, bits // 8)
    # Weight packing: walk each weight row contiguously (4-byte groups, one 32-bit move each)
    # instead of gathering 16 rows per packed group (all pre-passes at 1024 x 1024: 0.26 ->
    # 0.07 ms).
    wb, wg, we = sch.get_loops(blocks["wp"])
    wc, wk = sch.split(we, [BLOCK, KGROUP])
    sch.reorder(wb, wc, wg, wk)
    sch.vectorize(wk)
    sch.parallel(wb)
    pack_at_compile_time(sch, func, blocks["wp"])
    schedule_weight_sums(sch, blocks)
    return sch


def schedule_weight_sums(sch: s_tir.Schedule, blocks: dict[str, Any]) -> None:
    """The per-channel weight sums of the compensation: each 16-channel block's 64 byte lanes
    summed over K in one vector (blocks in parallel), then 4 lanes per channel."""
    if "wsum_lanes" not in blocks:  # absent when the zero point cancels the shift
        return
    b, e, g = sch.get_loops(blocks["wsum_lanes"])
    sch.reorder(b, g, e)
    sch.vectorize(e)
    sch.parallel(b)


def pack_at_compile_time(sch: s_tir.Schedule, func: tirx.PrimFunc, block: Any) -> None:
    """Mark the weight packing ``block`` (it reads the weight ``w`` only) as a layout rewrite
    when ``w`` is bound to a constant: SplitLayoutRewritePreproc then moves it into a function
    of its own, which FoldConstant runs once at compile time (as the float matmul rule's
    packing)."""
    w = func.params[1]
    if is_layout_free(func, w):
        sch.annotate(block, "meta_schedule.layout_rewrite_preproc", True)


def schedule_qdense(func: tirx.PrimFunc, target: Target, kernel: Microkernel, *,
                    act_dtype: str, rows: int, cols: int) -> s_tir.Schedule | None:
    """A qdense rule's body: ``func`` rebuilt by :func:`rebuild_packed` (activations as
    ``act_dtype``, ``rows x cols`` tiles) and scheduled around ``kernel``; None when ``func``
    is not a qdense it can take."""
    packed = rebuild_packed(func, act_dtype=act_dtype, rows=rows, cols=cols)
    return None if packed is None else schedule_qdense_packed(packed, target, kernel)


def schedule_tile_epilogue(sch: s_tir.Schedule, tile: Any, rows_loop: Any, cols_loop: Any,
                           cols: int, bits: int, out_block: str) -> None:
    """The epilogue of a register tile (whole vectors of int32 lanes, unrolled) and the copy
    of the tile's in-bounds part to the output block ``out_block`` (predicated on the
    edges), both inside the parallel ``tile`` loop."""
    lanes32 = bits // 32
    if cols % lanes32 == 0:
        nv, vl = sch.split(cols_loop, [None, lanes32])
        sch.vectorize(vl)
        sch.unroll(nv)
    sch.unroll(rows_loop)
    copy = sch.get_sblock(out_block)
    sch.reverse_compute_at(copy, tile)
    inner = sch.get_loops(copy)[-1]
    # A one-pixel, one-channel output leaves the copy no loop of its own under the tile,
    # and the tile loop itself is parallel, not a vector.
    if not sch.get_sref(inner).same_as(sch.get_sref(tile)):
        vectorize_contiguous(sch, inner, bits // 8)


def _static_k_unpadded(func: tirx.PrimFunc) -> bool:
    k = func.params[0].shape[1]
    return isinstance(k, tirx.IntImm) and k.value % KGROUP == 0
