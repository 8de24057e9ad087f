"""``attention``: scaled dot-product attention in one kernel, Q K^T * scale (+ mask, causal) ->
softmax -> V, for encoders (every key visible) and decoders (causal, over a KV cache).

Layouts: ``"BSHD"`` (batch, sequence, heads, head dim: how a KV cache stores rows, and how
a decoder's projections reshape) or ``"BHSD"`` (torch's ``scaled_dot_product_attention``).
Queries ``(B, n, H, D)`` attend over ``m`` keys and values ``(B, m, Hkv, D)``; with
``Hkv < H`` (grouped-query attention) query head ``h`` reads key head ``h // (H / Hkv)``.
``Hkv`` must divide ``H`` (the declaration's free dim ``"Hkv"``, ``H`` where none is chosen):
a decoder passes its cache's key/value heads as they are, without repeating them.
``causal``: query ``i`` sits at position ``m - n + i`` (the ``n`` new tokens are the last of
the ``m``) and sees keys ``j <= m - n + i``; a query that sees no key gives zeros.
``scale`` 0 means ``1 / sqrt(D)``. ``mask`` (optional, float32 ``(B, 1, n, m)``, shared by
the heads) is added to the scaled scores, as torch's additive ``attn_mask`` (``-inf``: the key
is not seen).

torch: ``F.scaled_dot_product_attention`` (``aten.scaled_dot_product_attention``, kept out
of the decomposition) maps to this op with layout ``"BHSD"`` where it fits and is faster
(:func:`_from_torch`); other calls get the matmul / softmax / matmul decomposition in Relax.

The compute is float32 throughout; the schedules keep the scores and the exponentials in a
buffer of one row (decode) or one block of rows (many queries) of the ``m`` keys (no
``n x m`` matrix in memory); the division by the exponentials' sum is one reciprocal per
row. The inner stages pad the keys to a multiple of 16 and the query rows to a multiple of
8 (the last key / query repeated, the padded keys masked out, the padded rows dropped), so
the many-query schedule's tiles are whole.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from tvm import relax, te, tirx
from tvm.sym import Analyzer

from .._declare import op
from .._dtypes import FLOAT_DTYPES
from .._errmodel import MATH_ULPS, ModelInput, error_model, gamma
from .._opdef import Tensor
from ..te_utils import exp_f32
from ._convert import arg
from .softmax import softmax

__all__ = ["KEY_PAD", "QUERY_PAD", "attention"]

#: The keys' padding in the compute's score rows (a multiple of every target's vector width).
KEY_PAD = 16
#: The queries' padding in the stages before the output (the many-query schedule's block).
QUERY_PAD = 8


def _bhsd(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout == "BHSD" else a.transpose(0, 2, 1, 3)


def _parts(q, k, v, mask, scale, causal, layout):
    """float64 (B, H, n, m) scaled scores (with the mask added), visibility, the mask
    (or 0), and (B, H, m, D) values."""
    q, k, v = (_bhsd(a.astype(np.float64), layout) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    s = (q @ k.transpose(0, 1, 3, 2)) * (scale or 1.0 / math.sqrt(d))
    seen = np.ones((n, m), bool)
    if causal:
        seen = np.arange(m)[None, :] <= (m - n + np.arange(n))[:, None]
    seen = np.broadcast_to(seen, s.shape)
    add = np.zeros(1) if mask is None else mask.astype(np.float64)
    with np.errstate(invalid="ignore"):
        s = s + add
    return q, k, v, s, seen & np.isfinite(s), add


def _reference(q, k, v, mask=None, *, scale=0.0, causal=False, layout="BSHD"):
    _, _, v, s, seen, _ = _parts(q, k, v, mask, scale, causal, layout)
    s = np.where(seen, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(seen, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    return _bhsd(p @ v, layout)


def _input_shapes(s, a):
    # k / v: "M" keys and "Hkv" heads (a divisor of q's, checked in _check), shared with v
    if a["layout"] == "BSHD":
        kv = (s[0], "M", "Hkv", s[3])
        return {"k": kv, "v": kv, "mask": (s[0], 1, s[1], "M")}
    kv = (s[0], "Hkv", "M", s[3])
    return {"k": kv, "v": kv, "mask": (s[0], 1, s[2], "M")}


def _query_heads(s, a):
    """The default key/value head count: q's (no grouping)."""
    return s[2] if a["layout"] == "BSHD" else s[1]


