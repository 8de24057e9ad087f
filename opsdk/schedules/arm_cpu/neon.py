"""aarch64 NEON rules: 128-bit vectors (4 x float32), rows split across the cores."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._common import schedule_elementwise, schedule_rows, schedule_whole
from ..cpu.x86 import group_norm_schedule

_NEON = ("kind:llvm", "arch:aarch64", "neon")
# 32 NEON registers: four 4-lane accumulators (16 partial sums) leave plenty for the data.
_ACCUMULATORS = 4


@rule(
    "kind:elementwise",
    "arm_cpu",
    name="neon.elementwise",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _elementwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fused outer loops in parallel, contiguous inner loop in 128-bit NEON vectors + tail."""
    return schedule_elementwise(func, target)


@rule(
    "group_norm",
    "arm_cpu",
    name="neon.group_norm",
    requires=_NEON,
    priority=22,
    claims=("vectorize", "parallel"),
)
def _group_norm(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Group norm: NCHW as rows of (sample, group); NHWC with per-channel vector partials."""
    return group_norm_schedule(func, target, _ACCUMULATORS)


@rule(
    ["kind:norm", "kind:reduction"],
    "arm_cpu",
    name="neon.rows",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _rows(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Parallel rows, passes over a row kept in cache, 4 x 4-lane NEON partial sums reduced
    by a vector tree, NEON epilogue with a partitioned tail."""
    return schedule_rows(func, target, accumulators=_ACCUMULATORS)


@rule(
    ["kind:norm", "kind:reduction"],
    "arm_cpu",
    name="neon.whole",
    requires=_NEON,
    priority=19,
    claims=("vectorize",),
)
def _whole(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A norm or softmax over the whole tensor (no row axis, so one core): NEON partial
    sums for the reductions, vectorized producers and output."""
    return schedule_whole(func, target, accumulators=_ACCUMULATORS)
