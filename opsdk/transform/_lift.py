"""Weights stored once, transformed once at load: TVM's ``LiftTransformParams`` for opsdk.

A model compiled with its weights as constants has every weight transform folded into the
executable: a Winograd conv's weights stored as G·g·Gᵀ (16 values per 3x3 filter), packed
tiles padded, BatchNorm folded into conv weights. :func:`weights_as_params` turns the
weights of ``main`` into trailing parameters instead (``num_input`` marks where they begin),
and :func:`lift_passes` adds TVM's ``LiftTransformParams`` to the schedule passes at two
points:

1. before fusion: what depends on the weights alone (the channels-last transposes, the
   BatchNorm fold) becomes a function of its own before ``FuseOps`` can merge it into the
   kernel that reads it;
2. after ``SplitLayoutRewritePreproc``: the weight packing and the Winograd weight
   transform that the schedule rules split out of their kernels.

The two are composed into one ``main_transform_params(*weights)`` returning the weights in
the form the kernels read; ``main(*inputs, *transformed)`` then computes the model. A
deployed model stores the original weights, calls ``main_transform_params`` once at load and
keeps only its results.

Examples
--------
>>> import numpy as np
>>> from tvm import relax
>>> from opsdk.transform._lift import weights_as_params
>>> x = relax.Var("x", relax.TensorType((2, 64), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         w = relax.const(np.ones((64, 8), "float32"))
...         y = bb.emit_output(relax.op.matmul(x, w))
...     _ = bb.emit_func_output(y)
>>> mod, weights = weights_as_params(bb.get())
>>> [str(p.name) for p in mod["main"].params], int(mod["main"].attrs["num_input"])
(['x', 'w0'], 1)
>>> weights["w0"].shape
(64, 8)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import tvm
from tvm import relax

__all__ = ["LIFT_ATTR", "TRANSFORM_SUFFIX", "KernelFormWeights", "compose_lifted",
           "constants_as_params", "lift_passes", "lifts_weights", "weights_as_params"]

#: The function computing ``main``'s weights as its kernels read them: ``main`` + this.
TRANSFORM_SUFFIX = "_transform_params"

#: Constants smaller than this stay in the executable (scalars, clip bounds, tiny vectors:
#: some rewrites read their values at compile time, and they are no weight to speak of).
MIN_BYTES = 1024

#: ``main``'s attribute asking :func:`opsdk.model.compile_model` to lift the weight
#: transforms (set by :func:`weights_as_params`; a module with ``num_input`` from elsewhere
#: keeps taking its weights untransformed).
LIFT_ATTR = "opsdk.lift_weights"

_FIRST = "main_opsdk_lift_0"  # the first lift's function, until composed


def _nbytes(t: Any) -> int:
    dt = tvm.DataType(str(t.dtype))
    n = 1
    for d in t.shape:
        n *= int(d)
    return n * max(1, dt.bits * dt.lanes // 8)


def _is_tensor_const(e: Any) -> bool:
    # GenericConst also wraps dtypes and strings: tensors only.
    return isinstance(e, tvm.ir.expr.GenericConst) and isinstance(e.value, tvm.runtime.Tensor)


def weights_as_params(mod: tvm.IRModule, entry: str = "main", min_bytes: int = MIN_BYTES
                      ) -> tuple[tvm.IRModule, dict[str, Any]]:
    """``mod`` with every tensor constant of ``entry`` of ``min_bytes`` or more made a
    trailing parameter (``w0``, ``w1``, ... in order of first use; one per constant object),
    and those constants by parameter name, in parameter order.

    The function's ``num_input`` attribute is its number of own inputs, so TVM's passes
    (``AttachAttrLayoutFreeBuffers``, ``LiftTransformParams``) treat the rest as weights;
    :data:`LIFT_ATTR` makes :func:`opsdk.model.compile_model` lift their transforms.

    Raises
    ------
    ValueError
        ``entry`` is missing, or takes weights as parameters already (``num_input``
        below its parameter count).
    """
    if entry not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ValueError(f"the module has no function {entry!r} to take weights from")
    func = mod[entry]
    if not isinstance(func, relax.Function):
        raise ValueError(f"{entry!r} is not a Relax function")
    # ONNX's importer sets num_input to the input count: only one below it means weights.
    if func.attrs is not None and "num_input" in func.attrs \
            and int(func.attrs["num_input"]) < len(func.params):
        raise ValueError(f"{entry!r} takes weights as parameters already (num_input "
                         f"{int(func.attrs['num_input'])} of {len(func.params)})")
    found: dict[Any, relax.Var] = {}  # constant's address -> its parameter
    weights: dict[str, Any] = {}

    @relax.expr_functor.mutator
    class _ToParams(relax.PyExprMutator):
        def visit_generic_const_(self, c: Any) -> relax.Expr:
            if not _is_tensor_const(c) or _nbytes(c.value) < min_bytes:
                return c
            key = c.__chandle__()
            if key not in found:
                name = f"w{len(found)}"
                found[key] = relax.Var(name, relax.TensorType(list(c.value.shape),
                                                              str(c.value.dtype)))
                weights[name] = c.value
            return found[key]

    body = _ToParams().visit_expr(func.body)
    params = list(func.params) + list(found.values())
    attrs = dict(func.attrs) if func.attrs is not None else {}
    attrs["num_input"] = len(func.params)
    attrs[LIFT_ATTR] = True
    new = relax.Function(params, body, func.ret_ty, func.is_pure,
                         tvm.ir.make_node("ir.DictAttrs", **attrs))
    out = mod.copy() if hasattr(mod, "copy") else tvm.IRModule(dict(mod.functions.items()))
    out[entry] = new
    return out, weights


class KernelFormWeights(NamedTuple):
    """What :func:`constants_as_params` took out of a module: ``tensors`` (each once, in the
    form the kernels read) and ``uses`` (function name -> the indices into ``tensors`` of
    its trailing parameters, in order)."""

    tensors: list[Any]
    uses: dict[str, list[int]]

    @property
    def nbytes(self) -> int:
        """The tensors' bytes."""
        return sum(_nbytes(t) for t in self.tensors)


