"""x86-64 rules: AVX-512/AVX2 vector width from the target, rows split across the cores."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._common import schedule_blockwise, schedule_elementwise, schedule_rows

_X86 = ("kind:llvm", "arch:x86_64")  # the C backend cannot print vector code


@rule(
    "kind:elementwise",
    "cpu",
    name="x86.elementwise",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _elementwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fused outer loops in parallel, last axis in full-width vectors."""
    return schedule_elementwise(func, target)


@rule(
    ["kind:norm", "kind:reduction"],
    "cpu",
    name="x86.rows",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _rows(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Parallel rows; each row's passes computed together; vectorized epilogue."""
    return schedule_rows(func, target, unroll=4)


@rule(
    ["kind:norm", "kind:reduction"],
    "cpu",
    name="x86.blockwise",
    requires=_X86,
    priority=5,
    claims=("parallel",),
)
def _blockwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fallback: each block's outer loop parallel, spatial inner loops vectorized."""
    return schedule_blockwise(func, target)
