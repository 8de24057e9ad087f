"""The verify cell behind each kernel of a model, and the case of the kernel's own shapes.

A model's kernels are scheduled by the rules that ``opsdk verify`` checks, but a model's
kernel has its own shapes, attributes and fused epilogue. :func:`kernel_cell` reads an
*unscheduled* kernel (as FuseTIR leaves it, before ``ScheduleKernels``) and states:

- the cell that covers it: the kernel family (:mod:`opsdk.kernels`) or opsdk op, target,
  dtype and layout;
- its shape class (a matmul's layout, N and its residue against the vector width, K, the
  epilogue; a conv's window, stride, padding, dilation, groups, channel residues; a pool's
  kind and window) and what of it verify never draws (``gaps``, from the family's own
  attribute domains, so a wider domain closes a gap without a change here);
- the :class:`~opsdk.verify.Case` that builds exactly this kernel (its static shape, its
  attributes, its epilogue, its weights constant as in the model), when the family can
  express it, else the nearest one (``exact`` False), and the command that runs it.

:func:`verify_cells` runs those cases (each distinct case once). Kernels with no family
(transposes, elementwise, other reductions) say so (``verified_by == "none"``).

Examples
--------
>>> from tvm import te
>>> from opsdk.verify import kernel_cell
>>> x, w = te.placeholder((8, 32), name="x"), te.placeholder((32, 24), name="w")
>>> k = te.reduce_axis((0, 32), name="k")
>>> y = te.compute((8, 24), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="matmul")
>>> c = kernel_cell("dense", te.create_prim_func([x, w, y]), "x86", lanes=16)
>>> c.family, c.layout, c.shape_class["n"], c.exact
('tvm_matmul', 'kn', 24, True)
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.sym import Analyzer
from tvm.sym.pattern import detect_linear_equation
from tvm.tirx.analysis import undefined_vars

from ..kernels import KERNEL_OPS
from ._report import reproducer_command
from ._strategies import _STATIC_POOL, Case, corner_cases, is_valid, layout_attrs

__all__ = ["KernelCell", "kernel_cell", "verify_cells"]

#: The blocks of each activation of the kernel families' epilogue, as token lists
#: (:func:`_token`): what FuseOps appends after a matmul or conv for it.
_ACT_TOKENS: dict[str, tuple[str, ...]] = {
    "none": (), "relu": ("max0",), "relu6": ("max0", "min6"), "silu": ("sigmoid", "mul"),
    "hardswish": ("add3", "max0", "min6", "mul", "div6"), "sigmoid": ("sigmoid",),
    "tanh": ("tanh",),
}

_FAMILIES = {d.name: d for d in KERNEL_OPS}

#: The value of each attribute a reader states that computes what a family without that
#: attribute computes (an older family, or one that never grew it).
_NEUTRAL: dict[str, Any] = {"pad_left": -1, "pad_bottom": -1, "pad_right": -1, "dilation": 1,
                            "groups": 1, "multiplier": 1, "ceil_mode": False,
                            "count_include_pad": False}

NO_FAMILY = "none"


@dataclass
class KernelCell:
    """The verify cell of one kernel of a model (see the module docstring).

    ``family`` is a kernel family (``tvm_conv2d``, ...) or an opsdk op name, None when no
    family computes this kernel's kind (``verified_by`` is then ``"none"``). ``gaps`` lists
    what of its shape class verify never draws (empty: covered). ``case`` is the
    :meth:`Case.to_dict` of the kernel's own case (``exact``) or the nearest one;
    ``command`` reruns it. ``status`` / ``message`` / ``case_rule`` are filled by
    :func:`verify_cells` (``case_rule``: the rule the case's build took, which should be the
    model kernel's ``rule``).
    """

    kernel: str
    kind: str
    target: str
    family: str | None = None
    dtype: str | None = None
    layout: str | None = None
    shape_class: dict[str, Any] = field(default_factory=dict)
    gaps: list[str] = field(default_factory=list)
    case: dict[str, Any] | None = None
    exact: bool = False
    command: str = ""
    verified_by: str = NO_FAMILY
    rule: str | None = None
    status: str | None = None
    message: str = ""
    case_rule: str | None = None

    @property
    def covered(self) -> bool | None:
        """True when verify draws this kernel's class, False when not, None without a
        family (or for an opsdk op: its own cells cover it)."""
        if self.family is None or self.family not in _FAMILIES:
            return None
        return not self.gaps

    @property
    def cell(self) -> str:
        """``family/layout`` (``-`` without a family)."""
        if self.family is None:
            return "-"
        return f"{self.family}/{self.layout}" if self.layout else self.family

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with ``cell`` and ``covered``."""
        d = asdict(self)
        d["cell"], d["covered"] = self.cell, self.covered
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KernelCell:
        """The cell :meth:`as_dict` wrote (its derived ``cell`` / ``covered`` dropped).

        Examples
        --------
        >>> from opsdk.verify import KernelCell
        >>> c = KernelCell("transpose1", "elementwise", "x86")
        >>> KernelCell.from_dict(c.as_dict()) == c
        True
        """
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


# ------------------------------------------------------------------------------ TIR reading
def _int(e: Any) -> int | None:
    if isinstance(e, int):
        return e
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def _shape(buf: Any) -> list[int | None]:
    return [_int(d) for d in buf.shape]


def _float(e: Any) -> float | None:
    return float(e.value) if isinstance(e, tirx.FloatImm) else None


class _Func:
    """The blocks of an unscheduled kernel in order, who writes what, its parameters."""

    def __init__(self, func: tirx.PrimFunc) -> None:
        self.func = func
        self.sch = s_tir.Schedule(func)
        self.rvs = self.sch.get_child_blocks(self.sch.get_sblock("root"))
        self.blocks = [self.sch.get(b) for b in self.rvs]
        self.params = list(func.params)
        attrs = func.attrs or {}
        free = attrs.get("layout_free_buffers", None)
        self.constant = {int(i) for i in (free or [])}

    def param_index(self, buf: Any) -> int | None:
        return next((i for i, p in enumerate(self.params) if p.same_as(buf)), None)

    def producer(self, buf: Any) -> Any:
        return next((b for b in self.blocks if b.writes and b.writes[0].source.same_as(buf)),
                    None)

    def is_reduction(self, blk: Any) -> bool:
        return any(iv.iter_type == tirx.IterVar.CommReduce for iv in blk.iter_vars)


def _token(f: _Func, blk: Any, prev: Any, out_shape: list[int | None],
           channel_axis: int) -> str:
    """What one epilogue block does to the running value ``prev`` (a buffer): ``bias``,
    ``residual``, ``max0``, ``min6``, ``add3``, ``mul``, ``div6``, ``sigmoid``, ``tanh``, or
    ``other:<block>``."""
    body = blk.body
    v = getattr(body, "value", None)
    name = f"other:{blk.name_hint}"
    if v is None:
        return name
    if isinstance(v, Call):
        op = str(v.op.name) if hasattr(v.op, "name") else ""
        for act in ("sigmoid", "tanh"):
            if op.endswith("." + act):
                return act
        return name
    if isinstance(v, (tirx.Max, tirx.Min, tirx.Add, tirx.Mul, tirx.Div)):
        a, b = v.a, v.b
        if _float(a) is not None:
            a, b = b, a
        c = _float(b)
        if (isinstance(v, tirx.Max) and c == -math.inf) or (
                isinstance(v, tirx.Min) and c == math.inf):
            return "identity"  # torch's hardtanh exports clamp to +-inf too
        if isinstance(v, tirx.Max) and c == 0.0:
            return "max0"
        if isinstance(v, tirx.Min) and c == 6.0:
            return "min6"
        if isinstance(v, tirx.Add) and c == 3.0:
            return "add3"
        if isinstance(v, tirx.Div) and c == 6.0:
            return "div6"
        if isinstance(v, tirx.Mul) and c is None:
            return "mul"
        if isinstance(v, tirx.Add) and c is None:
            other = [ld for ld in (a, b) if isinstance(ld, TensorLoad)
                     and not ld.source.same_as(prev)]
            if len(other) == 1:
                i = f.param_index(other[0].source)
                if i is None:
                    return name
                s = _shape(f.params[i])
                if s == out_shape:  # a tensor of the output's shape: a skip connection
                    return "residual"
                # a per-channel vector (a constant in a model): read at the output's channel
                # index, every other index constant
                chan = set(undefined_vars(blk.writes[0].region[channel_axis].min))
                if all(n == 1 or set(undefined_vars(ix)) <= chan
                       for n, ix in zip(s, other[0].indices)):
                    return "bias"
    return name


def _epilogue(f: _Func, after: int, channel_axis: int) -> list[str]:
    """Tokens (:func:`_token`) of the blocks after block ``after``."""
    prev = f.blocks[after].writes[0].source
    out_shape = _shape(prev)
    tokens = []
    for blk in f.blocks[after + 1:]:
        tokens.append(_token(f, blk, prev, out_shape, channel_axis))
        if blk.writes:
            prev = blk.writes[0].source
    return tokens


def _match_epilogue(tokens: Sequence[str]) -> tuple[dict[str, Any], tuple[str, ...], str]:
    """(``{"activation": ...}``, present optional inputs, "" or why the family's epilogue
    (bias, residual, then one activation) is not this one; the nearest is returned then)."""
    toks = [t for t in tokens if t != "identity"]  # a clamp to +-inf changes nothing
    present = [n for n in ("bias", "residual") if n in toks]
    rest = [t for t in toks if t not in ("bias", "residual")]
    act = next((a for a, ts in _ACT_TOKENS.items() if list(ts) == rest), None)
    order = [t for t in toks if t in ("bias", "residual")]
    exact = (act is not None and toks[:len(order)] == order and order == present
             and all(toks.count(n) <= 1 for n in present))
    if act is None:
        act = "none"
    why = "" if exact else (f"epilogue {', '.join(toks) or 'none'} (the family's: bias, "
                            "residual, then one activation)")
    return {"activation": act}, tuple(present), why


def _window(expr: Any, spatial: set, reduce: set) -> tuple[int, int] | None:
    """(stride, dilation) of a window index ``o * stride + r * dilation + c``."""
    vs = list(undefined_vars(expr))
    o = [v for v in vs if any(v.same_as(s) for s in spatial)]
    r = [v for v in vs if any(v.same_as(s) for s in reduce)]
    if len(o) != 1 or len(r) != 1:
        return None
    co = detect_linear_equation(expr, [o[0], r[0]])
    if len(co) != 3 or _int(co[0]) is None or _int(co[1]) is None:
        return None
    return _int(co[0]), _int(co[1])


def _at_zero(expr: Any) -> int | None:
    """``expr`` with every variable 0: ``-c`` of a read index ``v - c`` or ``2 t - c`` (an
    extent-1 loop leaves a constant index; it is the same offset)."""
    ana = Analyzer()
    for v in undefined_vars(expr):
        ana.bind(v, 0)
    return _int(ana.simplify(expr))


def _offset(expr: Any) -> int | None:
    """``c`` of a padding block's read ``v - c`` of its input."""
    vs = list(undefined_vars(expr))
    if len(vs) > 1:
        return None
    if vs and [_int(c) for c in detect_linear_equation(expr, vs)][:1] != [1]:
        return None
    at = _at_zero(expr)
    return None if at is None else -at


def _unpadded(f: _Func, buf: Any, axes: Sequence[int]) -> tuple[Any, list[tuple[int, int]]]:
    """The kernel input ``buf`` reads and the (before, after) padding of each axis in
    ``axes``: ``buf`` itself (no padding) when a parameter, else its padding block's
    input. Raises ValueError for any other producer."""
    if f.param_index(buf) is not None:
        return buf, [(0, 0)] * len(axes)
    blk = f.producer(buf)
    if blk is None or len(blk.reads) != 1 or f.param_index(blk.reads[0].source) is None:
        raise ValueError("a producer fused before it (not a padding of a kernel input)")
    src = blk.reads[0].source
    pads = []
    for a in axes:
        top = _offset(blk.reads[0].region[a].min)
        n_in, n_pad = _int(src.shape[a]), _int(buf.shape[a])
        if top is None or n_in is None or n_pad is None:
            raise ValueError("a padding it cannot read")
        pads.append((top, n_pad - n_in - top))
    return src, pads


# -------------------------------------------------------------------------------- families
@dataclass
class _Found:
    family: str
    layout: str
    x: list[int | None]
    attrs: dict[str, Any]  # family attributes as found (before the domain check)
    present: tuple[str, ...] = ()
    dtype: str = "float32"
    packed: bool = False
    why: list[str] = field(default_factory=list)  # what the family cannot express
    extra: dict[str, Any] = field(default_factory=dict)  # class facts without an attribute


def _main_reduction(f: _Func) -> int:
    red = [i for i, b in enumerate(f.blocks) if f.is_reduction(b)]
    if len(red) != 1:
        raise ValueError(f"{len(red)} reduction blocks")
    return red[0]


def _matmul(f: _Func) -> _Found:
    i = _main_reduction(f)
    blk = f.blocks[i]
    out = blk.writes[0].source
    reads = [r for r in blk.reads if not r.source.same_as(out)]
    red = [iv for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if len(reads) != 2 or len(red) != 1:
        raise ValueError("not a multiply-accumulate the matmul family computes")
    # ``C[..., i, j] += A[..., i, k] * B[..., k, j]``: B is the operand carrying j (the last
    # output index), its indices each j, k or a batch dim (the kind classifier proved the
    # form: every index one iter var)
    jv = list(undefined_vars(blk.writes[0].region[-1].min))
    kv = red[0].var

    def uses(r: Any, v: Any) -> bool:
        return any(x.same_as(v) for rg in r.region for x in undefined_vars(rg.min))

    if len(jv) != 1:
        raise ValueError("an output column index that is not one iter var")
    rb = next((r for r in reads if uses(r, jv[0])), None)
    if rb is None:
        raise ValueError("no operand carries the output's columns")
    ra = next(r for r in reads if r is not rb)
    a, b = ra.source, rb.source
    b_pos = ["J" if any(x.same_as(jv[0]) for x in undefined_vars(rg.min)) else
             "K" if any(x.same_as(kv) for x in undefined_vars(rg.min)) else "S"
             for rg in rb.region]
    why: list[str] = []
    wprod = f.producer(b)
    before = [p.name_hint for p in f.blocks[:i] if wprod is None or not p.same_as(wprod)]
    if before:
        why.append(f"a producer fused before the matmul ({', '.join(before)})")
    layout_kn = b_pos[-2:] == ["K", "J"]
    nb = b_pos.count("S")
    w = b
    # the family's layouts as their TE reads the weight: ``kn`` / ``batched`` as (.., K, N),
    # ``batched_nk`` as (.., N, K) directly (at rank 2 too), ``nk`` through a transpose block
    layout = ("batched" if nb else "kn") if layout_kn else "batched_nk"
    if f.param_index(b) is None:  # read through a transpose block (a fused permute_dims)
        prod = f.producer(b)
        if prod is not None and len(prod.reads) == 1 \
                and f.param_index(prod.reads[0].source) is not None and not nb:
            w, layout = prod.reads[0].source, "nk"
        else:
            why.append("its weight computed in the kernel")
    ext = {"K": _int(red[0].dom.extent),
           "J": next(_int(iv.dom.extent) for iv in blk.iter_vars if iv.var.same_as(jv[0]))}
    x = _shape(a)
    if nb and _shape(w)[:nb] != x[:nb]:
        why.append(f"batch dims broadcast (x {x}, w {_shape(w)})")
    tokens = _epilogue(f, i, -1)
    act, present, ew = _match_epilogue(tokens)
    if ew:
        why.append(ew)
    wi = f.param_index(w)
    return _Found("tvm_matmul", layout, x, {"n": ext.get("J"), **act}, present,
                  str(a.dtype), packed=wi is not None and wi in f.constant, why=why,
                  extra={"K": ext.get("K"), "epilogue": tokens})


def _pad_attrs(top: int, left: int, bottom: int, right: int) -> dict[str, int]:
    """The families' padding attributes: ``padding`` the top, each other side -1 when it
    is the same."""
    return {"padding": top, **{k: (-1 if v == top else v) for k, v in (
        ("pad_left", left), ("pad_bottom", bottom), ("pad_right", right))}}


def _conv(f: _Func) -> _Found:
    i = _main_reduction(f)
    blk = f.blocks[i]
    out = blk.writes[0].source
    spatial = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.DataPar}
    reduce = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    reads = [r for r in blk.reads if not r.source.same_as(out)]
    data = next(r for r in reads if any(_window(rg.min, spatial, reduce) for rg in r.region))
    wread = next(r for r in reads if r is not data)
    win = [(k, _window(rg.min, spatial, reduce)) for k, rg in enumerate(data.region)]
    # A grouped conv's channel index ``ff + rc`` reads like a window too: the layout (TOPI's
    # block name, else which weight dim is the output's channel count) says which axes are
    # the image's.
    name, os_ = blk.name_hint.lower(), _shape(out)
    nhwc = "nhwc" in name or ("nchw" not in name and os_[3] == _shape(wread.source)[3])
    axes = [1, 2] if nhwc else [2, 3]
    if any(win[a][1] is None for a in axes):
        raise ValueError(f"no window on axes {axes}")
    (sh, dh), (sw, dw) = win[axes[0]][1], win[axes[1]][1]
    x, pads = _unpadded(f, data.source, axes)
    xs, ws = _shape(x), _shape(wread.source)
    kh, kw, cg, o = (ws[0], ws[1], ws[2], ws[3]) if nhwc else (ws[2], ws[3], ws[1], ws[0])
    c = xs[3] if nhwc else xs[1]
    why: list[str] = []
    if not (c and cg and o):
        raise ValueError("symbolic channels")
    groups = c // cg
    depthwise = groups == c and c > 1
    (top, bottom), (left, right) = pads
    rows = (xs[axes[0]] or 0) + top + bottom
    if kh == 1:  # a one-row window (a conv1d): its row dilation reads nothing
        dh = dw
        if rows == 1:  # over a one-row image: one output row whatever the row stride
            sh = sw
    if kh != kw and kh != 1:
        why.append(f"a {kh}x{kw} window (the family's are square or one row)")
    if sh != sw:
        why.append(f"stride {sh}x{sw} (the family's is one value)")
    if dh != dw:
        why.append(f"dilation {dh}x{dw} (the family's is one value)")
    tokens = _epilogue(f, i, 3 if nhwc else 1)
    act, present, ew = _match_epilogue(tokens)
    if ew:
        why.append(ew)
    attrs: dict[str, Any] = {"kernel": kw, "kernel_h": -1 if kh == kw else kh, "stride": sw,
                             **_pad_attrs(top, left, bottom, right), "dilation": dw}
    d = _FAMILIES["tvm_conv2d"]
    if depthwise and o != c and groups in d.attr_domain.get("groups", ()):
        # groups = channels with several outputs each is a grouped conv as much as a
        # depthwise one with a multiplier (the same TE): the label verify draws
        depthwise = False
    if depthwise:  # groups = channels: the _dw layouts, ``multiplier`` outputs per channel
        attrs["multiplier"] = o // c
    else:
        attrs.update(channels=o, groups=groups)
    attrs.update(act)
    layout = ("NHWC" if nhwc else "NCHW") + ("_dw" if depthwise else "")
    wi = f.param_index(wread.source)
    return _Found("tvm_conv2d", layout, xs, attrs, present, str(x.dtype),
                  packed=wi is not None and wi in f.constant, why=why,
                  extra={"input_channels": c, "output_channels": o, "epilogue": tokens})


def _winograd(f: _Func) -> _Found:
    tag = {str(b.annotations.get("opsdk.winograd", "")): k for k, b in enumerate(f.blocks)
           if "opsdk.winograd" in b.annotations}
    if not {"input", "weight", "output"} <= set(tag):
        raise ValueError("Winograd stages missing")
    inp, wblk, outb = (f.blocks[tag[s]] for s in ("input", "weight", "output"))
    x, w = inp.reads[0].source, wblk.reads[0].source
    xs, os_ = _shape(x), _shape(outb.writes[0].source)
    reg = inp.reads[0].region
    why: list[str] = []
    # a tile's first input row / column is ``tile * 2 - top``; the output has h + top +
    # bottom - 2 rows
    # (a region clipped to a tiny input no longer starts at the tile: its sides are taken as
    # even then)
    side = [-(_at_zero(reg[a].min) or 0) if _int(reg[a].extent) == 4
            else (os_[a] - xs[a] + 2) // 2 for a in (1, 2)]
    top, left = side
    bottom, right = os_[1] - xs[1] - top + 2, os_[2] - xs[2] - left + 2
    tokens = _epilogue(f, tag["output"], 3)
    act, present, ew = _match_epilogue(tokens)
    if ew:
        why.append(ew)
    wi = f.param_index(w)
    return _Found("tvm_conv2d_winograd", "NHWC", xs,
                  {"channels": _shape(w)[3], **_pad_attrs(top, left, bottom, right), **act},
                  present, str(x.dtype), packed=wi is not None and wi in f.constant, why=why,
                  extra={"input_channels": xs[3], "epilogue": tokens})


def _pool_len(n: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """Output length of a pool along an axis of length ``n`` (torch's and TVM's rule)."""
    span = n + 2 * padding - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= n + padding:
        out -= 1
    return out


def _corner_count(blk: Any, last: bool = False) -> float | None:
    """The divisor of an average's division block at the first output position (``last``:
    the last); TVM writes it as an expression of the position for both
    ``count_include_pad`` settings."""
    ana = Analyzer()
    for iv in blk.iter_vars:
        ext = _int(iv.dom.extent)
        ana.bind(iv.var, (ext - 1) if last and ext else 0)
    d = ana.simplify(blk.body.value.b)
    while isinstance(d, tirx.Cast):
        d = d.value
    d = ana.simplify(d)
    return float(d.value) if isinstance(d, (tirx.IntImm, tirx.FloatImm)) else None


def _counts_padding(blk: Any, sizes: Sequence[int], outs: Sequence[int], k: int, st: int,
                    p: int) -> bool:
    """Whether an average's divisor counts the padding (``count_include_pad``): its value at
    the first and the last window against both settings' counts (the padding counts up to
    ``p`` past each end; a window past that, with ``ceil_mode``, is cut there); False where
    the two agree (no window reaches the padding: either is the same average)."""
    def count(pos_last: bool, include: bool) -> int:
        n = 1
        for size, o in zip(sizes, outs):
            start = (o - 1 if pos_last else 0) * st - p
            lo, hi = (-p, size + p) if include else (0, size)
            n *= max(0, min(start + k, hi) - max(start, lo))
        return n

    got = [_corner_count(blk, last) for last in (False, True)]
    inc = [count(last, True) for last in (False, True)]
    exc = [count(last, False) for last in (False, True)]
    return inc != exc and got == [float(v) for v in inc]


def _pool(f: _Func) -> _Found:
    i = _main_reduction(f)
    blk = f.blocks[i]
    spatial = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.DataPar}
    reduce = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    out = blk.writes[0].source
    data = next(r for r in blk.reads if not r.source.same_as(out))
    win = [(k, _window(rg.min, spatial, reduce)) for k, rg in enumerate(data.region)]
    axes = [k for k, sd in win if sd is not None]
    if axes not in ([1, 2], [2, 3]):
        raise ValueError(f"window axes {axes}")
    x, pads = _unpadded(f, data.source, axes)
    xs = _shape(x)
    pool = "max" if isinstance(blk.body.value, tirx.Max) else "avg"
    kern = [_int(iv.dom.extent) for iv in blk.iter_vars
            if iv.iter_type == tirx.IterVar.CommReduce]
    (sh, dh), (sw, dw) = win[axes[0]][1], win[axes[1]][1]
    why: list[str] = []
    if len(set(kern)) != 1 or sh != sw or dh != 1 or dw != 1:
        why.append(f"window {kern}, stride {sh}x{sw}, dilation {dh}x{dw} (the family: one "
                   "square window and stride)")
    p = pads[0][0]
    got = [_shape(out)[a] for a in axes]
    # TVM pads the bottom / right further for ceil_mode (whether or not the output grows),
    # so uneven padding with a ceil-mode output length is ceil_mode
    even = len(set(pads)) == 1 and pads[0][0] == pads[0][1]
    ceil = None
    for mode in ((False, True) if even else (True,)):
        if None not in xs and got == [_pool_len(xs[a], kern[0], sh, p, mode) for a in axes]:
            ceil = mode
            break
    if ceil is None:
        why.append(f"padding {pads}, output {got} (the family pads every side alike)")
    tail = f.blocks[i + 1:]
    include = False
    if pool == "avg":
        if len(tail) != 1 or not isinstance(tail[0].body.value, tirx.Div):
            why.append("an average without its one division block")
        elif None not in xs:  # the divisor at the first and last windows says
            include = _counts_padding(tail[0], [xs[a] for a in axes], got, kern[0], sh, p)
    elif tail:
        why.append(f"blocks after the pool ({', '.join(b.name_hint for b in tail)})")
    layout = ("NHWC" if axes == [1, 2] else "NCHW") + f"_{pool}"
    attrs: dict[str, Any] = {"kernel": kern[0], "stride": sh, "padding": p,
                             "ceil_mode": bool(ceil)}
    if pool == "avg":
        attrs["count_include_pad"] = include
    return _Found("tvm_pool2d", layout, xs, attrs, (), str(x.dtype), why=why)


def _reduction(f: _Func) -> _Found:
    i = _main_reduction(f)
    blk = f.blocks[i]
    out = blk.writes[0].source
    data = [r for r in blk.reads if not r.source.same_as(out)]
    if len(data) != 1 or f.param_index(data[0].source) is None or i != 0:
        raise ValueError("not a reduction of one kernel input")
    x = data[0].source
    xs = _shape(x)
    red = {iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    axes = [k for k, rg in enumerate(data[0].region)
            if any(v.same_as(r) for v in undefined_vars(rg.min) for r in red)]
    keep = len(_shape(out)) == len(xs)
    why: list[str] = []
    v = blk.body.value
    tail = f.blocks[i + 1:]
    if len(xs) == 4 and axes in ([1, 2], [2, 3]) and isinstance(v, tirx.Add) and len(tail) == 1 \
            and isinstance(tail[0].body.value, tirx.Div):
        if not keep:
            why.append("the reduced dims dropped (the family keeps them)")
        return _Found("tvm_mean", "NHWC" if axes == [1, 2] else "NCHW", xs, {}, (),
                      str(x.dtype), why=why, extra={"keepdims": keep})
    if tail or len(axes) != 1 or not isinstance(v, (tirx.Max, tirx.Add)):
        raise ValueError("a reduction no family computes")
    if len(xs) != 3:
        why.append(f"rank {len(xs)} (the family's is 3)")
        if axes[0] == len(xs) - 1:
            xs, axes = [1] * max(0, 3 - len(xs)) + xs[-3:], [2]
        else:
            raise ValueError("a reduction no family computes")
    if axes[0] == 0:
        raise ValueError("a reduction over the first axis")
    if not keep:
        why.append("the reduced dim dropped (the family keeps it)")
    layout = "last" if axes[0] == 2 else "middle"
    return _Found("tvm_reduce", layout, xs,
                  {"reduce": "max" if isinstance(v, tirx.Max) else "sum"}, (), str(x.dtype),
                  why=why, extra={"keepdims": keep})


_READERS = {"matmul": _matmul, "conv2d": _conv, "winograd": _winograd, "pool": _pool,
            "reduction": _reduction}


# ------------------------------------------------------------------------------ the domains
def _residues(vals: Iterable[int], lanes: int) -> list[int]:
    return sorted({int(v) % lanes for v in vals})


@functools.lru_cache(maxsize=64)
def _corner_values(op: str, target: str, dtype: str, layout: str, lanes: int
                   ) -> tuple[dict[str, list[Any]], list[int]]:
    """The attribute values and input channel counts (the last axis of an NHWC input, axis 1
    of an NCHW one) of the cell's corner cases: what every verify run builds."""
    d = _FAMILIES[op]
    try:
        corners = corner_cases(d, target, dtype, layout, lanes)
    except Exception:  # the corners are an addition to the domains, never a failure
        return {}, []
    vals: dict[str, list[Any]] = {}
    chans = []
    for c in corners:
        for k, v in c.attrs.items():
            vals.setdefault(k, []).append(v)
        if len(c.shape) == 4:
            chans.append(c.shape[1] if layout.startswith("NCHW") else c.shape[3])
    return vals, chans


def _domain_gaps(d: Any, found: _Found, target: str, lanes: int) -> list[str]:
    """What of ``found``'s class the family's verify never draws: an attribute value outside
    its domain and the cell's corners, a channel / feature count whose residue against the
    vector width no drawn value has, a rank outside the family's."""
    gaps = []
    fixed = d.layouts.get(found.layout, {})
    corner, corner_chans = _corner_values(d.name, target, found.dtype, found.layout, lanes)
    for name, v in found.attrs.items():
        dom = d.attr_domain.get(name)
        if name in fixed or v is None or not isinstance(dom, (list, tuple)):
            continue
        drawn = [*dom, *(x for x in corner.get(name, ()) if x not in dom)]
        if name in ("n", "channels"):
            res = _residues(drawn, lanes)
            if int(v) % lanes not in res:
                gaps.append(f"{name} {v}: {name} % {lanes} = {int(v) % lanes}, verify draws "
                            f"residues {res}")
        elif v not in drawn:
            gaps.append(f"{name} {v}: verify draws {drawn}")
    c = found.extra.get("input_channels")
    if c:  # a conv's input channels: a static axis, drawn from the static pool and corners
        drawn = [*_STATIC_POOL, lanes + 1, lanes - 1, *corner_chans]
        if c % lanes not in _residues(drawn, lanes):
            gaps.append(f"input channels {c}: % {lanes} = {c % lanes}, verify draws residues "
                        f"{_residues(drawn, lanes)}")
    lo, hi = d.ranks
    if not lo <= len(found.x) <= hi:
        gaps.append(f"rank {len(found.x)}: verify draws ranks {lo}-{hi}")
    return gaps


# -------------------------------------------------------------------------------- the cells
def kernel_cell(name: str, func: tirx.PrimFunc, target: str, *, lanes: int,
                kind: str | None = None, rule: str | None = None) -> KernelCell:
    """The :class:`KernelCell` of the unscheduled kernel ``func`` (as FuseTIR leaves it) of
    a model compiled for ``target`` (a verify target name: ``x86``, ``arm``, ...).

    ``lanes`` is the target's float32 vector width (residues are stated against it);
    ``kind``: the kind the driver gave the scheduled kernel (``opsdk.<op>`` for an opsdk
    op; None: classified here); ``rule``: the rule that scheduled it (kept on the cell).

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.verify import kernel_cell
    >>> x = te.placeholder((4, 8), name="x")
    >>> y = te.compute((8, 4), lambda i, j: x[j, i], name="T_transpose")
    >>> kernel_cell("transpose", te.create_prim_func([x, y]), "x86", lanes=16).verified_by
    'none'
    """
    if kind is None:
        from ..schedules import classify

        kind = classify(func)
    cell = KernelCell(name, kind, target, rule=rule)
    if kind.startswith("opsdk."):  # an opsdk op: its own verify cells
        return _op_cell(cell, func)
    reader = _READERS.get(kind)
    if reader is None:
        return cell
    try:
        found = reader(_Func(func))
    except (ValueError, StopIteration):
        # a kernel of this kind that no family computes (a softmax piece, a fused prologue)
        return cell
    except Exception as e:  # a structure the readers do not know: said, not fatal
        cell.message = f"its structure was not read ({type(e).__name__}: {e})".split("\n")[0]
        return cell
    d = _FAMILIES[found.family]
    cell.family, cell.layout, cell.dtype = found.family, found.layout, found.dtype
    cell.verified_by = f"{found.family} ({found.layout})"
    static = all(s is not None for s in found.x)
    cell.shape_class = {
        "x": [s if s is not None else "symbolic" for s in found.x], **found.attrs,
        **found.extra,
        **({"n_residue": found.attrs["n"] % lanes} if found.attrs.get("n") else {}),
        **({"channel_residue": found.attrs["channels"] % lanes}
           if found.attrs.get("channels") else {}),
        "bias": "bias" in found.present, "residual": "residual" in found.present,
        "packed": found.packed, "static": static, "lanes": lanes,
    }
    gaps = list(found.why)
    if found.dtype not in d.dtypes:
        gaps.append(f"dtype {found.dtype}: the family is {', '.join(d.dtypes)}")
    params = {p.name for p in d.attr_params}
    for k, v in found.attrs.items():  # an attribute this family version does not have
        if k not in params and v != _NEUTRAL.get(k, v):
            gaps.append(f"{k} {v}: {found.family} has no {k!r} attribute")
    found.attrs = {k: v for k, v in found.attrs.items() if k in params}
    gaps += _domain_gaps(d, found, target, lanes)
    cell.gaps = gaps
    attrs = {**layout_attrs(d, found.layout), **found.attrs}
    shape = tuple(2 if s is None else int(s) for s in found.x)  # a symbolic dim: 2
    inputs = [p.name for p in d.tensor_params]
    optional = {p.name for p in d.tensor_params if p.optional}
    data = {n: "domain" for n in inputs if n not in optional or n in found.present}
    case = Case(found.family, target, found.dtype if found.dtype in d.dtypes else d.dtypes[0],
                found.layout, shape, attrs, tuple(n for n in inputs if n in found.present),
                data, 0, static=static, packed=found.packed and bool(d.weights))
    try:
        valid = is_valid(d, case.shape, case.dtype, case.attrs, case.present)
    except Exception:
        valid = False
    if not valid:
        cell.gaps.append("its case is refused by the family's checks")
        return cell
    cell.case = case.to_dict()
    cell.exact = not found.why and found.dtype in d.dtypes
    cell.command = reproducer_command(case, kernels=True)
    return cell


def _op_cell(cell: KernelCell, func: tirx.PrimFunc) -> KernelCell:
    from ..registry import get_op

    op = cell.kind.removeprefix("opsdk.")
    cell.family = op
    try:
        d = get_op(op)
    except KeyError:
        cell.verified_by = f"opsdk op {op} (not registered here)"
        return cell
    cell.dtype = str(func.params[0].dtype) if func.params else None
    if len(d.layouts) == 1:
        cell.layout = next(iter(d.layouts))
    cell.verified_by = f"the cells of opsdk op {op}"
    parts = ["opsdk", "verify", op, "--target", cell.target]
    if cell.dtype in d.dtypes:
        parts += ["--dtypes", cell.dtype]
    cell.command = " ".join(parts)
    return cell


def verify_cells(cells: Sequence[KernelCell], *, runner: Any = None) -> dict[str, Any]:
    """Run each distinct case of ``cells`` once (:func:`opsdk.verify.run_case`) and set every
    cell's ``status``, ``message`` and ``case_rule``; cells without a case are left as they
    are. Returns ``{"cases": distinct cases run, "failed": how many of them did not pass}``.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.verify import kernel_cell, verify_cells
    >>> x, w = te.placeholder((8, 32), name="x"), te.placeholder((32, 24), name="w")
    >>> k = te.reduce_axis((0, 32), name="k")
    >>> y = te.compute((8, 24), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="mm")
    >>> c = kernel_cell("dense", te.create_prim_func([x, w, y]), "x86", lanes=16)
    >>> verify_cells([c]), c.status
    ({'cases': 1, 'failed': 0}, 'pass')
    """
    from ..registry import register_kernels
    from ._engine import _runner_for, run_case

    register_kernels()
    todo: dict[str, list[KernelCell]] = {}
    for c in cells:
        if c.case is not None:
            todo.setdefault(json.dumps(c.case, sort_keys=True), []).append(c)
    failed = 0
    own: dict[str, Any] = {}
    try:
        for key, group in todo.items():
            case = Case.from_dict(json.loads(key))
            r = runner
            if r is None and case.target not in own:
                try:  # e.g. arm without its emulator: every case of the target says so
                    own[case.target] = _runner_for(case.target)
                except Exception as e:
                    own[case.target] = e
            if r is None:
                r = own[case.target]
            if isinstance(r, Exception):
                failed += 1
                for c in group:
                    c.status = "error"
                    c.message = f"no runner for target {case.target}: {r}".split("\n")[0]
                continue
            res = run_case(case, runner=r, op=_FAMILIES[case.op])
            failed += not res.ok
            for c in group:
                c.status, c.message, c.case_rule = res.status, res.message, res.rule
    finally:
        for r in own.values():
            if not isinstance(r, Exception) and hasattr(r, "close"):
                r.close()
    return {"cases": len(todo), "failed": failed}