def constants_as_params(mod: tvm.IRModule, min_bytes: int = MIN_BYTES
                        ) -> tuple[tvm.IRModule, KernelFormWeights]:
    """``mod`` (scheduled: its constants already in the form the kernels read, packed and
    folded) with every tensor constant of ``min_bytes`` or more made a trailing parameter of
    each Relax function using it, and those constants.

    Unlike :func:`weights_as_params` (the weights as the model has them, transformed at
    load), nothing is left to do at load: a module with several entry points (a decoder's
    ``prefill`` and ``decode``) takes the same tensors, each stored once, and the library
    holds no weights. Equal constants (the same object, or equal bytes) become one tensor.
    Each function's ``num_input`` is its own parameter count.

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import relax
    >>> from opsdk.transform import constants_as_params
    >>> x = relax.Var("x", relax.TensorType((2, 64), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> w = relax.const(np.ones((64, 8), "float32"))
    >>> for name in ("a", "b"):
    ...     with bb.function(name, [x]):
    ...         with bb.dataflow():
    ...             y = bb.emit_output(relax.op.matmul(x, w))
    ...         _ = bb.emit_func_output(y)
    >>> mod, weights = constants_as_params(bb.get())
    >>> len(weights.tensors), weights.uses, len(mod["b"].params)
    (1, {'a': [0], 'b': [0]}, 2)
    """
    tensors: list[Any] = []
    by_handle: dict[Any, int] = {}
    by_bytes: dict[tuple[str, tuple[int, ...], bytes], int] = {}

    def index_of(t: Any) -> int:
        h = t.__chandle__()
        if h not in by_handle:
            a = t.numpy()
            key = (str(a.dtype), a.shape, hashlib.blake2b(a.tobytes(), digest_size=32).digest())
            if key not in by_bytes:
                by_bytes[key] = len(tensors)
                tensors.append(t)
            by_handle[h] = by_bytes[key]
        return by_handle[h]

    funcs = {gv.name_hint: f for gv, f in mod.functions.items()
             if isinstance(f, relax.Function)}
    own: dict[str, set[int]] = {}
    calls: dict[str, set[str]] = {}
    for name, func in funcs.items():
        own[name], calls[name] = _constants_and_calls(func.body, index_of, min_bytes,
                                                      set(funcs))
    # A function calling another (a decoder's ``check`` runs ``prefill`` and ``decode``)
    # takes the callee's weights too and passes them on.
    needs = {name: set(s) for name, s in own.items()}
    changed = True
    while changed:
        changed = False
        for name in funcs:
            for callee in calls[name]:
                if not needs[callee] <= needs[name]:
                    needs[name] |= needs[callee]
                    changed = True
    uses = {name: sorted(n) for name, n in needs.items() if n}
    new_funcs: dict[str, relax.Function] = {}
    for gv, func in mod.functions.items():
        name = gv.name_hint
        if name not in uses:
            continue
        params = {i: relax.Var(f"w{i}", relax.TensorType(list(tensors[i].shape),
                                                         str(tensors[i].dtype)))
                  for i in uses[name]}
        attrs = dict(func.attrs) if func.attrs is not None else {}
        attrs["num_input"] = len(func.params)
        new_funcs[name] = relax.Function(
            list(func.params) + [params[i] for i in uses[name]], func.body, func.ret_ty,
            func.is_pure, tvm.ir.make_node("ir.DictAttrs", **attrs))
    # New global vars of the new types (a call is checked against its callee's type).
    gvs = {}
    for name, func in new_funcs.items():
        gvs[name] = tvm.ir.GlobalVar(name)
        relax.expr._update_type(gvs[name], func.ty)
    out = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint not in uses},
                       attrs=mod.attrs)
    for name, func in new_funcs.items():
        params = dict(zip(uses[name], list(func.params)[-len(uses[name]):]))
        body = _with_params(func.body, index_of, min_bytes, params, uses, gvs)
        out[gvs[name]] = relax.Function(list(func.params), body, func.ret_ty, func.is_pure,
                                        func.attrs)
    return out, KernelFormWeights(tensors, uses)


