"""``ChannelsLast``: run a model's convolutions in NHWC inside, whatever layout it came in.

torch and ONNX models are NCHW. On a CPU the conv kernels vectorize best over channels:
in NHWC the channel axis is contiguous in the input, the weights and the output, so a tile of
output channels is loaded, accumulated and stored in whole vectors, and a depthwise conv
reads its input in vectors too. (In NCHW the output tile must be stored transposed and a
strided depthwise conv gathers.) TVM's ``ConvertLayout`` rewrites every ``conv2d`` to NHWC /
HWIO and carries the layout through the elementwise ops, pools and reductions that follow,
so a chain of convs pays one transpose where it enters and one where it leaves.

An opsdk op stops it too (ConvertLayout knows TVM's ops only), so two rewrites follow it:

- the transposes it left are **sunk** below every op that commutes with them: an
  elementwise opsdk op (a user's hardswish, the built-in GELU), TVM's elementwise and
  broadcasting ops and its reductions (axes renumbered), so ``f(permute(x, P))`` becomes
  ``permute(f(x), P)`` and back-to-back permutes compose (to nothing when they cancel). A
  user's activation then sits between the convs in NHWC and fuses into the conv's epilogue
  like a built-in one, and so does what follows it (a squeeze-excite's mean and multiply).
  "Elementwise" is proven, not declared: the opsdk op's lowered kernel must have TVM's
  elementwise pattern (every input read where the output is written), which a softmax or a
  norm over an axis does not;
- a group norm between convs would sit between two transposes, so
  ``to_nhwc(group_norm_nchw(to_nchw(x)))`` becomes ``group_norm_nhwc(x)`` (opsdk's group
  norm has an NHWC kernel); an NCHW pool or group norm on ``to_nchw(x)`` runs NHWC on ``x``
  with its result permuted back, and a binary op's lower-rank operand (a ``(C, 1, 1)`` layer
  scale) is brought to the layout it broadcasts against, so PoolFormer's blocks (group norm,
  ``pool(y) - y``, layer scale) stay NHWC between the convs; an operand computed from
  constants only is permuted for free (folded); an inference ``batch_norm``, a ``pad`` and a
  ``concat`` of inputs permuted alike are carried with their axes renumbered (FastViT's BN
  after a GELU, HGNetV2's padded stem and concatenated branches); the identity permutes
  ConvertLayout leaves of a model's own ``permute`` (ConvNeXt's) are dropped;
- a transpose of an upsampled value (``resize2d``, whose output is larger than its input),
  or of a concat of upsampled values, moves before the resizes, which then run in the
  layout their consumer reads: the transpose moves the small tensors (DeepLab's 21 class
  maps, upsampled 16x16 -> 256x256 to the NCHW output; SegFormer's four upsampled maps
  concatenated for an NHWC conv);
- ConvertLayout transposes a value once per use: the copies are merged (one
  ``EliminateCommonSubexpr``), so two convs reading one NCHW value share its transpose.

A 1-D conv (NCW) becomes a conv2d over a one-row image (``_Conv1dAsConv2d``) first, so an
audio or sequence model's convs (wav2vec2's feature encoder, Whisper's stem) go NHWC on the
same conv rules and epilogues; a 3-D conv (NCDHW) becomes an NHWC conv2d over its depth
windows, one image per output depth (``_Conv3dAsConv2d``: video and volumetric nets).

A depthwise conv with a channel multiplier reads its input through ``o // m``: it becomes a
``repeat`` of the input channels and a plain depthwise conv (``_MultiplierAsRepeat``), so the
conv rule loads whole vectors instead of gathering at every tap.

A transposed conv first becomes a conv and a depth-to-space (the sub-pixel form,
``_TransposedConvAsConv``; a 1x1 conv for UNet / FPN's kernel 2 / stride 2): it then runs NHWC
on the conv rules like the others, instead of TVM's NCHW conv over a zero-dilated input.

``relax.clip`` (ReLU6) stops ``ConvertLayout`` (its layout inference refuses the bound
arguments), so constant clips are first spelled ``minimum(maximum(x, lo), hi)``: the same
values, and elementwise ops it carries the layout through.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import tvm
from tvm import relax

from .. import relax as ops
from .._patterns import static_shape
from ..registry import decode_call
from ..targets import target as resolve_target
from ._lower import _legalize_opsdk_ops
from ._rewrite import op_counts

__all__ = ["ChannelsLast"]

#: conv2d layouts ``ChannelsLast`` asks ConvertLayout for: data / weight.
LAYOUTS = {"relax.nn.conv2d": ["NHWC", "HWIO"],
           # TVM legalizes only NCHW transposed convs: keep them so (a permute pair)
           "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}


def _bound(e: relax.Expr) -> float | None:
    """A clip bound's value: an immediate (``FloatImm`` / ``IntImm``) or a one-element
    constant; None when it is computed."""
    if isinstance(e, (tvm.tirx.FloatImm, tvm.tirx.IntImm)):
        return float(e.value)
    v = getattr(e, "value", None)  # a PrimValue wrapping an immediate
    if isinstance(v, (tvm.tirx.FloatImm, tvm.tirx.IntImm)):
        return float(v.value)
    if isinstance(e, tvm.ir.expr.GenericConst) and e.value.numpy().size == 1:
        return float(e.value.numpy().reshape(()))
    return None


@relax.expr_functor.mutator
class _ClipAsMinMax(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.clip"):
            return call
        ty = call.args[0].ty
        if not isinstance(ty, relax.TensorType) or not str(ty.dtype).startswith(("float", "bf")):
            return call
        lo, hi = _bound(call.args[1]), _bound(call.args[2])
        if lo is None or hi is None:
            return call
        dt = str(ty.dtype)
        x = relax.op.maximum(call.args[0], relax.const(lo, dt))
        return relax.op.minimum(self.builder_.normalize(x), relax.const(hi, dt))


@relax.expr_functor.mutator
class _SqueezeAxesPositive(relax.PyExprMutator):
    """``squeeze(x, axis=[-2])`` -> ``squeeze(x, axis=[rank - 2])``: TVM 0.27's layout
    inference of ``squeeze`` indexes the layout with the axis as given, and a negative one
    after a channels-last op throws ``std::bad_alloc`` out of ``ConvertLayout`` (NextViT's
    ``AvgPool1d`` spelled as ``expand_dims``, ``avg_pool2d``, ``squeeze(-2)``)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.squeeze"):
            return call
        axes = call.attrs.axis
        ty = call.args[0].ty
        if axes is None or not isinstance(ty, relax.TensorType) or ty.ndim < 0:
            return call
        given = [int(a) for a in axes]
        if all(a >= 0 for a in given):
            return call
        return relax.op.squeeze(call.args[0], axis=[a % ty.ndim for a in given])


