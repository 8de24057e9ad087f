"""A persistent cache of compiled kernels: one object file per scheduled TIR function, so that
a second compile of a model, or of an edited one, generates code only for the kernels that
changed.

The model's Relax part is code-generated as usual (VM bytecode); every kernel is compiled on
its own (``tvm.tirx.build`` of a one-function module: the TIR pipeline, LLVM, an object
file) or taken from the cache, and the objects are linked into the model's shared library
beside the VM executable (``export_library(addons=...)``). The VM finds a kernel by its
symbol in that library.

A kernel is compiled under a symbol derived from its key (``opsdk_k<key>``) and linked under
its name in the model with ``--defsym``: kernel names carry counters (``fused_conv2d7_add3``)
that shift when a layer is added or changed before them, and the same code must be found
under its new name. The key is the SHA-256 of:

- the scheduled function with its symbol replaced: its ``tvm_ffi.structural_hash`` (which
  ignores names) and its TVMScript text with every name replaced by its order of first
  appearance (the hash is only 64 bits; parameter names such as ``lv200`` come from the
  model's variables and shift when a layer before the kernel changes);
- the target string and the pass context (TIR options such as ``tir.disable_vectorize``);
- the versions of opsdk, apache-tvm and tvm-ffi (TVM's TIR pipeline and LLVM), and the
  SHA-256 of the source of opsdk's TIR pipeline (:func:`opsdk.transform.tir_pipeline`).

The rest of opsdk's source is not in the key (unlike the whole-model cache,
:mod:`opsdk._modelcache`): what opsdk decides about a kernel (rule, epilogue math, tiling) is
in its scheduled TIR, and its only step in TVM's TIR lowering is keyed above. An edited rule
therefore recompiles just the kernels whose TIR it changed.

Entries are :class:`opsdk._modelcache.ModelCache` entries (``<root>/<key>/kernel.o`` and a
sealed ``meta.json`` with the object's SHA-256 and size): written atomically, checked on every
read, removed and rebuilt when damaged, evicted least recently used beyond
:data:`MAX_BYTES` (or ``$OPSDK_KERNEL_CACHE_MAX_MB``).

The folded constants of a model compile (weight layout changes, packings) are kept beside
the kernels, in ``.folds/`` (:func:`opsdk.transform._fold.fold_cache`): same switches.

Location: ``$OPSDK_KERNEL_CACHE_DIR``, else ``.kernels/`` in the model cache's folder when
that is given (``$OPSDK_CACHE_DIR``, ``cache=<folder>``; the dot keeps it apart from the
model entries), else ``kernels/`` in opsdk's cache folder (beside ``models/``).
``OPSDK_NO_CACHE=1`` (``--no-cache``) or ``OPSDK_NO_KERNEL_CACHE=1`` turns it off. Only
Linux hosts compiling for their own architecture keep kernels (the library is linked with the
host's GNU linker and loaded back, which is how an entry is checked).

The same build without the store (:func:`kernel_builder`) serves every other LLVM compile on
Linux: with the caches off, and for another machine (an aarch64 board, linked with the
cross compiler). One module of all kernels is a single-threaded LLVM run (YOLOv8n: 6.6 s on
x86, 21 s for aarch64 with its export); kernel by kernel, the CPUs share it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
from tvm import relax, te, tirx
from tvm.relax import _ffi_api as relax_api
from tvm.relax.vm_build import VMExecutable, _vmcodegen

from ._files import cache_dir, sha256_file
from ._modelcache import (
    ModelCache,
    _pass_context,
    _truthy,
    _versions,
    caches_off,
    runs_on_host,
)
from ._tir import tir_pipeline
from .targets import LINK_OPTIONS

__all__ = ["MAX_BYTES", "KernelBuild", "KernelCache", "LinkedLibrary", "compile_jobs",
           "compile_objects", "default_dir", "kernel_builder", "open_kernel_cache"]

#: Bump when the key's ingredients or the object's form change: old entries are then misses.
FORMAT = 1

#: Entries beyond this many bytes in all are evicted, least recently used first.
MAX_BYTES = 512 * 1024**2

_OBJ = "kernel.o"


def default_dir() -> Path:
    """``$OPSDK_KERNEL_CACHE_DIR``, else ``.kernels/`` in ``$OPSDK_CACHE_DIR``, else
    ``kernels/`` in opsdk's cache folder."""
    if os.environ.get("OPSDK_KERNEL_CACHE_DIR"):
        return Path(os.environ["OPSDK_KERNEL_CACHE_DIR"]).expanduser()
    if os.environ.get("OPSDK_CACHE_DIR"):
        return Path(os.environ["OPSDK_CACHE_DIR"]).expanduser() / ".kernels"

    return cache_dir() / "kernels"


