"""Up-to-date artifacts: ``opsdk build`` of a model that has not changed since it was built
into the same folder does nothing, as ``make`` would.

A build of a model file (Python, ``.pt2``, ``.onnx``) leaves a record in the compile cache's
``records/`` folder (:func:`opsdk._modelcache.write_record`), named by the command's
material (the file, entry and its arguments, target, options, the host CPU, Python). It holds:

- ``deps``: every module imported by the end of the build (the user's files by content,
  installed packages by version, the standard library by Python's version): opsdk, TVM,
  torch and the model's own code;
- ``opened``: every file the model's import and entry opened for reading through Python
  (``open`` audit events: a config, a checkpoint read with ``torch.load``), by content;
- ``state``: a digest of what the entry returned: every tensor of the module (parameters,
  buffers, tensor attributes, however they were loaded: from a file, a seeded or unseeded
  generator), its ``repr`` (layers and their settings) and the example inputs; for a
  ``.pt2`` or ``.onnx`` file, the file itself (and an ONNX model's external data files);
- ``artifact``: the folder and the SHA-256 of each of its files.

The next build with the same material reads the record (deps changed: stale, removed), runs
the model file's entry again (its weights can come from anywhere, so only they say whether
they changed; this imports torch, not TVM), and finds the folder's files as written. Then
the artifact is up to date and is left as it is; anything else builds as before.

What the entry reads through native code (a safetensors file) is covered by its tensors;
a non-tensor setting read that way, or taken from anything but files and code, is not:
``OPSDK_NO_CACHE=1`` builds regardless.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .._files import sha256_file
from .._modelcache import (
    caches_off,
    default_dir,
    module_dependencies,
    read_record,
    source_key,
    write_record,
)

__all__ = ["BuildRecord", "artifact_files", "check_recorded", "check_up_to_date", "data_files",
           "entry_state", "open_build_record", "open_decoder_record", "opened_files", "reads"]


class BuildRecord:
    """Where the record of one ``opsdk build`` lives, and what the model was when built."""

    def __init__(self, root: Path, key: str, spec: str) -> None:
        self.root, self.key, self.spec = root, key, spec
        #: The entry's result (a Python model file), kept for the build on a miss, so the
        #: file's code runs once per command.
        self.built: Any = None
        self.state: str | None = None
        self.opened: list[list[str]] = []

    def write(self, out: Path, known: Mapping[str, str] | None = None) -> None:
        """Record the artifact just written to ``out`` (best effort: a cache that cannot
        be written only means the next build runs in full); ``known``: digests of files
        this build just wrote and hashed (the weights), not read again."""
        if self.state is None:
            return
        write_record(self.root, self.key, {
            "kind": "build", "state": self.state, "opened": self.opened,
            "deps": module_dependencies(list(sys.modules)),
            "artifact": {"folder": str(out), "files": artifact_files(out, known)}}, None)


def open_build_record(model: Any, out: Path, *, target: Any, entry: str,
                      entry_args: Mapping[str, Any] | None, options: Mapping[str, Any]
                      ) -> BuildRecord | None:
    """The record of building ``model`` into ``out`` with these arguments (one per output
    folder: two folders of one model are both up to date); None where builds are not
    recorded: the cache is off, the model is not a file (an IRModule, a module name), the
    target is not named by a string, or an option (``inputs``, real calibration data,
    tuning records) is not plain data."""
    if caches_off() or not isinstance(model, (str, os.PathLike)) or \
            not isinstance(target, str):
        return None
    path = Path(model)
    if not path.is_file() or path.suffix not in (".py", ".pt2", ".onnx"):
        return None
    try:
        json.dumps([dict(entry_args or {}), dict(options)], sort_keys=True)
    except (TypeError, ValueError):
        return None
    key = source_key({"command": "build", "out": str(out), "model": str(path.resolve()),
                      "entry": entry,
                      "entry_args": dict(entry_args or {}), "target": target,
                      "options": dict(options)})
    return BuildRecord(default_dir(), key, str(model))


# ---------------------------------------------------------------------- what the model is
_AUDIT: list[str] | None = None
_HOOKED = False


def _on_audit(event: str, args: tuple) -> None:
    if event != "open" or _AUDIT is None:
        return
    path, mode, flags = args
    if isinstance(mode, str):
        reading = not any(c in mode for c in "wax+")
    else:
        reading = isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY
    if reading and isinstance(path, (str, bytes)):
        _AUDIT.append(os.fsdecode(path))


# Python's own files and the environment's (packages, scripts): versions cover them.
_SKIP_DIRS = tuple({os.path.realpath(p) + os.sep for p in (
    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    sys.prefix, sys.base_prefix)})


@contextlib.contextmanager
def reads() -> Iterator[list[str]]:
    """The paths opened for reading through Python in the block, as given, in order (a
    block inside another one reports to both)."""
    global _AUDIT, _HOOKED
    if not _HOOKED:  # an audit hook cannot be removed: one, switched by _AUDIT
        sys.addaudithook(_on_audit)
        _HOOKED = True
    seen: list[str] = []
    outer, _AUDIT = _AUDIT, seen
    try:
        yield seen
    finally:
        _AUDIT = outer
        if outer is not None:
            outer.extend(seen)


def data_files(paths: Iterable[str]) -> list[str]:
    """The regular files among ``paths`` (real paths, sorted, once each) that are data, not
    code: installed packages, the standard library, Python sources (the module
    dependencies cover them), a package's metadata (an editable install's ``.egg-info``,
    read for versions) and ``/proc``, ``/sys``, ``/dev`` are left out."""
    out = set()
    for p in paths:
        real = os.path.realpath(p)
        if real.startswith(_SKIP_DIRS) or real.startswith(("/proc/", "/sys/", "/dev/")) or \
                real.endswith((".py", ".pyc")) or not os.path.isfile(real) or \
                os.path.dirname(real).endswith((".egg-info", ".dist-info")):
            continue
        out.add(real)
    return sorted(out)


@contextlib.contextmanager
def opened_files() -> Iterator[list[list[str]]]:
    """The regular files opened for reading in the block (``[path, sha256]``, sorted): a
    model's data files (:func:`data_files`)."""
    out: list[list[str]] = []
    with reads() as seen:
        yield out
    paths = data_files(seen)
    for p in sorted(paths):
        with contextlib.suppress(OSError):
            out.append([p, sha256_file(Path(p))])


