"""x86-64 rules: vector width and register count from the CPU's features (AVX-512: 16
float32 lanes in 32 registers; AVX2: 8 lanes in 16), rows split across the cores, reductions
held in vector registers."""

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

_X86 = ("kind:llvm", "arch:x86_64")  # the C backend cannot print vector code
# Partial sums per reduction step: 2 x 16 lanes (AVX-512) = 128 bytes per iteration. Measured
# on 4096x768 layer norm: with 4 accumulators LLVM fully unrolls the 12-trip loop and keeps the
# whole row live across the passes (spilling 3 KB per row to the stack), which is slower than 2;
# 1 accumulator leaves the 3-cycle add latency exposed.
_ACCUMULATORS = 2


@rule(
    "kind:elementwise",
    "cpu",
    name="x86.elementwise",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _elementwise(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fused outer loops in parallel, contiguous inner loop in full-width vectors + tail."""
    return schedule_elementwise(func, target)


@rule(
    "group_norm",
    "cpu",
    name="x86.group_norm",
    requires=_X86,
    priority=12,
    claims=("vectorize", "parallel"),
)
def _group_norm(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Group norm: NCHW as rows of (sample, group); NHWC with per-channel vector partials."""
    return group_norm_schedule(func, target, _ACCUMULATORS)


@rule(
    ["kind:norm", "kind:reduction"],
    "cpu",
    name="x86.rows",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _rows(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Parallel rows, all passes over a row while it is in cache, vector partial sums
    (2 full-width accumulators) reduced by a vector tree, vectorized epilogue with a
    partitioned tail."""
    return schedule_rows(func, target, accumulators=_ACCUMULATORS)


@rule(
    "kind:reduction",
    "cpu",
    name="x86.columns",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _columns(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A reduction over outer axes (channels-last mean over H, W; global average pooling):
    the output columns in AVX-512 vectors inside the reduction loops, column chunks across
    the cores."""
    return schedule_columns(func, target, accumulators=_ACCUMULATORS * 2)


@rule(
    ["kind:norm", "kind:reduction"],
    "cpu",
    name="x86.whole",
    requires=_X86,
    priority=9,
    claims=("vectorize",),
)
def _whole(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A norm or softmax over the whole tensor (no row axis, so one core): AVX-512 partial
    sums for the reductions, vectorized producers and output."""
    return schedule_whole(func, target, accumulators=_ACCUMULATORS)


@rule(
    "kind:matmul",
    "cpu",
    name="x86.matmul",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _matmul(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Dense / matmul / batch_matmul with its fused epilogue: MR x NR register tiles
    (three quarters of the vector registers hold accumulators), B packed (constant weights at
    compile time), parallel over tiles."""
    return schedule_matmul(func, target, acc_regs=accumulator_registers(target))


@rule(
    "kind:any",
    "cpu",
    name="x86.fallback",
    requires=_X86,
    priority=1,
)
def _fallback(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Any other plain loop nest: each block's outer loops across the cores (when it writes
    enough elements), its innermost output loop vectorized."""
    return schedule_fallback(func, target)


@rule(
    "kind:opaque",
    "cpu",
    name="x86.extern",
    requires=_X86,
    priority=2,
)
def _extern(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A kernel written as loops rather than blocks (a scatter), run as written."""
    return schedule_extern(func, target)


@rule(
    "kind:conv2d",
    "cpu",
    name="x86.conv2d",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _conv2d(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """conv2d NCHW / NHWC (1x1, 3x3, strided, grouped, depthwise) with its fused epilogue:
    pixels x output-channel vector tiles (three quarters of the vector registers hold
    accumulators: 24 of AVX-512's 32, 12 of AVX2's 16), weights packed at compile time;
    depthwise NCHW tiles rows x pixel vectors."""
    return schedule_conv2d(func, target, acc_regs=accumulator_registers(target))


@rule(
    "kind:pool",
    "cpu",
    name="x86.pool",
    requires=_X86,
    priority=10,
    claims=("vectorize",),
)
def _pool(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Max / average pooling: the padding read in place, window loops outside the innermost
    output axis (channels in NHWC), which is vectorized; rows across the cores."""
    return schedule_fallback(func, target)


@rule(
    "kind:winograd",
    "cpu",
    name="x86.winograd",
    requires=_X86,
    priority=10,
    claims=("vectorize", "parallel"),
)
def _winograd(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Winograd F(2x2, 3x3) conv (what the pipeline picks for 3x3 stride-1 convs with 16+
    channels) with its fused epilogue, one kernel: chunks of a tile row across the cores,
    each running its input transform, 16 register-tiled GEMMs (24 accumulators on AVX-512,
    12 on AVX2) and output transform in L2; transformed weights packed and folded at compile
    time."""
    return schedule_winograd(func, target, acc_regs=accumulator_registers(target))


@rule(
    ["dense_w8", "dense_q4"],
    "cpu",
    name="x86.wdense",
    requires=_X86,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _wdense(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Weight-only int8 / q4_0 dense: weights repacked (N / lanes, K, lanes) at compile
    time; a few rows as a GEMV unpacking the weights in registers (q4: per-group partial sums
    scaled once per group), many rows as a GEMM over a dequantized float32 panel per N-tile;
    parallel over N-tiles; scale, bias and activation fused. AVX-512 or AVX2 vectors by
    the CPU's features."""
    return schedule_wdense(func, target, acc_regs=accumulator_registers(target))


@rule(
    "take_q4",
    "cpu",
    name="x86.take_q4",
    requires=_X86,
    priority=20,
    claims=("vectorize",),
)
def _take_q4(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of a q4_0 table: for ``activations="float32"`` (a static table) gathered from
    the packing x86.wdense's one-row GEMV gives a dense_q4 weight, so a tied LM head's table
    is held once; otherwise from its bytes and scales as they are. A row per task (one core
    for a few rows), 16 bytes of a group per vector."""
    return schedule_take_q4(func, target, None, acc_regs=accumulator_registers(target))


@rule(
    "take_w8",
    "cpu",
    name="x86.take_w8",
    requires=_X86,
    priority=20,
    claims=("vectorize",),
)
def _take_w8(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of a per-channel int8 table: for ``activations="float32"`` (a static table)
    gathered from the packing x86.wdense's one-row GEMV gives a dense_w8 weight (a tied LM
    head's table held once); otherwise from its bytes as they are. A row per task (one core
    for a few rows), the row in full vectors."""
    return schedule_take_w8(func, target, None, acc_regs=accumulator_registers(target))


@rule(
    "attention",
    "cpu",
    name="x86.attention",
    requires=_X86,
    priority=12,
    claims=("vectorize", "parallel"),
)
def _attention(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Fused attention. Decode (under 16 static queries): one (batch, query, head) row per
    task, scores in vector partial sums, vectorized exponentials, value rows accumulated with
    the head dim in vectors. Many queries: a block of query rows of one head per task, K
    transposed once per head, scores and P V as register-tiled FMAs (``_attention``)."""
    return schedule_attention(func, target)
