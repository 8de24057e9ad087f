"""An on-disk cache of compiled models, keyed by content, so that ``opsdk explain --model``,
``bench``, ``drift``, ``build`` and ``quantize`` of an unchanged model do not each recompile.

An entry is a folder ``<root>/<key>/`` holding the exported library (``lib.so``), its
``meta.json`` (what the key was made of, the library's SHA-256 and size, the kernels' facts)
and, once a kernel report asked for them, ``asm.json`` (vector instructions per kernel).
Every JSON file carries the SHA-256 of its own content; a file that fails any check (checksum,
key, size, library hash, a load error) is never trusted: the entry is removed and rebuilt.

The key is the SHA-256 of:

- the module: its ``tvm_ffi.structural_hash`` (which hashes tensor contents; free variables
  by position, not address), its TVMScript
  text, and the dtype, shape and bytes of every tensor constant (SHA-256: the structural hash
  is only 64 bits);
- the target string, the compile options (``winograd``, the pipeline), the pass context;
- the versions of opsdk, apache-tvm and tvm-ffi, and the SHA-256 of the source files of opsdk
  and of every module that registered an op or a schedule rule (an edited rule is a new key).

Entries are written into a temporary folder beside the others and renamed into place: a
reader sees a whole entry or none, and of two concurrent writers of one key the second's
rename fails and it keeps the first's. Only targets whose code runs on this host are cached
(the library is loaded back into this process). Beyond :data:`MAX_BYTES` (or
``$OPSDK_CACHE_MAX_MB``) the least recently used entries are removed.

Location: ``$OPSDK_CACHE_DIR``, else ``<opsdk cache>/models`` (``$OPSDK_CACHE``,
``$XDG_CACHE_HOME/opsdk`` or ``~/.cache/opsdk``). ``OPSDK_NO_CACHE=1`` (or ``--no-cache``)
turns it off, and the kernel cache (:mod:`opsdk._kernelcache`) with it;
``OPSDK_NO_MODEL_CACHE=1`` turns off this one only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from ._files import cache_dir, sha256_file
from ._version import __version__

__all__ = ["MAX_BYTES", "Entry", "ModelCache", "open_cache"]

#: Bump when the entry layout or the key's ingredients change: old entries are then misses.
FORMAT = 1

#: Entries beyond this many bytes in all are evicted, least recently used first.
MAX_BYTES = 2 * 1024**3

_LIB = "lib.so"
_META = "meta.json"


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() not in ("", "0", "false", "no", "off")


def caches_off() -> bool:
    """Whether ``OPSDK_NO_CACHE`` (``--no-cache``) turns every cache and record off."""
    return _truthy(os.environ.get("OPSDK_NO_CACHE"))


def default_dir() -> Path:
    """``$OPSDK_CACHE_DIR``, else ``models/`` in opsdk's cache folder."""
    if os.environ.get("OPSDK_CACHE_DIR"):
        return Path(os.environ["OPSDK_CACHE_DIR"]).expanduser()

    return cache_dir() / "models"


def _sealed(data: Mapping[str, Any]) -> str:
    """``data`` as JSON with the SHA-256 of its canonical form added (``sha256``)."""
    body = json.dumps(data, sort_keys=True)
    return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "data": data},
                      sort_keys=True)


def _unseal(text: str) -> dict[str, Any]:
    """The data of a :func:`_sealed` file; ``ValueError`` when it was damaged."""
    doc = json.loads(text)
    body = json.dumps(doc["data"], sort_keys=True)
    if hashlib.sha256(body.encode()).hexdigest() != doc["sha256"]:
        raise ValueError("checksum mismatch")
    return doc["data"]


# ------------------------------------------------------------------------------------ keys
_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    st = path.stat()
    k = (str(path), st.st_mtime_ns, st.st_size)
    if k not in _FILE_HASHES:
        _FILE_HASHES[k] = sha256_file(path)
    return _FILE_HASHES[k]


