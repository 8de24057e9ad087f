"""``opsdk new-op``: render templates into an op file, its schedule rules and a test file.

Everything is rendered and syntax-checked in memory first, then written with temp files and
atomic renames; a failure restores what was there, so an error half-way leaves nothing behind.
Existing files are never overwritten without ``force``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import keyword
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import jinja2

from ._files import check_can_create, new_file_mode
from ._opdef import MAX_OP_NAME
from .registry import get_op, is_registered

__all__ = ["KINDS", "TARGETS", "ScaffoldError", "ScaffoldResult", "new_op"]

KINDS = ("elementwise", "binary", "reduction", "norm", "residual_norm")
TARGETS = ("x86", "arm")
_CLAIMS = {
    "elementwise": ("vectorize", "parallel"),
    "binary": ("vectorize", "parallel"),
    "reduction": ("parallel",),
    "norm": ("vectorize", "parallel"),
    "residual_norm": ("vectorize", "parallel"),
}


class ScaffoldError(ValueError):
    """Bad input to ``new-op``; nothing was written."""


@dataclass
class ScaffoldResult:
    """What :func:`new_op` wrote."""

    name: str
    module: str
    files: list[pathlib.Path]
    replaced: list[pathlib.Path] = field(default_factory=list)
    package_root: pathlib.Path = pathlib.Path(".")


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("opsdk.templates", "."),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


_MAX_NAME = MAX_OP_NAME  # test_NAME_schedules.py stays far below the 255-byte limit


def _check_name(name: str, own: pathlib.Path | None = None) -> None:
    """Refuse names that cannot be an op module. ``own`` is the ``NAME.py`` this scaffold
    writes: a module found there is the user's earlier scaffold (replaced with ``--force``,
    else refused as an existing file), not a clash."""
    if not name or os.sep in name or "/" in name or "\\" in name or "." in name:
        raise ScaffoldError(
            f"op name {name!r} must be a plain Python identifier (no path separators or dots); "
            "use --dir to choose where files go"
        )
    if not name.isidentifier():
        raise ScaffoldError(f"op name {name!r} is not a valid Python identifier; try e.g. 'my_op'")
    if not name.isascii():  # a Python identifier, but it names C symbols and files
        raise ScaffoldError(f"op name {name!r} must be ASCII letters, digits and _ only (it "
                            "names C symbols and files); try e.g. 'my_op'")
    if len(name) > _MAX_NAME:
        raise ScaffoldError(f"op name {name[:20]!r}... is {len(name)} characters; keep it to "
                            f"{_MAX_NAME} or fewer")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise ScaffoldError(f"op name {name!r} is a Python keyword; pick another name")
    if name.startswith("_"):
        raise ScaffoldError(f"op name {name!r} starts with '_'; op names are public")
    if is_registered(name):
        raise ScaffoldError(
            f"an op named {name!r} already exists ({get_op(name).source}); pick another name"
        )
    if name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()):
        raise ScaffoldError(f"op name {name!r} would shadow the Python module {name!r}")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and own is not None and spec.origin and (
            pathlib.Path(spec.origin).resolve() == own.resolve()):
        spec = None  # an earlier scaffold: the existing-files check decides
    if spec is not None:
        raise ScaffoldError(
            f"op name {name!r} would shadow the installed module {name!r} ({spec.origin}); "
            "pick another name"
        )


def _check_shadowing(name: str, src: str) -> None:
    """The op's function would replace a module-level name its own file uses (``te``,
    ``np``, ``acc`` ...), and the generated op would then fail."""

    taken: set[str] = set()
    for node in ast.parse(src).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            taken |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef) and node.name != name:
            taken.add(node.name)
        elif isinstance(node, ast.Assign):
            taken |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    if name in taken:
        raise ScaffoldError(f"op name {name!r} would shadow {name!r}, which the generated "
                            f"{name}.py uses; pick another name (e.g. 'my_{name}')")


def _module_path(directory: pathlib.Path, name: str) -> tuple[str, pathlib.Path]:
    """Dotted module name of ``directory/name.py`` and the folder it is importable from."""
    parts = [name]
    d = directory
    while (d / "__init__.py").is_file():
        parts.insert(0, d.name)
        d = d.parent
    return ".".join(parts), d.resolve()


def _from_source(from_op: str, name: str) -> str:
    d = get_op(from_op)
    mod = sys.modules[d.module]
    src = inspect.getsource(mod)
    if not d.module.startswith("opsdk.ops."):
        raise ScaffoldError(f"--from {from_op}: only built-in ops can be copied (it is {d.source})")
    # The built-in's fusion rule (decomposed subgraph -> the built-in) stays the built-in's:
    # a copy that also claimed it would compete with it.
    src = _drop_builtin_hooks(src, from_op)
    src = re.sub(r"from \.\._dtypes import", "from opsdk import", src)
    src = re.sub(r"from \.\._(?:opdef|declare) import", "from opsdk import", src)
    src = re.sub(r"from \.\._domains import", "from opsdk import", src)
    src = re.sub(r"from \.\.(\w+) import", r"from opsdk.\1 import", src)
    src = re.sub(r"from \.(\w+) import", r"from opsdk.ops.\1 import", src)
    src = re.sub(rf"\bdef {from_op}\(", f"def {name}(", src)
    if f"def {name}(" not in src:
        raise ScaffoldError(f"--from {from_op}: could not find its compute function to rename")
    return src


def _drop_builtin_hooks(src: str, op: str) -> str:
    """The built-in's own facts that name it (its torch / ONNX mappings, replace and fusion
    rules, and the converters they call) stay the built-in's: a copy that also claimed them
    would compete with it. Every top-level statement that uses the op's name, but its
    definition, goes."""

    lines = src.split("\n")
    drop: set[int] = set()
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == op:
            continue
        if any(isinstance(n, ast.Name) and n.id == op for n in ast.walk(node)):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            drop.update(range(first - 1, node.end_lineno))
    out = [line for i, line in enumerate(lines) if i not in drop]
    return re.sub(r"\n{4,}", "\n\n\n", "\n".join(out)).rstrip("\n") + "\n"


def _render(
    name: str, kind: str, from_op: str | None, targets: Sequence[str], module: str
) -> dict[str, str]:
    env = _env()
    ctx = {
        "name": name,
        "kind": kind,
        "targets": list(targets),
        "module": module,
        "from_op": from_op,
    }
    files: dict[str, str] = {}
    if from_op:
        src = _from_source(from_op, name)
        header = (
            f'"""``{name}``: made by ``opsdk new-op {name} --from {from_op}``; edit freely.\n\n'
            f"Started as a copy of the built-in ``{from_op}`` (its original docstring follows).\n"
            f"Verify with ``opsdk verify {name} --module {module} --target x86``.\n"
        )
        src = src.replace('"""', header, 1) if src.startswith('"""') else header + '"""\n' + src
        footer = (
            f"\n\n#: The ops this module provides.\nOPS = [{name}]\n\n"
            f"# verify's rounding-error model of the built-in {from_op} fits this copy while the\n"
            "# math is the same; delete these lines when you change it (verify then falls back\n"
            "# to a generic, heuristic bound, or write a model with opsdk.verify.error_model).\n"
            "from opsdk import get_op  # noqa: E402\n"
            "from opsdk.verify import error_model, model_for  # noqa: E402\n\n"
            f'error_model({name})(model_for(get_op("{from_op}"))[1])\n'
        )
        if targets:
            footer += (
                "\n# Schedule rules for this op live beside this file.\n"
                "from opsdk import import_beside  # noqa: E402\n\n"
                f'import_beside(__file__, "{name}_schedules")\n'
            )
        files[f"{name}.py"] = src.rstrip("\n") + "\n" + footer
        if targets:
            from .schedules import load_builtin_rules, rules_for

            load_builtin_rules()
            claims: set[str] | None = None
            for r in rules_for(get_op(from_op)):
                claims = set(r.claims) if claims is None else claims & set(r.claims)
            files[f"{name}_schedules.py"] = env.get_template("schedules_from.py.j2").render(
                **ctx, claims=tuple(sorted(claims or ()))
            )
    else:
        files[f"{name}.py"] = env.get_template(f"op_{kind}.py.j2").render(**ctx)
        if not targets:
            files[f"{name}.py"] = (
                files[f"{name}.py"]
                .replace(
                    "\n# Schedule rules for this op live beside this file.\n"
                    f'import_beside(__file__, "{name}_schedules")\n',
                    "\n",
                )
                .replace("from opsdk import import_beside\n", "")
            )
        else:
            files[f"{name}_schedules.py"] = env.get_template("schedules.py.j2").render(
                **ctx, claims=_CLAIMS[kind]
            )
    files[f"test_{name}.py"] = env.get_template("test_op.py.j2").render(**ctx)
    for fname, text in files.items():
        try:
            compile(text, fname, "exec")
        except SyntaxError as e:  # a template bug: never write broken files
            raise ScaffoldError(f"internal error: rendered {fname} does not compile: {e}") from e
    return files


