"""torch.export import: converters for TVM's ``from_exported_program`` that emit opsdk ops."""

from __future__ import annotations

import operator
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from .. import ops as op_library  # the explicit op list, read when used
from ..registry import builder, get_op, registered_ops
from . import _indexing
from ._asis import as_is_converters, importable_as_is
from ._recurrent import RECURRENT, recurrent_kept

if TYPE_CHECKING:  # torch is optional: imported only when a converter runs
    import torch
    from torch import fx

__all__ = ["TORCH_OPS", "from_torch", "mapping_counts", "torch_convert_map"]

Converter = Callable[["fx.Node", Any], relax.Expr]

#: Built-in op -> the aten overloads (``node.target.__name__``) converted to it: the op files'
#: ``OpDef.torch`` mappings, read when first asked for (module ``__getattr__``).
TORCH_OPS: dict[str, tuple[str, ...]]


def _builtins() -> list[Any]:
    """The built-in ops that map torch ops (``OpDef.torch``), in the op list's order."""

    return [d for d in op_library.BUILTIN_OPS if d.torch_maps]


def _is_builtin(d: Any) -> bool:
    return any(d is b for b in op_library.BUILTIN_OPS)


def _torch_ops() -> dict[str, tuple[str, ...]]:
    return {d.name: tuple(d.torch_maps) for d in _builtins()}


def __getattr__(name: str) -> Any:
    # TORCH_OPS is derived from the op files' own mappings, when first asked for.
    if name == "TORCH_OPS":
        return _torch_ops()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tensor(imp: Any, v: Any) -> relax.Expr | None:
    """The Relax value of an fx node argument, None for an absent optional tensor."""
    if v is None:
        return None
    return imp.env[v]


def _select(ops: Iterable[str] | None) -> list[Any]:
    known = _torch_ops()
    names = list(known) if ops is None else list(ops)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown opsdk ops {unknown} for the torch importer; use {list(known)}"
        )
    by_name = {d.name: d for d in _builtins()}
    return [by_name[n] for n in names]


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
    return {aten: fn or _op_converter(d) for d in _select(ops) for aten, fn in d.torch_maps.items()}


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
    import torch  # heavy: torch

    table = torch.export.default_decompositions()
    for target in _kept_ops(ops, keep_linear, keep):
        table.pop(target, None)
    return table


def _kept_ops(ops: Iterable[str] | None, keep_linear: bool, keep: Iterable[str]) -> list[Any]:
    """The aten overloads :func:`decomposition_table` leaves whole."""
    import torch  # heavy: torch

    names = [name for d in _select(ops) for name in d.torch_keep]
    if keep_linear:
        names.append("linear")
    out = []
    for name in [*names, *keep]:
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        target = getattr(packet, overload or "default", None) if packet is not None else None
        if target is not None:
            out.append(target)
    return out


def _op_converter(d: Any) -> Converter:
    """The default converter of ``OpDef.torch``: positional arguments are the op's tensor
    inputs in order; keyword arguments named like its attributes are those."""

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
    """aten name -> (op, converter) from the registered ops' ``OpDef.torch`` mappings (the
    built-in ops' are selected by ``from_torch(ops=...)`` instead)."""

    out: dict[str, tuple[str, Converter]] = {}
    for d in registered_ops():
        if _is_builtin(d):
            continue
        for aten, fn in d.torch_maps.items():
            if aten not in skip:
                out[aten] = (d.name, fn or _op_converter(d))
    return out


def _user_keep(mapped: Mapping[str, tuple[str, Converter]]) -> list[str]:
    """The aten ops the applied user mappings keep out of the decomposition (``OpDef.torch``'s
    ``keep``, by default the mapped overloads themselves)."""

    ops = dict.fromkeys(op for op, _ in mapped.values())
    return [k for op in ops for k in get_op(op).torch_keep]


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


