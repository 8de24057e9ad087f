"""The int8 convolution schedule shared by the x86 VNNI and the ARM sdot / NEON ``qconv2d`` rules.

Like the qdense rules, a rule is a strategy: it rebuilds the op as
:func:`~opsdk.ops.qconv2d.qconv2d_packed` (input re-biased, zero-point padded and laid out
``(N, C/4, H', W', 4)`` once; weights packed 16 channels x 4 bytes per window tap; the zero
point folded into a per-channel compensation: the same integers, so the same outputs) and
tiles it as a direct convolution, no im2col:

- each parallel task owns ``rows`` output pixels of one output row x ``cols`` output
  channels and keeps them in registers over all input channels and window taps; each step
  broadcasts one pixel's 4 channels (one 32-bit word of the blocked input) against 16 (x86)
  or 4 (ARM) channels of packed weights with one dot-product instruction;
- the epilogue (compensation, requantize / dequantize) runs on the tile while it is in L1,
  and the valid part is written in the op's layout (NCHW or NHWC).

A depthwise conv has no dot product over input channels (each output channel reads its own),
so :func:`schedule_qconv2d_depthwise` vectorizes its int32 multiply-adds along the contiguous
output axis instead (channels in NHWC, the output row in NCHW) over a padded int16 copy of
the input (:func:`~opsdk.ops.qconv2d.qconv2d_depthwise_padded`).
"""

from __future__ import annotations

from typing import Any

from tvm import s_tir, tirx
from tvm.target import Target

from ..ops.qconv2d import ATTRS_KEY, conv_geometry, qconv2d_depthwise_padded, qconv2d_packed
from ..ops.qdense import BLOCK, KGROUP
from ..targets import vector_bits
from ._core import _fuse, replace_block_body, vector_lanes, vectorize_loop
from ._gemm import is_layout_free
from ._qgemm import (
    QUANT_ATTR_TYPES,
    Microkernel,
    block_attrs,
    op_buffers,
    pack_at_compile_time,
    recompute,
    region,
    register_tile,
    schedule_tile_epilogue,
    schedule_weight_sums,
    vectorize_contiguous,
)

__all__ = [
    "qconv2d_attrs",
    "rebuild_qconv2d",
    "schedule_qconv2d",
    "schedule_qconv2d_depthwise",
    "schedule_qconv2d_packed",
]

_ATTR_TYPES = (
    ("layout", str), ("stride", int), ("padding", int), ("depthwise", bool),
    *QUANT_ATTR_TYPES,
)


def qconv2d_attrs(func: tirx.PrimFunc) -> dict[str, Any] | None:
    """The qconv2d attributes recorded on ``func``'s output block, or None.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.ops.qconv2d import qconv2d
    >>> from opsdk.schedules._qconv import qconv2d_attrs
    >>> x = te.placeholder((1, 4, 6, 6), "int8", name="x")
    >>> w = te.placeholder((8, 4, 3, 3), "int8", name="w")
    >>> s = te.placeholder((8,), "float32", name="w_scale")
    >>> y = qconv2d.call_compute([x, w, s, None], {**qconv2d.default_attrs(), "padding": 1})
    >>> qconv2d_attrs(te.create_prim_func([x, w, s, y]))["padding"]
    1
    """
    return block_attrs(func, "qconv2d", ATTRS_KEY, _ATTR_TYPES)


