"""torch.export import: converters for TVM's ``from_exported_program`` that emit opsdk ops."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import tvm
from tvm import relax

from .. import relax as _ops
from .._dtypes import FLOAT_DTYPES

if TYPE_CHECKING:  # torch is optional: imported only when a converter runs
    import torch
    from torch import fx

__all__ = ["TORCH_OPS", "from_torch", "mapping_counts", "torch_convert_map"]

Converter = Callable[["fx.Node", Any], relax.Expr]

#: opsdk op -> the aten overloads (``node.target.__name__``) converted to it.
TORCH_OPS: dict[str, tuple[str, ...]] = {
    "layer_norm": ("layer_norm.default", "native_layer_norm.default"),
    "rms_norm": ("rms_norm.default",),
    "gelu": ("gelu.default",),
    "softmax": ("softmax.int", "_softmax.default"),
    "group_norm": ("group_norm.default", "native_group_norm.default"),
}

# Composite aten ops that torch's default decomposition table would break apart before TVM
# sees them: keeping them lets the converters above (and linear's bias add, for bias_gelu)
# see the op instead of its pieces.
_PRESERVE = {
    "layer_norm": ("layer_norm",),
    "rms_norm": ("rms_norm",),
    "softmax": ("softmax.int",),
    "group_norm": ("group_norm",),
}


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _tensor(imp: Any, v: Any) -> relax.Expr | None:
    """The Relax value of an fx node argument, None for an absent optional tensor."""
    if v is None:
        return None
    return imp.env[v]


def _opsdk_dtype(x: relax.Expr) -> bool:
    ty = x.ty
    return isinstance(ty, relax.TensorType) and str(ty.dtype) in FLOAT_DTYPES


def _ones(shape: list[Any], dtype: str, value: float) -> relax.Expr:
    return relax.op.full(relax.ShapeExpr(shape), relax.const(value, dtype), dtype)


def _fallback(imp: Any, node: fx.Node) -> relax.Expr:
    """TVM's own ops, for inputs the opsdk op does not cover (float64, group norm that is not
    4-D). Emitted here rather than through TVM's converters: in 0.27 those fail on absent
    weights (``elementwise_affine=False``) and there is no rms_norm converter at all."""
    name = node.target.__name__
    x = imp.env[node.args[0]]
    dtype = str(x.ty.dtype)
    emit = imp.block_builder.emit
    if name in ("layer_norm.default", "native_layer_norm.default", "rms_norm.default"):
        shape = [int(d) for d in _arg(node, 1, "normalized_shape")]
        axes = list(range(-len(shape), 0))
        gamma = _tensor(imp, _arg(node, 2, "weight"))
        gamma = _ones(shape, dtype, 1.0) if gamma is None else gamma
        if name == "rms_norm.default":
            eps = _arg(node, 3, "eps")
            eps = _default_eps(dtype) if eps is None else eps
            return emit(relax.op.nn.rms_norm(x, gamma, axes, float(eps)))
        beta = _tensor(imp, _arg(node, 3, "bias"))
        beta = _ones(shape, dtype, 0.0) if beta is None else beta
        eps = _arg(node, 4, "eps", 1e-5)
        return emit(relax.op.nn.layer_norm(x, gamma, beta, axes, float(eps)))
    if name == "gelu.default":
        approximate = _arg(node, 1, "approximate", "none")
        return emit(relax.op.nn.gelu_tanh(x) if approximate == "tanh" else relax.op.nn.gelu(x))
    gamma, beta, groups, eps = _group_norm_args(imp, node)
    c = x.ty.shape[1]
    gamma = _ones([c], dtype, 1.0) if gamma is None else gamma
    beta = _ones([c], dtype, 0.0) if beta is None else beta
    axes = list(range(2, x.ty.ndim))
    return emit(relax.op.nn.group_norm(x, gamma, beta, int(groups), 1, axes, float(eps)))


def _default_eps(dtype: str) -> float:
    """torch's rms_norm default: the machine epsilon of the input dtype."""
    import torch

    return float(torch.finfo(getattr(torch, dtype)).eps)