def _div_mode(node: fx.Node, imp: Any) -> relax.Expr:
    """``div.Tensor_mode`` (``x // 2``, ``torch.div(x, y, rounding_mode=...)``) with torch's
    type promotion. TVM 0.27's converter makes a Python scalar an int32 or float32 constant
    whatever the tensor's dtype, so ``float_tensor // 2`` (EdgeNeXt's positional encoding)
    failed to import ("Binary operators must have the same datatype")."""
    import torch  # heavy: torch

    a, b = (imp.env[v] if isinstance(v, torch.fx.Node) else v for v in node.args[:2])
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("rounding_mode")
    bb = imp.block_builder
    exprs = [v for v in (a, b) if isinstance(v, relax.Expr)]
    dts = [str(v.ty.dtype) for v in exprs]
    if len(exprs) == 2:
        dt = str(torch.promote_types(*(getattr(torch, d) for d in dts))).removeprefix("torch.")
    else:
        scalar = b if isinstance(a, relax.Expr) else a
        # a float scalar makes an integer tensor's quotient float (torch's default dtype)
        dt = "float32" if isinstance(scalar, float) and "float" not in dts[0] else dts[0]
    a, b = (bb.emit(relax.op.astype(v, dt)) if isinstance(v, relax.Expr) and
            str(v.ty.dtype) != dt else v if isinstance(v, relax.Expr) else relax.const(v, dt)
            for v in (a, b))
    if mode is None:
        return bb.emit(relax.op.divide(a, b))
    if mode == "floor":
        return bb.emit(relax.op.floor_divide(a, b))
    if mode == "trunc":
        return bb.emit(relax.op.trunc(bb.emit(relax.op.divide(a, b))))
    raise ValueError(f"aten.div: rounding_mode={mode!r} is not one of None, 'floor', 'trunc'")


def _cat(node: fx.Node, imp: Any) -> relax.Expr:
    """``cat`` without the empty 1-D tensors that torch skips (its legacy rule: a ``(0,)``
    tensor joins any other), which TVM's ``concat`` refuses ("Concat expects all input
    tensors to have same ndim"). A Hugging Face decoder's KV cache starts as one: a Qwen2 or
    GPT-2 exported with its cache did not import."""
    tensors = list(node.args[0])

    def empty_1d(t: Any) -> bool:  # an fx.Node (torch is imported only when needed)
        val = t.meta.get("val") if isinstance(getattr(t, "meta", None), dict) else None
        return val is not None and tuple(val.shape) == (0,)

    kept = [t for t in tensors if not empty_1d(t)]
    if len(kept) == len(tensors) or not kept:
        return imp._cat(node)
    if len(kept) == 1:
        return imp.env[kept[0]]
    return imp._cat(types.SimpleNamespace(args=(kept, *node.args[1:]), kwargs=node.kwargs,
                                          target=node.target, name=node.name,
                                          meta=node.meta))


def _conv_transpose3d(node: fx.Node, imp: Any, args: tuple[Any, ...]) -> relax.Expr:
    x, weight, bias, stride, padding, output_padding, groups, dilation = args

    def triple(v: Any) -> list[int]:
        return [int(v)] * 3 if isinstance(v, int) else [int(e) for e in v]

    pad = triple(padding)
    y = imp.block_builder.emit(relax.op.nn.conv3d_transpose(
        imp.env[x], imp.env[weight], strides=triple(stride), padding=pad + pad,
        output_padding=triple(output_padding), dilation=triple(dilation), groups=int(groups),
        data_layout="NCDHW", kernel_layout="IODHW", out_dtype=str(imp.env[x].ty.dtype)))
    if bias is None:
        return y
    b = imp.block_builder.emit(relax.op.reshape(imp.env[bias], (1, -1, 1, 1, 1)))
    return imp.block_builder.emit(relax.op.add(y, b))


def _convolution(node: fx.Node, imp: Any) -> relax.Expr:
    """``convolution`` (a ``ConvTranspose3d`` after torch's decompositions) and
    ``conv_transpose3d``: TVM 0.27's converter has no transposed 3-D conv ("Unsupported
    transposed convolution dimensionality: 5"), though Relax has ``conv3d_transpose``. A 3-D
    UNet's upsampling did not import. Everything else goes to TVM's own converter."""
    a = list(node.args) + [None] * 9
    if node.target.__name__.startswith("conv_transpose3d"):
        x, w, b = a[:3]
        return _conv_transpose3d(node, imp, (x, w, b, a[3] or 1, a[4] or 0, a[5] or 0,
                                             a[6] or 1, a[7] or 1))
    transposed = a[6]
    if not transposed or len(node.args[0].meta["val"].shape) != 5:
        return imp._convolution(node)
    return _conv_transpose3d(node, imp, (a[0], a[1], a[2], a[3], a[4], a[7], a[8], a[5]))