def new_op(
    name: str,
    *,
    kind: str = "elementwise",
    from_op: str | None = None,
    directory: str | os.PathLike = ".",
    targets: Sequence[str] = TARGETS,
    force: bool = False,
) -> ScaffoldResult:
    """Scaffold a new op: ``NAME.py`` (compute, reference, schema, matrix, domain hints),
    ``NAME_schedules.py`` (rules for ``targets``) and ``test_NAME.py`` (generic verify suite).

    Examples
    --------
    >>> import tempfile, opsdk
    >>> from opsdk._scaffold import new_op
    >>> r = new_op("demo_swish", directory=tempfile.mkdtemp())
    >>> sorted(p.name for p in r.files)
    ['demo_swish.py', 'demo_swish_schedules.py', 'test_demo_swish.py']
    """
    folder = pathlib.Path(directory)
    _check_name(name, folder / f"{name}.py")
    if from_op is not None:
        try:
            base = get_op(from_op)
        except KeyError as e:
            raise ScaffoldError(f"--from {from_op}: {e.args[0]}") from None
        kind = base.kind
    elif kind not in KINDS:
        raise ScaffoldError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ScaffoldError(
            f"--targets {','.join(bad)}: supported targets are {', '.join(TARGETS)}"
        )
    if folder.exists() and not folder.is_dir():
        raise ScaffoldError(f"--dir {folder}: is a file, not a directory; pass a folder")
    if not folder.is_dir():
        raise ScaffoldError(f"--dir {folder}: no such directory; create it first")
    folder = folder.resolve()
    module, root = _module_path(folder, name)
    files = _render(name, kind, from_op, targets, module)
    _check_shadowing(name, files[f"{name}.py"])
    paths = {folder / f: text for f, text in files.items()}
    dirs = [p for p in paths if p.is_dir()]
    if dirs:
        raise ScaffoldError(f"{dirs[0]} is a directory; move it or pick another op name")
    try:  # a read-only folder, /proc, a full disk: say so before anything is written
        check_can_create(folder)
    except OSError as e:
        raise ScaffoldError(f"--dir {folder}: cannot create files there "
                            f"({e.strerror or e})") from None
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise ScaffoldError(
            "refusing to overwrite existing files (pass --force to replace them): "
            + ", ".join(str(p) for p in existing)
        )
    try:
        _write_all(paths)
    except OSError as e:  # e.g. the disk filled up: every file is as it was
        raise ScaffoldError(f"could not write the scaffold in {folder} ({e.strerror or e}); "
                            "nothing was changed") from None
    return ScaffoldResult(name, module, list(paths), existing, root)


