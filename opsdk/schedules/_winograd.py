"""Winograd F(2x2, 3x3) convolutions (``opsdk.kernels.winograd``) as one fused kernel.

The four stages of :func:`~opsdk.kernels.winograd.winograd_conv2d` (blocks tagged
``opsdk.winograd``) plus the epilogue FuseOps appended (bias, residual add, any
activation DAG, folded by :func:`~opsdk.schedules._gemm.fold_epilogue`):

- **weights** ``U[e, c, k]`` are written in the GEMM's packed layout ``[e, k / NR, c, NR]``;
  for constant weights (the PrimFunc's ``layout_free_buffers``) the block is annotated
  ``meta_schedule.layout_rewrite_preproc`` and folded into a constant at compile time, like
  the matmul rule's packing; runtime weights are transformed by a parallel prologue.
- The output is computed in **chunks** of a row of tiles (``Q * MR`` tiles of one tile row),
  split across the cores. Inside a chunk the input transform writes ``V`` for its tiles
  (vectors along the input channels, the 16 transform outputs unrolled), the 16 GEMMs run
  as ``MR x NR`` register tiles over the input channels (the matmul rule's tile), and the
  output transform reads the chunk's ``M`` and writes 2x2 output pixels per tile with the
  epilogue (vectors along the output channels). ``V`` and ``M`` of a chunk stay in L2
  (``chunk_bytes``), so the transformed tensors never go to memory.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from ._core import _fuse, extent_of, vector_lanes, vectorize_loop
from ._gemm import float32_accumulator, fold_epilogue, is_layout_free, tile_mn
from ._kernels import WINOGRAD_TAG

__all__ = ["schedule_winograd", "winograd_blocks"]

_STAGES = ("weight", "input", "gemm", "output")


def winograd_blocks(sch: s_tir.Schedule) -> dict[str, s_tir.schedule.SBlockRV] | None:
    """The stage blocks by tag, or None unless each stage is there exactly once."""
    found: dict[str, list] = {}
    for b in sch.get_child_blocks(sch.get_sblock("root")):
        tag = sch.get(b).annotations.get(WINOGRAD_TAG)
        if tag is not None:
            found.setdefault(str(tag), []).append(b)
    if sorted(found) != sorted(_STAGES) or any(len(v) != 1 for v in found.values()):
        return None
    return {k: v[0] for k, v in found.items()}


def schedule_winograd(
    func: tirx.PrimFunc,
    target: Target,
    *,
    acc_regs: int,
    max_vecs: int = 4,
    mr_max: int = 8,
    chunk_bytes: int = 96 << 10,
) -> s_tir.Schedule | None:
    """Schedule a Winograd conv kernel (with its fused epilogue) as chunked, fused stages, or
    None if ``func`` is not one.

    Parameters
    ----------
    acc_regs
        Vector registers for the GEMM's accumulators.
    max_vecs, mr_max
        Most vectors per tile row and rows (tiles) per register tile.
    chunk_bytes
        Budget for one chunk's ``V`` and ``M`` (``16 x tiles x (C + K)`` float32).

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.kernels.winograd import winograd_conv2d
    >>> from opsdk.schedules._winograd import schedule_winograd
    >>> x, w = te.placeholder((1, 8, 8, 16), name="x"), te.placeholder((3, 3, 16, 16), name="w")
    >>> f = te.create_prim_func([x, w, winograd_conv2d(x, w, 1)])
    >>> schedule_winograd(f, opsdk.target("x86"), acc_regs=24) is not None
    True
    """
    sch = s_tir.Schedule(func)
    st = winograd_blocks(sch)
    if st is None or not float32_accumulator(sch.get(st["gemm"])):
        return None
    out = st["output"]
    folded = fold_epilogue(sch, out)  # the epilogue (bias, residual, activation, SiLU)
    if folded is None:
        return None
    for c in folded:
        try:
            sch.reverse_compute_inline(c)
        except Exception:
            return None
    if sch.get_consumers(out):
        return None
    gemm_loops = sch.get_loops(st["gemm"])
    if len(gemm_loops) != 6 or len(sch.get_loops(out)) != 4:
        return None
    e_ext, _, _, tw_ext, k_ext, c_ext = (extent_of(sch, lp) for lp in gemm_loops)
    if None in (e_ext, tw_ext, k_ext, c_ext):
        return None
    lanes_max = vector_lanes(target, 32)
    lanes, nv, mr = tile_mn(tw_ext, k_ext, lanes_max, max_vecs, mr_max, acc_regs)
    nr = lanes * nv
    # A chunk: Q register tiles of MR tiles, within the budget, at most the tile row.
    per_tile = e_ext * (c_ext + k_ext) * 4
    q = max(1, min(-(-tw_ext // mr), chunk_bytes // (per_tile * mr)))
    _pack_weights(sch, func, st["weight"], nr, k_ext, lanes_max)

    # The output's loops drive the chunks: (n, tile row, chunk) across the cores.
    n, oh, ow, ok = sch.get_loops(out)
    ty, r = sch.split(oh, [None, 2])
    tx, s = sch.split(ow, [None, 2])
    chunk, tx_in = sch.split(tx, [None, q * mr])
    sch.reorder(n, ty, chunk, tx_in, r, s, ok)
    sch.compute_at(st["gemm"], chunk, preserve_unit_loops=True)
    sch.compute_at(st["input"], chunk, preserve_unit_loops=True)
    sch.parallel(_fuse(sch, [n, ty, chunk]))
    # Output transform: 2x2 pixels per tile (unrolled: the tables fold to one expression
    # each), vectors along the output channels.
    sch.unroll(r)
    sch.unroll(s)
    vectorize_loop(sch, ok, lanes_max)
    # GEMMs: [e, n, ty, tx, k, c] under the chunk -> MR x NR register tiles over c.
    e, bn, bty, btx, k, c = sch.get_loops(st["gemm"])[-6:]
    txo, txi = sch.split(btx, [None, mr])
    ko, kv, kl = sch.split(k, [None, nv, lanes])
    sch.reorder(e, bn, bty, ko, txo, c, txi, kv, kl)
    acc = sch.cache_write(st["gemm"], 0, "local")
    sch.reverse_compute_at(acc, txo)
    sch.unroll(txi)
    sch.unroll(kv)
    sch.vectorize(kl)
    vectorize_loop(sch, sch.get_loops(acc)[-1], lanes)
    sch.decompose_reduction(st["gemm"], c)
    # Input transform: per tile, vectors along the input channels, the 16 outputs unrolled.
    ie, _, _, itx, ic = sch.get_loops(st["input"])[-5:]
    if c_ext % lanes_max == 0:
        co, ci = sch.split(ic, [None, lanes_max])
        sch.reorder(itx, co, ie, ci)
        sch.vectorize(ci)
    else:
        sch.reorder(itx, ie, ic)
        vectorize_loop(sch, ic, lanes_max)
    sch.unroll(ie)
    return sch


def _pack_weights(sch, func, block, nr: int, k_ext: int, lanes: int) -> None:
    """The weight transform writes ``[e, k / NR, c, NR]`` (zero-padded output channels when
    NR does not divide them); folded at compile time for constant weights."""
    sch.transform_layout(block, ("write", 0), lambda e, c, k: [e, k // nr, c, k % nr],
                         pad_value=None if k_ext % nr == 0 else 0.0)
    wbuf = sch.get(block).reads[0].source
    if is_layout_free(func, wbuf):
        sch.annotate(block, "meta_schedule.layout_rewrite_preproc", True)
        return
    # Runtime weights: input channels across the cores, the 16 outputs unrolled (each its
    # own short sum once the select table folds), vectors along the output channels. With
    # padded output channels the block runs over the packed layout, (e, k / NR, c, NR).
    loops = sch.get_loops(block)
    if len(loops) == 3:
        e, c, k = loops
        sch.reorder(c, e, k)
    else:
        e, ko, c, k = loops
        sch.reorder(c, ko, e, k)
    sch.parallel(c)
    sch.unroll(e)
    vectorize_loop(sch, k, lanes)