def _elu(node: fx.Node, imp: Any) -> relax.Expr:
    """``elu(x, alpha, scale, input_scale)``: ``scale * (x if x > 0 else alpha * (exp(x *
    input_scale) - 1))``. TVM 0.27's converter reads ``alpha`` only, and torch decomposes
    ``selu`` into an ``elu`` with ``scale = 1.0507``: a SELU net's activations came out 5 %
    small, silently. With ``scale = input_scale = 1`` TVM's own converter runs (the same
    import as before)."""
    a = [*node.args, None, None, None]
    scale = a[2] if a[2] is not None else node.kwargs.get("scale", 1.0)
    input_scale = a[3] if a[3] is not None else node.kwargs.get("input_scale", 1.0)
    if scale == 1 and input_scale == 1:
        return imp._elu(node)
    alpha = a[1] if a[1] is not None else node.kwargs.get("alpha", 1.0)
    bb, x = imp.block_builder, imp.env[a[0]]
    dt = x.ty.dtype

    def const(v: float) -> relax.Expr:
        return relax.const(v, dt)

    # alpha * (exp(x * s) - 1) for x <= 0 is -alpha * relu(1 - exp(x * s)) (s > 0), as TVM's
    grow = bb.emit(relax.op.exp(bb.emit(relax.op.multiply(x, const(input_scale)))))
    neg = bb.emit(relax.op.multiply(const(-alpha), bb.emit(relax.op.nn.relu(
        bb.emit(relax.op.subtract(const(1.0), grow))))))
    return bb.emit(relax.op.multiply(const(scale), bb.emit(relax.op.add(
        neg, bb.emit(relax.op.nn.relu(x))))))


def _integer_clamp(which: str) -> Converter:
    """``clamp`` / ``clamp_min`` / ``clamp_max`` of an integer tensor: TVM 0.27's converters
    pass the missing bound as an infinite ``clip`` limit, which an integer tensor's
    legalization cannot hold ("Cannot convert infinity to BigInt"); torch's decomposition of
    a trilinear upsample clamps its integer indices so, and did not compile. Each finite
    integer bound becomes a ``maximum`` / ``minimum``; anything else goes to TVM's converter."""
    positions = {"clamp": ("lo", "hi"), "clamp_min": ("lo",), "clamp_max": ("hi",)}[which]

    def convert(node: fx.Node, imp: Any) -> relax.Expr:
        x = imp.env[node.args[0]]
        given = dict(zip(positions, node.args[1:], strict=False))
        given.update({k: node.kwargs[n] for k, n in (("lo", "min"), ("hi", "max"))
                      if n in node.kwargs})
        bounds = [v for v in given.values() if v is not None]
        if "int" not in str(x.ty.dtype) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in bounds):
            return getattr(imp, f"_{which}")(node)
        bb, dt = imp.block_builder, x.ty.dtype
        if given.get("lo") is not None:
            x = bb.emit(relax.op.maximum(x, relax.const(given["lo"], dt)))
        if given.get("hi") is not None:
            x = bb.emit(relax.op.minimum(x, relax.const(given["hi"], dt)))
        return x

    return convert


def _grid_sample(node: fx.Node, imp: Any) -> relax.Expr:
    """``grid_sampler_2d``: torch's grid is ``(N, H_out, W_out, 2)``; TVM 0.27's
    ``image.grid_sample`` reads it as ``(N, 2, H_out, W_out)`` (its shape inference and
    kernel; the docstring says otherwise), and its converter passed torch's as it is: the
    result had shape ``(N, C, W_out, 2)``. The grid is transposed first, then TVM's
    converter runs."""
    grid = imp.env[node.args[1]]
    if len(grid.ty.shape.values) != 4:
        return imp._grid_sampler_2d(node)
    imp.env[node.args[1]] = imp.block_builder.emit(relax.op.permute_dims(grid, [0, 3, 1, 2]))
    try:
        return imp._grid_sampler_2d(node)
    finally:  # other readers of the grid get torch's layout
        imp.env[node.args[1]] = grid


def _var_mean(node: fx.Node, imp: Any) -> relax.Expr:
    """``var_mean(x, dim, correction=, keepdim=)``: no converter in TVM 0.27, but its
    ``var.correction`` and ``mean`` converters read the same arguments."""
    return imp.block_builder.emit(relax.Tuple([imp._var(node), imp._mean(node)]))