def _layer_norm(node: fx.Node, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    if not _opsdk_dtype(x):
        return _fallback(imp, node)
    shape = _arg(node, 1, "normalized_shape")
    gamma = _tensor(imp, _arg(node, 2, "weight"))
    beta = _tensor(imp, _arg(node, 3, "bias"))
    eps = _arg(node, 4, "eps", 1e-5)
    call = _ops.layer_norm(x, gamma, beta, begin_axis=-len(shape), epsilon=float(eps))
    # native_layer_norm returns (out, mean, rstd); inference graphs read only [0], and TVM's
    # getitem passes a tensor through for an integer index, as TVM's own converter relies on.
    return imp.block_builder.emit(call)


def _rms_norm(node: fx.Node, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    if not _opsdk_dtype(x):
        return _fallback(imp, node)
    shape = _arg(node, 1, "normalized_shape")
    gamma = _tensor(imp, _arg(node, 2, "weight"))
    eps = _arg(node, 3, "eps")
    eps = _default_eps(str(x.ty.dtype)) if eps is None else eps
    call = _ops.rms_norm(x, gamma, begin_axis=-len(shape), epsilon=float(eps))
    return imp.block_builder.emit(call)


def _gelu(node: fx.Node, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    approximate = _arg(node, 1, "approximate", "none")
    if not _opsdk_dtype(x) or approximate not in ("none", "tanh"):
        return _fallback(imp, node)
    return imp.block_builder.emit(_ops.gelu(x, approximate=approximate))


def _softmax(node: fx.Node, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    dim = _arg(node, 1, "dim", -1)
    if node.target.__name__ == "_softmax.default":
        to_float = bool(_arg(node, 2, "half_to_float", False))
        dtype = "float32" if to_float else None
    else:
        dtype = _arg(node, 2, "dtype")
        dtype = None if dtype is None else imp._convert_data_type(dtype)
    if dtype is not None and dtype != str(x.ty.dtype):
        x = imp.block_builder.emit(relax.op.astype(x, dtype))  # torch casts the input first
    if not _opsdk_dtype(x):
        return imp.block_builder.emit(relax.op.nn.softmax(x, dim))
    return imp.block_builder.emit(_ops.softmax(x, axis=int(dim)))


def _group_norm_args(imp: Any, node: fx.Node) -> tuple[Any, Any, Any, Any]:
    """(gamma, beta, groups, eps) of either torch group-norm op; gamma/beta may be None."""
    if node.target.__name__ == "native_group_norm.default":
        # (input, weight, bias, N, C, HxW, group, eps)
        return (_tensor(imp, node.args[1]), _tensor(imp, node.args[2]), node.args[6],
                node.args[7])
    # (input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True)
    return (_tensor(imp, _arg(node, 2, "weight")), _tensor(imp, _arg(node, 3, "bias")),
            _arg(node, 1, "num_groups"), _arg(node, 4, "eps", 1e-5))


def _group_norm(node: fx.Node, imp: Any) -> relax.Expr:
    x = imp.env[node.args[0]]
    gamma, beta, groups, eps = _group_norm_args(imp, node)
    ty = x.ty
    static_c = ty.ndim == 4 and isinstance(ty.shape[1], tvm.tirx.IntImm)
    if not _opsdk_dtype(x) or not static_c:  # opsdk.group_norm: 4-D, static channels
        return _fallback(imp, node)
    call = _ops.group_norm(x, gamma, beta, num_groups=int(groups), epsilon=float(eps))
    return imp.block_builder.emit(call)


_CONVERTERS: dict[str, Converter] = {
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "gelu": _gelu,
    "softmax": _softmax,
    "group_norm": _group_norm,
}


def _select(ops: Iterable[str] | None) -> list[str]:
    names = list(TORCH_OPS) if ops is None else list(ops)
    unknown = [n for n in names if n not in TORCH_OPS]
    if unknown:
        raise ValueError(
            f"unknown opsdk ops {unknown} for the torch importer; use {list(TORCH_OPS)}"
        )
    return names


def torch_convert_map(ops: Iterable[str] | None = None) -> dict[str, Converter]:
    """The ``custom_convert_map`` for TVM's ``from_exported_program`` that emits opsdk ops.

    Keys are aten overload names as TVM's importer looks them up (``"layer_norm.default"``,
    ``"native_layer_norm.default"``, ``"gelu.default"``, ``"softmax.int"``,
    ``"_softmax.default"``, ``"rms_norm.default"``, ``"group_norm.default"``,
    ``"native_group_norm.default"``); values are ``f(node, importer) -> relax.Var``. Inputs
    opsdk does not cover (float64, group norm that is not 4-D) fall back to TVM's converter.

    Parameters
    ----------
    ops : iterable of str, optional
        The opsdk ops to map to (keys of :data:`TORCH_OPS`); all by default.

    Returns
    -------
    dict of str to callable

    Examples
    --------
    >>> from opsdk.frontend import torch_convert_map
    >>> sorted(torch_convert_map(["gelu", "softmax"]))
    ['_softmax.default', 'gelu.default', 'softmax.int']
    """
    return {aten: _CONVERTERS[op] for op in _select(ops) for aten in TORCH_OPS[op]}


def decomposition_table(ops: Iterable[str] | None = None, keep_linear: bool = True,
                        keep: Iterable[str] = ()) -> Any:
    """torch.export's default decomposition table without the composite ops opsdk converts.

    ``linear`` is kept too (``keep_linear``): TVM imports it as ``matmul`` + bias ``add``,
    which ``FuseIntoOps`` can fuse with a following GELU, where torch's decomposition would
    put a reshape between the bias add and the activation. ``keep`` names more aten ops
    (``"hardswish"``, ``"silu.default"``) to leave whole, e.g. those a converter maps.

    Examples
    --------
    >>> import torch
    >>> from opsdk.frontend import decomposition_table
    >>> table = decomposition_table()
    >>> torch.ops.aten.layer_norm.default in table, torch.ops.aten.linear.default in table
    (False, False)
    >>> torch.ops.aten.linear.default in decomposition_table(keep_linear=False)
    True
    """
    import torch

    table = torch.export.default_decompositions()
    names = [name for op in _select(ops) for name in _PRESERVE.get(op, ())]
    if keep_linear:
        names.append("linear")
    for name in [*names, *keep]:
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        target = getattr(packet, overload or "default", None) if packet is not None else None
        if target is not None:
            table.pop(target, None)
    return table


def _op_converter(d: Any) -> Converter:
    """The default converter of ``OpDef.torch``: positional arguments are the op's tensor
    inputs in order; keyword arguments named like its attributes are those."""
    from ..registry import builder

    tensors = [p.name for p in d.tensor_params]
    attrs = {p.name for p in d.attr_params}

    def convert(node: Any, imp: Any) -> relax.Expr:
        if len(node.args) > len(tensors):
            raise ValueError(
                f"opsdk.{d.name}: torch mapping of {node.target.__name__} got "
                f"{len(node.args)} positional arguments for {len(tensors)} tensor inputs "
                f"({', '.join(tensors)}); pass convert= to OpDef.torch for this op")
        ins = [_tensor(imp, a) for a in node.args]
        kw = {k: v for k, v in node.kwargs.items() if k in attrs}
        return imp.block_builder.emit(builder(d)(*ins, **kw))

    return convert


def _op_mappings(skip: Iterable[str]) -> dict[str, tuple[str, Converter]]:
    """aten name -> (op, converter) from the registered ops' ``OpDef.torch`` mappings."""
    from ..registry import registered_ops

    out: dict[str, tuple[str, Converter]] = {}
    for d in registered_ops():
        for aten, fn in d.torch_maps.items():
            if aten not in skip:
                out[aten] = (d.name, fn or _op_converter(d))
    return out


def mapping_counts(mod: tvm.IRModule) -> dict[str, int]:
    """How many nodes each torch mapping (an op's ``OpDef.torch``, or a
    ``custom_convert_map`` entry) converted when :func:`from_torch` made ``mod``.

    Examples
    --------
    >>> import torch, opsdk
    >>> ep = torch.export.export(torch.nn.ReLU(), (torch.randn(2, 4),))
    >>> opsdk.frontend.mapping_counts(opsdk.frontend.from_torch(ep))
    {}
    """
    counts = (mod.attrs or {}).get("opsdk.torch_mappings", {}) if mod.attrs else {}
    return {str(k): int(v) for k, v in counts.items()}


def _counted(name: str, fn: Converter, hits: dict[str, int]) -> Converter:
    def convert(node: Any, imp: Any) -> relax.Expr:
        hits[name] += 1
        return fn(node, imp)

    return convert


def _aten_names(ep: Any) -> set[str]:
    """``node.target.__name__`` of every call in the program (what a converter keys on)."""
    return {getattr(n.target, "__name__", str(n.target)) for n in ep.graph.nodes
            if n.op == "call_function"}


def from_torch(
    exported_program: torch.export.ExportedProgram,
    *,
    ops: Iterable[str] | None = None,
    decompose: bool = True,
    custom_convert_map: Mapping[str, Converter] | None = None,
    op_mappings: bool | None = None,
    **kwargs: Any,
) -> tvm.IRModule:
    """Import a ``torch.export`` program into Relax with opsdk ops for LayerNorm, RMSNorm, GELU
    (both approximations), softmax and GroupNorm.

    Wraps TVM's ``from_exported_program`` with :func:`torch_convert_map`. The program is first
    decomposed to core ATen like TVM does by default, but keeping the composite ops converted
    here (and ``linear``), so they arrive whole.

    Parameters
    ----------
    exported_program : torch.export.ExportedProgram
        What ``torch.export.export(model, args)`` returned.
    ops : iterable of str, optional
        The opsdk ops to map (keys of :data:`TORCH_OPS`); all by default. ``ops=()`` gives
        TVM's own import (with the same decomposition), useful as an unfused baseline.
    decompose : bool
        Run torch's decompositions first (as TVM's importer does); pass False for a program
        that is decomposed already.
    custom_convert_map : mapping, optional
        More converters, keyed by aten overload (``"hardswish.default"``), each
        ``f(node, importer) -> relax.Expr`` (see docs/model-compile.md); they take precedence
        over opsdk's. Their ops are kept out of the decomposition, so they reach the
        converter whole, and an entry that matched no node of the program is reported with
        a ``UserWarning`` (naming similar ops the program has), never silently dropped.
    op_mappings : bool, optional
        Apply the registered ops' own mappings (``OpDef.torch``, e.g. a user's op for
        ``hardswish.default``). Default: with ``ops=None`` yes, with an explicit ``ops`` no;
        ``ops=(), op_mappings=True`` is TVM's import of the built-ins plus every op's own
        mapping (what ``opsdk drift`` rewrites from).
    **kwargs
        Passed to ``from_exported_program`` (``keep_params_as_input``,
        ``unwrap_unit_return_tuple``, ``no_bind_return_tuple``).

    Returns
    -------
    tvm.IRModule
        ``main`` takes the program's user inputs; parameters and buffers are bound as
        constants unless ``keep_params_as_input=True``.

    Examples
    --------
    >>> import torch, opsdk
    >>> m = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.GELU(approximate="tanh"))
    >>> ep = torch.export.export(m.eval(), (torch.randn(2, 16),))
    >>> mod = opsdk.frontend.from_torch(ep)
    >>> opsdk.transform.op_counts(mod, "opsdk.")
    {'opsdk.gelu': 1, 'opsdk.layer_norm': 1}
    """
    import warnings

    from tvm.relax.frontend.torch import from_exported_program

    names = _select(ops)
    custom = dict(custom_convert_map or {})
    if op_mappings is None:
        op_mappings = ops is None
    mapped = _op_mappings(skip=custom) if op_mappings else {}
    if decompose:
        table = decomposition_table(names, keep=[*custom, *mapped])
        exported_program = exported_program.run_decompositions(table)
    cmap: dict[str, Converter] = torch_convert_map(names)
    # TVM has no rms_norm converter: one left whole (decompose=False, or not mapped) still imports.
    cmap.setdefault("rms_norm.default", lambda node, imp: _fallback(imp, node))
    hits = dict.fromkeys([*mapped, *custom], 0)
    cmap.update({k: _counted(k, fn, hits) for k, (_, fn) in mapped.items()})
    cmap.update({k: _counted(k, fn, hits) for k, fn in custom.items()})
    mod = from_exported_program(
        exported_program, custom_convert_map=cmap, run_ep_decomposition=False, **kwargs
    )
    if hits:
        mod = mod.with_attr("opsdk.torch_mappings", {k: n for k, n in hits.items()})
    # An op's own mapping matching nothing is normal (the model lacks that op); an entry the
    # caller passed for this model is a mistake worth saying.
    unused = [k for k in custom if hits[k] == 0]
    if unused:
        present = _aten_names(exported_program)
        for k in unused:
            base = k.partition(".")[0].lstrip("_")
            near = sorted(a for a in present if base and base in a)
            warnings.warn(
                f"opsdk.frontend.from_torch: custom_convert_map entry {k!r} converted no node "
                f"of the program"
                + (f"; it has {', '.join(near)}" if near else
                   f"; its ops are {', '.join(sorted(present)[:12])}"
                   + (" ..." if len(present) > 12 else ""))
                + ". Key converters by the aten overload's name (node.target.__name__, e.g. "
                  "'hardswish.default')", UserWarning, stacklevel=2)
    return mod
