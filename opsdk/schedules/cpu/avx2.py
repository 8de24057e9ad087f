"""x86 rules for ``qdense`` and dense ``qconv2d`` on AVX2 CPUs without VNNI (Zen 3, Haswell
to Skylake client): an exact int8 dot product from ``vpmaddwd``.

Without ``vpdpbusd`` these ops had no rule on such a CPU and ran the generic lowering
(scalar, one core). The rules are the VNNI rules' strategy and tiling
(:func:`~opsdk.schedules.cpu.vnni.schedule_qdense` and the direct convolution of
:func:`~opsdk.schedules._qconv.schedule_qconv2d`) with int8 activations (as on ARM: uint8
inputs move down by 128, the compensation restores the exact result) and an 8-channel
micro-kernel:

- the 32 weight bytes of 8 channels x 4 bytes of K are split into the byte halves
  (channels 0, 1, 4, 5) and (2, 3, 6, 7) and sign-extended to int16 (``vpmovsxbw``); the
  row's 4 activation bytes, repeated, likewise;
- ``vpmaddwd`` multiplies and adds pairs (int16 x int16 -> int32, exact: no saturation, unlike
  ``vpmaddubsw``, which onnxruntime uses with 7-bit weights to stay in range);
- ``vphaddd`` adds the pairs of both halves, which leaves the channels in order 0-7, and a
  ``vpaddd`` accumulates.

Tiles are 4 rows (pixels) x 16 channels: 8 int32 accumulators, the extended weights of both
channel groups and the activation in 16 ymm registers. The weight work is shared by the
tile's rows (the same loads, merged by LLVM), so a step costs about two ``vpmaddwd``, one
``vphaddd`` and one ``vpaddd`` per 32 multiply-adds per row.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.target import Target

from .. import rule
from .._qconv import schedule_qconv2d
from .._qgemm import Microkernel, schedule_qdense, splat4

__all__ = ["AVX2_PMADDWD"]

_X86_AVX2 = ("kind:llvm", "arch:x86_64", "avx2")
ROWS, COLS = 4, 16


def _halves(w: tirx.PrimExpr) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """The 32 bytes of 8 channels x 4 bytes as two int16x16 vectors: channels (0, 1, 4, 5)
    and (2, 3, 6, 7), so that ``vphaddd`` of their pair sums is in channel order."""
    lo = [*range(0, 8), *range(16, 24)]
    hi = [*range(8, 16), *range(24, 32)]
    return tuple(  # type: ignore[return-value]
        tirx.Cast("int16x16", tirx.Shuffle([w], [tirx.IntImm("int32", i) for i in idx]))
        for idx in (lo, hi))


def _pmaddwd(acc: tirx.PrimExpr, a: tirx.PrimExpr, load_b: Callable) -> tirx.PrimExpr:
    a16 = tirx.Cast("int16x16", splat4(a, "int8x16", 4))
    x, y = _halves(load_b(0, 32))
    px = tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", x, a16)
    py = tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", y, a16)
    # [c0 k01, c0 k23, c1 k01, c1 k23 | c4 .., c5 ..] + [c2 .., c3 .. | c6 .., c7 ..]
    return acc + tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.phadd.d", px, py)


#: ``vpmaddwd`` + ``vphaddd``: 8 channels x 4 bytes of K, s8 x s8 -> s32 (exact).
AVX2_PMADDWD = Microkernel("vpmaddwd", 8, _pmaddwd)


@rule(
    "qdense",
    "cpu",
    name="x86.qdense_avx2",
    requires=_X86_AVX2,
    priority=18,
    claims=("vectorize", "parallel", "insn:vpmaddwd"),
)
def _qdense_avx2(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 GEMM on vpmaddwd (AVX2 without VNNI): int8-shifted activations, packed weights,
    zero-point compensation, 4 x 16 register tiles in parallel, fused requantize epilogue."""
    return schedule_qdense(func, target, AVX2_PMADDWD, act_dtype="int8", rows=ROWS, cols=COLS)


@rule(
    "qconv2d",
    "cpu",
    name="x86.qconv2d_avx2",
    requires=_X86_AVX2,
    priority=18,
    claims=("vectorize", "parallel", "insn:vpmaddwd"),
)
def _qconv2d_avx2(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """int8 direct convolution on vpmaddwd (AVX2 without VNNI): blocked int8-shifted input,
    packed weights, zero-point compensation, 4-pixel x 16-channel register tiles in parallel,
    fused requantize epilogue (dense convs; depthwise goes to the next rule)."""
    return schedule_qconv2d(func, target, AVX2_PMADDWD, act_dtype="int8", rows=ROWS, cols=COLS)
