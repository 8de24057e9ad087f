"""The boundary where a user's own code and files enter opsdk: op modules, model files, their
entry functions, ``.onnx`` files.

Whatever goes wrong inside them (a syntax error, an exception at import or in the entry
function, a corrupt file) becomes one :class:`UserCodeError` whose message is
``path:line: ErrorType: message`` at the user's innermost frame: opsdk's own frames and the
libraries' never name the place. The command line prints it as one line (exit 2).
``KeyboardInterrupt`` passes through untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType, TracebackType
from typing import Any, TypeVar

from ._cliargs import model_path_problem

__all__ = ["UserCodeError", "call_entry", "call_user", "example_args", "import_model_module",
           "import_user_file", "import_user_module", "load_onnx_file", "one_line",
           "read_user_file", "user_code", "user_modules"]

T = TypeVar("T")

_OPSDK_DIR = pathlib.Path(__file__).resolve().parent


class UserCodeError(Exception):
    """A user's file or function failed: ``path:line: ErrorType: message`` in one line.

    ``path`` and ``line`` name the user's innermost frame (``line`` is None when only the
    file is known); the original exception is the ``__cause__``.

    Examples
    --------
    >>> from opsdk._userfile import UserCodeError
    >>> str(UserCodeError("m.py", 3, "KeyError: 'x'"))
    "m.py:3: KeyError: 'x'"
    """

    def __init__(self, path: str, line: int | None, detail: str) -> None:
        self.path, self.line, self.detail = path, line, detail
        super().__init__(f"{path}:{line}: {detail}" if line else f"{path}: {detail}")


def _library_dirs() -> list[pathlib.Path]:
    """Where the interpreter's and the installed packages' files live (not the user's)."""
    out = {_OPSDK_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            out.add(pathlib.Path(sysconfig.get_paths()[key]).resolve())
    return sorted(out)


# Once, at import: sysconfig imports its data module on first use, which must not happen
# while a failed import is being cleaned up (sys.modules is restored as it was).
_LIBRARY_DIRS = _library_dirs()


def _is_under(p: pathlib.Path, folders: list[pathlib.Path]) -> bool:
    return any(p == f or f in p.parents for f in folders)


def one_line(e: BaseException) -> str:
    """``ErrorType: first line of the message`` (TVM's messages carry their own traceback:
    their last line is the message; a first line ending in a colon, such as TVM's "Check
    failed at file:line:", takes the next line with it).

    Examples
    --------
    >>> from opsdk._userfile import one_line
    >>> one_line(ValueError("Traceback (most recent call last):\\n  ...\\nbad shape"))
    'ValueError: bad shape'
    >>> one_line(RuntimeError("Check failed at relax/op.cc:42:\\nshapes 3 and 4 differ"))
    'RuntimeError: Check failed at relax/op.cc:42: shapes 3 and 4 differ'
    """
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Traceback"):
        lines = lines[-1:]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # "Check 'false' failed at ...:" says nothing
        text = f"{text} {lines[1]}"
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _user_frame(tb: TracebackType | None, anchor: pathlib.Path | None) -> tuple[str, int] | None:
    """The innermost frame of the user's code: in ``anchor``'s folder, or outside opsdk, the
    standard library and the installed packages."""
    libs = _LIBRARY_DIRS
    found = None
    for fs in traceback.extract_tb(tb):
        if fs.filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            continue
        p = pathlib.Path(fs.filename).resolve()
        if (anchor is not None and _is_under(p, [anchor])) or not _is_under(p, libs):
            found = (fs.filename, fs.lineno or 0)
    return found


def _convert(e: BaseException, where: str, anchor: pathlib.Path | None) -> UserCodeError:
    if isinstance(e, SyntaxError) and e.filename:  # its place is the error's, not a frame's
        detail = f"{type(e).__name__}: {e.msg}"
        return UserCodeError(_short(e.filename), e.lineno, detail)
    frame = _user_frame(e.__traceback__, anchor)
    if frame is None:
        return UserCodeError(where, None, one_line(e))
    return UserCodeError(_short(frame[0]), frame[1], one_line(e))


def _short(path: str) -> str:
    """``path`` relative to the working directory when it is below it (as the user typed)."""
    with contextlib.suppress(ValueError, OSError):
        return str(pathlib.Path(path).resolve().relative_to(pathlib.Path.cwd().resolve()))
    return path


@contextlib.contextmanager
def user_code(where: str, anchor: str | os.PathLike | None = None) -> Iterator[None]:
    """Run the block as the user's code: any exception (``SystemExit`` too, never
    ``KeyboardInterrupt``) becomes a :class:`UserCodeError` naming the user's frame.

    ``where`` names the file or function when no frame of the user's is on the traceback;
    ``anchor`` is a folder whose files are the user's even when installed in site-packages.

    Examples
    --------
    >>> from opsdk._userfile import UserCodeError, user_code
    >>> try:
    ...     with user_code("m.py"):
    ...         raise SystemExit(3)
    ... except UserCodeError as e:
    ...     e.detail
    'SystemExit: 3'
    """
    try:
        yield
    except UserCodeError:
        raise
    except (Exception, SystemExit) as e:
        a = pathlib.Path(anchor).resolve() if anchor is not None else None
        raise _convert(e, where, a) from e


def import_user_file(path: str | os.PathLike, name: str | None = None) -> ModuleType:
    """Import the Python file ``path`` as module ``name`` (default ``_opsdk_user_<stem>``).

    Its folder goes first on ``sys.path`` (as for ``python path``) and stays there, so the
    file can import its sibling modules, at import or later in its functions (a sibling
    named like one of an earlier model file's, in another folder, is imported afresh); when
    the import fails, the file's module and folder are taken off ``sys.modules`` and
    ``sys.path`` again.

    Raises
    ------
    UserCodeError
        The file has a syntax error or raised while imported.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from opsdk._userfile import import_user_file
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "helper_a.py").write_text("K = 4\\n")
    >>> _ = (d / "m.py").write_text("import helper_a\\nN = helper_a.K + 1\\n")
    >>> import_user_file(d / "m.py").N
    5
    """
    p = pathlib.Path(path)
    folder = str(p.resolve().parent)
    name = name or f"_opsdk_user_{p.stem}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise UserCodeError(str(path), None, "not an importable Python file")
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    _forget_other_siblings(pathlib.Path(folder))
    known = folder in _MODEL_FOLDERS
    _MODEL_FOLDERS.add(folder)
    module = importlib.util.module_from_spec(spec)
    old = sys.modules.get(name)
    sys.modules[name] = module
    try:
        with user_code(str(path), folder):
            spec.loader.exec_module(module)
    except BaseException:  # KeyboardInterrupt too: no half-imported module, no stray path
        if old is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)
        if not known:
            _MODEL_FOLDERS.discard(folder)
        raise
    return module


#: Folders of the model files imported so far (each on ``sys.path``).
_MODEL_FOLDERS: set[str] = set()


def user_modules() -> dict[str, pathlib.Path]:
    """The imported modules whose source is the user's (not opsdk's, the standard library's
    or an installed package's), by name: the model files and the modules they import.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from opsdk._userfile import import_user_file, user_modules
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "tiny_model.py").write_text("K = 1\\n")
    >>> m = import_user_file(d / "tiny_model.py")
    >>> user_modules()[m.__name__].name
    'tiny_model.py'
    >>> "json" in user_modules()
    False
    """
    out = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not f or not f.endswith(".py"):
            continue
        p = pathlib.Path(f).resolve()
        if not _is_under(p, _LIBRARY_DIRS):
            out[name] = p
    return out


def _forget_other_siblings(folder: pathlib.Path) -> None:
    """Two model files in two folders, each with its own ``helpers.py``: the second's
    ``import helpers`` must not get the first one's, cached in ``sys.modules``."""
    for mod_name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not f or "." in mod_name:
            continue
        owner = str(pathlib.Path(f).resolve().parent)
        if (owner in _MODEL_FOLDERS and owner != str(folder)
                and (folder / f"{mod_name}.py").is_file()):
            del sys.modules[mod_name]  # the first model keeps its reference


def import_user_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for a user's module: a module that is not there is
    an ``ImportError`` (``No module named ...``); one that fails to import is a
    :class:`UserCodeError` naming its file and line.

    Examples
    --------
    >>> from opsdk._userfile import import_user_module
    >>> import_user_module("opsdk.ops").__name__
    'opsdk.ops'
    """
    if name.endswith(".py") or os.sep in name or "/" in name:
        # `--module ./mod.py`: importlib took it for a relative name ("the 'package'
        # argument is required"); a path is imported as `python path` would.
        return _import_module_path(name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # The module itself (or its package) is missing: a wrong name, not a broken file.
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise
        raise _convert(e, name, _anchor_of(name)) from e
    except (Exception, SystemExit) as e:
        raise _convert(e, name, _anchor_of(name)) from e


def _import_module_path(text: str) -> ModuleType:
    """``--module path/to/mod.py``: the file, its folder on ``sys.path``, imported under its
    stem (so ``--module ./mod.py`` and ``--module mod`` register the same module) unless
    that name is another module's already."""
    p = pathlib.Path(text)
    if p.is_dir():
        raise ImportError(f"{text}: is a folder; --module takes a module name (mod) or a .py "
                          "file path")
    if p.suffix != ".py" or not p.is_file():
        raise ImportError(f"{text}: no such .py file; --module takes a module name (mod) or a "
                          ".py file path")
    known = sys.modules.get(p.stem)
    f = getattr(known, "__file__", None)
    if known is not None and f and pathlib.Path(f).resolve() == p.resolve():
        return known
    return import_user_file(p, p.stem if known is None else None)


def _anchor_of(name: str) -> pathlib.Path | None:
    """The folder of the top package of ``name`` (its files are the user's)."""
    top = sys.modules.get(name.split(".")[0])
    f = getattr(top, "__file__", None)
    return pathlib.Path(f).resolve().parent if f else None


def call_user(fn: Callable[..., T], *args: Any, where: str, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a user's function (a model file's entry): what it raises
    becomes a :class:`UserCodeError` naming the user's frame (``where`` if none is left).

    Examples
    --------
    >>> from opsdk._userfile import UserCodeError, call_user
    >>> call_user(len, [1, 2], where="m.py:build_model")
    2
    """
    anchor = getattr(getattr(fn, "__code__", None), "co_filename", None)
    with user_code(where, pathlib.Path(anchor).parent if anchor else None):
        return fn(*args, **kwargs)


def load_onnx_file(path: str | os.PathLike) -> Any:
    """``onnx.load(path)``, with a file that is no ONNX model (truncated, another format)
    reported as a :class:`UserCodeError` naming it.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from opsdk._userfile import UserCodeError, load_onnx_file
    >>> bad = pathlib.Path(tempfile.mkdtemp()) / "m.onnx"
    >>> _ = bad.write_bytes(b"not a model")
    >>> try:
    ...     load_onnx_file(bad)
    ... except UserCodeError as e:
    ...     "not a valid ONNX model" in str(e)
    True
    """
    import onnx  # heavy: onnx

    def load(p: str | os.PathLike) -> Any:
        if pathlib.Path(p).is_file() and pathlib.Path(p).stat().st_size == 0:
            raise UserCodeError(str(path), None, "not an ONNX model (empty file)")
        proto = onnx.load(str(p))
        # protobuf decodes many non-ONNX byte strings into an empty ModelProto; TVM then
        # said only "Model IR version 0 not supported" (or raised deeper).
        if proto.ir_version < 1 or not proto.HasField("graph"):
            raise UserCodeError(str(path), None, "cannot be read as ONNX: no IR version or "
                                "graph in it (not an ONNX model file)")
        return proto

    return read_user_file(path, load, "ONNX model")


def read_user_file(path: str | os.PathLike, load: Callable[[str | os.PathLike], T],
                   what: str) -> T:
    """``load(path)`` of a user's data file (an ``.onnx``, a ``torch.export`` ``.pt2``): what
    a missing or corrupt file raises inside the library becomes one
    :class:`UserCodeError` naming the file and ``what`` it should have been.

    Examples
    --------
    >>> import json, pathlib, tempfile
    >>> from opsdk._userfile import UserCodeError, read_user_file
    >>> bad = pathlib.Path(tempfile.mkdtemp()) / "c.json"
    >>> _ = bad.write_text("{")
    >>> try:
    ...     read_user_file(bad, lambda p: json.loads(pathlib.Path(p).read_text()), "JSON")
    ... except UserCodeError as e:
    ...     str(e).split(" (")[0].endswith("c.json: not a valid JSON")
    True
    """
    try:
        return load(path)
    except UserCodeError:
        raise
    except OSError as e:  # missing / unreadable: as any file the command names
        raise UserCodeError(str(path), None, f"cannot read it ({e.strerror or e})") from e
    except Exception as e:  # protobuf's DecodeError, a zip error, whatever a corrupt file
        raise UserCodeError(str(path), None, f"not a valid {what} ({one_line(e)})") from e


def import_model_module(spec: str) -> Any:
    """A model file (its folder importable, for its sibling modules) or module; what fails in
    it is a :class:`~opsdk._userfile.UserCodeError` naming its line."""
    problem = model_path_problem(spec)  # a folder, m.txt: "No module named 'm'" before
    if problem:
        raise UserCodeError(spec, None, problem)
    path = pathlib.Path(spec)
    if path.suffix == ".py" and path.exists():
        return import_user_file(path, f"_opsdk_drift_{path.stem}")
    return import_user_module(spec)


def call_entry(module: Any, spec: str, entry: str, **kwargs: Any) -> Any:
    """``module.entry(**kwargs)``: a missing entry is an ``AttributeError`` naming it, what
    the entry raises a :class:`~opsdk._userfile.UserCodeError` at the user's line."""
    fn = getattr(module, entry, None)
    if not callable(fn):
        raise AttributeError(f"{spec} has no function {entry}() (pass --entry NAME)")
    return call_user(fn, where=f"{spec}:{entry}()", **kwargs)


def example_args(built: tuple, spec: str, entry: str) -> tuple:
    """The ``args`` of an entry's ``(model, args)``, checked once at load time: a bare
    tensor there was unpacked along its first dim ("too many positional arguments")."""
    args = built[1]
    if not isinstance(args, (tuple, list)):
        raise UserCodeError(spec, None, f"{entry}() must return (model, args) with args a "
                            "tuple of example inputs, e.g. (model, (x,)); got a "
                            f"{type(args).__name__}")
    return tuple(args)