#: opsdk source that no compile runs (commands, importers, runners, benchmarks): editing it
#: keeps the cache. Everything else in the package is in the key; the compile path
#: (transform, schedules, kernels, ops, registry, targets) imports none of these.
_NOT_COMPILE = ("bench/", "deploy/", "frontend/", "quant/", "runners/", "templates/",
                "verify/", "__main__.py", "_cliargs.py", "_files.py", "_plugins.py",
                "_quiet.py", "_scaffold.py", "_userfile.py", "cli.py", "drift.py",
                "pytest_plugin.py")
_COMPILE_AFTER_ALL = ("verify/_lints.py",)  # the report's loop facts and asm counts


def code_fingerprint() -> str:
    """SHA-256 of the code that decides what a compile produces: opsdk's source files (but
    :data:`_NOT_COMPILE`) and the files of the modules that registered ops or schedule rules
    (plugins)."""
    from . import schedules  # heavy: TVM
    from .registry import registered_ops  # heavy: TVM

    pkg = Path(__file__).resolve().parent
    files = {f for f in pkg.rglob("*.py")
             if (rel := f.relative_to(pkg).as_posix()) in _COMPILE_AFTER_ALL
             or not rel.startswith(_NOT_COMPILE)}
    fns: list[Any] = [r.fn for r in schedules.registered_rules()]
    for op in registered_ops():
        fns += [getattr(op, "compute", None), getattr(op, "legalize", None)]
    for fn in fns:
        mod = sys.modules.get(getattr(fn, "__module__", "") or "")
        f = getattr(mod, "__file__", None)
        if f:
            files.add(Path(f).resolve())
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f"{f}\0{_file_digest(f)}\0".encode())
    return h.hexdigest()