def _constants_and_calls(body: relax.Expr, index_of: Any, min_bytes: int,
                         functions: set[str]) -> tuple[set[int], set[str]]:
    """The indices of ``body``'s tensor constants of ``min_bytes`` or more, and the names of
    the module's ``functions`` it calls."""
    found: set[int] = set()
    called: set[str] = set()

    @relax.expr_functor.visitor
    class _Find(relax.PyExprVisitor):
        def visit_generic_const_(self, c: Any) -> None:
            if _is_tensor_const(c) and _nbytes(c.value) >= min_bytes:
                found.add(index_of(c.value))

        def visit_call_(self, call: relax.Call) -> None:
            super().visit_call_(call)
            if isinstance(call.op, tvm.ir.GlobalVar) and call.op.name_hint in functions:
                called.add(call.op.name_hint)

    _Find().visit_expr(body)
    return found, called


def _with_params(body: relax.Expr, index_of: Any, min_bytes: int,
                 params: dict[int, relax.Var], uses: dict[str, list[int]],
                 gvs: dict[str, tvm.ir.GlobalVar]) -> relax.Expr:
    """``body`` with its large tensor constants replaced by ``params`` (by index), and each
    call of a function in ``uses`` calling ``gvs``' function of that name with the function's
    weights after its arguments."""

    @relax.expr_functor.mutator
    class _ToParams(relax.PyExprMutator):
        def visit_generic_const_(self, c: Any) -> relax.Expr:
            if not _is_tensor_const(c) or _nbytes(c.value) < min_bytes:
                return c
            return params[index_of(c.value)]

        def visit_call_(self, call: relax.Call) -> relax.Expr:
            new = super().visit_call_(call)
            if isinstance(new.op, tvm.ir.GlobalVar) and new.op.name_hint in uses:
                name = new.op.name_hint
                extra = [params[i] for i in uses[name]]
                return relax.Call(gvs[name], list(new.args) + extra, new.attrs,
                                  new.ty_args)
            return new

    return _ToParams().visit_expr(body)


