"""``take_w8``: rows of a per-channel int8 matrix, dequantized: an embedding lookup in a
table held as :func:`~opsdk.ops.dense_w8.dense_w8` holds its weights.

``y[i, k] = w_scale[r] * float32(w[r, k])`` with ``r = clip(indices[i], 0, N - 1)``: one
float32 multiply per element (the reference repeats it in float32, so verify compares bit
for bit). Indices outside ``[0, N)`` are clipped (TVM ``take``'s ``mode="clip"``), so no
index reads outside the table. The table's width K must be static (a weight's: checked
when the call is typed); N and the number of indices may be symbolic.

Why an op: a model whose embedding table is also a ``dense_w8`` weight (GPT-2's tied LM
head, int8) would otherwise keep the table twice, the layer's packed copy and the plain
bytes the gather reads (38.6 MB for GPT-2-small). The integer rules of ``dense_w8``
(``activations="q8_0"``, :mod:`opsdk.schedules._qwgemm`) and its float32-activation rules'
one-row GEMV packing (``activations="float32"``, :mod:`opsdk.schedules._wgemm`) rebuild this
op to gather from the very same packed bytes, so the compile-time folding keeps one copy.
Elsewhere the rules gather from ``w`` as it is. The sibling of :mod:`~opsdk.ops.take_q4`
(one op cannot be both: the table's dtype and the scales' shape differ by format).

Examples
--------
>>> import numpy as np
>>> from opsdk.ops.dense_w8 import quantize_w8
>>> from opsdk.ops.take_w8 import take_w8
>>> w = np.array([[1.0, -0.5], [0.25, 2.0], [0.0, 0.0]], "float32")
>>> q, s = quantize_w8(w)
>>> rows = take_w8.run_reference({"w": q, "w_scale": s, "indices": np.array([1, 7, -2])}, {})
>>> rows.shape, bool(np.abs(rows[0] - w[1]).max() < 0.01), rows[1].tolist()  # 7: the last row
((3, 2), True, [0.0, 0.0])
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._domains import log_uniform
from .._errmodel import error_model
from .._opdef import Tensor
from ._quant import exact_model
from .dense_w8 import WeightActivations

__all__ = ["ATTRS_KEY", "take_w8"]

#: Annotation on the output block that marks it (the rules find the op by it).
ATTRS_KEY = "opsdk.take_w8"


def _check(shapes, dtypes, attrs):
    k = shapes["w"][1]
    if isinstance(k, tirx.IntImm):
        k = int(k.value)
    if not isinstance(k, int):  # a table is a weight: its width is known when compiling
        raise ValueError(
            "op 'take_w8': argument 'w' has a symbolic row length (its last axis); the "
            "table's width must be static (the kernels copy whole rows in full vectors)")


def _reference(w, w_scale, indices, *, activations="float32"):  # the values do not depend on it
    rows = np.clip(np.asarray(indices).astype(np.int64), 0, w.shape[0] - 1)
    # one IEEE float32 multiply, as the kernel does: bit for bit
    got = np.asarray(w)[rows].astype(np.float32) * np.asarray(w_scale, np.float32)[rows, None]
    return got.astype(np.float64)


error_model(_reference)(exact_model)


@op(
    reference=_reference,
    dtypes={"w": ("int8",), "w_scale": ("float32",), "indices": ("int32", "int64")},
    ranks=(2, 2),
    free_dims={"T": (1, 64)},
    input_shapes=lambda s, a: {"w_scale": (s[0],), "indices": ("T",)},
    check=_check,
    # Weights over the whole symmetric int8 range, scales as quantize_w8 makes them;
    # indices past both ends of the table (clipped).
    domain={"w": (-127, 127), "w_scale": log_uniform(1e-5, 1e-2), "indices": (-3, 70)},
    # Not elementwise: the kernel stays whole (a fused neighbour would hide it from the
    # rules that gather from the packed table); "dense": the table is a dense layer's weight.
    kind="dense",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "w_scale"),
    output_dtype="float32",
    # which dense kernels' packing a rule gathers from (the table a layer of those shares)
    layouts={"float32": {"activations": "float32"}, "q8_0": {"activations": "q8_0"}},
    examples=[(40, 32)],
)
def take_w8(w: Tensor, w_scale: Tensor, indices: Tensor, *,
            activations: WeightActivations = "float32") -> te.Tensor:
    """Rows ``indices`` (``(T,)`` int32 / int64, clipped to ``[0, N)``) of the int8 matrix
    ``w`` ``(N, K)`` with per-row scales ``w_scale`` ``(N,)`` float32, dequantized:
    ``(T, K)`` float32 (see the module). ``activations``: those of the ``dense_w8`` layers
    whose weight the table also is (which kernels' packing a rule gathers from)."""
    n, k = w.shape
    idx = str(n.ty.dtype)

    def body(i, c):
        r = tirx.max(tirx.min(indices[i].astype(idx), n - 1), tirx.const(0, idx))
        return w_scale[r] * w[r, c].astype("float32")

    return te.compute((indices.shape[0], k), body, name="take_w8",
                      attrs={ATTRS_KEY: {"format": "w8", "activations": activations}})
