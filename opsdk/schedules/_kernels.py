"""What a PrimFunc from TVM's own legalization computes, read off its blocks.

The driver chooses rules by op name or op *kind*. A kernel that TVM's ops lower to (and that
FuseOps/FuseTIR may have fused with its neighbours) has no opsdk op, so it gets a
:class:`Kernel` whose kind is classified from the loop and buffer structure:

- ``winograd``: a Winograd convolution (``opsdk.kernels.winograd``: blocks tagged
  ``opsdk.winograd``, which the model pipeline legalizes eligible 3x3 convs to) with its
  epilogue;
- ``matmul``: one multiply-accumulate reduction ``C[S, I, J] += A[S, I, K] * B[S, J, K]``
  (dense, matmul, batch_matmul), plus injective producers and elementwise consumers;
- ``conv2d``: one multiply-accumulate reduction whose input index is a window
  (``oh * stride + kh * dilation``): conv2d NCHW / NHWC, grouped and depthwise;
- ``pool``: window reductions of one operand (max / sum pooling);
- ``reduction``: other reductions (mean, sum, max over axes, TVM's softmax pieces);
- ``elementwise``: only spatial blocks (elementwise, broadcast, transpose, reshape, concat,
  split, slice, pad);
- ``opaque``: what is none of these (extern calls, blocks with opaque iterators).

Rules for these kinds sit in the same registry as the op rules and are chosen by the same
driver, so ``opsdk explain`` reports one story for a whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.tirx.analysis import undefined_vars

from ..kernels.winograd import WINOGRAD_TAG
from ._gemm import analyze_gemm
from ._memo import memoized

__all__ = ["KERNEL_KINDS", "WINOGRAD_TAG", "Kernel", "classify", "kernel_for"]


#: Kinds :func:`classify` assigns, in the order they are tested.
KERNEL_KINDS = ("winograd", "matmul", "conv2d", "pool", "reduction", "elementwise", "opaque")


@dataclass(frozen=True)
class Kernel:
    """A PrimFunc of a model that is not an opsdk op: its name and classified kind.

    It stands where the driver expects an op (``.name``, ``.kind``), so rules keyed by
    ``kind:matmul`` etc. apply to it.
    """

    name: str
    kind: str

    @property
    def op_name(self) -> str:
        return self.name


def _is_reduction(blk: s_tir.SBlock) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in blk.iter_vars)


def _window_read(blk: s_tir.SBlock) -> bool:
    """Whether some read index combines a spatial and a reduction iter var (a window)."""
    red = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    spat = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.DataPar}
    for r in blk.reads:
        for rg in r.region:
            vs = set(undefined_vars(rg.min))
            if vs & red and vs & spat:
                return True
    return False


def classify(func: tirx.PrimFunc) -> str:
    """The kernel kind of ``func`` (one of :data:`KERNEL_KINDS`).

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.schedules._kernels import classify
    >>> a = te.placeholder((8, 4), name="a")
    >>> classify(te.create_prim_func([a, te.compute((4, 8), lambda i, j: a[j, i])]))
    'elementwise'
    """
    return memoized("classify", func, None, lambda: _classify(func))


def _classify(func: tirx.PrimFunc) -> str:
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:
        return "opaque"
    if not blocks:
        return "opaque"
    infos = [sch.get(b) for b in blocks]
    if any(WINOGRAD_TAG in blk.annotations for blk in infos):
        return "winograd"
    for blk in infos:
        if any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
               for iv in blk.iter_vars):
            return "opaque"
    red = [b for b, blk in zip(blocks, infos) if _is_reduction(blk)]
    if not red:
        return "elementwise"
    if len(red) == 1:
        blk = sch.get(red[0])
        out = blk.writes[0].source if blk.writes else None
        operands = [r for r in blk.reads if out is None or not r.source.same_as(out)]
        if analyze_gemm(sch, red[0]) is not None:
            return "matmul"
        if len(operands) == 2 and _window_read(blk):
            return "conv2d"
        if len(operands) == 1 and _window_read(blk):
            return "pool"
    if all(_window_read(sch.get(b)) and len(sch.get(b).reads) <= 2 for b in red):
        return "pool"
    return "reduction"


def kernel_for(name: str, func: tirx.PrimFunc) -> Kernel:
    """The :class:`Kernel` descriptor the driver uses for a model's PrimFunc ``name``."""
    return Kernel(name=name, kind=classify(func))