def open_kernel_cache(cache: Any, target: Any) -> KernelCache | None:
    """The kernel cache for a compile for ``target``, or None: ``cache`` as
    :func:`opsdk._modelcache.open_cache` takes it (None: the environment decides; a path is
    the model cache's folder, whose ``.kernels/`` this one then is)."""
    if cache is False or (cache is None and (
            caches_off() or _truthy(os.environ.get("OPSDK_NO_KERNEL_CACHE")))):
        return None
    if not sys.platform.startswith("linux"):  # --defsym: the GNU linker
        return None
    if not runs_on_host(target):
        return None
    if cache is None or cache is True:
        return KernelCache(default_dir())
    return KernelCache(Path(cache) / ".kernels")


def kernel_builder(target: Any) -> KernelCache | None:
    """A :class:`KernelCache` that keeps nothing, for a compile that does not use the cache
    (caches off; code for another machine), or None when this build cannot serve
    ``target``: not an LLVM target, not a Linux host (``--defsym``: the GNU linker), or no
    linker for its architecture (the ordinary build then, which needs none until export)."""
    if not sys.platform.startswith("linux") or \
            getattr(getattr(target, "kind", None), "name", None) != "llvm":
        return None
    cc = None
    if not runs_on_host(target):
        from .runners import cross_compiler  # heavy: the runners
        from .targets import target_arch

        try:
            cc = cross_compiler(target_arch(target))
        except (RuntimeError, ValueError):  # no cross compiler installed
            return None
        if cc is None:
            return None
    return KernelCache(None, cc=cc)


