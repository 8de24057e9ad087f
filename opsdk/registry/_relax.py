"""Relax glue: turn an :class:`~opsdk.OpDef` into the Relax op ``opsdk.<name>``.

TVM's op registry cannot forget an op, and setting an attribute twice at one level raises.
So each TVM op gets trampolines once (FInferType, FLegalize) that look the definition up in
``_REGISTRY`` by name: registering again is a no-op, a new definition replaces the table entry,
and ``unregister`` removes it (the trampolines then raise a clear error).
"""

from __future__ import annotations

import inspect
import pathlib
from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax, te

from .._opdef import OpDef, install_handler
from ..kernels import KERNEL_OPS
from ..ops import BUILTIN_OPS
from ..schedules import apply_schedule, load_builtin_rules, scheduling_deferred

__all__ = [
    "builder",
    "decode_call",
    "get_op",
    "is_registered",
    "register",
    "registered_ops",
    "unregister",
]

_REGISTRY: dict[str, OpDef] = {}
_INPUTS_KEY = "opsdk.inputs"  # comma-joined names of the tensor inputs present in the call
_HOOKED: set[str] = set()


def register(d: OpDef, *, replace: bool = False) -> OpDef:
    """Register ``d`` as the Relax op ``opsdk.<name>``.

    Registering the same definition twice is a no-op. A different definition under an existing
    name raises unless ``replace=True``.

    Examples
    --------
    >>> import opsdk
    >>> opsdk.register(opsdk.get_op("gelu")).op_name
    'opsdk.gelu'
    """
    if not isinstance(d, OpDef):
        hint = (f"; to look one up use opsdk.get_op({d!r})" if isinstance(d, str) else
                "; define it with @opsdk.op")
        raise TypeError(f"opsdk.register takes an OpDef, got {type(d).__name__} {d!r}{hint}")
    _builtins()  # first: a built-in registered later would clash with a replacement
    old = _REGISTRY.get(d.name)
    if old is d:
        return d
    if old is not None and not replace:
        raise ValueError(
            f"opsdk.{d.name}: an op of this name is already registered (from {old.module}); "
            "pick another name, or pass replace=True / call opsdk.unregister first"
        )
    _ensure_tvm_op(d.name)
    _REGISTRY[d.name] = d
    return d


def unregister(name: str | OpDef) -> None:
    """Remove an op from opsdk (its TVM op stays, inert). Unknown names are ignored."""
    _builtins()  # first: else the first lookup would register it again
    key = name.name if isinstance(name, OpDef) else name
    _REGISTRY.pop(key, None)


_LOADED = False