def _write_all(paths: dict[pathlib.Path, str]) -> None:
    """Write every file or none: temp files first, then renames; on any exception (Ctrl-C
    included) the new files are removed and the files they replaced are back.

    The originals stay on disk (hard-linked, else copied, beside them) until every rename is
    done, and the renames and their rollback run with Ctrl-C held back, so an interrupt that
    lands between two renames, or right after one, cannot leave half a scaffold or lose a
    file replaced under ``--force``.
    """
    temps: dict[pathlib.Path, str] = {}
    backups: dict[pathlib.Path, str] = {}
    fresh = new_file_mode()
    try:
        for p, text in paths.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
            temps[p] = tmp
            # Python source is UTF-8 whatever the locale (LC_ALL=C made it ASCII: the
            # templates' dashes raised UnicodeEncodeError)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            # mkstemp makes 0600 files; a source file gets the mode any editor would give it
            # (0644 under the usual umask), or keeps the one of the file it replaces.
            mode = p.stat().st_mode & 0o777 if p.exists() else fresh
            os.chmod(tmp, mode)
        for p in paths:
            if p.exists():
                backups[p] = _keep_copy(p)
        with _interrupt_held():
            started: list[pathlib.Path] = []
            try:
                for p, tmp in temps.items():
                    started.append(p)  # before the rename: it may land and then raise
                    os.replace(tmp, p)
            except BaseException:
                for p in started:
                    if p in backups:  # (a no-op when p was not replaced yet: two links
                        os.replace(backups[p], p)  # of one file; finally unlinks it)
                    else:
                        p.unlink(missing_ok=True)
                raise
    finally:
        for f in [*temps.values(), *backups.values()]:
            pathlib.Path(f).unlink(missing_ok=True)


def _keep_copy(p: pathlib.Path) -> str:
    """A second name for ``p``'s current content beside it (a hard link, else a copy)."""

    fd, keep = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".orig", dir=p.parent)
    os.close(fd)
    try:
        os.unlink(keep)
        os.link(p, keep)
    except OSError:  # no hard links here (vfat, some network mounts): copy it
        shutil.copy2(p, keep)
    return keep


@contextlib.contextmanager
def _interrupt_held() -> Iterator[None]:
    """Hold Ctrl-C back while the block runs, then deliver it: a short critical section
    (three renames, or their rollback) always finishes. Outside the main thread, where no
    signal handler can be set, the block simply runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and callable(old):
            old(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