def _tensor_bytes(t: Any) -> memoryview:
    import torch  # heavy: torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def _digest_value(h: Any, name: str, v: Any) -> None:
    import torch  # heavy: torch

    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_quantized:
            raise TypeError(f"{name}: a {v.layout} tensor")
        h.update(f"\0{name} {v.dtype} {tuple(v.shape)}\0".encode())
        h.update(_tensor_bytes(v))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _digest_value(h, f"{name}[{i}]", x)
    elif isinstance(v, dict):
        for k in sorted(v, key=str):
            _digest_value(h, f"{name}[{k!r}]", v[k])
    else:
        text = repr(v)
        if " at 0x" in text:  # an object's default repr: no stable value to compare
            raise TypeError(f"{name}: {type(v).__name__} has no comparable value")
        h.update(f"\0{name} {text}\0".encode())


def _module_state(h: Any, module: Any) -> None:
    import torch  # heavy: torch

    h.update(repr(module).encode())
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for k, v in sorted(vars(sub).items()):
            if isinstance(v, torch.Tensor):  # a constant tensor attribute (export lifts it)
                _digest_value(h, f"{prefix}.{k}", v)
        for k, v in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            _digest_value(h, f"{prefix}.{k}", v)


def state_of(built: Any) -> str | None:
    """A digest of an entry's result (``(module, args)`` or an ``ExportedProgram``); None
    when it holds something without a comparable value (a sparse tensor, an object)."""
    import torch  # heavy: torch

    h = hashlib.sha256()
    try:
        if isinstance(built, torch.export.ExportedProgram):
            h.update(b"exported\0" + str(built.graph_module.code).encode())
            _digest_value(h, "state", dict(built.state_dict))
            _digest_value(h, "constants", dict(built.constants))
            _digest_value(h, "inputs", built.example_inputs)
        elif isinstance(built, tuple) and len(built) == 2 and \
                isinstance(built[0], torch.nn.Module):
            _module_state(h, built[0])
            _digest_value(h, "inputs", built[1])
        else:
            return None
    except (TypeError, RuntimeError):
        return None
    return h.hexdigest()