def module_digest(mod: Any) -> str:
    """SHA-256 of an IRModule's content: structural hash (tensor contents included),
    TVMScript text and every tensor constant's dtype, shape and bytes."""
    import tvm  # heavy: TVM
    import tvm_ffi  # heavy: TVM
    from tvm import relax  # heavy: TVM

    from ._walk import relax_exprs  # heavy: TVM

    h = hashlib.sha256()
    # map_free_vars: a free variable (the DataflowVars in the module attribute
    # opsdk.rewrite_sites) is otherwise hashed by its address, a new key in every process.
    h.update(f"shash:{tvm_ffi.structural_hash(mod, map_free_vars=True)}\0".encode())
    h.update(mod.script(show_meta=False).encode())
    seen: set[int] = set()

    def visit(e: Any) -> None:
        if isinstance(e, tvm.ir.expr.Constant) and isinstance(
                getattr(e, "value", None), tvm.runtime.Tensor):
            handle = e.__chandle__()
            if handle in seen:
                return
            seen.add(handle)
            a = e.value.numpy()
            h.update(f"\0const {a.dtype} {a.shape}\0".encode())
            h.update(memoryview(a.reshape(-1).view("uint8")))

    for gv in sorted(mod.get_global_vars(), key=lambda g: g.name_hint):
        f = mod[gv]
        if isinstance(f, relax.Function):
            for e in relax_exprs(f):
                visit(e)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    out = {"opsdk": __version__}
    for d in ("apache-tvm", "apache-tvm-ffi"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = "?"
    import tvm  # heavy: TVM

    out["tvm"] = str(getattr(tvm, "__version__", "?"))
    return out


def _pass_context() -> dict[str, Any]:
    import tvm  # heavy: TVM

    ctx = tvm.transform.PassContext.current()
    return {"opt_level": int(ctx.opt_level), "config": str(dict(ctx.config)),
            "required": sorted(map(str, ctx.required_pass)),
            "disabled": sorted(map(str, ctx.disabled_pass))}


def key_material(mod: Any, target: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the cache key of compiling ``mod`` for ``target`` is made of."""
    return {"format": FORMAT, "module": module_digest(mod), "target": str(target),
            "options": {k: options[k] for k in sorted(options)}, "pass_context": _pass_context(),
            "versions": _versions(), "code": code_fingerprint()}


# ---------------------------------------------------------------------------------- entries
@dataclass
class Entry:
    """One cached compiled model: ``path/lib.so`` and the ``meta`` stored with it."""

    path: Path
    key: str
    meta: dict[str, Any]
    lib_name: str = _LIB

    @property
    def library(self) -> Path:
        return self.path / self.lib_name

    def load_module(self) -> Any:
        """The library loaded into this process (``tvm.runtime.load_module``)."""
        import tvm  # heavy: TVM

        return tvm.runtime.load_module(str(self.library))

    def read_extra(self, name: str) -> dict[str, Any] | None:
        """A JSON side file (``asm``) stored with the entry, or None when it is absent or
        fails its checksum (then it is removed)."""
        p = self.path / f"{name}.json"
        try:
            data = _unseal(p.read_text())
            if data.get("key") != self.key:
                raise ValueError("key mismatch")
            return data["value"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                p.unlink()
            return None

    def write_extra(self, name: str, value: dict[str, Any]) -> None:
        """Store a JSON side file atomically (temporary file + rename); best effort."""
        p = self.path / f"{name}.json"
        with contextlib.suppress(OSError):
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(_sealed({"key": self.key, "value": value}))
                os.replace(tmp, p)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


class ModelCache:
    """The cache folder ``root``: look up, store and evict compiled models.

    Examples
    --------
    >>> import tempfile
    >>> from opsdk._modelcache import ModelCache
    >>> c = ModelCache(tempfile.mkdtemp())
    >>> c.load("0" * 64) is None
    True
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None, *,
                 lib_name: str = _LIB) -> None:
        self.root = Path(root).expanduser()
        if max_bytes is None:
            mb = os.environ.get("OPSDK_CACHE_MAX_MB")
            max_bytes = int(float(mb) * 1024**2) if mb else MAX_BYTES
        self.max_bytes = max_bytes
        self.lib_name = lib_name  # the file each entry holds (the kernel cache: an object)
        self.materials: dict[str, dict[str, Any]] = {}  # key -> what it was made of

    def key(self, mod: Any, target: Any, options: Mapping[str, Any]) -> str:
        """The entry name for compiling ``mod`` for ``target`` with ``options``."""
        material = key_material(mod, target, options)
        key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        self.materials[key] = material
        return key

    def load(self, key: str) -> Entry | None:
        """The entry ``key`` when it is whole and intact, else None (a damaged one is
        removed, so that the caller's rebuild replaces it)."""
        path = self.root / key
        try:
            meta = _unseal((path / _META).read_text())
            lib = path / self.lib_name
            if (meta.get("format") != FORMAT or meta.get("key") != key
                    or lib.stat().st_size != meta["lib_bytes"]
                    or sha256_file(lib) != meta["lib_sha256"]):
                raise ValueError("entry does not match its metadata")
        except FileNotFoundError:
            if path.exists():
                self.discard(key)
            return None
        except (OSError, ValueError, KeyError, TypeError):
            self.discard(key)
            return None
        with contextlib.suppress(OSError):  # least recently used: a hit counts as a use
            os.utime(path / _META)
        return Entry(path, key, meta, self.lib_name)

    def store(self, key: str, export: Callable[[str], None],
              meta: Mapping[str, Any], *, evict: bool = True) -> Entry | None:
        """Write an entry: ``export(path)`` writes the library; None when it could not be
        written (a full disk, a read-only folder: the compile result is still used).
        ``evict=False`` leaves :meth:`evict` (a scan of every entry) to the caller, once
        after a batch of stores."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        except OSError:
            return None
        try:
            lib = tmp / self.lib_name
            export(str(lib))
            data = dict(meta) | {"format": FORMAT, "key": key, "created": time.time(),
                                 "material": self.materials.get(key),
                                 "lib_bytes": lib.stat().st_size,
                                 "lib_sha256": sha256_file(lib)}
            (tmp / _META).write_text(_sealed(data))
            try:
                os.rename(tmp, self.root / key)
            except OSError:  # a concurrent writer was first: keep its entry
                return self.load(key)
            if evict:
                self.evict()
            return Entry(self.root / key, key, data, self.lib_name)
        except Exception:  # the cache must never fail a compile that succeeded
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def discard(self, key: str) -> None:
        """Remove entry ``key`` (renamed aside first, so a rebuild can take its place)."""
        path = self.root / key
        aside = self.root / f".tmp-discard-{key}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.rename(path, aside)
        except OSError:
            return
        shutil.rmtree(aside, ignore_errors=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, folder) of every entry."""
        out = []
        with contextlib.suppress(OSError):
            for p in self.root.iterdir():
                if p.name.startswith(".") or not p.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    size = sum(f.stat().st_size for f in p.iterdir())
                    out.append(((p / _META).stat().st_mtime, size, p))
        return out

    def evict(self) -> None:
        """Remove the least recently used entries beyond ``max_bytes``, and temporary
        folders a killed writer left (older than an hour)."""
        with contextlib.suppress(OSError):
            for p in self.root.glob(".tmp-*"):
                if time.time() - p.stat().st_mtime > 3600:
                    shutil.rmtree(p, ignore_errors=True)
        items = sorted(self.entries())
        total = sum(s for _, s, _ in items)
        for _, size, p in items:
            if total <= self.max_bytes:
                break
            self.discard(p.name)
            total -= size


def runs_on_host(target: Any) -> bool:
    """Whether code for ``target`` loads into this process (an LLVM target of the host's
    architecture): only such compiles are cached, since an entry is checked by loading it."""
    from .runners.local import host_arch  # heavy: TVM
    from .targets import target_arch  # heavy: TVM

    return getattr(getattr(target, "kind", None), "name", None) == "llvm" and \
        target_arch(target) == host_arch()


def open_cache(cache: bool | str | os.PathLike | None, target: Any) -> ModelCache | None:
    """The cache to use for a compile for ``target``: ``cache`` None follows the environment
    (on unless ``OPSDK_NO_CACHE``), True / False force it on / off, a path is the folder.
    None for targets whose code cannot be loaded on this host."""
    if cache is False or (cache is None and (
            caches_off() or _truthy(os.environ.get("OPSDK_NO_MODEL_CACHE")))):
        return None
    if not runs_on_host(target):
        return None
    if cache is None or cache is True:
        return ModelCache(default_dir())
    return ModelCache(cache)


# ------------------------------------------------------------------ source-keyed records
# A second `opsdk explain --model` of an unchanged model file skips importing it: importing
# torch (which TVM's FFI does on `import tvm`) and torch.export alone cost more than the rest
# of a cached report. A record maps the model *source* -- the file, its entry and arguments,
# every module imported while the command loaded it (the user's own files by content,
# installed packages by distribution version, the standard library by Python's version) --
# to the compile-cache entry and the example inputs. Everything in it is checked before use;
# any mismatch means the ordinary path (which then writes a new record).

_RECORDS = "records"


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


def _dist_of(path: str, top: Mapping[str, list[str]],
             versions: dict[str, tuple[str, str] | None]) -> tuple[str, str] | None:
    """(distribution, version) of a module file installed under site-packages;
    ``versions`` memoizes them by top-level name (reading a distribution's metadata parses
    its METADATA file: thousands of torch modules took seconds)."""

    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = len(parts) - 1 - parts[::-1].index(marker)
            if i + 1 >= len(parts):
                return None
            name = parts[i + 1]
            name = name[:-3] if name.endswith(".py") else name
            if name not in versions:
                versions[name] = None
                for dist in top.get(name, []):
                    with contextlib.suppress(metadata.PackageNotFoundError):
                        versions[name] = (dist, metadata.version(dist))
                        break
            return versions[name]
    return None


_DISTS: dict[str, Any] = {}


def _packages_distributions() -> Mapping[str, list[str]]:
    """``importlib.metadata.packages_distributions()`` (top-level module -> distributions),
    read again only when the distributions on ``sys.path`` changed (their ``.dist-info`` /
    ``.egg-info`` folders by name: an install, an upgrade or a removal renames one): it
    reads every distribution's file list, 0.2-0.3 s here, once per build record, and a watch
    writes one per rebuild."""
    stamp = []
    for d in sys.path:
        with contextlib.suppress(OSError), os.scandir(d or ".") as it:
            stamp += sorted(f"{d}/{e.name}" for e in it
                            if e.name.endswith((".dist-info", ".egg-info")))
    key = "\n".join(stamp)
    if _DISTS.get("key") != key:
        _DISTS.update(key=key, top=metadata.packages_distributions())
    return _DISTS["top"]


def module_dependencies(names: Any) -> list[list[str]]:
    """The dependencies of the modules ``names`` (imported in this process): ``["dist",
    name, version]`` for installed packages, ``["file", path, sha256]`` for other source
    files; standard-library modules are covered by the Python version.

    Examples
    --------
    >>> import json
    >>> from opsdk._modelcache import module_dependencies
    >>> module_dependencies(["json"])
    []
    """

    stdlib = _stdlib_dirs()
    top = _packages_distributions()
    deps: dict[tuple[str, str], str] = {}
    versions: dict[str, tuple[str, str] | None] = {}
    dirs: dict[str, str] = {}  # realpath of each folder once (thousands of torch modules)
    for name in sorted(set(names)):
        f = getattr(sys.modules.get(name), "__file__", None)
        if not f:
            continue
        head, tail = os.path.split(os.path.abspath(f))
        if head not in dirs:
            dirs[head] = os.path.realpath(head)
        real = os.path.join(dirs[head], tail)
        if os.path.islink(real):
            real = os.path.realpath(real)
        if real.startswith(stdlib) and "-packages" not in real:
            continue
        dist = _dist_of(real, top, versions)
        if dist is not None:
            deps[("dist", dist[0])] = dist[1]
        elif os.path.isfile(real):
            with contextlib.suppress(OSError):
                deps[("file", real)] = _file_digest(Path(real))
    return [[k, n, v] for (k, n), v in sorted(deps.items())]


def dependencies_unchanged(deps: list[list[str]]) -> bool:
    """Whether every dependency :func:`module_dependencies` recorded is still the same."""

    for kind, name, value in deps:
        try:
            now = (metadata.version(name) if kind == "dist"
                   else _file_digest(Path(name)) if kind == "file" else None)
        except (metadata.PackageNotFoundError, OSError):
            return False
        if now != value:
            return False
    return True


def source_key(material: Mapping[str, Any]) -> str:
    """The record name for ``material`` (the model file's path and content digest, its entry
    and arguments, the target's name and the host, the command's options)."""

    full = {"format": FORMAT, "python": sys.version, "machine": platform.machine(),
            "cpu": _cpu_signature(), **material}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()


def _cpu_signature() -> str:
    # "host" / "x86" resolve to the detected CPU: another CPU is another record.

    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
        return hashlib.sha256("\n".join(sorted(set(keep))).encode()).hexdigest()
    return platform.processor() or platform.machine()


def read_record(root: Path, key: str) -> dict[str, Any] | None:
    """The record ``key`` when intact and its dependencies unchanged; else None (a damaged
    or stale one is removed)."""
    path = root / _RECORDS / f"{key}.json"
    try:
        data = _unseal(path.read_text())
        if data.get("key") != key:
            raise ValueError("key mismatch")
        if not dependencies_unchanged(data["deps"]):
            raise ValueError("a dependency changed")
        inputs = root / _RECORDS / f"{key}.npz"
        if data.get("inputs_sha256") and sha256_file(inputs) != data["inputs_sha256"]:
            raise ValueError("inputs changed")
        return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        for p in (path, root / _RECORDS / f"{key}.npz"):
            with contextlib.suppress(OSError):
                p.unlink()
        return None


def write_record(root: Path, key: str, data: Mapping[str, Any],
                 inputs: list[Any] | None) -> None:
    """Store a record (and the example inputs, as ``.npz``) atomically; best effort."""

    folder = root / _RECORDS
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        body = dict(data) | {"key": key}
        if inputs is not None:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".in.", suffix=".npz")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, *[np.ascontiguousarray(a) for a in inputs])
                body["inputs_sha256"] = sha256_file(Path(tmp))
                os.replace(tmp, folder / f"{key}.npz")
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rec.", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_sealed(body))
            os.replace(tmp, folder / f"{key}.json")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def read_inputs(root: Path, key: str) -> list[Any]:
    """The example inputs stored with record ``key``."""

    with np.load(root / _RECORDS / f"{key}.npz") as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]
