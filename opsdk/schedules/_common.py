"""Schedule building blocks shared by the CPU rules (x86 and NEON differ in parameters)."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width

__all__ = [
    "BlockInfo",
    "analyze",
    "schedule_blockwise",
    "schedule_elementwise",
    "schedule_rows",
    "vector_lanes",
]


def vector_lanes(target: Target, dtype_bits: int = 32) -> int:
    """Lanes of ``dtype_bits`` in one vector register of ``target`` (at least 4)."""
    try:
        width = int(llvm_get_vector_width(target))
    except Exception:  # non-LLVM target
        width = 128
    return max(width // dtype_bits, 4)


@dataclass
class BlockInfo:
    """A block of a TE-made PrimFunc: its handle, iter kinds and loop extents."""

    rv: s_tir.schedule.SBlockRV
    name: str
    kinds: str  # one letter per iter var: S (spatial) or R (reduction)
    extents: list

    @property
    def is_reduction(self) -> bool:
        return "R" in self.kinds

    @property
    def n_spatial(self) -> int:
        return self.kinds.count("S")


def analyze(sch: s_tir.Schedule) -> list[BlockInfo] | None:
    """Blocks under the root in order, or None if the function is not a simple loop nest."""
    out = []
    for rv in sch.get_child_blocks(sch.get_sblock("root")):
        blk = sch.get(rv)
        kinds = ""
        for iv in blk.iter_vars:
            if iv.iter_type == tirx.IterVar.DataPar:
                kinds += "S"
            elif iv.iter_type == tirx.IterVar.CommReduce:
                kinds += "R"
            else:
                return None
        # Only plain nests: spatial vars first, then reduction vars.
        if "RS" in kinds:
            return None
        out.append(BlockInfo(rv, blk.name_hint, kinds, [iv.dom.extent for iv in blk.iter_vars]))
    return out


def _same(a, b) -> bool:
    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return a.value == b.value
    return a.same_as(b) or str(a) == str(b)


def _dtype_bits(sch: s_tir.Schedule, rv) -> int:
    blk = sch.get(rv)
    return blk.writes[0].source.dtype.bits if blk.writes else 32


def _vectorize_tail(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Split ``loop`` by ``lanes`` and vectorize the inner part (any extent)."""
    ext = sch.get(loop).extent
    if isinstance(ext, tirx.IntImm) and ext.value <= lanes:
        if ext.value > 1:
            sch.vectorize(loop)
        return
    _, inner = sch.split(loop, factors=[None, lanes])
    sch.vectorize(inner)


def schedule_elementwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """One injective block: outer loops fused and parallel, the last axis vectorized."""
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks or any(b.is_reduction for b in blocks):
        return None
    for b in blocks[:-1]:
        sch.compute_inline(b.rv)
    last = blocks[-1].rv
    loops = sch.get_loops(last)
    lanes = vector_lanes(target, _dtype_bits(sch, last))
    if len(loops) > 1:
        sch.parallel(sch.fuse(*loops[:-1]))
        _vectorize_tail(sch, loops[-1], lanes)
    else:
        outer, inner = sch.split(loops[0], factors=[None, lanes])
        sch.vectorize(inner)
        sch.parallel(outer)
    return sch


def schedule_rows(func: tirx.PrimFunc, target: Target, *, unroll: int = 0) -> s_tir.Schedule | None:
    """Row-wise reductions (norms, softmax over the last axes).

    All blocks must share their leading spatial axes with the output block (the rows). The
    rows are fused and split across the cores; every producer is computed inside the row
    loop so a row stays in cache between passes; elementwise inner loops are vectorized and
    reduction loops split by the vector width (``unroll`` > 0 adds an unroll hint).
    """
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks or not any(b.is_reduction for b in blocks) or blocks[-1].is_reduction:
        return None
    out = blocks[-1]
    rows = min(b.n_spatial for b in blocks[:-1])
    if rows == 0 or rows >= out.n_spatial:
        return None
    for b in blocks[:-1]:
        if b.n_spatial != rows or not all(
            _same(x, y) for x, y in zip(b.extents[:rows], out.extents[:rows])
        ):
            return None
    lanes = vector_lanes(target, _dtype_bits(sch, out.rv))
    loops = sch.get_loops(out.rv)
    row = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
    inner = sch.fuse(*loops[rows:]) if len(loops) - rows > 1 else loops[rows]
    sch.parallel(row)
    _vectorize_tail(sch, inner, lanes)
    for b in reversed(blocks[:-1]):
        sch.compute_at(b.rv, row, preserve_unit_loops=True)
    for b in blocks[:-1]:
        if not b.is_reduction:
            continue
        bl = sch.get_loops(b.rv)[1:]  # below the row loop
        red = sch.fuse(*bl) if len(bl) > 1 else bl[0] if bl else None
        if red is None:
            continue
        ext = sch.get(red).extent
        if unroll and not (isinstance(ext, tirx.IntImm) and ext.value <= lanes):
            _, r_in = sch.split(red, factors=[None, unroll])
            sch.unroll(r_in)
    return sch


def schedule_blockwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fallback for reductions whose blocks do not share row axes (group norm, softmax over a
    middle axis): each block gets its outer spatial loop parallel and, when its innermost loop
    is spatial, that loop vectorized."""
    sch = s_tir.Schedule(func)
    blocks = analyze(sch)
    if not blocks or not any(b.is_reduction for b in blocks):
        return None
    for b in blocks:
        loops = sch.get_loops(b.rv)
        if not loops:
            continue
        if b.n_spatial >= 1:
            sch.parallel(loops[0])
        if not b.is_reduction and b.n_spatial >= 2:
            _vectorize_tail(sch, loops[-1], vector_lanes(target, _dtype_bits(sch, b.rv)))
    return sch
