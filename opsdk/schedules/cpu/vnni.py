"""x86 rules for ``qdense`` and ``qconv2d`` on AVX-512 VNNI ``vpdpbusd`` (u8 x s8 -> s32),
and the depthwise ``qconv2d`` rule of every x86 CPU.

The schedules are the int8 GEMM core (:mod:`.._qgemm`) and the int8 convolution
(:mod:`.._qconv`) around the :data:`VNNI` micro-kernel with a 6 x 64 register tile; the ARM
rules (``sdot`` / NEON) and the AVX2 rules use the same schedules with their own micro-kernel
and tile.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._qconv import schedule_qconv2d, schedule_qconv2d_depthwise
from .._qgemm import Microkernel, schedule_qdense, splat4
from .._qwgemm import QKernel, schedule_qwdense, schedule_take_q4, schedule_take_w8

__all__ = ["COLS", "Q8_VNNI", "ROWS", "VNNI"]

_X86_VNNI = ("kind:llvm", "arch:x86_64", "avx512vnni")
# 6 rows x 4 zmm of 16 channels = 24 accumulators; with the 4 weight vectors and the activation
# broadcasts that is 29 of 32 zmm registers (LLVM keeps them all in registers, checked in asm).
ROWS, COLS = 6, 64


def _vnni(acc: tirx.PrimExpr, a: tirx.PrimExpr, load_b: Callable) -> tirx.PrimExpr:
    return tirx.call_llvm_pure_intrin(
        "int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, splat4(a, "uint8x64", 16), load_b(0, 64)
    )


#: ``vpdpbusd zmm``: 16 channels x 4 bytes of K, u8 activations x s8 weights. LLVM 22 takes the
#: byte operands as ``<64 x i8>`` (TVM 0.27's own intrinsic still passes ``<16 x i32>``).
VNNI = Microkernel("vpdpbusd", 16, _vnni)


@rule(
    "qdense",
    "cpu",
    name="x86.qdense_vnni",
    requires=_X86_VNNI,
    priority=20,
    claims=("vectorize", "parallel", "insn:vpdpbusd"),
)
def _qdense_vnni(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 GEMM on vpdpbusd: uint8-shifted activations, packed weights, zero-point
    compensation, 6 x 64 register tiles in parallel, fused requantize epilogue."""
    return schedule_qdense(func, target, VNNI, act_dtype="uint8", rows=ROWS, cols=COLS)


def _q8_vnni(acc: tirx.PrimExpr, w: tirx.PrimExpr, xword: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.call_llvm_pure_intrin(
        "int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, w, splat4(xword, "int8x64", 16))


#: ``vpdpbusd zmm`` for the q8_0 weight-only kernels: the weights are the unsigned operand
#: (q4 nibbles, int8 weights + 128), the q8_0 activations the signed one.
Q8_VNNI = QKernel("vpdpbusd", 16, "uint8", 128, _q8_vnni)


@rule(
    ["dense_q4", "dense_w8"],
    "cpu",
    name="x86.qwdense_vnni",
    requires=_X86_VNNI,
    priority=25,
    claims=("vectorize", "parallel", "insn:vpdpbusd"),
)
def _qwdense_vnni(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """activations="q8_0" weight-only dense on vpdpbusd: x quantized per (row, 32-block) to
    int8 in one pass, weights packed 16 channels x 4 bytes (folded at compile time), per
    block exact int32 sums (q4: and / shift of the nibbles, -8 * sum(xq) start; w8: weights
    + 128, -128 * sum(xq) start) scaled once into float32 accumulators; 1-2 row x 64-channel
    tiles for a decode GEMV, 3 x 64 otherwise (a symbolic M padded to whole row tiles), in
    parallel; scale, bias and activation fused. Declines activations="float32"."""
    return schedule_qwdense(func, target, Q8_VNNI)


@rule(
    "take_q4",
    "cpu",
    name="x86.take_q4_vnni",
    requires=_X86_VNNI,
    priority=25,
    claims=("vectorize",),
)
def _take_q4_vnni(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of a q4_0 table gathered from the packing x86.qwdense_vnni gives a dense_q4
    weight (16 x 4 channels), so a table that is also a q8_0 layer's weight (a tied LM
    head) is held once; static table shapes, activations="q8_0" only."""
    return schedule_take_q4(func, target, Q8_VNNI)


@rule(
    "take_w8",
    "cpu",
    name="x86.take_w8_vnni",
    requires=_X86_VNNI,
    priority=25,
    claims=("vectorize",),
)
def _take_w8_vnni(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Rows of an int8 table gathered from the packing x86.qwdense_vnni gives a dense_w8
    weight (16 x 4 channels, stored + 128), so a table that is also a q8_0 layer's weight (a
    tied LM head) is held once; static table shapes, activations="q8_0" only."""
    return schedule_take_w8(func, target, Q8_VNNI)


@rule(
    "qconv2d",
    "cpu",
    name="x86.qconv2d_vnni",
    requires=_X86_VNNI,
    priority=20,
    claims=("vectorize", "parallel", "insn:vpdpbusd"),
)
def _qconv2d_vnni(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 direct convolution on vpdpbusd: blocked uint8-shifted input, packed weights,
    zero-point compensation, 6-pixel x 64-channel register tiles in parallel, fused
    requantize epilogue (dense convs; depthwise goes to the next rule)."""
    return schedule_qconv2d(func, target, VNNI, act_dtype="uint8", rows=ROWS, cols=COLS)


@rule(
    "qconv2d",
    "cpu",
    name="x86.qconv2d_depthwise",
    requires=("kind:llvm", "arch:x86_64"),
    priority=15,
    claims=("vectorize", "parallel"),
)
def _qconv2d_depthwise_x86(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Depthwise int8 conv: int32 multiply-adds of a padded int16 input in vectors along the
    contiguous output axis (channels in NHWC), all other axes in parallel."""
    return schedule_qconv2d_depthwise(func, target)