def _exp2(node: fx.Node, imp: Any) -> relax.Expr:
    """``exp2`` (no converter in TVM 0.27): ``2 ** x``, exact at integers."""
    x = imp.env[node.args[0]]
    return imp.block_builder.emit(relax.op.power(relax.const(2.0, x.ty.dtype), x))


def _hypot(node: fx.Node, imp: Any) -> relax.Expr:
    """``hypot`` (no converter in TVM 0.27): ``m * sqrt((x/m)^2 + (y/m)^2)`` with ``m`` the
    larger magnitude, so that ``1e30`` does not overflow where ``sqrt(x^2 + y^2)`` would
    (``m = 0``: 0)."""
    bb = imp.block_builder
    x, y = imp.env[node.args[0]], imp.env[node.args[1]]
    ax, ay = bb.emit(relax.op.abs(x)), bb.emit(relax.op.abs(y))
    m = bb.emit(relax.op.maximum(ax, ay))
    zero = relax.const(0.0, x.ty.dtype)
    safe = bb.emit(relax.op.where(relax.op.equal(m, zero), relax.const(1.0, x.ty.dtype), m))
    r = relax.op.add(relax.op.square(relax.op.divide(ax, safe)),
                     relax.op.square(relax.op.divide(ay, safe)))
    return bb.emit(relax.op.multiply(m, relax.op.sqrt(r)))


