"""``ConvLiveTaps``: a convolution whose taps read its zero padding over much of the image
runs as one convolution per region of the output, each with only the taps that read the
image there.

An atrous conv (DeepLab's ASPP: 3x3 taps at dilation 12, 24 and 36) on a small feature map
(16x16 at output stride 16 of a 256x256 image) reads mostly padding: at dilation 24 and 36
the outer taps land outside the image for every output pixel, and at dilation 12 for three
quarters of them. TVM's conv, like any direct or im2col conv, multiplies those zeros: in
torchvision's DeepLabV3-MobileNetV3 the three ASPP convs were 72 % of the model's time.

Along each spatial axis, output ``o`` reads input ``o * stride + t * dilation - pad`` at
tap ``t``; the taps that land inside the image form an interval, and runs of outputs with
the same interval form the axis' regions. A region is an ordinary convolution without
padding: its input rows cut out of the image (``strided_slice``), its taps cut out of the
weights (a constant slice folds at compile time), and the regions' outputs concatenated
back in place. Every multiply of an image value by its weight is kept and none of a zero
is added, so the result equals the original up to float32's order of summation.

It pays where the taps dropped outweigh the extra kernels: a conv whose regions are one
(every output drops the same taps: dilation 24 and 36 above become 1x1 convs) whenever a
tap is dropped; otherwise at most :data:`MAX_REGIONS` regions per axis, at most
:data:`SPLIT_BELOW` of the multiplies left, and :data:`MIN_SAVED_PER_REGION` multiply-adds
saved per kernel added. An ordinary 3x3 conv with padding 1 drops taps
only on its border (a 7x7 map keeps 74 % of them) and stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from .._patterns import static_shape
from .._walk import calls_of
from ._rewrite import op_counts

__all__ = ["MAX_REGIONS", "MIN_SAVED_PER_REGION", "SPLIT_BELOW", "ConvLiveTaps", "live_regions"]

#: Split into regions only where at most this fraction of the multiplies is left.
SPLIT_BELOW = 0.5
#: At most this many regions along each axis (three: the two borders and the middle).
MAX_REGIONS = 3
#: Multiply-adds a split must save per kernel it adds (about 5 us at this CPU's GEMM rate;
#: a kernel call and its share of the concat cost a few us): a tiny conv on a 2x2 map, whose
#: border taps are half its work, is not worth four kernels.
MIN_SAVED_PER_REGION = 1 << 20


@dataclass(frozen=True)
class Region:
    """Outputs ``[start, stop)`` along one axis, which read the image only at taps
    ``[first, last]``."""

    start: int
    stop: int
    first: int
    last: int

    @property
    def taps(self) -> int:
        return self.last - self.first + 1


def live_regions(size: int, out: int, stride: int, dilation: int, taps: int,
                 pad: int) -> list[Region] | None:
    """The regions of one axis of a conv: runs of outputs that read the image at the same
    taps; None when some output reads only padding.

    Examples
    --------
    >>> from opsdk.transform._taps import live_regions
    >>> [(r.start, r.stop, r.first, r.last) for r in live_regions(16, 16, 1, 12, 3, 12)]
    [(0, 4, 1, 2), (4, 12, 1, 1), (12, 16, 0, 1)]
    >>> [(r.start, r.stop, r.first, r.last) for r in live_regions(16, 16, 1, 36, 3, 36)]
    [(0, 16, 1, 1)]
    """
    regions: list[Region] = []
    for o in range(out):
        live = [t for t in range(taps) if 0 <= o * stride + t * dilation - pad < size]
        if not live:
            return None
        if regions and (regions[-1].first, regions[-1].last) == (live[0], live[-1]):
            regions[-1] = Region(regions[-1].start, o + 1, live[0], live[-1])
        else:
            regions.append(Region(o, o + 1, live[0], live[-1]))
    return regions


def _multiplies(regions: list[Region]) -> int:
    return sum((r.stop - r.start) * r.taps for r in regions)


def _plan(call: relax.Call) -> tuple[list[Region], list[Region]] | None:
    """The row and column regions of a static 2-D conv worth splitting, else None."""
    a = call.attrs
    x_shape, w_shape, y_shape = (static_shape(e) for e in (call.args[0], call.args[1], call))
    if x_shape is None or w_shape is None or y_shape is None or len(x_shape) != 4:
        return None
    dl, kl = str(a.data_layout), str(a.kernel_layout)
    ol = str(a.out_layout) or dl
    if sorted(dl) != sorted("NCHW") or sorted(kl) != sorted("OIHW") or sorted(ol) != sorted(dl):
        return None
    pad = [int(v) for v in a.padding]
    axes = []
    for d, name in enumerate("HW"):
        regions = live_regions(x_shape[dl.index(name)], y_shape[ol.index(name)],
                               int(a.strides[d]), int(a.dilation[d]),
                               w_shape[kl.index(name)], pad[d])
        if regions is None:
            return None
        axes.append(regions)
    rows, cols = axes
    full = y_shape[ol.index("H")] * w_shape[kl.index("H")] * \
        y_shape[ol.index("W")] * w_shape[kl.index("W")]
    left = _multiplies(rows) * _multiplies(cols)
    if left >= full:
        return None
    if len(rows) == 1 and len(cols) == 1:
        return rows, cols
    # multiply-adds per (output pixel, tap): batch, output channels, input channels a group
    per = y_shape[ol.index("N")] * y_shape[ol.index("C")] * w_shape[kl.index("I")]
    if (len(rows) > MAX_REGIONS or len(cols) > MAX_REGIONS or left > SPLIT_BELOW * full
            or (full - left) * per < (len(rows) * len(cols) - 1) * MIN_SAVED_PER_REGION):
        return None
    return rows, cols


@relax.expr_functor.mutator
class _LiveTaps(relax.PyExprMutator):
    """Each conv worth it (:func:`_plan`) -> one conv per region, concatenated."""

    def __init__(self, mod: tvm.IRModule | None = None) -> None:
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv2d"):
            return call
        plan = _plan(call)
        if plan is None:
            return call
        rows, cols = plan
        a = call.attrs
        dl, kl = str(a.data_layout), str(a.kernel_layout)
        ol = str(a.out_layout) or dl
        stride = [int(v) for v in a.strides]
        dil = [int(v) for v in a.dilation]
        pad = [int(v) for v in a.padding]
        taps = static_shape(call.args[1])
        emit = self.builder_.emit
        bands = []
        for r in rows:
            band = []
            for c in cols:
                begin = [r.start * stride[0] + r.first * dil[0] - pad[0],
                         c.start * stride[1] + c.first * dil[1] - pad[1]]
                end = [(r.stop - 1) * stride[0] + r.last * dil[0] - pad[0] + 1,
                       (c.stop - 1) * stride[1] + c.last * dil[1] - pad[1] + 1]
                x = emit(relax.op.strided_slice(
                    call.args[0], [dl.index("H"), dl.index("W")], begin, end))
                w = call.args[1]
                if (r.taps, c.taps) != (taps[kl.index("H")], taps[kl.index("W")]):
                    w = emit(relax.op.strided_slice(
                        w, [kl.index("H"), kl.index("W")], [r.first, c.first],
                        [r.last + 1, c.last + 1]))
                band.append(emit(relax.op.nn.conv2d(
                    x, w, strides=stride, padding=[0, 0, 0, 0],
                    dilation=[dil[0] if r.taps > 1 else 1, dil[1] if c.taps > 1 else 1],
                    groups=int(a.groups), data_layout=dl, kernel_layout=kl,
                    out_layout=ol, out_dtype=a.out_dtype)))
            bands.append(band[0] if len(band) == 1
                         else emit(relax.op.concat(band, axis=ol.index("W"))))
        self.rewritten += 1
        return bands[0] if len(bands) == 1 else relax.op.concat(bands, axis=ol.index("H"))


def ConvLiveTaps() -> tvm.transform.Pass:
    """Convolutions that read mostly padding -> one convolution per region of the output,
    each with the taps that read the image there (see the module's description).

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    >>> w = relax.const(np.ones((4, 8, 3, 3), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.conv2d(x, w, padding=24, dilation=24))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.ConvLiveTaps()(bb.get())
    >>> [c.attrs.dilation[0] for c in opsdk.transform._taps.conv_calls(mod)]  # now 1x1
    [1]
    """

    @tvm.transform.module_pass(opt_level=0, name="opsdk.ConvLiveTaps")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not op_counts(mod, "relax.nn.conv2d"):  # (a transformer: no walk in Python)
            return mod
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m = _LiveTaps(mod)
                new = m.visit_expr(func)
                if m.rewritten:
                    updates[gv] = new
        if not updates:
            return mod
        mod = mod.clone()
        for gv, func in updates.items():
            mod[gv] = func
        return relax.transform.DeadCodeElimination()(mod)

    return _pass


def conv_calls(mod: tvm.IRModule) -> list[relax.Call]:
    """The ``conv2d`` calls of ``mod``'s Relax functions (for tests and examples)."""
    return [c for func in mod.functions.values() if isinstance(func, relax.Function)
            for c in calls_of(func, "relax.nn.conv2d")]