def _static_int(x):
    if isinstance(x, (int, np.integer)):
        return int(x)
    return int(x.value) if isinstance(x, tirx.IntImm) else None


def _check(shapes, dtypes, attrs):
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    lay = attrs["layout"]
    if lay not in ("BSHD", "BHSD"):
        raise ValueError(f"argument 'layout' is {lay!r}; use 'BSHD' or 'BHSD'")
    mask = shapes.get("mask")
    n, m = (q[1], k[1]) if lay == "BSHD" else (q[2], k[2])
    if mask is not None and (len(mask) != 4 or mask[1] != 1 or mask[0] != q[0]
                             or mask[2] != n or mask[3] != m):
        raise ValueError(f"mask {tuple(mask)} must be (batch, 1, queries, keys) = "
                         f"({q[0]}, 1, {n}, {m})")
    if k != v:
        raise ValueError(f"k {tuple(k)} and v {tuple(v)} must have the same shape")
    h_axis = 2 if lay == "BSHD" else 1
    if q[0] != k[0] or q[3] != k[3]:
        raise ValueError(f"q {tuple(q)} and k {tuple(k)} must agree in batch and head dim "
                         f"({lay})")
    hq, hk = (_static_int(x[h_axis]) for x in (q, k))
    if hq is not None and hk is not None and (hk == 0 or hq % hk):
        raise ValueError(f"argument 'k' has {hk} heads, which do not divide the {hq} heads of "
                         f"'q' ({lay}; grouped-query attention); give k and v a number of "
                         f"heads that divides {hq}")
    if attrs["scale"] < 0:
        raise ValueError(f"argument 'scale' is {attrs['scale']}; give a positive factor, or 0 "
                         "for 1/sqrt(head dim)")


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    input_shapes=_input_shapes,
    free_dims={"M": (1, 80), "Hkv": (1, 64, _query_heads)},
    check=_check,
    layouts={"causal": {"causal": True}, "full": {"causal": False},
             "BHSD": {"layout": "BHSD", "causal": False}},
    domain={"q": (-2.0, 2.0), "k": (-2.0, 2.0), "v": (-2.0, 2.0), "mask": (-4.0, 0.0)},
    attr_domain={"scale": [0.0, 0.125, 0.5]},
    kind="reduction",
    examples=[(1, 3, 2, 8)],
)
def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, scale: float = 0.0,
    causal: bool = False,
    layout: Literal["BSHD", "BHSD"] = "BSHD",
) -> te.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head, float32 (module docstring)."""
    bshd = layout == "BSHD"
    n, h_q = (q.shape[1], q.shape[2]) if bshd else (q.shape[2], q.shape[1])
    m, h_k = (k.shape[1], k.shape[2]) if bshd else (k.shape[2], k.shape[1])
    d = q.shape[3]
    hq_s, hk_s = _static_int(h_q), _static_int(h_k)
    per_query = False  # kt per query head instead of per key head (see kt)
    if hq_s is not None and hk_s is not None:
        group = hq_s // hk_s  # query heads per key head (1 without grouping)
        kv_head = (lambda h: h) if group == 1 else (lambda h: h // group)
    elif Analyzer().can_prove_equal(h_q, h_k):
        kv_head = lambda h: h  # noqa: E731
    else:
        # Symbolic head counts, which _check cannot prove to divide: h * Hkv / H stays below
        # Hkv for any counts (no read out of bounds) and is h // (H / Hkv) where they do.
        # (truncdiv: equal for these non-negative operands; floordiv by a variable lowers
        # to a Let that LLVM codegen rejected as bound twice in the vectorized rows kernel)
        kv_head = lambda h: tirx.truncdiv(h * h_k, h_q)  # noqa: E731
        per_query = True
    if scale:
        f = tirx.const(scale, "float32")
    elif isinstance(d, (int, tirx.IntImm)):
        f = tirx.const(1.0 / math.sqrt(int(d)), "float32")
    else:  # a symbolic head dim (one kernel for every size)
        f = tirx.const(1.0, "float32") / tirx.sqrt(d.astype("float32"))

    def at(t: te.Tensor, b, s, h, e):
        return t[b, s, h, e] if bshd else t[b, h, s, e]

    def seen(i, j):
        return j <= m - n + i if causal else tirx.const(True, "bool")

    # K transposed per key head, (B, Hk, D, mp), the keys padded to a multiple of KEY_PAD
    # (the last key repeated: no branch; the padded scores are masked out below). The
    # many-query schedule reads a tile of keys of one head dim as one vector; the decode
    # schedule inlines it (K read in place). With symbolic head counts that may differ, per
    # query head (H, reading its key head): a generic rule's task of one (batch, head) then
    # needs one kt head, not a range of them (else the rows rule made one task per batch
    # over all heads, a much larger kernel to compile in verify's symbolic builds).
    mp = (m + KEY_PAD - 1) // KEY_PAD * KEY_PAD
    kt = te.compute(
        (q.shape[0], h_q if per_query else h_k, d, mp),
        lambda b, h, e, j: at(k, b, tirx.min(j, m - 1), kv_head(h) if per_query else h, e),
        name="kt")
    kt_head = (lambda h: h) if per_query else kv_head
    # The stages between hold the query rows padded to a multiple of QUERY_PAD (the last
    # query repeated), so a block of rows is whole; only the output drops the padding.
    np_ = (n + QUERY_PAD - 1) // QUERY_PAD * QUERY_PAD
    rd = te.reduce_axis((0, d), name="rd")
    sc = te.compute(
        (q.shape[0], h_q, np_, mp),
        lambda b, h, i, j: te.sum(
            at(q, b, tirx.min(i, n - 1), h, rd) * kt[b, kt_head(h), rd, j], axis=rd),
        name="scores")

    def live(i, j):  # a real key the query sees
        return tirx.all(j < m, seen(i, j)) if causal else j < m

    def scaled(b, h, i, j):  # the score as softmax sees it (padding reads the last row / key)
        t = sc[b, h, i, j] * f
        return t if mask is None else t + mask[b, 0, tirx.min(i, n - 1), tirx.min(j, m - 1)]

    rm = te.reduce_axis((0, mp), name="rm")
    lowest = tirx.min_value("float32")
    mx = te.compute(
        (q.shape[0], h_q, np_),
        lambda b, h, i: te.max(tirx.Select(live(i, rm), scaled(b, h, i, rm), lowest), axis=rm),
        name="rowmax")
    ex = te.compute(
        sc.shape,
        lambda b, h, i, j: tirx.Select(
            live(i, j), exp_f32(scaled(b, h, i, j) - mx[b, h, i], nonpositive=True),
            tirx.const(0.0, "float32")),
        name="exp")
    rs = te.reduce_axis((0, mp), name="rs")
    tot = te.compute(mx.shape, lambda b, h, i: te.sum(ex[b, h, i, rs], axis=rs), name="expsum")
    rv = te.reduce_axis((0, m), name="rv")

    def row_head(a1, a2):  # (query row, head) of an output index
        return (a1, a2) if bshd else (a2, a1)

    pv = te.compute(
        (q.shape[0], h_q, np_, d),
        lambda b, h, i, e: te.sum(ex[b, h, i, rv] * at(v, b, rv, kv_head(h), e), axis=rv),
        name="pv")

    def norm(b, a1, a2, e):
        i, h = row_head(a1, a2)
        t = tot[b, h, i]
        return tirx.Select(t > tirx.const(0.0, "float32"),
                           pv[b, h, i, e] * (tirx.const(1.0, "float32") / t),
                           tirx.const(0.0, "float32"))

    return te.compute(q.shape, norm, name="attention")


@error_model(_reference)
def _error(m: ModelInput) -> np.ndarray:
    """First-order bound. Scores: a float32 dot product of ``D`` terms (``gamma_D`` times the
    sum of |products|), then the scale multiply and the max subtraction (one rounding each,
    relative to the value); exp adds its ulps. The exponentials' sum adds ``gamma_m`` and the
    reciprocal and product one rounding each; the values' weighted sum ``gamma_m``."""
    a = m.attrs
    u = m.u
    q, k, v, s, seen, add = _parts(m.inputs["q"], m.inputs["k"], m.inputs["v"],
                                   m.inputs.get("mask"), a["scale"], a["causal"], a["layout"])
    d = q.shape[3]
    f = a["scale"] or 1.0 / math.sqrt(d)
    s = np.where(seen, s, 0.0)  # the masked-out (-inf) scores take no part
    qk = np.where(seen, np.abs(s - add), 0.0)  # |q k * scale|
    # |delta s_j|: the dot product's rounding, then the scale (itself rounded to float32),
    # then the mask's add (one rounding of the sum)
    ds = gamma(d, u) * f * (np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2)) + 2 * u * qk
    if np.ndim(add) > 1:
        ds = ds + u * np.abs(s)
    s_m = np.where(seen, s, -np.inf)
    mx = s_m.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(seen, np.exp(s - mx), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    # relative error of each exponential: its argument's absolute error, then exp itself
    rho_e = np.where(seen, np.expm1(ds + u * np.abs(s - mx)), 0.0) + MATH_ULPS["exp"] * u
    n_keys = s.shape[-1]
    rho_t = (p * rho_e).sum(-1, keepdims=True) + gamma(n_keys, u)
    rel = rho_e + rho_t + gamma(n_keys, u) + 3 * u  # per term: e_j, 1/sum, the products
    err = (p * rel) @ np.abs(v)
    return _bhsd(err / np.maximum(1 - rho_t, 0.5), a["layout"])



# ---------------------------------------------------------------------------------------------
# torch: F.scaled_dot_product_attention (aten.scaled_dot_product_attention.default, kept out of
# the decomposition: torch.export's default table turns it into bmm / softmax / bmm)

#: Fewest static queries (and keys) for which the torch mapping uses the fused op. Measured
#: against the matmul / softmax / matmul path it replaces (one Zen 4 core, CPU time, 6-8
#: heads of 64): 0.70x at 197 tokens, 0.92x at 128, 0.96x at 64, 0.89x at 32, 1.03x at 16
#: (a few microseconds either way): below 32 the decomposition stays.
TORCH_MIN_TOKENS = 32


def _static(shape: Any) -> list[int] | None:
    dims = [d.value if isinstance(d, tirx.IntImm) else None for d in shape]
    return None if None in dims else dims


def _torch_mask(mask: relax.Expr, b: int, n: int, m: int) -> relax.Expr | None:
    """torch's ``attn_mask`` as the op's additive ``(B, 1, n, m)`` float32 mask
    (:func:`_additive`), or None when its shape does not broadcast that way (per-head
    masks)."""
    add = _additive(mask, (b, 1, n, m), "float32")
    return None if add is None else relax.op.broadcast_to(add, relax.ShapeExpr([b, 1, n, m]))


def _additive(mask: relax.Expr, scores: tuple, dtype: str) -> relax.Expr | None:
    """torch's ``attn_mask`` as an additive mask of the scores' dtype (a bool mask: 0 where
    True, -inf where False, as torch's math path makes it), or None when it does not
    broadcast to the ``scores`` shape."""
    ty = mask.ty
    shape = _static(ty.shape) if isinstance(ty, relax.TensorType) else None
    if shape is None or len(shape) > 4 or any(
            d not in (1, s) for d, s in zip(shape[::-1], scores[::-1])):
        return None
    if str(ty.dtype) == "bool":
        return relax.op.where(mask, relax.const(0.0, dtype), relax.const(float("-inf"), dtype))
    return mask if str(ty.dtype) == dtype else None


def _decomposed(imp: Any, q: relax.Expr, k: relax.Expr, v: relax.Expr, mask: relax.Expr | None,
                scale: float, causal: bool) -> relax.Expr:
    """``softmax(q k^T * scale + mask) v`` as matmul / softmax / matmul (torch's math path)."""
    bb = imp.block_builder
    hq, hk = int(q.ty.shape[1]), int(k.ty.shape[1])
    if hq != hk:  # grouped heads: repeat each key / value head
        k = bb.emit(relax.op.repeat(k, hq // hk, axis=1))
        v = bb.emit(relax.op.repeat(v, hq // hk, axis=1))
    d = int(q.ty.shape[3])
    dtype = str(q.ty.dtype)
    s = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])))
    s = bb.emit(relax.op.multiply(s, relax.const(scale or 1.0 / math.sqrt(d), dtype)))
    if causal:  # torch's is_causal: query i sees keys j <= i
        n, m = int(q.ty.shape[2]), int(k.ty.shape[2])
        tri = np.where(np.tril(np.ones((n, m), bool)), 0.0, -np.inf).astype(dtype)
        s = bb.emit(relax.op.add(s, relax.const(tri)))
    if mask is not None:
        s = bb.emit(relax.op.add(s, mask))
    p = bb.emit(softmax(s, axis=-1) if dtype in FLOAT_DTYPES else relax.op.nn.softmax(s, -1))
    return bb.emit(relax.op.matmul(p, v))


def _from_torch(node: Any, imp: Any) -> relax.Expr:
    q, k, v = (imp.env[a] for a in node.args[:3])
    mask = arg(node, 3, "attn_mask")
    dropout = arg(node, 4, "dropout_p", 0.0)
    causal = bool(arg(node, 5, "is_causal", False))
    scale = node.kwargs.get("scale")
    scale = 0.0 if scale is None else float(scale)
    shapes = [_static(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
              for x in (q, k, v)]
    if (dropout or any(s is None or len(s) != 4 for s in shapes)
            or len({str(x.ty.dtype) for x in (q, k, v)}) != 1):
        return imp._scaled_dot_product_attention(node)  # TVM's own import
    (b, hq, n, d), (_, hk, m, _), _ = shapes
    if hk != hq and hk != 1 and not node.kwargs.get("enable_gqa", False):
        # (one key / value head broadcasts over the query heads like any batch dim:
        # MobileNetV4's multi-query attention; the op's grouped heads take it)
        return imp._scaled_dot_product_attention(node)
    madd = None if mask is None else _torch_mask(imp.env[mask], b, n, m)
    if mask is not None and madd is None:
        # a mask per head (TinyViT's and Swin's relative position bias, (H, n, m)): the
        # op takes one mask for all heads, the decomposition adds it to the scores
        per_head = _additive(imp.env[mask], (b, hq, n, m), str(q.ty.dtype))
        if per_head is None:
            return imp._scaled_dot_product_attention(node)
        return _decomposed(imp, q, k, v, imp.block_builder.emit(per_head), scale, causal)
    madd = None if madd is None else imp.block_builder.emit(madd)
    fits = (str(q.ty.dtype) == "float32" and hq % hk == 0 and d % 4 == 0
            and (not causal or n == m) and min(n, m) >= TORCH_MIN_TOKENS)
    if not fits:
        return _decomposed(imp, q, k, v, madd, scale, causal)
    return imp.block_builder.emit(attention(q, k, v, madd, scale=scale, causal=causal,
                                            layout="BHSD"))


attention.torch("scaled_dot_product_attention.default", convert=_from_torch)
