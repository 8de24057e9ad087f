"""opsdk: author custom Apache TVM operators once, get them registered, scheduled per target
and verified.

Importing opsdk registers the built-in ops (an explicit list, :data:`opsdk.ops.BUILTIN_OPS`).
Plugin ops from other packages are registered on request with :func:`load_plugins`.

Examples
--------
>>> import opsdk
>>> [d.name for d in opsdk.list_ops()][:3]
['bias_gelu', 'gelu', 'group_norm']
"""

from __future__ import annotations

from . import drift, frontend, model, relax, transform
from ._domains import Bounded, LogUniform, bounded, log_uniform
from ._dtypes import FLOAT_DTYPES
from ._opdef import Axis, OpDef, OpDefinitionError, Param, Tensor, op
from ._plugins import import_beside
from .register import get_op, is_registered, register, registered_ops, unregister
from .schedules import rule
from .targets import target
from .transform import LowerOps, pipeline

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

__version__ = "0.1.0"


def register_builtin_ops() -> list[OpDef]:
    """Register the built-in ops and their schedule rules (idempotent)."""
    from .ops import BUILTIN_OPS
    from .schedules import load_builtin_rules

    load_builtin_rules()
    return [register(d) for d in BUILTIN_OPS]


def list_ops() -> list[OpDef]:
    """Registered ops, sorted by name.

    Examples
    --------
    >>> import opsdk
    >>> "layer_norm" in [d.name for d in opsdk.list_ops()]
    True
    """
    return registered_ops()


def load_plugins(modules: list[str] | None = None) -> list[OpDef]:
    """Register ops from the ``opsdk.ops`` entry-point group and from ``modules``."""
    from ._plugins import load_plugins as _load

    return _load(modules)


def compile(mod, target="x86", *, params=None, **kwargs):
    """``tvm.compile`` with opsdk lowering for ``target`` (a friendly name or TVM target).

    ``params`` maps parameter names of ``main`` to arrays that are bound as constants before
    compiling (e.g. weights of a model imported with ``keep_params_as_input=True``; TVM's own
    ``params`` argument does not bind them); ``params=True`` binds the values the importer
    attached to ``main`` (see :func:`opsdk.frontend.bind_params`). Other keyword arguments go
    to ``tvm.compile``.
    """
    import tvm

    t = globals()["target"](target)
    if params is not None and params is not False:
        mod = frontend.bind_params(mod, None if params is True else params)
    return tvm.compile(mod, target=t, relax_pipeline=pipeline(t), **kwargs)


def explain(op_name: str, target="x86", **kwargs):
    """Which schedule rule lowers ``op_name`` on ``target`` and why, plus the lowered TIR."""
    from ._explain import explain as _explain

    return _explain(op_name, target, **kwargs)


register_builtin_ops()
