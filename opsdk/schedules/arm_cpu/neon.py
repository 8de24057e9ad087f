"""aarch64 NEON rules: 128-bit vectors (4 x float32), rows split across the cores."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._attention import schedule_attention
from .._conv import schedule_conv2d
from .._core import accumulator_registers
from .._elementwise import schedule_elementwise
from .._fallback import schedule_extern, schedule_fallback
from .._gemm import schedule_matmul
from .._qwgemm import schedule_take_q4, schedule_take_w8
from .._rows import group_norm_schedule, schedule_columns, schedule_rows, schedule_whole
from .._wgemm import schedule_wdense
from .._winograd import schedule_winograd

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
    "kind:reduction",
    "arm_cpu",
    name="neon.columns",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _columns(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A reduction over outer axes (channels-last mean over H, W; global average pooling):
    the output columns in NEON vectors inside the reduction loops, column chunks across
    the cores."""
    return schedule_columns(func, target, accumulators=_ACCUMULATORS)


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


@rule(
    "kind:winograd",
    "arm_cpu",
    name="neon.winograd",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _winograd(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Winograd F(2x2, 3x3) conv with its fused epilogue, one kernel: chunks of a tile row
    across the cores (input transform, 16 GEMMs in 4-lane register tiles, output transform);
    transformed weights packed and folded at compile time."""
    return schedule_winograd(func, target, acc_regs=accumulator_registers(target))


@rule(
    "kind:matmul",
    "arm_cpu",
    name="neon.matmul",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _matmul(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Dense / matmul / batch_matmul with its fused epilogue: MR x NR register tiles of
    4-lane NEON vectors (24 of the 32 registers hold accumulators), B packed (constant weights
    at compile time), parallel over tiles."""
    return schedule_matmul(func, target, acc_regs=accumulator_registers(target), max_vecs=4)


@rule(
    "kind:any",
    "arm_cpu",
    name="neon.fallback",
    requires=_NEON,
    priority=11,
)
def _fallback(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Any other plain loop nest: each block's outer loops across the cores (when it writes
    enough elements), its innermost output loop vectorized."""
    return schedule_fallback(func, target)


@rule(
    "kind:opaque",
    "arm_cpu",
    name="neon.extern",
    requires=_NEON,
    priority=12,
)
def _extern(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A kernel written as loops rather than blocks (a scatter), run as written."""
    return schedule_extern(func, target)


@rule(
    "kind:conv2d",
    "arm_cpu",
    name="neon.conv2d",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _conv2d(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """conv2d NCHW / NHWC (1x1, 3x3, strided, grouped, depthwise) with its fused epilogue:
    pixels x output-channel vector tiles (24 of the 32 registers hold accumulators),
    weights packed at compile time; depthwise NCHW tiles rows x pixel vectors."""
    return schedule_conv2d(func, target, acc_regs=accumulator_registers(target))


@rule(
    "kind:pool",
    "arm_cpu",
    name="neon.pool",
    requires=_NEON,
    priority=20,
    claims=("vectorize",),
)
def _pool(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Max / average pooling: the padding read in place, window loops outside the innermost
    output axis (channels in NHWC), which is vectorized; rows across the cores."""
    return schedule_fallback(func, target)


@rule(
    ["dense_w8", "dense_q4"],
    "arm_cpu",
    name="neon.wdense",
    requires=_NEON,
    priority=30,
    claims=("vectorize", "parallel"),
)
def _wdense(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Weight-only int8 / q4_0 dense: weights repacked (N / lanes, K, lanes) at compile
    time; a few rows as a GEMV unpacking the weights in registers (q4: per-group partial sums
    scaled once per group), many rows as a GEMM over a dequantized float32 panel per N-tile;
    parallel over N-tiles; scale, bias and activation fused. 4-lane NEON vectors."""
    return schedule_wdense(func, target, acc_regs=accumulator_registers(target))


@rule(
    "take_q4",
    "arm_cpu",
    name="neon.take_q4",
    requires=_NEON,
    priority=30,
    claims=("vectorize",),
)
def _take_q4(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of a q4_0 table: for ``activations="float32"`` (a static table) gathered from
    the packing neon.wdense's one-row GEMV gives a dense_q4 weight, so a tied LM head's
    table is held once (a Cortex-A53 / A72 board's default numerics); otherwise from its
    bytes and scales as they are. A row per task (one core for a few rows), 16 bytes of a
    group per vector."""
    return schedule_take_q4(func, target, None, acc_regs=accumulator_registers(target))


@rule(
    "take_w8",
    "arm_cpu",
    name="neon.take_w8",
    requires=_NEON,
    priority=30,
    claims=("vectorize",),
)
def _take_w8(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of a per-channel int8 table: for ``activations="float32"`` (a static table)
    gathered from the packing neon.wdense's one-row GEMV gives a dense_w8 weight (a tied LM
    head's table held once); otherwise from its bytes as they are. A row per task (one core
    for a few rows), the row in full vectors."""
    return schedule_take_w8(func, target, None, acc_regs=accumulator_registers(target))


@rule(
    "attention",
    "arm_cpu",
    name="neon.attention",
    requires=_NEON,
    priority=22,
    claims=("vectorize", "parallel"),
)
def _attention(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fused attention. Decode (under 16 static queries): one (batch, query, head) row per
    task, scores in vector partial sums, vectorized exponentials, value rows accumulated with
    the head dim in vectors. Many queries: a block of query rows of one head per task, K
    transposed once per head, scores and P V as register-tiled FMAs (``_attention``)."""
    return schedule_attention(func, target)
