"""``qdense``: int8 x int8 -> int32 dense layer with fused bias and requantize / dequantize.

``acc[m, n] = sum_k (x[m, k] - x_zero_point) * w[n, k] + bias[n]`` in int32 (asymmetric
activations, symmetric weights). Then, by ``out_dtype``:

- ``int32``: ``acc``;
- ``float32``: ``float32(acc) * s[n]`` with ``s[n] = float32(x_scale * w_scale[n])``;
- ``int8``: ``sat(nearbyint(float32(acc) * r[n]) + out_zero_point)`` with
  ``r[n] = float32(s[n] / out_scale)`` (ties to even).

Every float step is one float32 rounding that the reference repeats, so all outputs are
compared bit-exactly. ``w_scale`` has shape ``(N,)`` (per channel) or ``(1,)`` (per tensor).

The compute below is the definition (and the generic lowering). :func:`qdense_packed` computes
the same values in the shape int8 dot-product instructions want (activations re-biased to the
instruction's signedness, weights packed in 16-channel x 4-byte groups, zero point folded into
a per-channel compensation); schedule rules rebuild it from the attributes that the definition
records on its output block under :data:`ATTRS_KEY`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._domains import log_uniform
from .._errmodel import error_model
from .._opdef import Tensor
from ._quant import QRANGE, QUANT_ATTR_DOMAIN, exact_model, rint_f32, round_to_te

__all__ = [
    "ATTRS_KEY",
    "BLOCK",
    "KGROUP",
    "packed_channel_terms",
    "packed_epilogue",
    "qdense",
    "qdense_packed",
]

#: Annotation on the output block holding the op's attributes (``x_scale``, ``x_zero_point``,
#: ``out_dtype``, ``out_scale``, ``out_zero_point``, ``per_channel``, ``has_bias``): a schedule
#: rule receives only the PrimFunc, and these are what it needs to rebuild the computation.
ATTRS_KEY = "opsdk.qdense"
#: Channels per packed weight block, and bytes of K per dot-product group (vpdpbusd / sdot).
BLOCK, KGROUP = 16, 4


def _reference(
    x, w, w_scale, bias=None, *, x_scale=1.0, x_zero_point=0, out_dtype="int8",
    out_scale=1.0, out_zero_point=0, per_channel=True,
):
    acc = (x.astype(np.int64) - x_zero_point) @ w.astype(np.int64).T
    if bias is not None:
        acc = acc + bias.astype(np.int64)
    acc = acc.astype(np.int32)  # the kernel accumulates in int32 (no overflow for K < 2**16)
    if out_dtype == "int32":
        return acc
    s = np.float32(x_scale) * w_scale.astype(np.float32)
    if out_dtype == "float32":
        return acc.astype(np.float32) * s
    r = s / np.float32(out_scale)
    q = rint_f32(acc.astype(np.float32) * r).astype(np.int64) + out_zero_point
    lo, hi = QRANGE[out_dtype]
    return np.clip(q, lo, hi).astype(out_dtype)


def _check(shapes, dtypes, attrs):
    if not attrs["x_scale"] > 0 or not attrs["out_scale"] > 0:
        raise ValueError("arguments 'x_scale' and 'out_scale' must be > 0")
    lo, hi = QRANGE[dtypes["x"]]
    if not lo <= attrs["x_zero_point"] <= hi:
        raise ValueError(
            f"argument 'x_zero_point' is {attrs['x_zero_point']}; it must lie in the range of "
            f"{dtypes['x']} [{lo}, {hi}]"
        )


@op(
    reference=_reference,
    dtypes={"x": ("int8", "uint8"), "w": ("int8",), "w_scale": ("float32",), "bias": ("int32",)},
    ranks=(2, 2),
    free_dims={"N": (1, 64)},
    input_shapes=lambda s, a: {
        "w": ("N", s[1]),
        "w_scale": ("N",) if a["per_channel"] else (1,),
        "bias": ("N",),
    },
    check=_check,
    layouts={
        "int8_per_channel": {"out_dtype": "int8", "per_channel": True},
        "int8_per_tensor": {"out_dtype": "int8", "per_channel": False},
        "float32": {"out_dtype": "float32"},
        "int32": {"out_dtype": "int32"},
    },
    # x over the whole int8 / uint8 range (an integer input's domain is cut to its dtype).
    # Scales over decades: x_scale and out_scale 1e-4..1e2 (their ratio centred on 1),
    # w_scale 1e-5..1 (weights' max|w| / 127), so the requantize factor r = x_scale * w_scale
    # / out_scale is ~1e-3 typically (outputs in range) and from ~1e-11 (all zero point) to
    # ~1e8 (all saturated; the "mixed" recipe takes w_scale to 1e2). Bit-exact comparison
    # holds over all of it: |acc| <= K * 255 * 127 + 5000 < 2**31 for K up to 5000 (the
    # longest drawn), s = x_scale * w_scale and r are normal float32 (1e-11..1e8), and
    # |acc * r| <= 2e16 neither overflows float32 nor loses the int64 conversion of the
    # reference, so every step is one IEEE rounding of a normal float, as in the kernel.
    domain={
        "x": (-128, 255),
        "w": (-127, 127),
        "w_scale": log_uniform(1e-5, 1.0),
        "bias": (-5000, 5000),
    },
    attr_domain=QUANT_ATTR_DOMAIN,
    kind="dense",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "w_scale", "bias"),
    output_dtype="out_dtype",
    examples=[(4, 20)],
)
def qdense(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    x_scale: float = 1.0,
    x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8",
    out_scale: float = 1.0,
    out_zero_point: int = 0,
    per_channel: bool = True,
) -> te.Tensor:
    """Quantized dense ``x @ w.T`` (x: ``(M, K)`` int8/uint8, w: ``(N, K)`` int8) with int32
    accumulation, optional int32 bias and a fused requantize (int8) or dequantize (float32)."""
    m, k = x.shape
    n = w.shape[0]
    rk = te.reduce_axis((0, k), name="k")
    acc = te.compute(
        (m, n),
        lambda i, j: te.sum(
            (x(i, rk).astype("int32") - x_zero_point) * w(j, rk).astype("int32"), axis=rk
        ),
        name="acc",
    )

    def scale(j):
        return tirx.const(x_scale, "float32") * w_scale(j if per_channel else 0)

    def body(i, j):
        v = acc(i, j) if bias is None else acc(i, j) + bias(j)
        if out_dtype == "int32":
            return v
        f = v.astype("float32")
        if out_dtype == "float32":
            return f * scale(j)
        return round_to_te(f * (scale(j) / tirx.const(out_scale, "float32")), out_zero_point,
                           out_dtype)

    attrs = {
        "x_scale": x_scale,
        "x_zero_point": x_zero_point,
        "out_dtype": out_dtype,
        "out_scale": out_scale,
        "out_zero_point": out_zero_point,
        "per_channel": per_channel,
        "has_bias": bias is not None,
    }
    return te.compute((m, n), body, name="qdense", attrs={ATTRS_KEY: attrs})


def _cdiv(a, b):
    return (a + b - 1) // b


def packed_channel_terms(
    wp: te.Tensor, w_scale: te.Tensor, bias: te.Tensor | None, *, n: int, padded: int,
    zp_eff: int, x_scale: float, out_dtype: str, out_scale: float, per_channel: bool,
) -> tuple[te.Tensor, te.Tensor | None]:
    """The per-channel stages of a packed int8 kernel (qdense, qconv2d): ``comp`` (bias minus
    the zero point times the weight sums) and ``oscale`` (None for an int32 output), both
    padded with zeros to ``padded`` channels so the tile epilogue runs unpredicated.

    The weight sums read the packed weights ``wp`` (``(N/16, groups, 16*4)``, zero padded: the
    same sums), so that a rule may pack a constant weight at compile time (nothing else then
    reads the weight): first per byte lane of each 16-channel block (contiguous vectors,
    ``wsum_lanes``), then the 4 lanes of a channel (``wsum``).
    """
    idx = str(wp.shape[0].ty.dtype)

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    rg = te.reduce_axis((dim(0), dim(int(wp.shape[1]))), name="rg")
    lanes = te.compute(
        (dim(int(wp.shape[0])), dim(BLOCK * KGROUP)),
        lambda bb, e: te.sum(wp[bb, rg, e].astype("int32"), axis=rg),
        name="wsum_lanes",
    )

    def lane(j, r):
        return lanes[j // BLOCK, (j % BLOCK) * KGROUP + r]

    wsum = te.compute((dim(n),), lambda j: lane(j, 0) + lane(j, 1) + lane(j, 2) + lane(j, 3),
                      name="wsum")
    comp = te.compute(
        (dim(padded),),
        lambda j: tirx.if_then_else(
            j < n,
            (0 if bias is None else bias[j]) - wsum[j] * tirx.const(zp_eff, "int32"),
            tirx.const(0, "int32"),
        ),
        name="comp",
    )
    if out_dtype == "int32":
        return comp, None

    def scale(j):
        s = tirx.const(x_scale, "float32") * w_scale[j if per_channel else 0]
        return s / tirx.const(out_scale, "float32") if out_dtype == "int8" else s

    osc = te.compute(
        (dim(padded),),
        lambda j: tirx.if_then_else(j < n, scale(j), tirx.const(0.0, "float32")),
        name="oscale",
    )
    return comp, osc


def packed_epilogue(raw: tirx.PrimExpr, j: tirx.PrimExpr, comp: te.Tensor,
                    osc: te.Tensor | None, out_dtype: str, out_zero_point: int) -> tirx.PrimExpr:
    """The output of channel ``j`` from a raw int32 dot product: compensation, then the
    float32 rescale and (int8) rounding of :func:`qdense`'s definition."""
    v = raw + comp[j]
    if out_dtype == "int32":
        return v
    f = v.astype("float32") * osc[j]
    if out_dtype == "float32":
        return f
    return round_to_te(f, out_zero_point, out_dtype)