def _static_conv(call: relax.Call, name: str
                 ) -> tuple[Any, tuple[int, ...], tuple[int, ...]] | None:
    """(attrs, input shape, weight shape) of ``call`` when it calls op ``name`` with a static
    input and weight (the conv kernels need static images); else None."""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name == name):
        return None
    x_shape, w_shape = static_shape(call.args[0]), static_shape(call.args[1])
    return None if x_shape is None or w_shape is None else (call.attrs, x_shape, w_shape)


#: Transposed convs taken to their sub-pixel form: op, the conv it becomes, the layouts.
_TRANSPOSED = (("relax.nn.conv1d_transpose", relax.op.nn.conv1d, ("NCW", "IOW", "NCW")),
               ("relax.nn.conv2d_transpose", relax.op.nn.conv2d, ("NCHW", "IOHW", "NCHW")),
               ("relax.nn.conv3d_transpose", relax.op.nn.conv3d, ("NCDHW", "IODHW", "NCDHW")))


@relax.expr_functor.mutator
class _TransposedConvAsConv(relax.PyExprMutator):
    """``conv2d_transpose`` (no dilation or groups) -> one ``conv2d`` to ``Co * s * s``
    channels, a depth-to-space and a crop: the sub-pixel form.

    Output row ``oy`` of a stride-``s`` transposed conv takes only the taps ``ky`` with
    ``ky = (oy + pad) mod s``: phase ``r`` of the output is an ordinary stride-1 conv of the
    input with the taps ``w[r], w[r + s], ...`` reversed. The kernel is zero-padded to a
    multiple of ``s`` (``J = ceil(k / s)`` taps a phase), the ``s * s`` phases become the
    output channels of one ``J x J`` conv over the input padded by ``J - 1``, and a
    depth-to-space then a crop of ``pad`` put the rows in place. TVM legalizes transposed
    convs (NCHW only) as a conv over the zero-dilated input, where at stride 2 three of four
    multiplies are by zero; this conv goes NHWC on the conv rules with the others and the
    depth-to-space fuses with its neighbours (a skip concat). Kernel 2 / stride 2 (UNet and
    FPN upsampling) is a 1x1 conv with no padding and no crop. A ``conv3d_transpose`` (a 3-D
    UNet's) is the same over three axes, a ``conv3d`` to ``Co * s^3`` channels, and a
    ``conv1d_transpose`` (a vocoder's upsampling) over one."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        hit = next(((f, conv, layouts) for name, conv, layouts in _TRANSPOSED
                    if (f := _static_conv(call, name)) is not None
                    and len(f[1]) == len(f[2]) == len(layouts[0])), None)
        if hit is None:
            return call
        (a, x_shape, w_shape), conv, layouts = hit
        nd = len(x_shape) - 2  # spatial dims
        s = [int(v) for v in a.strides]
        lo, hi = [int(v) for v in a.padding][:nd], [int(v) for v in a.padding][nd:]
        op = [int(v) for v in a.output_padding]
        if (any(int(v) != 1 for v in a.dilation) or int(a.groups) != 1 or min(s) < 1
                or (a.data_layout, a.kernel_layout, a.out_layout) != layouts):
            return call
        n, ci, size = x_shape[0], x_shape[1], list(x_shape[2:])
        co, k = w_shape[1], w_shape[2:]
        dims = range(nd)
        out = [(size[d] - 1) * s[d] - lo[d] - hi[d] + k[d] + op[d] for d in dims]
        taps = [-(-k[d] // s[d]) for d in dims]  # J: taps per phase
        # Rows of the phase conv: enough that pad + out rows exist after the depth-to-space.
        rows = [max(size[d] + taps[d] - 1, -(-(lo[d] + out[d]) // s[d])) for d in dims]
        wt = call.args[1]
        if any(taps[d] * s[d] != k[d] for d in dims):  # zero taps to a multiple of s
            wt = relax.op.nn.pad(wt, [0, 0, 0, 0] + [v for d in dims
                                                     for v in (0, taps[d] * s[d] - k[d])])
        norm = self.builder_.normalize
        # w[ci, co, j*s + r, ...] -> w1[(co, r, ...), ci, J-1-j, ...]
        wt = relax.op.reshape(norm(wt), [ci, co] + [v for d in dims for v in (taps[d], s[d])])
        wt = relax.op.permute_dims(norm(wt), [1] + [3 + 2 * d for d in dims] + [0]
                                   + [2 + 2 * d for d in dims])
        wt = relax.op.reshape(norm(wt), [co * math.prod(s), ci, *taps])
        for d in dims:
            if taps[d] > 1:
                wt = relax.op.flip(norm(wt), 2 + d)
        padding = [t - 1 for t in taps] + [rows[d] - size[d] for d in dims]
        y = conv(call.args[0], norm(wt), padding=padding, out_dtype=a.out_dtype)
        # (n, co, r..., rows...) -> (n, co, rows0, r0, rows1, r1, ...)
        y = relax.op.reshape(norm(y), [n, co, *s, *rows])
        y = relax.op.permute_dims(norm(y), [0, 1] + [v for d in dims for v in (2 + nd + d, 2 + d)])
        y = relax.op.reshape(norm(y), [n, co] + [rows[d] * s[d] for d in dims])
        if lo == [0] * nd and out == [rows[d] * s[d] for d in dims]:
            return y
        return relax.op.strided_slice(norm(y), [2 + d for d in dims], lo,
                                      [lo[d] + out[d] for d in dims])


@relax.expr_functor.mutator
class _Conv1dAsConv2d(relax.PyExprMutator):
    """``conv1d(x, w)`` (NCW / OIW) -> ``squeeze(conv2d(expand_dims(x, 2), expand_dims(w, 2)),
    2)``: a one-row conv2d, so a 1-D conv (wav2vec2's and HuBERT's feature encoders,
    Whisper's stem, a TCN) runs channels-last on the conv rules and their epilogues instead
    of TVM's NCW conv1d on the catch-all rule (wav2vec2's seven convs were 21 GFLOP/s)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        found = _static_conv(call, "relax.nn.conv1d")
        if found is None or len(found[1]) != 3:
            return call
        a = found[0]
        if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCW", "OIW", "NCW"):
            return call
        norm = self.builder_.normalize
        pad = [int(v) for v in a.padding]
        y = relax.op.nn.conv2d(
            norm(relax.op.expand_dims(call.args[0], [2])),
            norm(relax.op.expand_dims(call.args[1], [2])),
            strides=[1, int(a.strides[0])], padding=[0, pad[0], 0, pad[-1]],
            dilation=[1, int(a.dilation[0])], groups=int(a.groups), out_dtype=a.out_dtype)
        return relax.op.squeeze(norm(y), [2])