def _adaptive_max_pool2d(node: fx.Node, imp: Any) -> relax.Expr:
    """``adaptive_max_pool2d`` (no converter in TVM 0.27) where the output size divides the
    input's: a max pool with window and stride ``in / out`` (a global max pool, a 2x
    reduction). The op also returns the argmax positions, which only a use refuses."""
    x = imp.env[node.args[0]]
    out = node.args[1]
    out = [out, out] if isinstance(out, int) else list(out)
    hw = [int(d) for d in x.ty.shape.values[-2:]]
    out = [hw[i] if o is None else int(o) for i, o in enumerate(out)]
    where = f"aten.adaptive_max_pool2d ({node.name})"
    if any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
        raise ValueError(f"{where}: its argmax indices are used, which opsdk does not "
                         "compute; use the pooled values only (or torch.nn.MaxPool2d with "
                         "return_indices outside the model)")
    if any(o <= 0 or h % o for h, o in zip(hw, out)):
        raise ValueError(f"{where}: output size {out} does not divide the input's {hw}, "
                         "which opsdk pools only in equal windows; pick an output size that "
                         "divides it, or pad the input")
    k = [h // o for h, o in zip(hw, out)]
    y = imp.block_builder.emit(relax.op.nn.max_pool2d(x, k, k))
    return imp.block_builder.emit(relax.Tuple([y, y]))  # [1]: never read (checked above)


def _extreme(reduce: Callable[..., relax.Expr]) -> Converter:
    """``amax`` / ``amin`` (a reduction over ``dim``, all dims when empty): TVM 0.27's
    importer has no converter ("Unsupported function types ['amax.default']"), so a
    PointNet's max over its points did not import."""

    def convert(node: fx.Node, imp: Any) -> relax.Expr:
        a = [*node.args, None, None]
        x = imp.env[a[0]]
        dim = a[1] if a[1] is not None else node.kwargs.get("dim", [])
        keep = bool(a[2] if a[2] is not None else node.kwargs.get("keepdim", False))
        dims = [dim] if isinstance(dim, int) else list(dim or [])
        return imp.block_builder.emit(reduce(x, dims or None, keep))

    return convert


def _with_alpha(scaled: int, base: Callable[[Any], Callable[[Any], relax.Expr]]) -> Converter:
    """``add`` / ``sub`` / ``rsub`` with torch's ``alpha`` (``x + alpha * y``; ``rsub``:
    ``y - alpha * x``): TVM 0.27's converters drop it, so ``torch.add(x, y, alpha=2)``
    imported as ``x + y``. Argument ``scaled`` is multiplied by ``alpha`` first, then TVM's
    own converter (``base(importer)``) runs, so ``alpha=1`` imports exactly as before."""

    def convert(node: fx.Node, imp: Any) -> relax.Expr:
        import torch  # heavy: torch

        alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
        if alpha == 1:
            return base(imp)(node)
        args = list(node.args[:2])
        v = args[scaled]
        if isinstance(v, torch.fx.Node):
            e = imp.env[v]
            args[scaled] = imp.block_builder.emit(
                relax.op.multiply(e, relax.const(alpha, e.ty.dtype)))
        else:
            args[scaled] = v * alpha
        return base(imp)(types.SimpleNamespace(args=tuple(args), kwargs={},
                                               target=node.target, name=node.name))

    return convert


#: Converters for aten overloads TVM 0.27's importer gets wrong; below opsdk's op mappings
#: and the caller's ``custom_convert_map`` in precedence.
_ATEN_FIXES: dict[str, Converter] = {
    "div.Tensor_mode": _div_mode,
    "cat.default": _cat,
    "add.Tensor": _with_alpha(1, lambda imp: imp._binary_op(relax.op.add, operator.add)),
    "add_.Tensor": _with_alpha(1, lambda imp: imp._binary_op(relax.op.add, operator.add)),
    "sub.Tensor": _with_alpha(1, lambda imp: imp._binary_op(relax.op.subtract, operator.sub)),
    "rsub.Tensor": _with_alpha(0, lambda imp: imp._rsub),
    "rsub.Scalar": _with_alpha(0, lambda imp: imp._rsub),
    "select.int": _indexing.select,
    "index.Tensor": _indexing.index,
    "index_put.default": _indexing.index_put,
    "index_put_.default": _indexing.index_put,
    "convolution.default": _convolution,
    "amax.default": _extreme(relax.op.max),
    "elu.default": _elu,
    "exp2.default": _exp2,
    "hypot.default": _hypot,
    "adaptive_max_pool2d.default": _adaptive_max_pool2d,
    "var_mean.correction": _var_mean,
    "grid_sampler_2d.default": _grid_sample,
    "clamp.default": _integer_clamp("clamp"),
    "clamp_min.default": _integer_clamp("clamp_min"),
    "clamp_max.default": _integer_clamp("clamp_max"),
    "amin.default": _extreme(relax.op.min),
    "conv_transpose3d.input": _convolution,
    **RECURRENT,
}


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
    (both approximations), softmax, GroupNorm and scaled dot-product attention (each op
    file's ``OpDef.torch`` mapping says where it applies).

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

    names = [d.name for d in _select(ops)]
    custom = dict(custom_convert_map or {})
    if op_mappings is None:
        op_mappings = ops is None
    mapped = _op_mappings(skip=custom) if op_mappings else {}
    as_is = False
    if decompose:
        # recurrent layers this path runs as one kernel each arrive whole (_recurrent.py)
        keep = [*custom, *_user_keep(mapped), *recurrent_kept(exported_program)]
        table = decomposition_table(names, keep=keep)
        # torch's second trace only where it changes what the importer sees (_asis.py)
        as_is = importable_as_is(exported_program, table, _kept_ops(names, True, keep))
        if not as_is:
            exported_program = exported_program.run_decompositions(table)
    cmap: dict[str, Converter] = torch_convert_map(names)
    # A mapped aten op TVM's importer cannot convert (rms_norm) still imports when its op's
    # mapping is not applied (decompose=False, or not selected).
    for d in registered_ops():
        for aten, fn in d.torch_unmapped.items():
            cmap.setdefault(aten, fn)
    for aten, fn in _ATEN_FIXES.items():
        cmap.setdefault(aten, fn)
    if as_is:  # below the mappings (their ops are kept whole in either path)
        cmap.update(as_is_converters())
    hits = dict.fromkeys([*mapped, *custom], 0)
    cmap.update({k: _counted(k, fn, hits) for k, (_, fn) in mapped.items()})
    cmap.update({k: _counted(k, fn, hits) for k, fn in custom.items()})
    try:
        mod = from_exported_program(
            exported_program, custom_convert_map=cmap, run_ep_decomposition=False, **kwargs
        )
    except AssertionError as e:  # TVM's check of the program's ops: say which and what to do
        if not str(e).startswith("Unsupported function types"):
            raise
        names = str(e).removeprefix("Unsupported function types ").strip("[]").replace("'", "")
        raise ValueError(
            f"torch ops that neither TVM 0.27's importer nor opsdk converts: {names}; convert "
            "each with "
            "custom_convert_map={'aten_name.overload': f} (opsdk.frontend.from_torch) or an "
            "op's OpDef.torch mapping (docs/model-compile.md), or rewrite them in the model"
        ) from None
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
