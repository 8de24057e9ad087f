"""opsdk: author custom Apache TVM operators once, get them registered, scheduled per target
and verified.

``import opsdk`` is cheap: TVM (and torch through it) is imported, and the built-in ops (an
explicit list, :data:`opsdk.ops.BUILTIN_OPS`) are registered, on the first use of any opsdk
name or of an op lookup, so the command line's ``--help`` and a pytest run that only loads the
plugin do not pay for them. Code that hands TVM a module with opsdk calls without touching
opsdk first calls :func:`register_builtin_ops`. Plugin ops from other packages are registered
on request with :func:`load_plugins`.

Examples
--------
>>> import opsdk
>>> [d.name for d in opsdk.list_ops()][:3]
['attention', 'bias_gelu', 'dense_q4']
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # the names __getattr__ provides, for type checkers and editors
    from . import deploy, drift, frontend, model, relax, transform
    from ._declare import op
    from ._domains import Bounded, LogUniform, bounded, log_uniform
    from ._dtypes import FLOAT_DTYPES
    from ._opdef import Axis, OpDef, OpDefinitionError, Param, Tensor
    from ._pipeline import pipeline
    from ._plugins import import_beside
    from .registry import get_op, is_registered, register, registered_ops, unregister
    from .schedules import rule
    from .targets import target
    from .transform import LowerOps

#: Public name -> (module, attribute; None for the module itself), bound on first use.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    **{m: (f".{m}", None) for m in (
        "deploy", "drift", "frontend", "model", "relax", "transform")},
    **{n: ("._domains", n) for n in ("Bounded", "LogUniform", "bounded", "log_uniform")},
    "FLOAT_DTYPES": ("._dtypes", "FLOAT_DTYPES"),
    **{n: ("._opdef", n) for n in ("Axis", "OpDef", "OpDefinitionError", "Param", "Tensor")},
    "op": ("._declare", "op"),
    "import_beside": ("._plugins", "import_beside"),
    **{n: (".registry", n)
       for n in ("get_op", "is_registered", "register", "registered_ops", "unregister")},
    "rule": (".schedules", "rule"),
    "target": (".targets", "target"),
    "LowerOps": (".transform", "LowerOps"),
    "pipeline": ("._pipeline", "pipeline"),
}


def _bind(name: str) -> Any:
    module, attr = _EXPORTS[name]
    if module in ("._opdef", "._declare"):  # an op's .rule and call hand over to the rules
        # and the registry, which install themselves when they load
        importlib.import_module(".registry", __name__)
    m = importlib.import_module(module, __name__)
    value = m if attr is None else getattr(m, attr)
    globals()[name] = value
    return value


def _load() -> None:
    """Register the built-in ops (once): on the first op lookup (``opsdk.registry``), or
    from the functions below."""
    from .registry import load_builtin_ops

    load_builtin_ops()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return _bind(name)  # only what was asked for: opsdk's own modules import each other
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # opsdk.ops, opsdk.verify, ...
    raise AttributeError(f"module 'opsdk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "FLOAT_DTYPES",
    "Axis",
    "Bounded",
    "LogUniform",
    "LowerOps",
    "OpDef",
    "OpDefinitionError",
    "Param",
    "Tensor",
    "bounded",
    "compile",
    "deploy",
    "drift",
    "explain",
    "frontend",
    "get_op",
    "import_beside",
    "is_registered",
    "list_ops",
    "load_plugins",
    "log_uniform",
    "model",
    "op",
    "pipeline",
    "register",
    "register_builtin_ops",
    "registered_ops",
    "relax",
    "rule",
    "target",
    "transform",
    "unregister",
]

def register_builtin_ops() -> list[OpDef]:
    """Register the built-in ops and their schedule rules (idempotent)."""
    from .registry import register_builtin_ops as _register

    return _register()


def list_ops() -> list[OpDef]:
    """Registered ops, sorted by name.

    Examples
    --------
    >>> import opsdk
    >>> "layer_norm" in [d.name for d in opsdk.list_ops()]
    True
    """
    from .registry import registered_ops

    return registered_ops()


def load_plugins(modules: list[str] | None = None) -> list[OpDef]:
    """Register ops from the ``opsdk.ops`` entry-point group and from ``modules``."""
    from ._plugins import load_plugins as _load_plugins

    _load()
    return _load_plugins(modules)


def compile(mod, target="x86", *, params=None, winograd=True, **kwargs):
    """``tvm.compile`` with opsdk lowering for ``target`` (a friendly name or TVM target).

    ``params`` maps parameter names of ``main`` to arrays that are bound as constants before
    compiling (e.g. weights of a model imported with ``keep_params_as_input=True``; TVM's own
    ``params`` argument does not bind them); ``params=True`` binds the values the importer
    attached to ``main`` (see :func:`opsdk.frontend.bind_params`). ``winograd=False``
    computes every conv directly (by default eligible 3x3 convs run Winograd F(2x2, 3x3):
    :mod:`opsdk.kernels.winograd`). Other keyword arguments go to ``tvm.compile``.
    """
    from ._pipeline import compile_module

    return compile_module(mod, target, params=params, winograd=winograd, **kwargs)


def explain(op_name: str, target="x86", **kwargs):
    """Which schedule rule lowers ``op_name`` on ``target`` and why, plus the lowered TIR."""
    from ._explain import explain as _explain

    _load()
    return _explain(op_name, target, **kwargs)
