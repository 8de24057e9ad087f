"""Discovery of ops from other packages: the ``opsdk.ops`` entry-point group or module names.

A plugin module lists its ops explicitly in ``OPS`` (a sequence of :class:`~opsdk.OpDef`);
an entry point may also point straight at such a sequence or at a single OpDef.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Iterable
from importlib import metadata

from ._opdef import OpDef
from ._userfile import import_user_module, user_code
from .ops import BUILTIN_OPS
from .registry import register

__all__ = ["import_beside", "load_plugins", "ops_of"]

ENTRY_POINT_GROUP = "opsdk.ops"


def ops_of(obj: object, where: str) -> list[OpDef]:
    """The OpDefs an entry point or module exposes (``OPS`` for modules)."""
    if isinstance(obj, OpDef):
        return [obj]
    if hasattr(obj, "OPS"):
        obj = obj.OPS
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        items = list(obj)
        if all(isinstance(o, OpDef) for o in items):
            return items
    raise TypeError(
        f"{where}: expected an OpDef, a sequence of OpDefs, or a module with OPS = [...]; "
        f"got {type(obj).__name__}"
    )


def load_plugins(modules: Iterable[str] | None = None, *, entry_points: bool = True) -> list[OpDef]:
    """Import and register plugin ops; returns them (already-registered ones included).

    A module that is not there raises ``ImportError``; one that has a syntax error or raises
    while imported raises :class:`~opsdk._userfile.UserCodeError` naming its file and line.

    Examples
    --------
    >>> import opsdk
    >>> opsdk.load_plugins(["opsdk.ops"])[0].name
    'layer_norm'
    """
    found: list[OpDef] = []
    if entry_points:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            with user_code(f"entry point {ep.name} = {ep.value}"):  # a broken plugin
                obj = ep.load()
            for d in ops_of(obj, f"entry point {ep.name} = {ep.value}"):
                d.source = f"entry point {ep.name} ({ep.value})"
                found.append(d)

    for name in modules or ():
        mod = import_user_module(name)
        if name == "opsdk.ops":
            items = list(mod.BUILTIN_OPS)
        else:
            items = ops_of(mod, f"module {name}")
            for d in items:
                if not any(d is b for b in BUILTIN_OPS):  # e.g. opsdk.ops.int8: still built-in
                    d.source = f"module {name}"
        found.extend(items)
    return [register(d) for d in found]


def import_beside(anchor_file: str, module: str):
    """Import ``module`` from the directory of ``anchor_file`` (once), e.g. an op file's
    schedule rules. Works whether or not that directory is a package on ``sys.path``.

    Examples
    --------
    >>> import opsdk.ops
    >>> from opsdk import import_beside
    >>> import_beside(opsdk.ops.__file__, "softmax").__name__
    'opsdk.ops.softmax'
    """

    folder = pathlib.Path(anchor_file).resolve().parent
    path = folder / f"{module}.py"
    if not path.is_file():
        raise ImportError(f"{path} not found (imported beside {anchor_file})")
    # Already imported (under any name)? Reuse it so rules are not registered twice.
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and pathlib.Path(f).resolve() == path:
            return mod
    anchor = next(
        (
            m
            for m in list(sys.modules.values())
            if getattr(m, "__file__", None)
            and pathlib.Path(m.__file__).resolve() == pathlib.Path(anchor_file).resolve()
        ),
        None,
    )
    pkg = getattr(anchor, "__package__", None) if anchor else None
    if pkg:
        return importlib.import_module(f"{pkg}.{module}")
    name = f"_opsdk_beside_{abs(hash(str(path)))}_{module}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
