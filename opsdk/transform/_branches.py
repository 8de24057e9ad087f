"""Parallel convolution branches of one input, summed, become one convolution.

Re-parameterizable nets (RepVGG, MobileOne, FastViT, RepViT as trained, and timm's models
before ``reparameterize``) sum several convs of the same input: a 3x3 and a 1x1 branch, k
copies of each, a BN of the input itself (the skip branch), each with its bias. Convolution
is linear in its weights, so ``conv(x, A) + conv(x, B) = conv(x, A + B)`` when both have the
same stride, dilation and groups and read the same input pixels: a smaller kernel is placed
inside the larger one at its padding's offset (``pad`` of the merged conv is the largest),
and a per-channel ``a * x + b`` of the input (a BN, or ``x`` itself) is the kernel's tap on
the output pixel's own input. The merged conv costs the largest branch's FLOPs instead of
their sum, and the adds between them are gone (MobileOne-S0: k = 4 branches of 3x3
depthwise and 1x1 convs each plus a BN skip, per block).

The weights are summed in float64 and rounded once, so the merged conv differs from the
branches only by float32 rounding of a sum: the same order of error as the branches' own
summation.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .._patterns import bn_scale_shift, call_attr, const_value, float_tensor, static_shape
from .._walk import relax_exprs
from ._rewrite import SITES_ATTR, _as_dict, _dedupe, _site, _values, op_counts, rewrite_sites

__all__ = ["MergeConvBranches"]


@dataclass
class _Conv:
    """One convolution term: ``conv2d(x, weight) + bias``, the weight ``raw`` as stored
    (``weight``: OIHW in float64, made on first use: most sums of a conv merge nothing, and
    ResNet-50's weights in float64 took 0.14 s), the bias one value per output channel."""

    raw: np.ndarray
    bias: np.ndarray
    attrs: relax.attrs.Conv2DAttrs
    perm: tuple[int, ...] = (0, 1, 2, 3)  # raw's axes as OIHW

    @functools.cached_property
    def weight(self) -> np.ndarray:
        return np.transpose(self.raw, self.perm).astype(np.float64)


@dataclass
class _Affine:
    """``scale * x + shift`` per channel of ``x`` along ``axis``: a BN of the input, or the
    input itself (``axis`` None: whichever the convs' channel axis is)."""

    scale: np.ndarray | float
    shift: np.ndarray | float
    axis: int | None


_IDENTITY = _Affine(1.0, 0.0, None)


#: The ops a sum is built from (a constant scaling of a summand is read through too).
_SUM_OPS = ("relax.add", "relax.subtract")


def _op(e: relax.Expr) -> str:
    return str(e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else ""


@relax.expr_functor.mutator
class _Merge(relax.PyExprMutator):
    """Each ``add`` tree over conv terms of one input: the terms merged, the rest kept."""

    def __init__(self, func: relax.Function, mod: tvm.IRModule | None = None) -> None:
        super().__init__(mod)
        self.uses, self.inner = _uses(func)
        self.merged = 0
        self.sites: list[relax.Var] = []
        self._at_root = True

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        # a sum is merged at its root, over all its summands at once (the summands' own
        # adds stay as they are: the root's rewrite leaves them dead)
        before = self.merged
        self._at_root = binding.var not in self.inner
        value = self.visit_expr(binding.value)
        if self.merged == before:
            self._at_root = False  # the default re-visits the value: no second attempt
            super().visit_var_binding_(binding)
            self._at_root = True
            return
        self._at_root = True
        # the same bound variable: rewrite sites (and drift) identify the binding by it
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
        self.sites.append(binding.var)

    def _value(self, e: relax.Expr, uses: int = 1) -> relax.Expr | None:
        """The value bound to ``e`` when the ``uses`` being merged are all of its uses (so
        its work goes away once merged), else None."""
        if not isinstance(e, relax.Var) or self.uses[e] != uses:
            return None
        return self.lookup_binding(e)

    def _summands(self, e: relax.Expr, shape: tuple, coef: np.ndarray, out: list) -> None:
        """``(summand, coefficient)`` pairs of ``e`` (of ``shape``) through the single-use
        adds, subtracts and constant scalings it is built from; a constant (a bias, a
        ``+ 0``) is a summand of its own."""
        b = self._value(e)
        op = _op(b)
        if op in _SUM_OPS and static_shape(b) == shape:
            signs = (1.0, -1.0 if op == "relax.subtract" else 1.0)
            if all(const_value(a) is not None or static_shape(a) == shape for a in b.args):
                for a, sign in zip(b.args, signs):
                    if const_value(a) is not None:
                        out.append((a, coef * sign))
                    else:
                        self._summands(a, shape, coef * sign, out)
                return
        if op == "relax.multiply" and static_shape(b) == shape:
            for side in (0, 1):
                c, other = const_value(b.args[side]), b.args[1 - side]
                if c is not None and static_shape(other) == shape:
                    self._summands(other, shape, coef * c.astype(np.float64), out)
                    return
        out.append((e, coef))

    def _term(self, e: relax.Expr, uses: int) -> tuple[relax.Expr, _Conv | _Affine] | None:
        """``(input, term)`` for a conv or an inference BN of one input, else None; ``uses``:
        how often ``e`` is a summand (torch.export shares one BN between two branches)."""
        b = self._value(e, uses)
        if _op(b) == "relax.nn.conv2d":
            conv = _conv(b)
            return None if conv is None else (b.args[0], conv)
        if isinstance(b, relax.TupleGetItem) and int(b.index) == 0:
            bn = self._value(b.tuple_value)
            if _op(bn) == "relax.nn.batch_norm":
                affine = _bn(bn)
                return None if affine is None else (bn.args[0], affine)
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        shape = static_shape(call)
        if (_op(call) not in _SUM_OPS or not self._at_root or float_tensor(call) is None
                or shape is None):
            return super().visit_call_(call)
        summands: list = []
        for a, sign in zip(call.args, (1.0, -1.0 if _op(call) == "relax.subtract" else 1.0)):
            if const_value(a) is not None:
                summands.append((a, np.array(sign)))
            elif static_shape(a) == shape:
                self._summands(a, shape, np.array(sign), summands)
            else:
                return super().visit_call_(call)
        merged = self._merged(summands, shape, str(call.ty.dtype))
        return super().visit_call_(call) if merged is None else merged

    def _merged(self, summands: list, shape: tuple, dtype: str) -> relax.Expr | None:
        count = Counter(e for e, _ in summands)
        terms = [self._term(e, count[e]) for e, _ in summands]
        first = next((i for i, t in enumerate(terms) if t is not None
                      and isinstance(t[1], _Conv)), None)
        if first is None:
            return None
        x, conv = terms[first]
        layout = str(conv.attrs.out_layout)
        channels = shape[layout.index("C")]
        coefs = [_per_channel(c, channels, layout) for _, c in summands]
        mine = [i for i, ((e, _), t) in enumerate(zip(summands, terms))
                if coefs[i] is not None and ((t is not None and t[0].same_as(x))
                                             or e.same_as(x))]
        consts = {i: _per_channel(const_value(e), channels, layout)
                  for i, (e, _) in enumerate(summands)
                  if coefs[i] is not None and const_value(e) is not None}
        consts = {i: c * coefs[i] for i, c in consts.items() if c is not None}
        if len(mine) < 2:
            return None
        scaled = []
        for i in mine:
            t, k = (terms[i][1] if terms[i] is not None else _IDENTITY), coefs[i]
            if isinstance(t, _Conv):
                scaled.append(_Conv(t.weight * k[:, None, None, None], t.bias * k, t.attrs))
            else:
                scaled.append(_Affine(t.scale * k, t.shift * k, t.axis))
        merged = _merge(scaled, static_shape(x), shape)
        if merged is None:
            return None
        weight, bias, params = merged
        bias = bias + sum(consts.values(), np.zeros(channels))
        kl = params["kernel_layout"]
        w = np.transpose(weight, ["OIHW".index(c) for c in kl]).astype(dtype)
        y = self.builder_.emit(relax.op.nn.conv2d(self.visit_expr(x), relax.const(w),
                                                  **params, out_dtype=dtype))
        bshape = [1] * 4
        bshape[layout.index("C")] = channels
        y = relax.op.add(y, relax.const(bias.reshape(bshape).astype(dtype)))
        for i, (e, coef) in enumerate(summands):
            if i in mine or i in consts:
                continue
            e = self.visit_expr(e)
            if np.any(coef != 1.0):
                e = self.builder_.emit(relax.op.multiply(e, relax.const(
                    np.asarray(coef, dtype=dtype))))
            y = relax.op.add(self.builder_.emit(y), e)
        self.merged += 1
        return y


def _conv(call: relax.Call) -> _Conv | None:
    a = call.attrs
    w = const_value(call.args[1])
    shape = static_shape(call)
    layout, kl = str(a.out_layout), str(a.kernel_layout)
    if (w is None or shape is None or float_tensor(call) is None
            or str(a.data_layout) != layout or sorted(layout) != sorted("NCHW")
            or sorted(kl) != sorted("OIHW") or any(int(d) != 1 for d in a.dilation)):
        return None
    return _Conv(w, np.zeros(shape[layout.index("C")]), a, tuple(kl.index(c) for c in "OIHW"))


def _bn(call: relax.Call) -> _Affine | None:
    shape = static_shape(call.args[0])
    if shape is None or len(shape) != 4:
        return None
    axis = int(call_attr(call, "axis")) % 4
    affine = bn_scale_shift(call, shape[axis])
    return None if affine is None else _Affine(*affine, axis)


def _per_channel(c: np.ndarray, channels: int, layout: str) -> np.ndarray | None:
    """A bias constant as one value per channel, or None when it varies along another axis."""
    c = np.asarray(c)
    if c.ndim > 4:
        return None
    c = c.reshape((1,) * (4 - c.ndim) + c.shape).astype(np.float64)
    axis = layout.index("C")
    if any(c.shape[i] != 1 for i in range(4) if i != axis) or c.shape[axis] not in (1, channels):
        return None
    return np.broadcast_to(c.reshape(-1), (channels,)).copy()


def _merge(terms: list, x_shape, out_shape) -> tuple[np.ndarray, np.ndarray, dict] | None:
    """One (OIHW float64 weight, bias, conv2d keyword arguments) for ``terms`` of one input,
    or None when they do not line up (different strides, groups or layouts, paddings that
    read other pixels, an affine term that is no tap of the kernel)."""
    convs = [t for t in terms if isinstance(t, _Conv)]
    a0 = convs[0].attrs
    layout, strides = str(a0.out_layout), [int(s) for s in a0.strides]
    for c in convs:
        a = c.attrs
        if (str(a.out_layout) != layout or str(a.kernel_layout) != str(a0.kernel_layout)
                or [int(s) for s in a.strides] != strides or int(a.groups) != int(a0.groups)
                or c.weight.shape[:2] != convs[0].weight.shape[:2]):
            return None
    o, i = convs[0].weight.shape[:2]
    # conv k reads rows ``out * s - top_k + t``: in the merged kernel its taps start at
    # ``top - top_k`` (top: the largest padding), and every conv must end up with the same
    # bottom padding (the same output rows); likewise for the columns
    pads = [[int(p) for p in c.attrs.padding] for c in convs]
    top, left = max(p[0] for p in pads), max(p[1] for p in pads)
    kh = max(top - p[0] + c.weight.shape[2] for p, c in zip(pads, convs))
    kw = max(left - p[1] + c.weight.shape[3] for p, c in zip(pads, convs))
    bottom = {p[0] + p[2] - c.weight.shape[2] - top + kh for p, c in zip(pads, convs)}
    right = {p[1] + p[3] - c.weight.shape[3] - left + kw for p, c in zip(pads, convs)}
    if len(bottom) != 1 or len(right) != 1 or min(bottom) < 0 or min(right) < 0:
        return None
    weight, bias = np.zeros((o, i, kh, kw)), np.zeros(o)
    for p, c in zip(pads, convs):
        dh, dw = top - p[0], left - p[1]
        weight[:, :, dh:dh + c.weight.shape[2], dw:dw + c.weight.shape[3]] += c.weight
        bias += c.bias
    affine = [t for t in terms if isinstance(t, _Affine)]
    if affine:
        # ``a * x + b`` is the tap on the output pixel's own input: the same shape in and
        # out (stride 1), that tap inside the kernel, each output channel's own input
        # channel in its group, the BN over the channel axis
        per_group = o // int(a0.groups)
        caxis = layout.index("C")
        if (tuple(x_shape) != tuple(out_shape) or top >= kh or left >= kw or i != per_group
                or any(t.axis not in (None, caxis) for t in affine)):
            return None
        for t in affine:
            weight[np.arange(o), np.arange(o) % per_group, top, left] += t.scale
            bias += t.shift
    params = {"strides": strides, "padding": [top, left, *bottom, *right], "dilation": [1, 1],
              "groups": int(a0.groups), "data_layout": layout,
              "kernel_layout": str(a0.kernel_layout), "out_layout": layout}
    return weight, bias, params


def _uses(func: relax.Function) -> tuple[Counter, set]:
    """How often each var is used, and the adds that are summands of another add of their
    shape (used there only): the inner nodes of a sum."""
    uses: Counter = Counter(e for e in relax_exprs(func.body) if isinstance(e, relax.Var))
    nodes = {}  # the sum's nodes: adds, subtracts, constant scalings
    for block in getattr(func.body, "blocks", []):
        for b in block.bindings:
            if isinstance(b, relax.VarBinding) and (
                    _op(b.value) in _SUM_OPS or (_op(b.value) == "relax.multiply" and any(
                        const_value(a) is not None for a in b.value.args))):
                nodes[b.var] = b.value
    inner = {a for v, call in nodes.items() for a in call.args
             if a in nodes and uses[a] == 1 and static_shape(a) == static_shape(v)}
    return uses, inner


def MergeConvBranches() -> tvm.transform.Pass:
    """Sum parallel convolutions of one input (and a BN or identity of it) into one conv.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))
    >>> w3 = relax.const(np.ones((8, 8, 3, 3), "float32"))
    >>> w1 = relax.const(np.ones((8, 8, 1, 1), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         a = bb.emit(relax.op.nn.conv2d(x, w3, padding=1))
    ...         b = bb.emit(relax.op.nn.conv2d(x, w1))
    ...         y = bb.emit_output(relax.op.add(a, b))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.MergeConvBranches()(bb.get())
    >>> opsdk.transform.op_counts(mod)["relax.nn.conv2d"]
    1
    """

    @tvm.transform.module_pass(opt_level=0, name="opsdk.MergeConvBranches")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not op_counts(mod, "relax.nn.conv2d"):
            return mod
        updates, sites = {}, [_as_dict(s) for s in rewrite_sites(mod)]
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m = _Merge(func, mod)
                new = m.visit_expr(func)
                if m.merged:
                    updates[gv] = new
                    values = _values(new)
                    sites += [_site(gv.name_hint, v, "fuse.conv_branches", values)
                              for v in m.sites]
        if not updates:
            return mod
        mod = mod.clone()
        for gv, func in updates.items():
            mod[gv] = func
        mod = relax.transform.DeadCodeElimination()(mod)
        return mod.with_attr(SITES_ATTR, _dedupe(sites))

    return _pass