def lifts_weights(mod: tvm.IRModule) -> bool:
    """Whether ``mod``'s ``main`` asks for its weight transforms lifted (:data:`LIFT_ATTR`)."""
    try:
        func = mod["main"]
    except Exception:  # no main: nothing to lift
        return False
    return bool(isinstance(func, relax.Function) and func.attrs is not None
                and func.attrs.get(LIFT_ATTR, False))


def _rename(mod: tvm.IRModule, old: str, new: str) -> tvm.IRModule:
    func = mod[old]
    out = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != old},
                       attrs=mod.attrs)
    # No num_input: the next LiftTransformParams must not lift from this one too.
    out[new] = func.without_attr("num_input").with_attr("global_symbol", new)
    return out


def _lift_first() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="opsdk.LiftWeightTransforms")
    def _pass(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        mod = relax.transform.LiftTransformParams()(mod)
        return _rename(mod, "main" + TRANSFORM_SUFFIX, _FIRST)

    return _pass


def compose_lifted() -> tvm.transform.Pass:
    """The second lift (after the weight packing was split out of the kernels), composed
    with the first into one ``main_transform_params``."""

    @tvm.transform.module_pass(opt_level=0, name="opsdk.LiftWeightPacking")
    def _pass(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        mod = relax.transform.LiftTransformParams()(mod)
        name = "main" + TRANSFORM_SUFFIX
        second = _rename(mod, name, "main_opsdk_lift_1")
        first_gv = second.get_global_var(_FIRST)
        last_gv = second.get_global_var("main_opsdk_lift_1")
        first, last = second[_FIRST], second["main_opsdk_lift_1"]
        for gv, f in ((first_gv, first), (last_gv, last)):
            relax.expr._update_type(gv, f.ty)  # a GlobalVar made by name has none
        bb = relax.BlockBuilder(second)
        # One parameter per weight (LiftTransformParams takes them as one tuple): callers
        # pass tensors, also over RPC, where a list of remote tensors does not travel.
        (packed,) = first.params
        params = [relax.Var(f"w{i}", t) for i, t in enumerate(packed.ty.fields)]
        with bb.function(name, params, attrs={"global_symbol": name}):
            mid = bb.emit(relax.Call(first_gv, [bb.emit(relax.Tuple(params))]))
            bb.emit_func_output(bb.emit(relax.Call(last_gv, [mid])))
        out = bb.get()
        for gv in (first_gv, last_gv):  # called by the composition only
            out[gv] = out[gv].without_attr("global_symbol")
        return out

    return _pass


def lift_passes(passes: Sequence[tvm.transform.Pass]) -> list[tvm.transform.Pass]:
    """``passes`` (:func:`opsdk.transform.schedule_passes`) with the two lifts inserted:
    before ``FuseOps`` and right after ``SplitLayoutRewritePreproc``.

    Raises
    ------
    ValueError
        ``passes`` lacks ``FuseOps`` or ``SplitLayoutRewritePreproc``.
    """
    names = [p.info.name for p in passes]
    for need in ("FuseOps", "SplitLayoutRewritePreproc"):
        if need not in names:
            raise ValueError(f"lift_passes: the passes lack {need}: {', '.join(names)}")
    fuse = names.index("FuseOps")
    split = names.index("SplitLayoutRewritePreproc")
    out = list(passes)
    out.insert(split + 1, compose_lifted())
    out.insert(fuse, _lift_first())
    return out