def rebuild_qconv2d(
    func: tirx.PrimFunc, *, act_dtype: str, rows: int, cols: int
) -> tirx.PrimFunc | None:
    """``func`` (a legalized, not depthwise ``qconv2d``) recomputed as
    :func:`~opsdk.ops.qconv2d.qconv2d_packed` with the same signature, or None (not a
    qconv2d, depthwise, or sizes other than the batch symbolic). The pixel tile shrinks to a
    narrow output row and the channel tile to O rounded up to 16."""
    attrs = qconv2d_attrs(func)
    if attrs is None or attrs.pop("depthwise"):
        return None
    has_bias = attrs.pop("has_bias")
    bufs = op_buffers(func, has_bias, rank=4)
    if bufs is None:
        return None
    try:
        g = conv_geometry(bufs[0].shape, bufs[1].shape, attrs)
    except ValueError:
        return None
    cols = min(cols, -(-g["O"] // BLOCK) * BLOCK)
    rows = min(rows, g["OW"])
    new = recompute(func, bufs, has_bias, lambda *ins: qconv2d_packed(
        *ins, act_dtype=act_dtype, rows=rows, cols=cols, **attrs))  # type: ignore[arg-type]
    return new.with_attr("opsdk.qconv2d_tile", [rows, cols, attrs["stride"]])


def _conv_tile_kernel(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV,
                      kernel: Microkernel, stride: int) -> None:
    """Replace a blockized ``rows x cols`` accumulator tile (one output row's pixels, summed
    over input-channel blocks and window taps) by a register kernel."""
    blk = sch.get(block)
    c, a, b = region(blk, "acc"), region(blk, "xa"), region(blk, "wp")
    n0, y0, x0, col0 = (rg.min for rg in c.region)
    rows, cols = int(c.region[2].extent), int(c.region[3].extent)
    if cols % kernel.lanes:
        raise ValueError(f"tile of {cols} channels does not fit {kernel.name} x {kernel.lanes}")
    cb = int(a.source.shape[1])
    kh = int(a.region[2].extent)
    kw = int(b.source.shape[1]) // (cb * kh)
    blk0 = b.region[0].min
    idx = str(n0.ty.dtype) if hasattr(n0, "ty") else "int32"
    q, i, j = (tirx.Var(nm, idx) for nm in ("q", "i", "j"))

    def a_word(r: int) -> tirx.BufferLoad:
        return tirx.BufferLoad(a.source, [n0, q, y0 * stride + i, (x0 + r) * stride + j,
                                          tirx.Ramp(tirx.IntImm(idx, 0), 1, KGROUP)])

    def b_load(ch: int, offset: int, n: int) -> tirx.BufferLoad:
        byte = (ch % BLOCK) * KGROUP + offset
        return tirx.BufferLoad(b.source, [blk0 + ch // BLOCK, (q * kh + i) * kw + j,
                                          tirx.Ramp(tirx.IntImm(idx, byte), 1, n)])

    body = register_tile(
        kernel, rows, cols, idx, [(q, cb), (i, kh), (j, kw)], a_word=a_word, b_load=b_load,
        c_index=lambda r, col: [n0, y0, x0 + r, tirx.Ramp(col0 + col, 1, kernel.lanes)],
        c_buffer=c.source,
    )
    replace_block_body(sch, block, body)


def schedule_qconv2d(func: tirx.PrimFunc, target: Target, kernel: Microkernel, *,
                     act_dtype: str, rows: int, cols: int) -> s_tir.Schedule | None:
    """A dense qconv2d rule's body: ``func`` rebuilt by :func:`rebuild_qconv2d` (input as
    ``act_dtype``, ``rows``-pixel x ``cols``-channel tiles) and scheduled around ``kernel``;
    None when ``func`` is not a dense qconv2d it can take."""
    packed = rebuild_qconv2d(func, act_dtype=act_dtype, rows=rows, cols=cols)
    return None if packed is None else schedule_qconv2d_packed(packed, target, kernel)


def schedule_qconv2d_packed(
    func: tirx.PrimFunc, target: Target, kernel: Microkernel
) -> s_tir.Schedule:
    """Tile, parallelize and vectorize a :func:`rebuild_qconv2d` function around ``kernel``.

    Loop nest: ``parallel (batch, output row, pixel tile, channel tile)`` -> the register
    kernel over (input-channel block, kh, kw) -> vectorized epilogue on the tile -> its valid
    part written out. The pre-passes (blocked input, packed weights, compensation, scales)
    run in parallel first.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.ops.qconv2d import qconv2d
    >>> from opsdk.schedules.cpu.vnni import VNNI
    >>> from opsdk.schedules._qconv import rebuild_qconv2d, schedule_qconv2d_packed
    >>> x = te.placeholder((1, 8, 9, 9), "int8", name="x")
    >>> w = te.placeholder((20, 8, 3, 3), "int8", name="w")
    >>> s = te.placeholder((20,), "float32", name="w_scale")
    >>> y = qconv2d.call_compute([x, w, s, None], {**qconv2d.default_attrs(), "padding": 1})
    >>> f = rebuild_qconv2d(te.create_prim_func([x, w, s, y]), act_dtype="uint8", rows=6,
    ...                     cols=64)
    >>> sch = schedule_qconv2d_packed(f, opsdk.target("x86"), VNNI)
    >>> [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    ['xa', 'wp', 'wsum_lanes', 'wsum', 'comp', 'oscale', 'acc_o', 'qtile', 'qconv2d']
    """
    rows, cols, stride = (int(v) for v in func.attrs["opsdk.qconv2d_tile"])
    bits = vector_bits(target)
    sch = s_tir.Schedule(func)
    out = sch.get_sblock("qtile")
    n, y, x, j = sch.get_loops(out)
    xo, xi = sch.split(x, [None, rows])
    jo, ji = sch.split(j, [None, cols])
    sch.reorder(n, y, xo, jo, xi, ji)
    tile = sch.fuse(n, y, xo, jo)
    sch.parallel(tile)

    acc = sch.get_sblock("acc")
    sch.compute_at(acc, tile)
    # The first loop under the tile (unit loops are elided: a 1-wide row, one channel block)
    _conv_tile_kernel(sch, sch.blockize(sch.get_loops(acc)[1]), kernel, stride)

    schedule_tile_epilogue(sch, tile, xi, ji, cols, bits, "qconv2d")

    blocks = {sch.get(b).name_hint: b for b in sch.get_child_blocks(sch.get_sblock("root"))}
    xn, xq, xy, _, xe = sch.get_loops(blocks["xa"])
    sch.parallel(sch.fuse(xn, xq, xy))
    sch.vectorize(xe)
    wb, _, we = sch.get_loops(blocks["wp"])
    sch.parallel(wb)
    vectorize_contiguous(sch, we, bits // 8)
    pack_at_compile_time(sch, func, blocks["wp"])
    schedule_weight_sums(sch, blocks)
    return sch


def schedule_qconv2d_depthwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A depthwise ``qconv2d`` (static sizes but the batch) rebuilt on a padded int16 input
    and vectorized along its contiguous output axis; None for any other function.

    Loop nest: ``parallel (all axes but the last)`` -> vectors along the last axis (a
    partitioned tail), each the ``KH x KW`` int32 multiply-adds and the epilogue. The padded
    copy is one parallel, vectorized pass.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.ops.qconv2d import qconv2d
    >>> from opsdk.schedules._qconv import schedule_qconv2d_depthwise
    >>> x = te.placeholder((1, 9, 9, 24), "int8", name="x")
    >>> w = te.placeholder((24, 1, 3, 3), "int8", name="w")
    >>> s = te.placeholder((24,), "float32", name="w_scale")
    >>> a = {**qconv2d.default_attrs(), "padding": 1, "depthwise": True, "layout": "NHWC"}
    >>> y = qconv2d.call_compute([x, w, s, None], a)
    >>> sch = schedule_qconv2d_depthwise(te.create_prim_func([x, w, s, y]), opsdk.target("x86"))
    >>> # the padded copy, the weights and the conv, each as 16 channels + a tail of 8
    >>> [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    ['xp_i3_common', 'wt_ch_common', 'qconv2d_i3_common']
    """
    attrs = qconv2d_attrs(func)
    if attrs is None or not attrs.pop("depthwise"):
        return None
    has_bias = attrs.pop("has_bias")
    bufs = op_buffers(func, has_bias, rank=4)
    if bufs is None:
        return None
    try:
        conv_geometry(bufs[0].shape, bufs[1].shape, attrs)
    except ValueError:
        return None
    new = recompute(func, bufs, has_bias,
                    lambda *ins: qconv2d_depthwise_padded(*ins, **attrs))
    lanes = vector_lanes(target, 32)
    sch = s_tir.Schedule(new)
    xp = sch.get_sblock("xp")
    loops = sch.get_loops(xp)
    vectorize_loop(sch, loops[-1], lanes)
    sch.parallel(_fuse(sch, loops[:-1]))
    wt = sch.get_sblock("wt")
    if is_layout_free(new, new.params[1]):
        pack_at_compile_time(sch, new, wt)  # runs once at compile time: left as it is
    else:
        vectorize_loop(sch, sch.get_loops(wt)[-1], lanes)
    epi = sch.get_sblock("qconv2d")
    sch.compute_inline(sch.get_sblock("acc"))
    e_loops = sch.get_loops(epi)
    sch.parallel(_fuse(sch, e_loops[:-1]))
    vectorize_loop(sch, e_loops[-1], lanes)
    return sch
