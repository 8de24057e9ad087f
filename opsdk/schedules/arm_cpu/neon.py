"""aarch64 NEON rules: 128-bit vectors (4 x float32), rows split across the cores."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._common import schedule_blockwise, schedule_elementwise, schedule_rows

_NEON = ("kind:llvm", "arch:aarch64", "neon")


@rule(
    "kind:elementwise",
    "arm_cpu",
    name="neon.elementwise",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _elementwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fused outer loops in parallel, last axis in 128-bit NEON vectors."""
    return schedule_elementwise(func, target)


@rule(
    ["kind:norm", "kind:reduction"],
    "arm_cpu",
    name="neon.rows",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _rows(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Parallel rows; each row's passes computed together; NEON epilogue, 8-way unrolled
    reductions (NEON has 32 vector registers to hold partial sums)."""
    return schedule_rows(func, target, unroll=8)


@rule(
    ["kind:norm", "kind:reduction"],
    "arm_cpu",
    name="neon.blockwise",
    requires=_NEON,
    priority=15,
    claims=("parallel",),
)
def _blockwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fallback: each block's outer loop parallel, spatial inner loops vectorized."""
    return schedule_blockwise(func, target)
