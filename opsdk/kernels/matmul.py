"""``tvm_matmul``: the kernel TVM lowers ``matmul`` / ``linear`` / ``batch_matmul`` to.

``y[..., i, j] = act(sum_k x[..., i, k] * w[k, j] + bias[j] + residual[..., i, j])`` with the
same TE as relax's matmul legalization, the epilogue as FuseOps appends it. Layouts:

- ``kn``: a weight ``(K, N)`` (a Linear's weight after FoldConstant folded its transpose);
- ``nk``: a weight ``(N, K)`` read through a transpose block (the rule inlines producers);
- ``batched``: ``w`` is ``(..., K, N)`` with x's batch dims (attention's QK^T and PV; at
  rank 2 it is ``kn``);
- ``batched_nk``: ``w`` is ``(..., N, K)``, read along its last axis in the reduction
  (attention's ``Q @ K^T`` with the transpose folded into the matmul).

Scheduled by the ``kind:matmul`` rules (``x86.matmul``, ``neon.matmul``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from tvm import te

from .._declare import op
from .._errmodel import error_model
from .._opdef import Tensor
from ._epilogue import (
    ACTIVATIONS,
    Activation,
    epilogue_abs,
    epilogue_error,
    epilogue_np,
    epilogue_te,
    gamma,
)

__all__ = ["tvm_matmul"]


def _weight(w: np.ndarray, layout: str) -> np.ndarray:
    return np.swapaxes(w, -1, -2) if layout in ("nk", "batched_nk") else w


def _reference(x, w, bias=None, residual=None, *, layout="kn", n=16, activation="none"):
    y = np.matmul(x, _weight(w, layout))
    return epilogue_np(y, bias, residual, activation, (n,))


def _input_shapes(s, a):
    k, n = s[-1], a["n"]
    w = {"kn": (k, n), "nk": (n, k), "batched": (*s[:-2], k, n),
         "batched_nk": (*s[:-2], n, k)}[a["layout"]]
    return {"w": w, "bias": (n,), "residual": (*s[:-1], n)}


def _check(shapes, dtypes, attrs):
    if attrs["n"] < 1:
        raise ValueError(f"argument 'n' is {attrs['n']}; pass n >= 1 (output features)")


def _error(m) -> np.ndarray:
    """One float32 dot product of length K (recursive summation, any order: gamma_K of the
    sum of |x_k w_k|), then the bias and residual adds (one rounding each)."""
    a = m.attrs
    x, w = m.inputs["x"], m.inputs["w"]
    s = np.matmul(np.abs(x), np.abs(_weight(w, a["layout"])))
    return epilogue_error(m, gamma(x.shape[-1] + 2, m.u) * (s + epilogue_abs(m, (-1,))))


@op(
    reference=_reference,
    dtypes=("float32",),
    ranks=(2, 4),
    input_shapes=_input_shapes,
    check=_check,
    layouts={"kn": {"layout": "kn"}, "nk": {"layout": "nk"}, "batched": {"layout": "batched"},
             "batched_nk": {"layout": "batched_nk"}},
    domain={"x": (-2.0, 2.0), "w": (-1.0, 1.0), "bias": (-1.0, 1.0), "residual": (-2.0, 2.0)},
    # Output features around the vector widths (16 lanes on AVX-512, 4 on NEON): tails,
    # fewer than one vector, several tiles; 67 no vector width divides (its tiles are padded).
    attr_domain={"n": [33, 16, 1, 10, 24, 64, 80, 7, 67], "activation": list(ACTIVATIONS)},
    kind="matmul",
    # constants in a model: the rules pack them at compile time (verify's packed cases)
    weights=("w", "bias"),
    examples=[(4, 3, 8)],
)
def tvm_matmul(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    *,
    layout: Literal["kn", "nk", "batched", "batched_nk"] = "kn",
    n: int = 16,
    activation: Activation = "relu",
) -> te.Tensor:
    """``act(x @ w + bias + residual)``: relax's matmul compute plus a fused epilogue."""
    k_ext = x.shape[-1]
    # "nk": the weight transpose as its own block (a fused permute_dims)
    wk = (te.compute((k_ext, n), lambda kk, j: w[j, kk], name="T_transpose")
          if layout == "nk" else w)
    nb = len(x.shape) - 2
    k = te.reduce_axis((0, k_ext), name="k")

    def body(*i):
        b = i[:nb]
        widx = {"batched": (*b, k, i[-1]), "batched_nk": (*b, i[-1], k)}.get(
            layout, (k, i[-1]))
        return te.sum(x(*b, i[-2], k) * wk(*widx), axis=k)

    y = te.compute((*x.shape[:-1], n), body, name="matmul")
    return epilogue_te(y, bias, residual, activation, lambda i: i[-1])


error_model(tvm_matmul)(_error)