@relax.expr_functor.mutator
class _Conv3dAsConv2d(relax.PyExprMutator):
    """``conv3d(x, w)`` (NCDHW / OIDHW) -> an NHWC ``conv2d`` over the depth windows, each
    output depth an image of the batch. TVM legalizes conv3d as an NCDHW loop nest that no
    rule takes (the catch-all rule at 12-50 GFLOP/s).

    Output depth ``od`` sums the ``KD`` taps ``k`` over input depths ``od * s + k * d``: the
    ``KD`` depth-shifted views of the channels-last input (``N, D, H, W, C``), side by side
    on the channel axis, are one image of ``KD * C`` channels per output depth, and the
    kernel's ``(KD, C)`` become its input channels. The conv2d runs on the conv rules and
    epilogues (``N * OD`` images); its result is ``N, OD, OH, OW, O``, channels-last for the
    next layer, whose own transpose cancels this one's (``_PermutesSink``). The gather
    copies the input ``KD`` times; the convs do hundreds of multiply-adds per element copied.

    A grouped conv (a depthwise one: X3D's) is a sum of one grouped conv2d per depth tap
    instead (a residual epilogue): gathered, each group's few channels would interleave with
    the taps' (copied element by element), and the conv would have ``KD`` channels a group."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        found = _static_conv(call, "relax.nn.conv3d")
        if found is None or len(found[1]) != 5 or len(found[2]) != 5:
            return call
        a, (n, c, d, h, w), (o, cg, kd, kh, kw) = found
        layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout))
        if layouts != ("NCDHW", "OIDHW", "NCDHW"):
            return call
        sd, sh, sw = (int(v) for v in a.strides)
        dd, dh, dw = (int(v) for v in a.dilation)
        pd0, ph0, pw0, pd1, ph1, pw1 = (int(v) for v in a.padding)
        g = int(a.groups)
        od = (d + pd0 + pd1 - dd * (kd - 1) - 1) // sd + 1
        if od < 1:
            return call
        emit = self.builder_.emit
        x = emit(relax.op.permute_dims(call.args[0], [0, 2, 3, 4, 1]))
        if pd0 or pd1:
            x = emit(relax.op.nn.pad(x, [0, 0, pd0, pd1, 0, 0, 0, 0, 0, 0]))
        taps = []
        for k in range(kd):  # the input depths tap k reads, one image per output depth
            t = x
            if kd > 1 or sd > 1 or od != d + pd0 + pd1:
                t = emit(relax.op.strided_slice(x, [1], [k * dd], [k * dd + sd * (od - 1) + 1],
                                                [sd]))
            taps.append(emit(relax.op.reshape(t, [n * od, h, w, c])))
        # (KH, KW, KD, C / g, O): tap k's HWIO kernel is [:, :, k]
        wt = emit(relax.op.permute_dims(call.args[1], [3, 4, 2, 1, 0]))

        def conv(x: relax.Expr, wk: relax.Expr) -> relax.Var:
            return emit(relax.op.nn.conv2d(
                x, wk, strides=[sh, sw], padding=[ph0, pw0, ph1, pw1], dilation=[dh, dw],
                groups=g, data_layout="NHWC", kernel_layout="HWIO", out_dtype=a.out_dtype))

        if g == 1:  # one GEMM over the taps side by side: K = KD * C
            x = emit(relax.op.concat(taps, axis=3)) if kd > 1 else taps[0]
            y = conv(x, emit(relax.op.reshape(wt, [kh, kw, kd * cg, o])))
        else:  # grouped (depthwise): a grouped conv per tap, summed (a residual epilogue)
            y = None
            for k, t in enumerate(taps):
                wk = emit(relax.op.squeeze(emit(relax.op.strided_slice(
                    wt, [2], [k], [k + 1])), [2]))
                yk = conv(t, wk)
                y = yk if y is None else emit(relax.op.add(y, yk))
        oh, ow = static_shape(y)[1:3]
        y = emit(relax.op.reshape(y, [n, od, oh, ow, o]))
        return relax.op.permute_dims(y, [0, 4, 1, 2, 3])


_TO_NCHW, _TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


@relax.expr_functor.mutator
class _MultiplierAsRepeat(relax.PyExprMutator):
    """An NHWC depthwise conv with a channel multiplier ``m`` (``Cin`` groups, ``m * Cin``
    output channels: FastViT's and MobileViT's downsampling convs) -> its input with every
    channel repeated ``m`` times, then a depthwise conv with one output channel a group
    (the same HWIO weights). Output channel ``o`` reads input channel ``o // m``: in the
    conv, a vector of output channels gathers its inputs lane by lane at every tap (a 7x7
    stride-2 conv of 48 -> 96 channels at 64x64: 0.89 ms, 5 % of the roof); the repeat
    gathers once per input element and the conv then loads whole vectors."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        found = _static_conv(call, "relax.nn.conv2d")
        if found is None:
            return call
        a, x_shape, w_shape = found
        if (str(a.data_layout) != "NHWC" or str(a.kernel_layout) != "HWIO"
                or len(x_shape) != 4):
            return call
        cin, groups, cout = x_shape[3], int(a.groups), w_shape[3]
        if groups != cin or cin < 2 or w_shape[2] != 1 or cout % cin or cout == cin:
            return call
        x = self.builder_.emit(relax.op.repeat(call.args[0], cout // cin, axis=3))
        return relax.op.nn.conv2d(
            x, call.args[1], strides=[int(v) for v in a.strides],
            padding=[int(v) for v in a.padding], dilation=[int(v) for v in a.dilation],
            groups=cout, data_layout="NHWC", kernel_layout="HWIO",
            out_layout=str(a.out_layout), out_dtype=a.out_dtype)


def _axes(call) -> list[int] | None:
    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
            and call.op.name == "relax.permute_dims"):
        return None
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


@relax.expr_functor.mutator
class _GroupNormChannelsLast(relax.PyExprMutator):
    """``to_nhwc(group_norm_nchw(to_nchw(x)))`` -> ``group_norm_nhwc(x)``: ConvertLayout
    leaves the transposes around an opsdk op (it knows TVM's ops only); opsdk's group norm
    has an NHWC kernel of its own."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _axes(call) != _TO_NHWC or not isinstance(call.args[0], relax.Var):
            return call
        gn = self.lookup_binding(call.args[0])
        if not (isinstance(gn, relax.Call) and isinstance(gn.op, tvm.ir.Op)
                and gn.op.name == "opsdk.group_norm"):
            return call

        _, ins, attrs = decode_call(gn)
        if attrs.get("layout", "NCHW") != "NCHW" or not isinstance(ins["x"], relax.Var):
            return call
        inner = self.lookup_binding(ins["x"])
        if _axes(inner) != _TO_NCHW:
            return call

        extra = {k: v for k, v in ins.items() if k != "x"}
        return ops.group_norm(inner.args[0], **extra, **{**attrs, "layout": "NHWC"})


_ELEMENTWISE: dict[tuple, bool] = {}


def _is_elementwise(call: relax.Call) -> bool:
    """Whether an ``opsdk.*`` call lowers to one kernel with TVM's elementwise pattern
    (``op_pattern`` 0: each input read at the output's own index), its inputs all of the
    output's shape; cached per op, attributes and input types."""
    if not isinstance(call.ty, relax.TensorType):
        return False
    tys = [a.ty for a in call.args]
    if not tys or not all(isinstance(t, relax.TensorType) and t.ndim == call.ty.ndim
                          for t in tys):
        return False
    key = (call.op.name, str(call.attrs), tuple(str(t) for t in tys))
    if key not in _ELEMENTWISE:
        _ELEMENTWISE[key] = _lowers_elementwise(call)
    return _ELEMENTWISE[key]


def _lowers_elementwise(call: relax.Call) -> bool:

    params = [relax.Var(f"a{i}", a.ty) for i, a in enumerate(call.args)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit_output(relax.Call(call.op, params, call.attrs))
        bb.emit_func_output(y)
    tgt = tvm.target.Target.current(allow_none=True) or resolve_target("host")
    try:
        mod = _legalize_opsdk_ops(tgt, "opsdk.ProbeLayout", deferred=True)(bb.get())
        mod = relax.transform.AnnotateTIROpPattern()(mod)
    except Exception:  # an op that does not lower here keeps its layout (and its transposes)
        return False
    prims = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return len(prims) == 1 and int((prims[0].attrs or {}).get("op_pattern", -1)) == 0


def _moves_units_only(x: relax.Expr, perm: list[int]) -> bool:
    """Whether ``permute(x, perm)`` only moves axes of extent 1: the data stay in order, so
    it is a reshape (a view, no kernel)."""
    shape = static_shape(x)
    if shape is None or len(shape) != len(perm):
        return False
    big = [p for p in perm if shape[p] != 1]
    return big == sorted(big)


def _compose(a: list[int], b: list[int]) -> list[int]:
    """``permute(permute(x, a), b)`` as one permutation of ``x``."""
    return [a[i] for i in b]


#: TVM ops that commute with a permutation of their (one) tensor input: elementwise.
_UNARY = frozenset(f"relax.{n}" for n in (
    "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "negative", "clip", "astype",
    "erf", "round", "floor", "ceil", "nn.relu", "nn.silu", "nn.gelu", "nn.gelu_tanh",
    "nn.leakyrelu"))
#: Broadcasting binary TVM ops: they commute when both operands are permuted alike (a
#: scalar or a full-rank operand can be permuted to match).
_BINARY = frozenset(f"relax.{n}" for n in (
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "floor_divide"))
#: 2-D pools with a layout of their own: an NCHW one on ``to_nchw(x)`` runs NHWC on ``x``.
_POOLS = {"relax.nn.avg_pool2d": relax.op.nn.avg_pool2d,
          "relax.nn.max_pool2d": relax.op.nn.max_pool2d,
          "relax.nn.adaptive_avg_pool2d": relax.op.nn.adaptive_avg_pool2d,
          "relax.nn.avg_pool3d": relax.op.nn.avg_pool3d,
          "relax.nn.max_pool3d": relax.op.nn.max_pool3d,
          "relax.nn.adaptive_avg_pool3d": relax.op.nn.adaptive_avg_pool3d}
#: NCDHW <- NDHWC (a conv3d's result, ``_Conv3dAsConv2d``).
_TO_NCDHW = [0, 4, 1, 2, 3]
#: Reductions over ``axis`` (StatisticalAttrs): the axes are renumbered.
_REDUCE = {"relax.mean": relax.op.mean, "relax.sum": relax.op.sum, "relax.max": relax.op.max,
           "relax.min": relax.op.min, "relax.prod": relax.op.prod}


def _rank(e: relax.Expr) -> int:
    ty = e.ty
    return int(ty.ndim) if isinstance(ty, relax.TensorType) else -1


@relax.expr_functor.mutator
class _PermutesSink(relax.PyExprMutator):
    """Sink the transposes ConvertLayout left where it stopped (at an opsdk op, and the TVM
    ops after it) below every op that commutes with them, so that they meet their inverse
    and vanish: ``f(permute(x, P))`` -> ``permute(f(x), P)`` for an elementwise opsdk op
    (:func:`_is_elementwise`), TVM's elementwise and broadcasting ops and reductions (axes
    renumbered); ``permute(permute(x, A), B)`` -> one permute, or ``x`` when they cancel."""

    def _permuted(self, e: relax.Expr) -> tuple[relax.Expr, list[int]] | None:
        if not isinstance(e, relax.Var):
            return None
        b = self.lookup_binding(e)
        if isinstance(b, relax.TupleGetItem) and isinstance(b.tuple_value, relax.Var):
            # a field of a tuple built here (torch's max pool: ``(out, indices)[0]``)
            tup = self.lookup_binding(b.tuple_value)
            if isinstance(tup, relax.Tuple):
                return self._permuted(tup.fields[int(b.index)])
            return None
        axes = _axes(b)
        return None if axes is None else (b.args[0], axes)

    def _emit(self, call: relax.Call, args: list[relax.Expr]) -> relax.Var:
        return self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return call
        name = call.op.name
        if name == "relax.concat":
            return self._concat(call)
        first = self._permuted(call.args[0])
        if name == "relax.permute_dims":
            outer = _axes(call)
            if outer == list(range(len(outer or []))):
                return call.args[0]  # ConvertLayout's rewrite of a model's own permute
            if first is None and outer is not None:  # onto smaller tensors, or stays
                hoisted = self._hoisted(call.args[0], outer)
                return call if hoisted is None else hoisted
            if first is None or outer is None:
                return call
            axes = _compose(first[1], outer)
            if axes == list(range(len(axes))):
                return first[0]
            if _moves_units_only(first[0], axes):  # a 1-D conv's NCW <-> NHWC round trip
                return relax.op.reshape(first[0], static_shape(call))
            return relax.op.permute_dims(first[0], axes)
        if name in _BINARY and len(call.args) == 2:
            return self._binary(call)
        if first is None:
            return call
        x, perm = first
        if name in _UNARY:
            return relax.op.permute_dims(self._emit(call, [x, *call.args[1:]]), perm)
        if perm == _TO_NCHW and (name in _POOLS or name == "opsdk.group_norm"):
            return self._channels_last(call, x)
        if perm == _TO_NCDHW and name.endswith("pool3d"):
            return self._channels_last(call, x)
        if name in _REDUCE:
            return self._reduce(call, x, perm)
        if name == "relax.nn.pad":
            return self._pad(call, x, perm)
        if name == "relax.expand_dims":
            return self._expand_dims(call, x, perm)
        if name == "relax.squeeze":
            return self._squeeze(call, x, perm)
        if name == "relax.nn.batch_norm":
            return self._batch_norm(call, x, perm)
        if name.startswith("opsdk."):
            found = [self._permuted(a) for a in call.args]
            if any(f is None or f[1] != perm for f in found) or not _is_elementwise(call):
                return call
            return relax.op.permute_dims(self._emit(call, [f[0] for f in found]), perm)
        return call

    def _expand_dims(self, call: relax.Call, x: relax.Expr, perm: list[int]) -> relax.Expr:
        """``expand_dims(permute(x, P), A)`` -> ``permute(expand_dims(x, A), P')``: the new
        unit axes at the same places, the others permuted as before (a 1-D conv's input
        taken back to a one-row image)."""
        n = _rank(call)
        axes = sorted(int(a) % n for a in call.attrs.axis)
        kept = [d for d in range(n) if d not in axes]
        moved = list(range(n))
        for j, p in enumerate(perm):
            moved[kept[j]] = kept[p]
        y = self.builder_.emit(relax.op.expand_dims(x, axes))
        return relax.op.permute_dims(y, moved)

    def _squeeze(self, call: relax.Call, x: relax.Expr, perm: list[int]) -> relax.Expr:
        """``squeeze(permute(x, P), S)`` -> ``permute(squeeze(x, P[S]), P')``."""
        shape = static_shape(call.args[0])
        if shape is None:
            return call
        n = len(shape)
        axes = (sorted(int(a) % n for a in call.attrs.axis) if call.attrs.axis is not None
                else [d for d in range(n) if shape[d] == 1])
        gone = sorted(perm[a] for a in axes)
        rest = [perm[j] - sum(g < perm[j] for g in gone) for j in range(n) if j not in axes]
        y = self.builder_.emit(relax.op.squeeze(x, gone))
        return y if rest == list(range(len(rest))) else relax.op.permute_dims(y, rest)

    def _hoisted(self, e: relax.Expr, perm: list[int], depth: int = 4) -> relax.Expr | None:
        """``permute(e, P)`` computed with the permute moved onto smaller tensors, or None:

        - ``e = resize2d(x, layout=L)`` with an output not smaller than ``x`` ->
          ``resize2d(permute(x, P), layout=P(L))`` (DeepLab's final upsampling of 21 class
          maps to the model's NCHW output: the resize runs NCHW, its column pass blending
          contiguous rows);
        - ``e = concat([y1, y2, ..], axis)`` with every ``yi`` hoistable -> ``concat`` of the
          hoisted inputs along the permuted axis (SegFormer's decode head: four upsampled
          maps concatenated, then an NHWC conv: the resizes run NHWC instead);
        - a permute of a permuted ``x`` composes (and cancels to ``x``)."""
        b = self.lookup_binding(e) if isinstance(e, relax.Var) and depth else None
        if not isinstance(b, relax.Call) or not isinstance(b.op, tvm.ir.Op):
            return None
        emit = self.builder_.emit
        if b.op.name == "relax.concat":
            tup = b.args[0]
            if isinstance(tup, relax.Var):
                tup = self.lookup_binding(tup)
            if not isinstance(tup, relax.Tuple) or not tup.fields:
                return None
            parts = [self._hoisted(f, perm, depth - 1) for f in tup.fields]
            if any(p is None for p in parts):
                return None
            axis = int(b.attrs.axis) % len(perm)
            return relax.op.concat([emit(p) for p in parts], axis=perm.index(axis))
        if b.op.name != "relax.image.resize2d" or len(perm) != 4:
            return None
        a = b.attrs
        layout = "".join(str(a.layout)[p] for p in perm)
        ins, outs = static_shape(b.args[0]), static_shape(b)
        if layout not in ("NCHW", "NHWC") or ins is None or outs is None or \
                outs[0] * outs[1] * outs[2] * outs[3] < ins[0] * ins[1] * ins[2] * ins[3]:
            return None  # (one of the same size moves as much either way: SegFormer's first)
        src = self._permuted(b.args[0])
        if src is not None and _compose(src[1], perm) == list(range(4)):
            x = src[0]
        elif src is not None:
            x = emit(relax.op.permute_dims(src[0], _compose(src[1], perm)))
        else:
            x = emit(relax.op.permute_dims(b.args[0], perm))
        return relax.op.image.resize2d(
            x, b.args[1], roi=[float(v) for v in a.roi], layout=layout, method=str(a.method),
            coordinate_transformation_mode=str(a.coordinate_transformation_mode),
            rounding_method=str(a.rounding_method), cubic_alpha=float(a.cubic_alpha),
            cubic_exclude=int(a.cubic_exclude),
            extrapolation_value=float(a.extrapolation_value), out_dtype=a.out_dtype)

    def _binary(self, call: relax.Call) -> relax.Expr:
        """A broadcasting binary op with a permuted operand: the op on the unpermuted
        source, the other operand brought to that layout. A permuted second operand is sunk
        only when the first comes to its layout for free (a constant, a scalar, a
        lower-rank operand or one permuted alike): ConvertLayout's NHWC bias add,
        ``add(conv_nhwc, to_nhwc(bias))``, would otherwise move the conv's output to NCHW."""
        a, b = call.args
        for pos, got in enumerate((self._permuted(a), self._permuted(b))):
            if got is None:
                continue
            x, perm = got
            if pos == 1 and not self._free(a, perm, _rank(call)):
                continue
            other = self._matched((b, a)[pos], perm, _rank(call))
            if other is not None:
                args = [x, other] if pos == 0 else [other, x]
                return relax.op.permute_dims(self._emit(call, args), perm)
        return call

    def _free(self, e: relax.Expr, perm: list[int], rank: int) -> bool:
        """Whether ``e`` comes to ``perm``'s source layout without a transpose at run time."""
        got = self._permuted(e)
        if got is not None:
            return got[1] == perm
        return self._constant(e) or 0 <= _rank(e) < rank

    def _constant(self, e: relax.Expr, depth: int = 8) -> bool:
        """Whether ``e`` is computed from constants only (its permute folds at compile time:
        ConvNeXt-V2's ``gamma * 1.0``)."""
        if isinstance(e, tvm.ir.expr.GenericConst):
            return True
        b = self.lookup_binding(e) if isinstance(e, relax.Var) and depth else None
        return (isinstance(b, relax.Call) and isinstance(b.op, tvm.ir.Op)
                and all(self._constant(a, depth - 1) for a in b.args
                        if not isinstance(a, relax.ShapeExpr)))

    def _matched(self, e: relax.Expr, perm: list[int], rank: int) -> relax.Expr | None:
        """``e`` in the unpermuted layout: its own unpermuted source, itself when a scalar,
        or a permute of it (a constant's folds away). An operand of lower rank broadcasts
        from the right: it gets its leading unit axes first (PoolFormer's and ConvNeXt's
        per-channel layer scale, ``(C, 1, 1)`` against ``(N, C, H, W)``)."""
        got = self._permuted(e)
        if got is not None:
            return got[0] if got[1] == perm else None
        r = _rank(e)
        if r == 0:
            return e
        if r < 1 or r > rank:
            return None
        if r < rank:
            e = self.builder_.emit(relax.op.expand_dims(e, list(range(rank - r))))
        inverse = [perm.index(i) for i in range(len(perm))]
        return self.builder_.emit(relax.op.permute_dims(e, inverse))

    def _channels_last(self, call: relax.Call, x: relax.Expr) -> relax.Expr:
        """An NCHW pool or group norm whose input is ``to_nchw(x)`` (an NCDHW pool whose input
        is ``to_ncdhw(x)``): the same op in NHWC (NDHWC) on ``x``, its result permuted back
        (and sunk further by its consumers)."""
        if call.op.name == "opsdk.group_norm":
            _, ins, attrs = decode_call(call)
            if attrs.get("layout", "NCHW") != "NCHW":
                return call
            extra = {k: v for k, v in ins.items() if k != "x"}
            y = ops.group_norm(x, **extra, **{**attrs, "layout": "NHWC"})
        else:
            a = call.attrs
            first, last = ("NCDHW", "NDHWC") if call.op.name.endswith("3d") else ("NCHW", "NHWC")
            if str(a.layout) != first or str(a.out_layout) != first:
                return call
            if call.op.name.startswith("relax.nn.adaptive_avg_pool"):
                size = None if a.output_size is None else [int(v) for v in a.output_size]
                y = _POOLS[call.op.name](x, size, layout=last, out_layout=last)
            else:
                y = _POOLS[call.op.name](
                    x, pool_size=[int(v) for v in a.pool_size],
                    strides=[int(v) for v in a.strides], padding=[int(v) for v in a.padding],
                    dilation=[int(v) for v in a.dilation], ceil_mode=bool(a.ceil_mode),
                    count_include_pad=bool(a.count_include_pad), layout=last,
                    out_layout=last)
        back = _TO_NCDHW if call.op.name.endswith("3d") else _TO_NCHW
        return relax.op.permute_dims(self.builder_.emit(y), back)

    def _concat(self, call: relax.Call) -> relax.Expr:
        """A concat of inputs all permuted alike -> their sources concatenated along the
        source axis, permuted once (HGNetV2's stem and blocks join NHWC branches)."""
        tup = call.args[0]
        if isinstance(tup, relax.Var):
            tup = self.lookup_binding(tup)
        if not isinstance(tup, relax.Tuple) or not tup.fields:
            return call
        found = [self._permuted(f) for f in tup.fields]
        if any(f is None or f[1] != found[0][1] for f in found):
            return call
        perm = found[0][1]
        axis = int(call.attrs.axis) % len(perm)
        y = self.builder_.emit(relax.op.concat([f[0] for f in found], axis=perm[axis]))
        return relax.op.permute_dims(y, perm)

    def _pad(self, call: relax.Call, x: relax.Expr, perm: list[int]) -> relax.Expr:
        """``pad(permute(x, P))`` -> ``permute(pad(x))``, the widths moved to the source's
        axes (HGNetV2's stem pads between two convs)."""
        a = call.attrs
        width = [int(v) for v in a.pad_width]
        moved = [0] * len(width)
        for i, src in enumerate(perm):
            moved[2 * src: 2 * src + 2] = width[2 * i: 2 * i + 2]
        y = self.builder_.emit(relax.op.nn.pad(x, moved, pad_mode=str(a.pad_mode),
                                               pad_value=float(a.pad_value)))
        return relax.op.permute_dims(y, perm)

    def _batch_norm(self, call: relax.Call, x: relax.Expr, perm: list[int]) -> relax.Expr:
        """``batch_norm(permute(x, P), axis=a)`` -> ``batch_norm(x, axis=P[a])``, its
        normalized field permuted by ``P`` (the statistics fields have no layout): a BN that
        follows a user's or a built-in activation stays NHWC (FastViT's RepMixer)."""
        a = call.attrs
        axis = int(a.axis) % len(perm)
        y = self.builder_.emit(relax.op.nn.batch_norm(
            x, *call.args[1:], axis=perm[axis], epsilon=float(a.epsilon),
            center=bool(a.center), scale=bool(a.scale), momentum=float(a.momentum),
            training=bool(a.training)))
        out = self.builder_.emit(relax.op.permute_dims(
            self.builder_.emit(relax.TupleGetItem(y, 0)), perm))
        return relax.Tuple([out, *(self.builder_.emit(relax.TupleGetItem(y, i))
                                   for i in (1, 2))])

    def _reduce(self, call: relax.Call, x: relax.Expr, perm: list[int]) -> relax.Expr:
        axis = call.attrs.axis
        if axis is None:  # over everything: the layout does not matter
            return relax.Call(call.op, [x], call.attrs, call.ty_args)
        n = len(perm)
        axes = [int(a) % n for a in axis]
        inner = _REDUCE[call.op.name](x, axis=[perm[a] for a in axes],
                                      keepdims=bool(call.attrs.keepdims))
        y = self.builder_.emit(inner)
        if call.attrs.keepdims:
            return relax.op.permute_dims(y, perm)
        kept = sorted(perm[i] for i in range(n) if i not in axes)
        rest = [kept.index(perm[i]) for i in range(n) if i not in axes]
        return y if rest == list(range(len(rest))) else relax.op.permute_dims(y, rest)


@relax.expr_functor.mutator
class _ReshapesSink(relax.PyExprMutator):
    """Elementwise ops on a reshaped value move above the reshape: ``f(reshape(y), c)`` ->
    ``reshape(f(y, c))`` when ``c`` is a scalar or varies only along trailing axes the
    reshape keeps, or is itself a reshape of a value shaped like ``y`` (SiLU's
    ``x * sigmoid(x)``). A conv3d runs as a conv2d whose result is reshaped back to 5-D
    (``_Conv3dAsConv2d``); its bias, BatchNorm shift and activation followed the reshape,
    which FuseOps does not fuse through, so each ran as a kernel of its own instead of the
    conv's epilogue; so did a 1-D conv's after its ``squeeze`` (``_Conv1dAsConv2d``). A
    reshape, squeeze or expand_dims moves no data (a view), wherever it sits."""

    def _reshaped(self, e: relax.Expr) -> tuple[relax.Expr, tuple[int, ...]] | None:
        if not isinstance(e, relax.Var):
            return None
        b = self.lookup_binding(e)
        if not (isinstance(b, relax.Call) and isinstance(b.op, tvm.ir.Op)
                and b.op.name in ("relax.reshape", "relax.squeeze", "relax.expand_dims")):
            return None
        src = static_shape(b.args[0])
        return None if src is None or static_shape(e) is None else (b.args[0], src)

    def _kept(self, shape: tuple[int, ...], src: tuple[int, ...]) -> int:
        """How many trailing axes the reshape from ``src`` to ``shape`` leaves alone."""
        k = 0
        while k < min(len(shape), len(src)) and shape[-1 - k] == src[-1 - k]:
            k += 1
        return k

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return call
        name = call.op.name
        shape = static_shape(call)
        if name.startswith("opsdk.") and shape is not None and _is_elementwise(call):
            # a user's activation, or the built-in GELU: every input reshaped from one shape
            found = [self._reshaped(a) for a in call.args]
            if any(f is None or f[1] != found[0][1] for f in found):
                return call
            y = self.builder_.emit(relax.Call(call.op, [f[0] for f in found], call.attrs,
                                              call.ty_args))
            return relax.op.reshape(y, shape)
        if name in _UNARY:
            got = self._reshaped(call.args[0])
            if got is None or shape is None:
                return call
            y = self.builder_.emit(relax.Call(call.op, [got[0], *call.args[1:]], call.attrs,
                                              call.ty_args))
            return relax.op.reshape(y, shape)
        if name not in _BINARY or len(call.args) != 2 or shape is None:
            return call
        for pos in (0, 1):
            got = self._reshaped(call.args[pos])
            other = call.args[1 - pos]
            oshape = static_shape(other)
            if got is None or oshape is None or static_shape(call.args[pos]) != shape:
                continue
            src, src_shape = got
            twin = self._reshaped(other)
            if twin is not None and twin[1] == src_shape:  # both from the same shape (SiLU)
                args = [src, twin[0]] if pos == 0 else [twin[0], src]
                y = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
                return relax.op.reshape(y, shape)
            k = self._kept(shape, src_shape)
            lead = len(oshape) - k
            if any(d != 1 for d in oshape[:max(lead, 0)]):
                continue  # it varies along an axis the reshape changes
            if lead > 0:
                other = self.builder_.emit(relax.op.reshape(other, list(oshape[lead:])))
            args = [src, other] if pos == 0 else [other, src]
            y = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
            return relax.op.reshape(y, shape)
        return call


def ChannelsLast() -> tvm.transform.Pass:
    """Convolutions in NHWC / HWIO, the layout carried through what follows them.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    >>> w = relax.const(np.ones((8, 8, 3, 3), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
    ...         y = bb.emit_output(relax.op.clip(y, 0.0, 6.0))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.ChannelsLast()(bb.get())
    >>> opsdk.transform.op_counts(mod)["relax.permute_dims"]  # in, weight, out
    3
    """

    @tvm.transform.module_pass(opt_level=0, name="opsdk.ChannelsLast")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not any(op_counts(mod, f"relax.nn.conv{k}d") for k in (1, 2, 3)):
            return mod
        mod = mod.clone()  # the caller's module stays as it was (item assignment mutates)
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                func = _TransposedConvAsConv().visit_expr(func)
                func = _Conv1dAsConv2d().visit_expr(func)
                func = _Conv3dAsConv2d().visit_expr(func)
                func = _SqueezeAxesPositive().visit_expr(func)
                updates[gv] = _ClipAsMinMax().visit_expr(func)
        for gv, func in updates.items():
            mod[gv] = func
        try:
            mod = relax.transform.ConvertLayout(LAYOUTS)(mod)
        except Exception as e:  # TVM's own pass on a graph it mishandles: stay NCHW
            first = next((ln for ln in str(e).splitlines()[::-1] if ln.strip()),
                         type(e).__name__)
            warnings.warn(f"opsdk: the convolutions stay in the model's layout: TVM's "
                          f"ConvertLayout failed on this model ({first.strip()[:200]}); the "
                          "model runs correctly but slower than channels-last. Please "
                          "report the model to opsdk", stacklevel=2)
            return mod
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                func = _PermutesSink().visit_expr(func)
                func = _ReshapesSink().visit_expr(func)
                func = _GroupNormChannelsLast().visit_expr(func)
                mod[gv] = _MultiplierAsRepeat().visit_expr(func)
        # ConvertLayout permutes a value once per use (FastViT: ``to_nhwc(x)`` twice)
        mod = relax.transform.EliminateCommonSubexpr()(mod)
        return relax.transform.DeadCodeElimination()(mod)

    return _pass

