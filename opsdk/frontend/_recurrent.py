"""LSTM and GRU layers (``aten.lstm.input``, ``aten.gru.input``) as one recurrence kernel per
layer and direction.

torch's decomposition unrolls a recurrent layer into its time steps: per step a small matrix
product ``h @ W_hh^T``, the gate slices and their activations, each a kernel of its own, so a
two-layer LSTM over 49 frames ran about 500 kernels (0.65x onnxruntime, whose LSTM is one op).
Here a layer is two kernels:

- the input projection of every step at once, ``x @ W_ih^T + b`` (a matmul on the matmul
  rules, with its bias epilogue);
- the recurrence: one loop nest over the steps that keeps ``h`` and ``c`` in place and, per
  step, multiplies ``h`` by ``W_hh`` into register accumulators (``W_hh`` packed by blocks of
  gate columns, each block read contiguously) and applies the gates, vectorized, with
  opsdk's polynomial ``sigmoid`` / ``tanh`` (:func:`opsdk._vecmath.polynomial_math`).

The recurrence is written as loops, not a TE compute (each step reads the last one's
result), like TOPI's own loop-nest kernels: it runs through the ``extern`` rules as written,
on x86 and aarch64 alike (LLVM splits its vectors into the target's registers). The batch
is the outer loop, so sequences run one after another, each step on one core: a step's
matrix product (``4H x H``, 64 K multiply-adds for ``H = 128``) is too small to share.

float32 layers without ``proj_size`` take this path; any other (and a layer of a program
that keeps the decomposition) is imported as torch decomposes it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
from tvm import relax, tirx
from tvm.script import tirx as T

from .._patterns import const_value

if TYPE_CHECKING:
    from torch import fx

__all__ = ["RECURRENT", "onnx_recurrent", "recurrent_kept"]

#: Gate count of each kind, in torch's order: LSTM (i, f, g, o), GRU (r, z, n).
_GATES = {"lstm": 4, "gru": 3}
_BLOCK = 128


def _lanes(n: int, most: int) -> int:
    """The largest power of two up to ``most`` that divides ``n``."""
    v = most
    while n % v:
        v //= 2
    return v


@T.macro
def _recurrent_product(acc, g, hn, w, b, jo, hidden, v):
    """Gate block ``jo`` of a step: ``acc`` (holding its addend) plus ``h @ W_hh``, into
    ``g``: one broadcast of ``h[k]`` and one streamed row of the block per ``k``."""
    for k in range(hidden):
        for ji in T.vectorized(v):
            acc[ji] = acc[ji] + hn[b, k] * w[jo, k, ji]
    for ji in T.vectorized(v):
        g[jo * v + ji] = acc[ji]


@functools.lru_cache(maxsize=32)
def _lstm_kernel(steps: int, batch: int, hidden: int, reverse: bool) -> tirx.PrimFunc:
    gates = 4 * hidden
    v, vh = _lanes(gates, _BLOCK), _lanes(hidden, 16)
    blocks, rev = gates // v, int(reverse)

    @T.prim_func(private=True, check_well_formed=False)
    def lstm_recurrence(xp: T.Buffer((batch, steps, gates), "float32"),
                        w: T.Buffer((blocks, hidden, v), "float32"),
                        h0: T.Buffer((batch, hidden), "float32"),
                        c0: T.Buffer((batch, hidden), "float32"),
                        y: T.Buffer((batch, steps, hidden), "float32"),
                        hn: T.Buffer((batch, hidden), "float32"),
                        cn: T.Buffer((batch, hidden), "float32")):
        T.func_attr({"tir.noalias": True})
        for b, j in T.grid(batch, hidden):
            hn[b, j] = h0[b, j]
            cn[b, j] = c0[b, j]
        for b in range(batch):
            g = T.decl_buffer((gates,), "float32")
            acc = T.decl_buffer((v,), "float32", scope="local")
            for s in range(steps):
                for jo in range(blocks):
                    for ji in T.vectorized(v):
                        acc[ji] = xp[b, s + (steps - 1 - 2 * s) * rev, jo * v + ji]
                    _recurrent_product(acc, g, hn, w, b, jo, hidden, v)
                for jo in range(hidden // vh):
                    for ji in T.vectorized(vh):
                        cn[b, jo * vh + ji] = (
                            T.sigmoid(g[hidden + jo * vh + ji]) * cn[b, jo * vh + ji]
                            + T.sigmoid(g[jo * vh + ji]) * T.tanh(g[2 * hidden + jo * vh + ji]))
                        hn[b, jo * vh + ji] = (T.sigmoid(g[3 * hidden + jo * vh + ji])
                                               * T.tanh(cn[b, jo * vh + ji]))
                        y[b, s + (steps - 1 - 2 * s) * rev, jo * vh + ji] = hn[b, jo * vh + ji]

    return lstm_recurrence


@functools.lru_cache(maxsize=32)
def _gru_kernel(steps: int, batch: int, hidden: int, reverse: bool) -> tirx.PrimFunc:
    gates = 3 * hidden
    v, vh = _lanes(gates, _BLOCK), _lanes(hidden, 16)
    blocks, rev = gates // v, int(reverse)

    @T.prim_func(private=True, check_well_formed=False)
    def gru_recurrence(xp: T.Buffer((batch, steps, gates), "float32"),
                       w: T.Buffer((blocks, hidden, v), "float32"),
                       bh: T.Buffer((gates,), "float32"),
                       h0: T.Buffer((batch, hidden), "float32"),
                       y: T.Buffer((batch, steps, hidden), "float32"),
                       hn: T.Buffer((batch, hidden), "float32")):
        T.func_attr({"tir.noalias": True})
        for b, j in T.grid(batch, hidden):
            hn[b, j] = h0[b, j]
        for b in range(batch):
            g = T.decl_buffer((gates,), "float32")
            acc = T.decl_buffer((v,), "float32", scope="local")
            for s in range(steps):
                for jo in range(blocks):  # W_hh h + b_hh: the n gate needs it apart from x's
                    for ji in T.vectorized(v):
                        acc[ji] = bh[jo * v + ji]
                    _recurrent_product(acc, g, hn, w, b, jo, hidden, v)
                for jo in range(hidden // vh):
                    for ji in T.vectorized(vh):
                        # r -> g[j], z -> g[H + j], n -> g[2H + j]
                        g[jo * vh + ji] = T.sigmoid(
                            xp[b, s + (steps - 1 - 2 * s) * rev, jo * vh + ji] + g[jo * vh + ji])
                        g[hidden + jo * vh + ji] = T.sigmoid(
                            xp[b, s + (steps - 1 - 2 * s) * rev, hidden + jo * vh + ji]
                            + g[hidden + jo * vh + ji])
                        g[2 * hidden + jo * vh + ji] = T.tanh(
                            xp[b, s + (steps - 1 - 2 * s) * rev, 2 * hidden + jo * vh + ji]
                            + g[jo * vh + ji] * g[2 * hidden + jo * vh + ji])
                        hn[b, jo * vh + ji] = g[2 * hidden + jo * vh + ji] + g[
                            hidden + jo * vh + ji] * (hn[b, jo * vh + ji]
                                                      - g[2 * hidden + jo * vh + ji])
                        y[b, s + (steps - 1 - 2 * s) * rev, jo * vh + ji] = hn[b, jo * vh + ji]

    return gru_recurrence


_KERNELS = {"lstm": _lstm_kernel, "gru": _gru_kernel}


def _facts(node: fx.Node) -> dict[str, Any] | None:
    """The layer's facts when this path takes it: float32, static shapes, no ``proj_size``,
    in inference; else None."""
    import torch  # heavy: torch

    kind = node.target.__name__.split(".")[0]
    if kind not in _GATES or node.target.__name__.split(".")[1:] != ["input"]:
        return None
    a = list(node.args) + [None] * 9
    x, params = a[0], a[2]
    has_biases, layers, train = a[3], a[4], a[6]
    bidirectional, batch_first = bool(a[7]), bool(a[8])
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if val is None or val.dtype != torch.float32 or val.dim() != 3 or train:
        return None
    if not all(isinstance(d, int) for d in val.shape):
        return None
    dirs, per = 1 + bidirectional, 4 if has_biases else 2
    if len(params) != layers * dirs * per:  # proj_size adds a weight_hr per direction
        return None
    w_hh = params[1].meta.get("val")
    gates = _GATES[kind]
    if w_hh is None or w_hh.dim() != 2 or w_hh.shape[0] != gates * w_hh.shape[1]:
        return None
    batch, steps = (val.shape[0], val.shape[1]) if batch_first else (val.shape[1], val.shape[0])
    return {"kind": kind, "layers": int(layers), "dirs": dirs, "per": per,
            "batch_first": batch_first, "batch": int(batch), "steps": int(steps),
            "hidden": int(w_hh.shape[1]), "has_biases": bool(has_biases)}


def recurrent_kept(exported_program: Any) -> list[str]:
    """The recurrent aten ops to keep out of torch's decomposition: those every call of
    which this path takes (``lstm.input``, ``gru.input``)."""
    seen: dict[str, bool] = {}
    for n in exported_program.graph.nodes:
        name = getattr(n.target, "__name__", "")
        if n.op == "call_function" and name in ("lstm.input", "gru.input"):
            seen[name] = seen.get(name, True) and _facts(n) is not None
    return [k for k, ok in seen.items() if ok]


def _direction(bb: relax.BlockBuilder, kind: str, x: relax.Expr, weights: list[Any],
              states: list[relax.Expr], *, reverse: bool) -> list[relax.Expr]:
    """One layer in one direction: the input projection of every step, then the recurrence
    kernel. ``x`` is ``(batch, steps, features)`` float32 with static shapes; ``weights`` are
    ``W_ih, W_hh, b_ih, b_hh`` in torch's layout and gate order (the biases may be None);
    ``states`` the initial ``h`` (and ``c``), ``(batch, hidden)`` each. Returns the sequence
    ``(batch, steps, hidden)`` and the final states."""
    w_ih, w_hh, b_ih, b_hh = weights
    b, steps, _ = (int(d) for d in x.ty.shape.values)
    h = int(w_hh.ty.shape.values[1])
    gates = _GATES[kind] * h
    v = _lanes(gates, _BLOCK)
    xp = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w_ih, [1, 0]))))
    # W_hh by blocks of v gate columns, each block (hidden, v) contiguous
    wp = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(w_hh, (gates // v, v, h))),
                                       [0, 2, 1]))
    if kind == "lstm":
        if b_ih is not None:
            xp = bb.emit(relax.op.add(xp, bb.emit(relax.op.add(b_ih, b_hh))))
        ins = [xp, wp, *states]
    else:  # W_hh's bias stays apart: the n gate multiplies it by r
        if b_ih is not None:
            xp = bb.emit(relax.op.add(xp, b_ih))
        ins = [xp, wp, relax.const(np.zeros((gates,), "float32")) if b_hh is None else b_hh,
               *states]
    gv = bb.add_func(_KERNELS[kind](steps, b, h, reverse), f"{kind}_recurrence")
    out_ty = [relax.TensorType((b, steps, h), "float32")] + [
        relax.TensorType((b, h), "float32") for _ in states]
    call = bb.emit(relax.call_tir(gv, ins, out_ty))
    return [bb.emit(relax.TupleGetItem(call, k)) for k in range(len(out_ty))]


def _stacked(bb: relax.BlockBuilder, parts: list[relax.Expr], axis: int) -> relax.Expr:
    """``parts`` stacked on a new ``axis`` (not ``relax.stack``: its layout inference fails
    in ConvertLayout, "Index -1 out of bounds")."""
    return bb.emit(relax.op.concat([bb.emit(relax.op.expand_dims(e, [axis])) for e in parts],
                                   axis=axis))


def _recurrent(node: fx.Node, imp: Any) -> relax.Expr:
    f = _facts(node)
    if f is None:  # what torch's decomposition would give: TVM's own converter
        return imp._lstm(node) if node.target.__name__.startswith("lstm") else imp._gru(node)
    bb, kind = imp.block_builder, f["kind"]
    args = imp.retrieve_args(node)
    x, hx, params = args[0], args[1], args[2]
    if kind == "gru":
        hx = [hx]
    if not f["batch_first"]:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
    finals: list[list[relax.Expr]] = [[] for _ in hx]
    per = f["per"]
    for layer in range(f["layers"]):
        outs = []
        for d in range(f["dirs"]):
            i = layer * f["dirs"] + d
            weights = params[i * per:i * per + 2] + (
                params[i * per + 2:i * per + 4] if f["has_biases"] else [None, None])
            states = [bb.emit(relax.op.squeeze(bb.emit(relax.op.strided_slice(
                s, [0], [i], [i + 1])), [0])) for s in hx]
            y, *last = _direction(bb, kind, x, list(weights), states, reverse=d == 1)
            outs.append(y)
            for k, e in enumerate(last):
                finals[k].append(e)
        x = outs[0] if len(outs) == 1 else bb.emit(relax.op.concat(outs, axis=2))
    y = x if f["batch_first"] else bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
    return bb.emit(relax.Tuple([y, *(_stacked(bb, s, 0) for s in finals)]))


#: The converters, by aten overload.
RECURRENT = {"lstm.input": _recurrent, "gru.input": _recurrent}


#: ONNX's gate order, as indices into torch's: LSTM (i, o, f, c) -> (i, f, c, o); GRU
#: (z, r, h) -> (r, z, h).
_ONNX_ORDER = {"lstm": [0, 2, 3, 1], "gru": [1, 0, 2]}
_ONNX_DEFAULT_ACTIVATIONS = {"lstm": ["sigmoid", "tanh", "tanh"], "gru": ["sigmoid", "tanh"]}


def _onnx_refuse(op: str, what: str, fix: str) -> ValueError:
    return ValueError(f"ONNX {op}: {what} is not supported; {fix}")


def _reordered(bb: relax.BlockBuilder, e: relax.Expr, kind: str, hidden: int) -> relax.Expr:
    """Rows of ``e`` (gates * hidden, ...) from ONNX's gate order to torch's."""
    shape = [int(d) for d in e.ty.shape.values]
    g = _GATES[kind]
    e = bb.emit(relax.op.reshape(e, [g, hidden, *shape[1:]]))
    e = bb.emit(relax.op.take(e, relax.const(np.array(_ONNX_ORDER[kind], "int64")), axis=0))
    return bb.emit(relax.op.reshape(e, shape))


def onnx_recurrent(kind: str, bb: relax.BlockBuilder, inputs: list[Any],
                   attr: dict[str, Any]) -> relax.Expr:
    """ONNX ``LSTM`` / ``GRU`` (opsets 7-22: one layer, either or both directions) on the
    recurrence kernels. TVM 0.27's ONNX importer has neither ("The following operators are
    not supported for frontend ONNX: LSTM"). Refused in words: peepholes, ``clip``,
    non-default activations, ``input_forget``, sequence lengths that differ from the
    input's, a GRU with ``linear_before_reset=0``, and non-float32 or dynamic inputs."""
    op = kind.upper()
    inputs = list(inputs) + [None] * 8
    x, w, r, b, lens = inputs[:5]
    h0 = inputs[5]
    c0 = inputs[6] if kind == "lstm" else None
    hidden = int(attr["hidden_size"])

    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    direction_ = text(attr.get("direction", "forward"))
    layout = int(attr.get("layout", 0))
    dirs = 2 if direction_ == "bidirectional" else 1
    acts = [text(a).lower() for a in attr.get("activations", [])]
    if acts and acts != _ONNX_DEFAULT_ACTIVATIONS[kind] * dirs:
        raise _onnx_refuse(op, f"activations {acts}",
                           "only the default sigmoid/tanh ones run as one kernel")
    if attr.get("clip") is not None:
        raise _onnx_refuse(op, "clip", "export the model without cell clipping")
    if int(attr.get("input_forget", 0)):
        raise _onnx_refuse(op, "input_forget=1", "export it with input_forget=0")
    if kind == "lstm" and inputs[7] is not None:
        raise _onnx_refuse(op, "peephole weights (input P)", "export it without peepholes")
    if kind == "gru" and not int(attr.get("linear_before_reset", 0)):
        raise _onnx_refuse(op, "linear_before_reset=0",
                           "export torch's nn.GRU, which is linear_before_reset=1")
    shape = [getattr(d, "value", None) for d in x.ty.shape.values]
    if str(x.ty.dtype) != "float32" or any(not isinstance(d, int) for d in shape):
        raise _onnx_refuse(op, f"input {x.ty}",
                           "give it a static float32 input shape (shape_dict=...)")
    if layout == 0:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))  # (batch, steps, features)
    batch, steps = (shape[1], shape[0]) if layout == 0 else (shape[0], shape[1])
    if lens is not None:
        v = const_value(lens)
        if v is None or not (v == steps).all():
            raise _onnx_refuse(op, "sequence_lens shorter than the input",
                               "pad the sequences to one length, or drop sequence_lens")
    gh = _GATES[kind] * hidden
    names = ["h0", "c0"] if kind == "lstm" else ["h0"]
    outs, finals = [], [[] for _ in names]
    for d in range(dirs):
        def pick(e: relax.Expr, d: int = d) -> relax.Expr:
            return bb.emit(relax.op.squeeze(bb.emit(relax.op.strided_slice(
                e, [0], [d], [d + 1])), [0]))

        w_ih, w_hh = _reordered(bb, pick(w), kind, hidden), _reordered(bb, pick(r), kind, hidden)
        b_ih = b_hh = None
        if b is not None:
            bd = pick(b)
            b_ih = _reordered(bb, bb.emit(relax.op.strided_slice(bd, [0], [0], [gh])), kind,
                              hidden)
            b_hh = _reordered(bb, bb.emit(relax.op.strided_slice(bd, [0], [gh], [2 * gh])),
                              kind, hidden)
        states = [pick(s) if s is not None else relax.const(np.zeros((batch, hidden),
                                                                       "float32"))
                  for s in ((h0, c0) if kind == "lstm" else (h0,))]
        y, *last = _direction(bb, kind, x, [w_ih, w_hh, b_ih, b_hh], states,
                             reverse=direction_ == "reverse" or d == 1)
        outs.append(y)
        for k, e in enumerate(last):
            finals[k].append(e)
    if layout == 0:  # Y (steps, dirs, batch, hidden); Y_h (dirs, batch, hidden)
        seq = _stacked(bb, [bb.emit(relax.op.permute_dims(y, [1, 0, 2])) for y in outs], 1)
        last_states = [_stacked(bb, f, 0) for f in finals]
    else:  # Y (batch, steps, dirs, hidden); Y_h (batch, dirs, hidden)
        seq = _stacked(bb, outs, 2)
        last_states = [_stacked(bb, f, 1) for f in finals]
    return relax.Tuple([seq, *last_states])