def _file_state(path: Path) -> str | None:
    """A ``.pt2`` file, or an ``.onnx`` file and the external data files it names."""
    h = hashlib.sha256(sha256_file(path).encode())
    if path.suffix == ".onnx":
        try:
            import onnx  # heavy: onnx

            proto = onnx.load(str(path), load_external_data=False)
        except Exception:  # the build reports a bad file in its own words
            return None
        names = {e.value for t in proto.graph.initializer
                 if t.data_location == onnx.TensorProto.EXTERNAL
                 for e in t.external_data if e.key == "location"}
        for n in sorted(names):
            p = path.parent / n
            if not p.is_file():
                return None
            h.update(f"\0{n}\0{sha256_file(p)}".encode())
    return h.hexdigest()


def entry_state(rec: BuildRecord, entry: str, entry_args: Mapping[str, Any] | None
                ) -> None:
    """Fill ``rec`` with what the model is now: the entry's result (kept for the build),
    its digest and the data files it opened. Raises what the model file raises (the
    build reports it as it always did)."""
    path = Path(rec.spec)
    if path.suffix != ".py":
        rec.state = _file_state(path)
        return
    from .._modelimports import prepare_model_imports
    from .._userfile import call_entry, import_model_module

    prepare_model_imports()
    with opened_files() as opened:
        module = import_model_module(rec.spec)
        if entry_args is None:
            entry_args = getattr(module, "DEFAULT_ARGS", None) or {}
        rec.built = (module, call_entry(module, rec.spec, entry, **dict(entry_args)))
    rec.opened = opened
    rec.state = state_of(rec.built[1])


# --------------------------------------------------------------------------- the artifact
def artifact_files(folder: Path, known: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` (``known``: those given)."""
    out = {}
    known = known or {}
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            rel = (Path(dirpath) / f).relative_to(folder).as_posix()
            out[rel] = known.get(rel) or sha256_file(Path(dirpath) / f)
    return dict(sorted(out.items()))


def check_up_to_date(rec: BuildRecord, out: Path, entry: str,
                     entry_args: Mapping[str, Any] | None) -> bool:
    """Whether ``out`` holds the artifact an earlier build of the same, unchanged model
    wrote; ``rec`` then holds the model's state either way (for the build on a miss)."""
    data = read_record(rec.root, rec.key)
    entry_state(rec, entry, entry_args)
    return _matches(rec, data, out)


def open_decoder_record(model: Any, out: Path, *, target: Any,
                        options: Mapping[str, Any]) -> BuildRecord | None:
    """The record of building the decoder ``model`` (a name of :data:`opsdk.llm.MODELS`,
    whose random weights come from opsdk's code and the seed in ``options``, or a checkpoint
    folder, by every file's content) into ``out``; None where builds are not recorded (the
    cache is off, weights given as an object, a target that is not a string)."""
    if caches_off() or not isinstance(model, (str, os.PathLike)) or \
            not isinstance(target, str):
        return None
    path = Path(model)
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}\0{sha256_file(f)}\0".encode())
        source = str(path.resolve())
    else:
        source = str(model)
    key = source_key({"command": "build decoder", "out": str(out), "model": source,
                      "target": target, "options": dict(options)})
    rec = BuildRecord(default_dir(), key, str(model))
    rec.state = h.hexdigest()
    return rec


def check_recorded(rec: BuildRecord, out: Path) -> bool:
    """Whether ``out`` holds the artifact the record of ``rec`` (state already known) names."""
    return _matches(rec, read_record(rec.root, rec.key), out)


def _matches(rec: BuildRecord, data: dict[str, Any] | None, out: Path) -> bool:
    if data is None or rec.state is None or data.get("kind") != "build":
        return False
    if data["state"] != rec.state or data["opened"] != rec.opened:
        return False
    art = data["artifact"]
    if art["folder"] != str(out) or not out.is_dir():
        return False
    try:
        return artifact_files(out) == art["files"]
    except OSError:
        return False
