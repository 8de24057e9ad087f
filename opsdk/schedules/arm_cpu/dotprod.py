"""aarch64 rules for ``qdense`` and ``qconv2d``: ``sdot`` (dot-product extension) and a plain
NEON fallback.

The qdense rules rebuild the op as :func:`~opsdk.ops.qdense.qdense_packed` with int8
activations (uint8 inputs are moved down by 128, the zero point by the same amount, and the
compensation ``(x_zero_point - 128) * sum_k w`` restores the exact result), then reuse the x86
VNNI rule's tiling (:func:`~opsdk.schedules.cpu.vnni.schedule_qdense`) with a 4-channel
micro-kernel; the qconv2d rules do the same with the direct convolution of
:mod:`opsdk.schedules._qconv`:

- ``neon.qdense_dotprod`` / ``neon.qconv2d_dotprod`` (need ``dotprod``): one
  ``sdot v.4s, v.16b, v.16b`` per 4 channels x 4 bytes of K (s8 x s8 -> s32); the kernel is
  written with ``T.call_llvm_pure_intrin`` because ``sch.tensorize`` crashes in this TVM
  build (see the VNNI rule);
- ``neon.qdense`` / ``neon.qconv2d`` (NEON only, e.g. Cortex-A72): ``smull`` (s8 x s8 -> s16,
  exact) + ``saddlp`` (pairwise widening add to s32) + ``addp``, accumulating in int32 vectors.

Tiles are 4 rows (pixels) x 16 channels: 16 accumulator registers, 4 weight vectors and the
activation broadcasts fit NEON's 32 registers.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._qconv import schedule_qconv2d, schedule_qconv2d_depthwise
from .._qgemm import Microkernel, schedule_qdense, splat4
from .._qwgemm import QKernel, schedule_qwdense, schedule_take_q4, schedule_take_w8

__all__ = ["NEON_SMULL", "Q8_SDOT", "SDOT"]

_NEON = ("kind:llvm", "arch:aarch64", "neon")
ROWS, COLS = 4, 16


def _sdot(acc: tirx.PrimExpr, a: tirx.PrimExpr, load_b: Callable) -> tirx.PrimExpr:
    return tirx.call_llvm_pure_intrin(
        "int32x4", "llvm.aarch64.neon.sdot.v4i32.v16i8", acc, splat4(a, "int8x16", 4), load_b(0, 16)
    )


def _smull(acc: tirx.PrimExpr, a: tirx.PrimExpr, load_b: Callable) -> tirx.PrimExpr:
    # 8 bytes of weights = 2 channels x 4 bytes of K; the activation word is repeated to match.
    a8 = splat4(a, "int8x8", 2)
    halves = []
    for half in (0, 8):
        prod = tirx.call_llvm_pure_intrin(
            "int16x8", "llvm.aarch64.neon.smull.v8i16", a8, load_b(half, 8)
        )
        halves.append(
            tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.saddlp.v4i32.v8i16", prod)
        )
    # [c0 k01, c0 k23, c1 k01, c1 k23] + [c2 .., c3 ..] -> pairwise -> [c0, c1, c2, c3]
    return acc + tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.addp.v4i32", *halves)


#: ``sdot v.4s``: 4 channels x 4 bytes of K, s8 x s8 (needs the dot-product extension).
SDOT = Microkernel("sdot", 4, _sdot)
#: NEON without dot product: ``smull`` + ``saddlp`` + ``addp`` for the same 4 x 4 step.
NEON_SMULL = Microkernel("smull", 4, _smull)


def _q8_sdot(acc: tirx.PrimExpr, w: tirx.PrimExpr, xword: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.call_llvm_pure_intrin(
        "int32x4", "llvm.aarch64.neon.sdot.v4i32.v16i8", acc, w, splat4(xword, "int8x16", 4))


#: ``sdot v.4s`` for the q8_0 weight-only kernels (s8 x s8: q4 nibbles 0..15 and int8
#: weights as they are).
Q8_SDOT = QKernel("sdot", 4, "int8", 0, _q8_sdot)


@rule(
    ["dense_q4", "dense_w8"],
    "arm_cpu",
    name="neon.qwdense_dotprod",
    requires=(*_NEON, "dotprod"),
    priority=35,
    claims=("vectorize", "parallel", "insn:sdot"),
)
def _qwdense_dotprod(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """activations="q8_0" weight-only dense on sdot: x quantized per (row, 32-block) to int8
    in one pass, weights packed 4 channels x 4 bytes (folded at compile time), per block
    exact int32 sums (q4: and / shift of the nibbles and a -8 * sum(xq) start) scaled once
    into float32 accumulators; 1-2 rows (a decode GEMV) or 3 rows x 4 vectors of 4
    channels, in parallel; scale, bias and activation fused. Declines
    activations="float32"."""
    return schedule_qwdense(func, target, Q8_SDOT)


@rule(
    "take_q4",
    "arm_cpu",
    name="neon.take_q4_dotprod",
    requires=(*_NEON, "dotprod"),
    priority=35,
    claims=("vectorize",),
)
def _take_q4_dotprod(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of a q4_0 table gathered from the packing neon.qwdense_dotprod gives a dense_q4
    weight (4 x 4 channels), so a table that is also a q8_0 layer's weight (a tied LM head)
    is held once; static table shapes, activations="q8_0" only."""
    return schedule_take_q4(func, target, Q8_SDOT)