def _builtins() -> None:
    """Register the built-in ops (once), on the first op lookup or first use of opsdk (see
    ``opsdk/__init__.py``)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True  # first: registering looks ops up
    register_builtin_ops()


def load_builtin_ops() -> None:
    """Register the built-in ops unless done already (what every lookup does first)."""
    _builtins()


def register_builtin_ops() -> list[OpDef]:
    """Register the built-in ops (:data:`opsdk.ops.BUILTIN_OPS`) and schedule rules
    (idempotent).

    Examples
    --------
    >>> from opsdk.registry import register_builtin_ops
    >>> "opsdk.layer_norm" in [d.op_name for d in register_builtin_ops()]
    True
    """
    load_builtin_rules()
    return [register(d) for d in BUILTIN_OPS]


def register_kernels() -> list[OpDef]:
    """Register the kernel families (:data:`opsdk.kernels.KERNEL_OPS`) as Relax ops
    ``opsdk.tvm_*`` (idempotent): not done by ``import opsdk`` (they are not ops to put in a
    model); verify does it for a ``--kernels`` run."""

    return [register(d) for d in KERNEL_OPS]


def is_registered(name: str) -> bool:
    """Whether ``opsdk.<name>`` is registered with opsdk."""
    _builtins()
    return name in _REGISTRY


def registered_ops() -> list[OpDef]:
    """The registered op definitions, sorted by name."""
    _builtins()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def get_op(name: str) -> OpDef:
    """Look up a registered op by name (with or without the ``opsdk.`` prefix)."""
    _builtins()
    key = name.removeprefix("opsdk.")
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(
            f"no opsdk op named {key!r}; registered: {', '.join(sorted(_REGISTRY)) or 'none'}"
            + _module_hint(key)
        ) from None


def _module_hint(name: str) -> str:
    """How to load an op that lives in a module nobody imported (e.g. right after
    ``opsdk new-op NAME``, whose ``NAME.py`` is in the current directory)."""

    here = pathlib.Path.cwd() / f"{name}.py"
    if not here.is_file():
        return ""
    return (f". ./{name}.py is here: load it first (on the command line: --module {name}; "
            f"in Python: opsdk.load_plugins([{name!r}]))")


def _ensure_tvm_op(name: str) -> None:
    full = f"opsdk.{name}"
    if full in _HOOKED:
        return
    try:
        op = tvm.ir.Op.get(full)
    except Exception:  # not registered with TVM yet
        tvm.get_global_func("ir.RegisterOp")(full, f"opsdk op {name}")
        op = tvm.ir.Op.get(full)
    for attr, value in (
        ("FInferType", lambda call, ctx: _infer_type(name, call)),
        ("FLegalize", lambda bb, call: _legalize(name, bb, call)),
        ("FPurity", True),
        ("TScriptPrinterName", full),
    ):
        if op.has_attr(attr):  # e.g. left by an earlier opsdk in the same process
            op.reset_attr(attr)
        op.set_attr(attr, value)
    _HOOKED.add(full)


def _lookup(name: str) -> OpDef:
    _builtins()
    d = _REGISTRY.get(name)
    if d is None:
        raise ValueError(f"opsdk.{name} is not registered (it was unregistered); register it again")
    return d


def decode_call(call: relax.Call) -> tuple[OpDef, dict[str, Any], dict[str, Any]]:
    """Split an ``opsdk.*`` call into (definition, {input: relax expr}, attributes)."""
    d = _lookup(call.op.name.removeprefix("opsdk."))
    raw = call.attrs
    # DictAttrs supports keys() and [] but not iteration.
    attrs = {k: raw[k] for k in raw.keys()} if raw is not None else {}  # noqa: SIM118
    names = str(attrs.pop(_INPUTS_KEY, d.primary)).split(",")
    if len(names) != len(call.args):
        raise ValueError(f"{d.op_name}: call has {len(call.args)} inputs but attrs list {names}")
    return d, dict(zip(names, call.args)), attrs


def _types(d: OpDef, args: dict[str, Any]) -> tuple[dict, dict]:
    shapes, dtypes = {}, {}
    for name, arg in args.items():
        ty = arg.ty
        if not isinstance(ty, relax.TensorType):
            raise d.error(name, f"is a {type(ty).__name__}, not a tensor", "pass a Relax tensor")
        if ty.ndim < 0:
            shapes[name] = None
        elif ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
            raise d.error(
                name, "has a rank but no shape", "give it a shape (symbolic dims are fine)"
            )
        else:
            shapes[name] = tuple(ty.shape.values)
        dtypes[name] = str(ty.dtype)
    return shapes, dtypes


def _infer_type(name: str, call: relax.Call) -> relax.TensorType | relax.TupleType:
    d, args, attrs = decode_call(call)
    shapes, dtypes = _types(d, args)
    outs = [relax.TensorType(list(shape), dtype)
            for shape, dtype in d.result_types(shapes, dtypes, attrs)]
    # A multi-output op's call is a tuple (its outputs in the compute's order).
    return outs[0] if d.n_outputs == 1 else relax.TupleType(outs)


#: TVM's fusion pattern kOpaque: FuseOps never merges such a kernel with its neighbours.
_OPAQUE = 8


def _legalize(name: str, bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    d, args, attrs = decode_call(call)
    shapes, dtypes = _types(d, args)
    nattrs = d.validate(shapes, dtypes, attrs)
    present = list(args)

    def te_fn(*tensors):
        by_name = dict(zip(present, tensors))
        out = d.call_compute([by_name.get(p.name) for p in d.tensor_params], nattrs)
        return out if isinstance(out, te.Tensor) else list(out)

    out = bb.call_te(
        te_fn,
        *args.values(),
        primfunc_name_hint=f"opsdk_{d.name}",
        primfunc_attrs={"opsdk.op": d.name},
    )
    gv = out.args[0]
    func = bb.get()[gv]
    if scheduling_deferred():
        # The model pipeline schedules after fusion; only elementwise ops may fuse (into a
        # producer's epilogue), the others keep their own kernel and rules.
        if d.kind != "elementwise" and "op_pattern" not in (func.attrs or {}):
            bb.update_func(gv, func.with_attr("op_pattern", _OPAQUE))
        return out
    if "opsdk.rule" not in (func.attrs or {}):  # call_te may reuse an identical function
        target = tvm.target.Target.current(allow_none=True)
        scheduled = apply_schedule(d, func, target)
        bb.update_func(gv, scheduled)
    return out


def builder(d: OpDef) -> Callable[..., relax.Call]:
    """A function building ``relax.Call(opsdk.<name>, ...)`` with checked attributes."""
    sig = inspect.signature(d.compute)

    def build(*args: Any, **kwargs: Any) -> relax.Call:
        _builtins()
        if d.name not in _REGISTRY:
            raise ValueError(f"{d.op_name} is not registered; call opsdk.register(op) first")
        known = {p.name for p in d.params}
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{d.op_name}: {e}") from None
        tensors, names = [], []
        attrs: dict[str, Any] = {}
        for p in d.params:
            if p.name not in bound.arguments:
                if p.kind == "tensor" and not p.optional:
                    raise d.error(p.name, "is missing", "pass a tensor for it")
                continue
            v = bound.arguments[p.name]
            if p.kind == "tensor":
                if v is None:
                    continue
                if not isinstance(v, relax.Expr):
                    raise d.error(
                        p.name, f"is a {type(v).__name__}", "pass a relax.Expr (Var or call)"
                    )
                tensors.append(v)
                names.append(p.name)
            else:
                attrs[p.name] = v
        attrs = d.bind_attrs({**attrs, **extra})  # unknown names get a clear error here
        attrs[_INPUTS_KEY] = ",".join(names)
        return relax.Call(tvm.ir.Op.get(d.op_name), tensors, tvm.ir.attrs.DictAttrs(attrs))

    build.__name__ = d.name
    build.__doc__ = f"Build a Relax call of ``{d.op_name}``.\n\n{d.doc}"
    build.__signature__ = sig  # type: ignore[attr-defined]
    return build


install_handler("builder", builder)  # calling an OpDef (opsdk._opdef cannot import this package)