class LinkedLibrary(os.PathLike):
    """A model linked into a shared library for another machine: what a runner or an
    artifact takes (a path, :func:`os.fspath`), and ``export_library`` copies it (where an
    executable is expected). The file lives as long as the compiled model that holds it
    (its temporary folder goes with that model).

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
    >>> from opsdk._kernelcache import LinkedLibrary
    >>> d = Path(tempfile.mkdtemp()); (d / "model.so").write_bytes(b"ELF")
    3
    >>> lib = LinkedLibrary(d / "model.so")
    >>> lib.export_library(str(d / "copy.so")); (d / "copy.so").read_bytes()
    b'ELF'
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LinkedLibrary({str(self.path)!r})"

    def export_library(self, file_name: str, **_options: Any) -> None:
        """Copy the library to ``file_name`` (it is linked already: options do nothing)."""
        shutil.copyfile(self.path, file_name)


@dataclass
class KernelBuild:
    """What :meth:`KernelCache.build` did: the kernels it took from the cache (``hits``),
    compiled (``misses``), and the seconds of each phase."""

    hits: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


class KernelCache:
    """Compiled kernels in the folder ``root``, and the model build that uses them.

    Examples
    --------
    >>> import tempfile
    >>> from opsdk._kernelcache import KernelCache
    >>> KernelCache(tempfile.mkdtemp()).store.load("0" * 64) is None
    True
    """

    def __init__(self, root: str | os.PathLike | None, max_bytes: int | None = None, *,
                 cc: str | None = None) -> None:
        # root None: keep nothing (kernel_builder); cc: the linker for another machine
        self.cc = cc
        self._common: dict[str, Any] | None = None
        self._seen: dict[int, list[tuple[Any, str]]] = {}  # (root None) hash -> [(f, key)]
        if root is None:
            self.store: ModelCache | None = None
            self.folds: ModelCache | None = None
            return
        if max_bytes is None:
            mb = os.environ.get("OPSDK_KERNEL_CACHE_MAX_MB")
            max_bytes = int(float(mb) * 1024**2) if mb else MAX_BYTES
        self.store = ModelCache(root, max_bytes, lib_name=_OBJ)
        #: Folded constants (:func:`opsdk.transform._fold.fold_cache`), in ``.folds/``
        #: (bounded like the model cache: ``$OPSDK_CACHE_MAX_MB``, 2 GB).
        self.folds = ModelCache(Path(root) / ".folds", lib_name="value.bin")

    def key(self, func: Any, target: Any) -> tuple[str, Any]:
        """(key, the function under its cache symbol) for kernel ``func``."""
        import tvm_ffi  # heavy: TVM

        canon = func.with_attr("global_symbol", "opsdk_kernel")
        if self.store is None:  # nothing kept: only this build's kernels are told apart,
            # by structural equality (no TVMScript text to print: 0.2 s for YOLOv8n)
            h = tvm_ffi.structural_hash(canon)
            same = self._seen.setdefault(h, [])
            key = next((k for f, k in same if tvm_ffi.structural_equal(f, canon)), None)
            if key is None:  # unique: the hash and the place among its equals
                key = hashlib.sha256(f"{h}:{len(same)}".encode()).hexdigest()
                same.append((canon, key))
            return key, func.with_attr("global_symbol", f"opsdk_k{key[:32]}")
        h = hashlib.sha256(f"shash:{tvm_ffi.structural_hash(canon)}\0".encode())
        h.update(_alpha_text(canon.script(show_meta=False)).encode())
        if self._common is None:
            self._common = {"format": FORMAT, "pass_context": _pass_context(),
                            "versions": _versions(),
                            "tir_pipeline": sha256_file(Path(tir_pipeline.__code__.co_filename))}
        material = dict(self._common, func=h.hexdigest(), target=str(target))
        key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        if self.store is not None:
            self.store.materials[key] = material
        return key, func.with_attr("global_symbol", f"opsdk_k{key[:32]}")

    def build(self, lowered: Any, target: Any, workdir: Path,
              compile_kernel: Callable[[Any, Any], Any] | None = None
              ) -> tuple[Any, Path, KernelBuild] | None:
        """Build ``lowered`` (a Relax module after :func:`opsdk.transform.lowering_passes`)
        for ``target`` into ``workdir/model.so`` and load it: (the executable, the library,
        what was reused); for another machine the executable is the library
        (:class:`LinkedLibrary`). None when the module needs what this build does not do
        (external or device modules): the caller compiles it the ordinary way."""

        rec = KernelBuild()

        def tick(phase: str, t0: float) -> float:
            now = time.perf_counter()
            rec.seconds[phase] = rec.seconds.get(phase, 0.0) + now - t0
            return now

        attrs = dict(lowered.attrs) if lowered.attrs else {}
        if attrs.get("external_mods"):
            return None
        params = dict(attrs.get("const_name_to_constant", {}))
        t0 = time.perf_counter()
        builder = relax.ExecBuilder()
        rest = _vmcodegen(builder, lowered)
        kernels = {gv.name_hint: f for gv, f in rest.functions.items()
                   if isinstance(f, tirx.PrimFunc)}
        if any((f.attrs or {}).get("target") is not None for f in kernels.values()):
            return None
        t0 = tick("vm codegen", t0)

        objects: dict[str, Path] = {}  # key -> object file
        aliases: list[str] = []
        todo: dict[str, tuple[str, Any]] = {}
        hit_keys: list[str] = []
        workdir.mkdir(parents=True, exist_ok=True)
        for name, f in sorted(kernels.items()):
            symbol = str((f.attrs or {}).get("global_symbol", name))
            key, canon = self.key(f, target)
            aliases.append(f"-Wl,--defsym,__tvm_ffi_{symbol}=__tvm_ffi_opsdk_k{key[:32]}")
            if key in objects or key in todo:
                continue
            entry = self.store.load(key) if self.store is not None else None
            if entry is not None and (local := _link_or_copy(entry.library, workdir, key)):
                objects[key] = local
                hit_keys.append(key)
                rec.hits.append(symbol)
            else:
                todo[key] = (symbol, canon)
        t0 = tick("kernel cache lookup", t0)

        build_one = compile_kernel or _compile_kernel
        if self.store is None:  # nothing kept: a few kernels to an object (below)
            for key, path in _compile_chunks(todo, target, workdir, build_one).items():
                objects[key] = path
                rec.misses.append(todo[key][0])
        else:
            compile_objects([(key, canon) for key, (_, canon) in todo.items()], target,
                            workdir, build_one)
            for key, (symbol, _) in todo.items():
                local = workdir / f"{key[:32]}.o"
                self.store.store(key, lambda p, src=local: shutil.copyfile(src, p),
                                 {"kernel": symbol}, evict=False)
                objects[key] = local
                rec.misses.append(symbol)
            if todo:
                self.store.evict()
        t0 = tick("kernel codegen", t0)

        # VMLink wants a compiled TIR module to import (the library's own code then loads
        # the kernels' symbols too): a one-line function, compiled every time (milliseconds).
        stub = _compile_kernel(_stub_func(), target)
        ex = VMExecutable(relax_api.VMLink(builder, target, stub, [], params))
        lib = workdir / "model.so"
        cross = {"cc": self.cc} if self.cc is not None else {}
        try:
            ex.export_library(str(lib), addons=sorted({str(p) for p in objects.values()}),
                              options=[*LINK_OPTIONS, *aliases], **cross)
            t0 = tick("link", t0)
            if self.cc is not None:  # code for another machine: not loadable here
                for p in set(objects.values()):  # what the library holds now
                    p.unlink(missing_ok=True)
                return LinkedLibrary(lib), lib, rec
            loaded = tvm.runtime.load_module(str(lib))
        except Exception:  # a reused object the linker or loader refused: never again
            for key in hit_keys if self.store is not None else ():
                self.store.discard(key)
            raise
        tick("load", t0)
        return loaded, lib, rec


_IDENT = re.compile(r"(?<![\w.])[A-Za-z_]\w*")


def _alpha_text(text: str) -> str:
    """TVMScript text with every name (but attribute names after a dot) replaced by its
    order of first appearance: the parameter and buffer names of a kernel come from the
    model's variables (``lv200``), which an edit earlier in the model renumbers. Beside the
    structural hash (which ignores names and holds every dtype, shape and constant) it
    guards against a 64-bit collision."""
    names: dict[str, str] = {}
    return _IDENT.sub(lambda m: names.setdefault(m.group(0), f"n{len(names)}"), text)


def compile_jobs(tasks: int) -> int:
    """How many processes compile ``tasks`` kernels: ``$OPSDK_COMPILE_JOBS``, else the CPUs
    this process may run on; never more than the kernels."""
    env = os.environ.get("OPSDK_COMPILE_JOBS", "").strip()
    try:
        jobs = int(env) if env else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):  # not a number; no sched_getaffinity (not Linux)
        jobs = os.cpu_count() or 1
    return max(1, min(jobs, tasks))


def compile_objects(todo: list[tuple[str, Any]], target: Any, workdir: Path,
                    build_one: Callable[[Any, Any], Any] | None = None) -> None:
    """Compile each ``(key, function)`` of ``todo`` into ``workdir/<key[:32]>.o``.

    Kernels are independent LLVM builds, so with several CPUs (:func:`compile_jobs`) forked
    workers take them one at a time from a shared pipe (a Winograd kernel with a SiLU
    epilogue takes 0.5 s, a ReLU one a tenth of that, so a fixed split would leave a worker
    idle) and write each object under a temporary name, renamed when whole. Whatever no
    worker wrote (a worker that failed or was killed) is compiled here, in this process, so
    that a kernel that cannot be compiled raises its own error.

    Examples
    --------
    >>> import tempfile, tvm, opsdk
    >>> from pathlib import Path
    >>> from tvm import te
    >>> from opsdk._kernelcache import compile_objects
    >>> a = te.placeholder((8,), name="a")
    >>> f = te.create_prim_func([a, te.compute((8,), lambda i: a[i] + 1)])
    >>> d = Path(tempfile.mkdtemp())
    >>> compile_objects([("0" * 64, f.with_attr("global_symbol", "k"))], opsdk.target("x86"), d)
    >>> (d / ("0" * 32 + ".o")).stat().st_size > 0
    True
    """
    build_one = build_one or _compile_kernel
    jobs = compile_jobs(len(todo))
    if jobs > 1:
        _forked_compile(todo, target, workdir, build_one, jobs)
        for part in workdir.glob("*.part.o"):  # a worker's object cut short
            part.unlink(missing_ok=True)
    for key, func in todo:
        obj = workdir / f"{key[:32]}.o"
        if not obj.exists():
            build_one(func, target).write_to_file(str(obj))


def _forked_compile(todo: list[tuple[str, Any]], target: Any, workdir: Path,
                    build_one: Callable[[Any, Any], Any], jobs: int) -> None:
    read_end, write_end = os.pipe()
    try:  # every task index is in the pipe before a worker starts (at most 64 KB: 16k)
        os.write(write_end, b"".join(struct.pack("<I", i) for i in range(len(todo))))
    finally:
        os.close(write_end)
    pids: list[int] = []
    try:
        for _ in range(jobs):
            pid = os.fork()
            if pid == 0:  # a worker: no Python exit handlers, no return to the caller
                code = 1
                try:
                    while len(word := os.read(read_end, 4)) == 4:
                        key, func = todo[struct.unpack("<I", word)[0]]
                        tmp = workdir / f"{key[:32]}.{os.getpid()}.part.o"  # suffix: format
                        build_one(func, target).write_to_file(str(tmp))
                        os.replace(tmp, workdir / f"{key[:32]}.o")
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        pids = []
    finally:
        os.close(read_end)
        for pid in pids:  # interrupted (Ctrl-C): the workers stop with this process
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _compile_kernel(func: Any, target: Any) -> Any:
    """``func`` (a PrimFunc, or a list of them: one object) compiled for ``target``."""
    funcs = func if isinstance(func, list) else [func]
    return tvm.tirx.build(tvm.IRModule({str(f.attrs["global_symbol"]): f for f in funcs}),
                          target=target, pipeline=tir_pipeline())


#: Chunks per compiling process when nothing is kept: few enough that a module's fixed cost
#: (26 ms: the TIR pipeline's passes, LLVM's set-up, an object file) and the constant pools
#: repeated in every object stay small; enough that the processes finish together.
_CHUNKS_PER_JOB = 4


def _compile_chunks(todo: dict[str, tuple[str, Any]], target: Any, workdir: Path,
                    build_one: Callable[[Any, Any], Any]) -> dict[str, Path]:
    """Compile the kernels of ``todo`` (key -> (symbol, function)) a few to an object file
    (kernels dealt round-robin over the chunks, so that a model's many similar kernels
    spread); key -> its object."""
    keys = list(todo)
    n = min(len(keys), compile_jobs(len(keys)) * _CHUNKS_PER_JOB)
    chunks = [keys[i::n] for i in range(n)]
    names = [f"chunk{i:027d}" for i in range(n)]  # 32 characters, like a key's object
    compile_objects([(name, [todo[k][1] for k in chunk]) for name, chunk in zip(names, chunks)],
                    target, workdir, build_one)
    return {k: workdir / f"{name}.o" for name, chunk in zip(names, chunks) for k in chunk}


def _stub_func() -> Any:
    a = te.placeholder((1,), "int8", name="a")
    b = te.compute((1,), lambda i: a[i], name="b")
    return te.create_prim_func([a, b]).with_attr("global_symbol", "__opsdk_kernels")


def _link_or_copy(src: Path, folder: Path, key: str) -> Path | None:
    """``src`` hard-linked (else copied) into ``folder``: an eviction or a concurrent
    rebuild of the entry cannot pull it from under the link step."""
    dst = folder / f"{key[:32]}.o"
    with contextlib.suppress(OSError):
        os.link(src, dst)
        return dst
    with contextlib.suppress(OSError):
        shutil.copyfile(src, dst)
        return dst
    return None
