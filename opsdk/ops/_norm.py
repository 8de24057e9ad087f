"""Shared pieces of the trailing-axes norms (``layer_norm``, ``rms_norm``): the error bound
of a norm over ``[begin_axis, ndim)`` and the patterns of its decomposed chain."""

from __future__ import annotations

from typing import Any

import numpy as np
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .._errmodel import ModelInput, norm_rows
from .._opdef import OpDef
from .._patterns import (
    either,
    float_tensor,
    param_of,
    reduced_axes,
    scalar_value,
    shape_of,
    trailing_begin,
)

__all__ = ["NormChain", "norm_error"]


def norm_error(m: ModelInput, centered: bool = True) -> np.ndarray:
    """The bound of a norm over the trailing axes ``[begin_axis, ndim)`` (``centered=False``:
    RMSNorm, which shares it)."""
    x = m.inputs[m.op.primary]
    b = m.attrs["begin_axis"]
    shape = x.shape
    rows = int(np.prod(shape[:b], dtype=np.int64))
    n = int(np.prod(shape[b:], dtype=np.int64))

    def rowview(t: np.ndarray | None) -> np.ndarray | None:
        return None if t is None else np.broadcast_to(t, shape).reshape(rows, n)

    g = m.inputs.get("gamma")
    beta = m.inputs.get("beta") if centered else None
    E = norm_rows(x.reshape(rows, n), rowview(g), rowview(beta), m.attrs["epsilon"], centered,
                  m.u)
    return E.reshape(shape)


class NormChain:
    """Patterns for the decomposed LayerNorm (``center=True``) or RMSNorm chain: ``d = x -
    mean(x)`` (or ``x``), ``mean(d**2 | d*d) + eps``, sqrt and divide or rsqrt and multiply,
    optional ``* gamma`` and ``+ beta``, fused into ``op``."""

    def __init__(self, center: bool, op: OpDef) -> None:
        self.center = center
        self.op = op
        if center:
            self.x = wildcard()
        else:
            # RMSNorm of a centred value, x - mean(x), is a LayerNorm chain: if it reached this
            # rule, the LayerNorm rule turned it down as a near miss, so leave it too.
            y = wildcard()
            self.x = ~is_op("relax.subtract")(y, is_op("relax.mean")(y))
        self.mean1 = is_op("relax.mean")(self.x)
        self.d = is_op("relax.subtract")(self.x, self.mean1) if center else self.x
        self.two = is_const()
        self.pow = is_op("relax.power")(self.d, self.two)
        self.var = is_op("relax.mean")(self.pow | is_op("relax.multiply")(self.d, self.d))
        self.eps = is_const()
        ve = either("relax.add", self.var, self.eps)
        self.norm = is_op("relax.divide")(self.d, is_op("relax.sqrt")(ve)) | either(
            "relax.multiply", self.d, is_op("relax.rsqrt")(ve)
        )
        self.gamma = wildcard()
        self.beta = wildcard()
        self.scaled = either("relax.multiply", self.norm, self.gamma)
        self.shifted = either("relax.add", self.scaled, self.beta)

    def check(self, m: Any) -> tuple[relax.Expr, int, float] | None:
        """(x, begin_axis, epsilon) when the chain is a real norm over the trailing axes."""
        x = m[self.x]
        ty = float_tensor(x)
        if ty is None:
            return None
        var_axes = reduced_axes(m[self.var], ty.ndim)
        if var_axes is None:
            return None
        if self.center and reduced_axes(m[self.mean1], ty.ndim) != var_axes:
            return None  # centred with a mean over other axes than the variance
        begin = trailing_begin(var_axes, ty.ndim)
        if begin is None:
            return None
        if self.pow in m and scalar_value(m[self.two]) != 2.0:
            return None
        eps = scalar_value(m[self.eps])
        if eps is None or eps < 0:
            return None
        return x, begin, eps

    def patterns(self) -> list[tuple[DFPattern, Any]]:
        """(pattern, build) with gamma and beta (LayerNorm only), with gamma, with neither."""

        def make(root: DFPattern, with_gamma: bool, with_beta: bool) -> tuple[DFPattern, Any]:
            def fused(orig: relax.Call, m: Any) -> relax.Expr | None:
                found = self.check(m)
                if found is None:
                    return None
                x, begin, eps = found
                tail = tuple(shape_of(x)[begin:])
                params = []
                for p, wanted in ((self.gamma, with_gamma), (self.beta, with_beta)):
                    if wanted:
                        q = param_of(m[p], tail)
                        if q is None or float_tensor(m[p]) is None:
                            return None  # not a per-feature parameter: fuse less
                        if str(m[p].ty.dtype) != str(x.ty.dtype):
                            return None
                        params.append(q)
                return self.op(x, *params, begin_axis=begin, epsilon=eps)

            return root, fused

        out = [make(self.scaled, True, False), make(self.norm, False, False)]
        if self.center:  # RMSNorm has no shift
            out.insert(0, make(self.shifted, True, True))
        return out
