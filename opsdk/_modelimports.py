"""Model zoos beside a CPU torch: torchvision's Python half without its C++ extension.

timm imports torchvision, and so do transformers' model modules when torchvision is
installed. The only torchvision wheels the package index serves are CUDA builds, whose C++
extension (``torchvision/_C.so``) needs ``libtorch_cuda.so`` and does not load beside a CPU
torch: torchvision then skips its C++ ops, but its ``_meta_registrations`` still registers
fake kernels for ``torchvision::nms`` / ``qnms`` unconditionally, and ``import torchvision``
dies with ``operator torchvision::nms does not exist`` (transformers reports it as ``Could
not import module 'BertModel'``). Measured with torch 2.13.0+cpu and torchvision
0.28.0+cu130, timm 1.0.31, transformers 5.24.0.

:func:`prepare_model_imports` puts an import hook in front of torchvision. After
``torchvision.extension`` ran, when the extension did not load, it defines those ops'
schemas, each with a kernel that raises a :class:`TorchvisionOpUnavailable` naming the
cause: the models, transforms and everything else pure-Python import and run (timm's
MobileNetV3, torchvision's ResNet, transformers' BERT: forward and ``torch.export``), and
only a C++ op says why it cannot run. Should torchvision still fail to import, the hook
turns what it raised into one :class:`ZooImportError` line naming the cause and the fix.
A torchvision whose extension loads is not touched.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import sys
from types import ModuleType
from typing import Any

__all__ = ["TorchvisionOpUnavailable", "ZooImportError", "prepare_model_imports",
           "zoo_import_error"]

#: The C++ ops torchvision >= 0.20 registers fake kernels for whether or not its extension
#: loaded (``torchvision/_meta_registrations.py``), with their schemas from its csrc.
STAND_INS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_FIX = "install the torchvision built for this torch (PyTorch's CPU wheel index)"

_LIBS: list[Any] = []  # the torch.library.Library holding the stand-ins (kept alive)
_STATE: dict[str, str | None] = {"cause": None}


class ZooImportError(ImportError):
    """torchvision (under timm or transformers) failed to import even with the stand-ins:
    one line naming the versions, the cause and the fix; the original is the ``__cause__``.

    Examples
    --------
    >>> from opsdk._modelimports import ZooImportError
    >>> isinstance(ZooImportError("x"), ImportError)
    True
    """


class TorchvisionOpUnavailable(RuntimeError):
    """A torchvision C++ op was called while its extension is not loaded (see
    :func:`prepare_model_imports`).

    Examples
    --------
    >>> from opsdk._modelimports import TorchvisionOpUnavailable
    >>> issubclass(TorchvisionOpUnavailable, RuntimeError)
    True
    """


def prepare_model_imports() -> None:
    """Let ``import torchvision`` (and timm, transformers) work beside a torch its C++
    extension was not built for; call before importing a user's model file. Idempotent,
    and a no-op once torchvision is imported.

    Examples
    --------
    >>> import sys
    >>> from opsdk._modelimports import prepare_model_imports
    >>> prepare_model_imports()
    >>> prepare_model_imports()  # the hook goes in once
    >>> sum(type(f).__name__ == "_TorchvisionHook" for f in sys.meta_path) <= 1
    True
    """
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionHook)
                                           for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionHook())


def zoo_import_error(exc: BaseException) -> ZooImportError | None:
    """The :class:`ZooImportError` behind ``exc`` (itself, or in its ``__cause__`` /
    ``__context__`` chain: transformers re-raises it as ``Could not import module
    'BertModel'``), or None.

    Examples
    --------
    >>> from opsdk._modelimports import ZooImportError, zoo_import_error
    >>> try:
    ...     try:
    ...         raise ZooImportError("torchvision 0.28.0 does not import")
    ...     except ImportError as e:
    ...         raise ModuleNotFoundError("Could not import module 'BertModel'") from e
    ... except ImportError as outer:
    ...     str(zoo_import_error(outer))
    'torchvision 0.28.0 does not import'
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, ZooImportError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of ``torchvision`` (one-line failure) and ``torchvision.extension``
    (stand-ins when the extension did not load)."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in ("torchvision", "torchvision.extension") or self._busy:
            return None
        self._busy = True
        try:  # the spec the other finders would give
            spec = None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, fullname: str) -> None:
        self._inner, self._name = inner, fullname

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps the real loader (importlib.resources, reloads).
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        if self._name == "torchvision.extension":
            self._inner.exec_module(module)
            has_ops = getattr(module, "_has_ops", None)
            if callable(has_ops) and not has_ops():
                _define_stand_ins(module)
            return
        _STATE["cause"] = None  # a fresh import: an earlier attempt's cause is not this one's
        try:
            self._inner.exec_module(module)
        except Exception as e:
            raise ZooImportError(_refusal(e)) from e


def _versions() -> str:
    import torch  # heavy: torch

    try:
        tv = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        tv = "?"
    return f"torchvision {tv} beside torch {torch.__version__}"


def _extension_cause(ext: ModuleType) -> str:
    """Why torchvision's ``_C`` extension does not load (the dynamic loader's message)."""
    folder = pathlib.Path(getattr(ext, "__file__", "") or ".").parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        so = folder / f"_C{suffix}"
        if so.exists():
            try:  # a failed dlopen changes nothing; torchvision's own attempt hid the reason
                ctypes.CDLL(str(so))
            except OSError as e:
                return _dl_reason(str(e))
            return "its C++ ops did not register"
    return "it has no C++ extension"


def _dl_reason(message: str) -> str:
    """The dynamic loader's message, short: ``libc10_cuda.so: cannot open shared object
    file: ...`` is ``needs libc10_cuda.so`` (a CUDA build beside a CPU torch)."""
    first = message.splitlines()[0] if message else "the dynamic loader refused it"
    lib, sep, _ = first.partition(": cannot open shared object file")
    if sep and "/" not in lib:
        return f"needs {lib}"
    return first if len(first) <= 120 else first[:117] + "..."


def _define_stand_ins(ext: ModuleType) -> None:
    import torch  # heavy: torch

    _STATE["cause"] = f"its C++ extension does not load ({_extension_cause(ext)})"
    missing = {n: s for n, s in STAND_INS.items() if not hasattr(torch.ops.torchvision, n)}
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in missing.items():
        lib.define(schema)
        lib.impl(name, _unavailable(name), "CompositeExplicitAutograd")
    _LIBS.append(lib)


def _unavailable(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise TorchvisionOpUnavailable(
            f"torchvision::{name} cannot run: {_versions()}: {_STATE['cause']}; its models and "
            f"transforms work without it; for its C++ ops, {_FIX}")

    return kernel


def _refusal(e: BaseException) -> str:
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    text = text if len(text) <= 100 else text[:97] + "..."  # the whole stays one short line
    why = _STATE["cause"] or f"{type(e).__name__}: {text}"
    detail = f" ({type(e).__name__}: {text})" if _STATE["cause"] else ""
    return f"{_versions()} does not import: {why}{detail}; fix: {_FIX}"
