"""``attention``: scaled dot-product attention in one kernel, Q K^T * scale (+ causal mask) ->
softmax -> V, for encoders (every key visible) and decoders (causal, over a KV cache).

Layouts: ``"BSHD"`` (batch, sequence, heads, head dim: how a KV cache stores rows, and how
a decoder's projections reshape) or ``"BHSD"`` (torch's ``scaled_dot_product_attention``).
Queries ``(B, n, H, D)`` attend over ``m`` keys and values ``(B, m, Hkv, D)``; with
``Hkv < H`` (grouped-query attention) query head ``h`` reads key head ``h // (H / Hkv)``.
``causal``: query ``i`` sits at position ``m - n + i`` (the ``n`` new tokens are the last of
the ``m``) and sees keys ``j <= m - n + i``; a query that sees no key gives zeros.
``scale`` 0 means ``1 / sqrt(D)``.

The compute is float32 throughout: the scores and the exponentials live in a row buffer of
the ``m`` keys (no ``n x m`` matrix in memory), the division by the exponentials' sum is
one reciprocal per row.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._errmodel import MATH_ULPS, ModelInput, error_model, gamma
from .._opdef import Tensor
from ..te_utils import exp_f32

__all__ = ["attention"]


def _bhsd(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout == "BHSD" else a.transpose(0, 2, 1, 3)


def _parts(q, k, v, scale, causal, layout):
    """float64 (B, H, n, m) scores, visibility mask, and (B, H, m, D) values."""
    q, k, v = (_bhsd(a.astype(np.float64), layout) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    s = (q @ k.transpose(0, 1, 3, 2)) * (scale or 1.0 / math.sqrt(d))
    seen = np.ones((n, m), bool)
    if causal:
        seen = np.arange(m)[None, :] <= (m - n + np.arange(n))[:, None]
    return q, k, v, s, np.broadcast_to(seen, s.shape)


def _reference(q, k, v, *, scale=0.0, causal=False, layout="BSHD"):
    _, _, v, s, seen = _parts(q, k, v, scale, causal, layout)
    s = np.where(seen, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(seen, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    return _bhsd(p @ v, layout)


def _check(shapes, dtypes, attrs):
    q, k, v = shapes["q"], shapes["k"], shapes["v"]
    lay = attrs["layout"]
    if lay not in ("BSHD", "BHSD"):
        raise ValueError(f"argument 'layout' is {lay!r}; use 'BSHD' or 'BHSD'")
    if k != v:
        raise ValueError(f"k {tuple(k)} and v {tuple(v)} must have the same shape")
    h_axis = 2 if lay == "BSHD" else 1
    if q[0] != k[0] or q[3] != k[3]:
        raise ValueError(f"q {tuple(q)} and k {tuple(k)} must agree in batch and head dim "
                         f"({lay})")
    hq, hk = q[h_axis], k[h_axis]
    if isinstance(hq, int) and isinstance(hk, int) and (hk == 0 or hq % hk):
        raise ValueError(f"q has {hq} heads and k {hk}: the query heads must be a multiple "
                         "of the key/value heads")
    if attrs["scale"] < 0:
        raise ValueError(f"argument 'scale' is {attrs['scale']}; give a positive factor, or 0 "
                         "for 1/sqrt(head dim)")


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(4, 4),
    input_shapes=lambda s, a: (
        {"k": (s[0], "M", s[2], s[3]), "v": (s[0], "M", s[2], s[3])} if a["layout"] == "BSHD"
        else {"k": (s[0], s[1], "M", s[3]), "v": (s[0], s[1], "M", s[3])}),
    free_dims={"M": (1, 80)},
    check=_check,
    layouts={"causal": {"causal": True}, "full": {"causal": False},
             "BHSD": {"layout": "BHSD", "causal": False}},
    domain={"q": (-2.0, 2.0), "k": (-2.0, 2.0), "v": (-2.0, 2.0)},
    attr_domain={"scale": [0.0, 0.125, 0.5]},
    kind="reduction",
    examples=[(1, 3, 2, 8)],
)
def attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float = 0.0, causal: bool = False,
    layout: Literal["BSHD", "BHSD"] = "BSHD",
) -> te.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head, float32 (module docstring)."""
    bshd = layout == "BSHD"
    n, h_q = (q.shape[1], q.shape[2]) if bshd else (q.shape[2], q.shape[1])
    m, h_k = (k.shape[1], k.shape[2]) if bshd else (k.shape[2], k.shape[1])
    d = q.shape[3]
    group = h_q // h_k  # query heads per key head (1 without grouping)
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

    rd = te.reduce_axis((0, d), name="rd")
    sc = te.compute(
        (q.shape[0], h_q, n, m),
        lambda b, h, i, j: te.sum(at(q, b, i, h, rd) * at(k, b, j, h // group, rd), axis=rd),
        name="scores")
    rm = te.reduce_axis((0, m), name="rm")
    lowest = tirx.min_value("float32")
    mx = te.compute(
        (q.shape[0], h_q, n),
        lambda b, h, i: te.max(tirx.Select(seen(i, rm), sc[b, h, i, rm] * f, lowest), axis=rm),
        name="rowmax")
    ex = te.compute(
        sc.shape,
        lambda b, h, i, j: tirx.Select(
            seen(i, j), exp_f32(sc[b, h, i, j] * f - mx[b, h, i], nonpositive=True),
            tirx.const(0.0, "float32")),
        name="exp")
    rs = te.reduce_axis((0, m), name="rs")
    tot = te.compute(mx.shape, lambda b, h, i: te.sum(ex[b, h, i, rs], axis=rs), name="expsum")
    rv = te.reduce_axis((0, m), name="rv")

    def row_head(a1, a2):  # (query row, head) of an output index
        return (a1, a2) if bshd else (a2, a1)

    def pv_f(b, a1, a2, e):
        i, h = row_head(a1, a2)
        return te.sum(ex[b, h, i, rv] * at(v, b, rv, h // group, e), axis=rv)

    pv = te.compute(q.shape, pv_f, name="pv")

    def norm(b, a1, a2, e):
        i, h = row_head(a1, a2)
        t = tot[b, h, i]
        return tirx.Select(t > tirx.const(0.0, "float32"),
                           pv[b, a1, a2, e] * (tirx.const(1.0, "float32") / t),
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
    q, k, v, s, seen = _parts(m.inputs["q"], m.inputs["k"], m.inputs["v"], a["scale"],
                              a["causal"], a["layout"])
    d = q.shape[3]
    f = a["scale"] or 1.0 / math.sqrt(d)
    # |delta s_j|: the dot product's rounding, then the scale (itself rounded to float32)
    ds = gamma(d, u) * f * (np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2)) + 2 * u * np.abs(s)
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