@rule(
    "take_w8",
    "arm_cpu",
    name="neon.take_w8_dotprod",
    requires=(*_NEON, "dotprod"),
    priority=35,
    claims=("vectorize",),
)
def _take_w8_dotprod(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of an int8 table gathered from the packing neon.qwdense_dotprod gives a
    dense_w8 weight (4 x 4 channels), so a table that is also a q8_0 layer's weight (a tied
    LM head) is held once; static table shapes, activations="q8_0" only."""
    return schedule_take_w8(func, target, Q8_SDOT)


@rule(
    "qdense",
    "arm_cpu",
    name="neon.qdense_dotprod",
    requires=(*_NEON, "dotprod"),
    priority=30,
    claims=("vectorize", "parallel", "insn:sdot"),
)
def _qdense_dotprod(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 GEMM on sdot: int8-shifted activations, packed weights, zero-point compensation,
    4 x 16 register tiles in parallel, fused requantize epilogue."""
    return schedule_qdense(func, target, SDOT, act_dtype="int8", rows=ROWS, cols=COLS)


@rule(
    "qdense",
    "arm_cpu",
    name="neon.qdense",
    requires=_NEON,
    priority=25,
    claims=("vectorize", "parallel"),
)
def _qdense_neon(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 GEMM on NEON without dot product: smull/saddlp/addp into int32 vectors, same
    tiling and epilogue as the sdot rule."""
    return schedule_qdense(func, target, NEON_SMULL, act_dtype="int8", rows=ROWS, cols=COLS)


@rule(
    "qconv2d",
    "arm_cpu",
    name="neon.qconv2d_dotprod",
    requires=(*_NEON, "dotprod"),
    priority=30,
    claims=("vectorize", "parallel", "insn:sdot"),
)
def _qconv2d_dotprod(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 direct convolution on sdot: blocked int8-shifted input, packed weights,
    zero-point compensation, 4-pixel x 16-channel register tiles in parallel, fused
    requantize epilogue (dense convs)."""
    return schedule_qconv2d(func, target, SDOT, act_dtype="int8", rows=ROWS, cols=COLS)


@rule(
    "qconv2d",
    "arm_cpu",
    name="neon.qconv2d",
    requires=_NEON,
    priority=25,
    claims=("vectorize", "parallel"),
)
def _qconv2d_neon(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 direct convolution on NEON without dot product (smull/saddlp/addp), same
    tiling and epilogue as the sdot rule."""
    return schedule_qconv2d(func, target, NEON_SMULL, act_dtype="int8", rows=ROWS, cols=COLS)


@rule(
    "qconv2d",
    "arm_cpu",
    name="neon.qconv2d_depthwise",
    requires=_NEON,
    priority=20,
    claims=("vectorize", "parallel"),
)
def _qconv2d_depthwise_neon(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Depthwise int8 conv in NEON int32 vectors along the contiguous output axis (the x86
    rule's schedule)."""
    return schedule_qconv2d_depthwise(func, target)