def qdense_packed(
    x: te.Tensor,
    w: te.Tensor,
    w_scale: te.Tensor,
    bias: te.Tensor | None = None,
    *,
    act_dtype: Literal["uint8", "int8"],
    rows: int,
    cols: int,
    x_scale: float = 1.0,
    x_zero_point: int = 0,
    out_dtype: Literal["int8", "int32", "float32"] = "int8",
    out_scale: float = 1.0,
    out_zero_point: int = 0,
    per_channel: bool = True,
) -> te.Tensor:
    """:func:`qdense` computed as a padded, packed int8 GEMM: bit-identical results.

    Stages (block names): ``xa`` activations moved into ``act_dtype`` (``uint8`` for x86
    ``vpdpbusd``: ``x + 128`` for int8 inputs; ``int8`` for ARM ``sdot``: ``x - 128`` for uint8
    inputs), zero-padded to ``rows``-row tiles and K to a multiple of 4; ``wp`` weights packed
    as ``(N/16, K/4, 16*4)`` with zero padding; ``wsum_lanes``/``wsum``/``comp`` the per-channel
    compensation ``bias[n] - (x_zero_point + offset) * sum_k w[n, k]``, which turns the raw
    product into
    ``sum_k (x - x_zero_point) * w + bias`` (exact: integer identities, int32 wraps alike);
    ``oscale`` the per-channel float32 factor (the same float32 operations as :func:`qdense`);
    ``acc`` the raw int32 dot products (rows padded to whole tiles); ``qtile`` the epilogue on
    whole tiles; ``qdense`` the copy of its ``(M, N)`` part to the output.

    Parameters
    ----------
    x, w, w_scale, bias
        As for :func:`qdense`; K and N must be static.
    act_dtype
        Signedness the dot-product instruction wants for the activations.
    rows, cols
        Output tile the schedule will use: M is padded to whole ``rows``-row tiles and N to a
        multiple of ``cols`` (a multiple of 16) in ``xa``, ``wp`` and ``acc``.
    x_scale, x_zero_point, out_dtype, out_scale, out_zero_point, per_channel
        As for :func:`qdense`.

    Returns
    -------
    te.Tensor
        The ``(M, N)`` output, equal to :func:`qdense`'s.

    Examples
    --------
    >>> import numpy as np, tvm
    >>> from tvm import te
    >>> from opsdk.ops.qdense import qdense, qdense_packed
    >>> x = te.placeholder((3, 10), "int8", name="x")
    >>> w = te.placeholder((5, 10), "int8", name="w")
    >>> s = te.placeholder((5,), "float32", name="w_scale")
    >>> attrs = {"x_zero_point": -7, "out_dtype": "int32"}
    >>> y = qdense_packed(x, w, s, act_dtype="uint8", rows=2, cols=16, **attrs)
    >>> f = tvm.compile(te.create_prim_func([x, w, s, y]), target={"kind": "llvm"})
    >>> rng = np.random.default_rng(0)
    >>> ins = {"x": rng.integers(-128, 128, (3, 10)).astype("int8"),
    ...        "w": rng.integers(-128, 128, (5, 10)).astype("int8"),
    ...        "w_scale": np.ones(5, "float32")}
    >>> out = tvm.runtime.empty((3, 5), "int32")
    >>> f["main"](*[tvm.runtime.tensor(a) for a in ins.values()], out)
    >>> bool(np.array_equal(out.numpy(), qdense.run_reference(ins, attrs)))
    True
    """
    if cols % BLOCK or rows < 1:
        raise ValueError(f"qdense_packed: cols must be a multiple of {BLOCK}, rows >= 1")
    m, k_dim = x.shape
    n_dim = w.shape[0]
    if not isinstance(k_dim, tirx.IntImm) or not isinstance(n_dim, tirx.IntImm):
        raise ValueError("qdense_packed: K and N must be static")
    k, n = int(k_dim), int(n_dim)
    idx = str(m.ty.dtype)  # extents in the batch's index type: mixed widths fuse with casts

    def dim(v: int) -> tirx.IntImm:
        return tirx.IntImm(idx, v)

    kp = _cdiv(k, KGROUP) * KGROUP
    np_ = _cdiv(n, cols) * cols
    mp = tirx.floordiv(m + (rows - 1), rows) * rows
    lo = QRANGE[str(x.dtype)][0]
    # Shift into the instruction's range: int8 -> uint8 adds 128, uint8 -> int8 subtracts 128.
    off = 0 if QRANGE[act_dtype][0] == lo else (128 if act_dtype == "uint8" else -128)
    zp_eff = x_zero_point + off

    def xa_f(i, j):
        v = (x[i, j].astype("int32") + off).astype(act_dtype)
        return tirx.if_then_else(tirx.all(i < m, j < k), v, tirx.const(0, act_dtype))

    xa = te.compute((mp, dim(kp)), xa_f, name="xa")

    def wp_f(b, g, e):
        nn, kk = b * BLOCK + e // KGROUP, g * KGROUP + e % KGROUP
        return tirx.if_then_else(tirx.all(nn < n, kk < k), w[nn, kk], tirx.const(0, "int8"))

    wp = te.compute((dim(np_ // BLOCK), dim(kp // KGROUP), dim(BLOCK * KGROUP)), wp_f, name="wp")
    comp, osc = packed_channel_terms(
        wp, w_scale, bias, n=n, padded=np_, zp_eff=zp_eff, x_scale=x_scale,
        out_dtype=out_dtype, out_scale=out_scale, per_channel=per_channel)
    rr = te.reduce_axis((dim(0), dim(kp)), name="k")
    acc = te.compute(
        (mp, dim(np_)),
        lambda i, j: te.sum(
            xa[i, rr].astype("int32")
            * wp[j // BLOCK, rr // KGROUP, (j % BLOCK) * KGROUP + rr % KGROUP].astype("int32"),
            axis=rr,
        ),
        name="acc",
    )

    def body(i, j):
        return packed_epilogue(acc[i, j], j, comp, osc, out_dtype, out_zero_point)

    # The epilogue covers whole (padded) tiles, so it vectorizes without bounds predicates
    # (a predicate on the channel lanes would scalarize it); only the copy out is cut to (M, N).
    tile = te.compute((mp, dim(np_)), body, name="qtile")
    return te.compute((m, dim(n)), lambda i, j: tile[i, j], name="qdense")


# Keyed by the reference: variants (same math) share it.
error_model(_reference)(exact_model)
