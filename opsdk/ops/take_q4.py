"""``take_q4``: rows of a ggml ``q4_0`` matrix, dequantized: an embedding lookup in a
table held as :func:`~opsdk.ops.dense_q4.dense_q4` holds its weights.

``y[i, k] = float32(d[r, k // 32]) * (q[r, k] - 8)`` with ``r = clip(indices[i], 0, N - 1)``
and ``q[r, k]`` the nibble of weight ``k`` of row ``r`` (``qs[r, 16 g + j]`` holds weights
``32 g + j`` (low nibble) and ``32 g + j + 16`` (high), as in ``dense_q4``). Indices outside
``[0, N)`` are clipped (TVM ``take``'s ``mode="clip"``), so no index reads outside the table.

The table's width K must be static and whole groups (a weight's; checked when the call is
typed); N and the number of indices may be symbolic.

Each output is one product of a float16 / float32 scale and a small integer, exact in
float32: the reference repeats it and verify compares bit for bit.

Why an op: a model whose embedding table is also a ``dense_q4`` weight (GPT-2's tied LM
head) would otherwise keep the table twice, the layer's packed copy and the plain bytes the
gather reads. The rules rebuild this op to gather from the very same packed tensors the
layer's kernel reads, so the compile-time folding keeps one copy: the attribute
``activations`` names that layer's numerics, hence its kernel family. ``"q8_0"``: the
integer rules' packing (:mod:`opsdk.schedules._qwgemm`); ``"float32"``: the one-row GEMV
packing of the float32-activation rules (:mod:`opsdk.schedules._wgemm`; an LLM's head
runs on the last token's row). Elsewhere (a symbolic table, no such rule) the rules gather
from ``qs`` / ``d`` as they are.

Examples
--------
>>> import numpy as np
>>> from opsdk.ops.dense_q4 import quantize_q4_0
>>> from opsdk.ops.take_q4 import take_q4
>>> w = np.tile(np.arange(-8, 8, dtype="float32"), (3, 2)) * [[0.5], [1], [2]]
>>> qs, d = quantize_q4_0(w)  # these weights are exact in q4_0
>>> rows = take_q4.run_reference({"qs": qs, "d": d, "indices": np.array([2, 9, -1])}, {})
>>> bool(np.array_equal(rows, w[[2, 2, 0]]))  # 9 and -1 clipped to the table
True
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .._declare import op
from .._domains import log_uniform
from .._errmodel import error_model
from .._opdef import Tensor
from ._quant import exact_model
from .dense_q4 import GROUP, dequantize_q4_0
from .dense_w8 import WeightActivations

__all__ = ["ATTRS_KEY", "take_q4"]

#: Annotation on the output block that marks it (the rules find the op by it).
ATTRS_KEY = "opsdk.take_q4"
#: Bytes of ``qs`` per q4_0 group.
_GROUP_BYTES = GROUP // 2


def _half_k(shape) -> int:
    """``qs``'s K / 2, after checking it is static and whole groups."""
    h = shape[1]
    if isinstance(h, tirx.IntImm):
        h = int(h.value)
    if not isinstance(h, int):  # a table is a weight: its width is known when compiling
        raise ValueError(
            "op 'take_q4': argument 'qs' has a symbolic row length (its last axis); the "
            "table's width must be static (the kernels rely on whole groups, which only a "
            "static width can be checked to be)")
    if h % _GROUP_BYTES:
        raise ValueError(
            f"op 'take_q4': argument 'qs' has {h} bytes per row (its last axis), not a "
            f"multiple of {_GROUP_BYTES}: q4_0 rows are whole groups of {GROUP} weights "
            f"({_GROUP_BYTES} bytes); pass the qs of quantize_q4_0 (K a multiple of {GROUP})")
    return h


def _input_shapes(s, a):
    return {"d": (s[0], _half_k(s) // _GROUP_BYTES), "indices": ("T",)}


def _check(shapes, dtypes, attrs):
    _half_k(shapes["qs"])


def _reference(qs, d, indices, *, activations="float32"):  # the values do not depend on it
    rows = np.clip(np.asarray(indices).astype(np.int64), 0, qs.shape[0] - 1)
    return dequantize_q4_0(np.asarray(qs)[rows], np.asarray(d)[rows]).astype(np.float64)


error_model(_reference)(exact_model)


@op(
    reference=_reference,
    dtypes={"qs": ("uint8",), "d": ("float16", "float32"), "indices": ("int32", "int64")},
    ranks=(2, 2),
    free_dims={"T": (1, 64)},
    input_shapes=_input_shapes,
    check=_check,
    dim_multiples={1: _GROUP_BYTES},
    # Nibbles over the whole byte range, scales as quantize_q4_0 makes them; indices past
    # both ends of the table (clipped).
    domain={"qs": (0, 255), "d": log_uniform(1e-4, 1e-1), "indices": (-3, 70)},
    # Not elementwise: the kernel stays whole (a fused neighbour would hide it from the
    # rules that gather from the packed table); "dense": the table is a dense layer's weight.
    kind="dense",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("qs", "d"),
    output_dtype="float32",
    # which dense kernels' packing a rule gathers from (the table a layer of those shares)
    layouts={"float32": {"activations": "float32"}, "q8_0": {"activations": "q8_0"}},
    examples=[(40, 32)],
)
def take_q4(qs: Tensor, d: Tensor, indices: Tensor, *,
            activations: WeightActivations = "float32") -> te.Tensor:
    """Rows ``indices`` (``(T,)`` int32 / int64, clipped to ``[0, N)``) of the q4_0 matrix
    ``qs`` ``(N, K / 2)`` uint8 / ``d`` ``(N, K / 32)``, dequantized: ``(T, K)`` float32
    (see the module). ``activations``: those of the ``dense_q4`` layers whose weight the
    table also is, so a rule gathers from the packing their kernels read (the values are
    the same either way)."""
    n, half = qs.shape
    idx = str(n.ty.dtype)

    def body(i, c):
        r = tirx.max(tirx.min(indices[i].astype(idx), n - 1), tirx.const(0, idx))
        g, e = c // GROUP, c % GROUP
        byte = qs[r, g * _GROUP_BYTES + e % _GROUP_BYTES].astype("int32")
        nib = tirx.bitwise_and(tirx.shift_right(byte, ((e // _GROUP_BYTES) * 4).astype("int32")),
                               15)
        return d[r, g].astype("float32") * (nib - 8).astype("float32")

    return te.compute((indices.shape[0], half * 2), body, name="take_q4",
                      attrs={ATTRS_KEY: {"format": "q4_0", "activations": activations}})
