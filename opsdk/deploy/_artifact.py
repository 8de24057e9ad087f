"""``opsdk build``: compile a model into a deployable folder (library, manifest, checks)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._dtypes import array_view
from .._files import check_can_create, new_file_mode, sha256_file
from .._timings import phase, record_phases
from .._version import __version__
from ..runners import InputMismatch, LocalRunner, check_inputs, cross_compiler
from ._uptodate import check_up_to_date, open_build_record

__all__ = ["MANIFEST_FORMAT", "WEIGHTS_FILE", "ArtifactError", "build_artifact",
           "read_manifest", "read_weights"]

#: ``manifest.json``'s ``format``: bumped when a field changes meaning. 2: the weights in
#: their own file (``weights``), transformed once at load by ``main_transform_params``.
MANIFEST_FORMAT = "opsdk-artifact/2"
#: Formats this opsdk still reads (1: weights bundled in ``model.so``, already transformed;
#: 3: a decoder, :mod:`opsdk.deploy._decoder`).
_READABLE = ("opsdk-artifact/1", MANIFEST_FORMAT, "opsdk-artifact/3")
#: The weights' file in an artifact: TVM's parameter format (``runtime.LoadParamsFromFile``).
WEIGHTS_FILE = "weights.params"

# x86 ISA extensions worth naming in a manifest (what LLVM may use for the target's -mcpu).
_X86_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                 "avx512vl", "avx512vnni", "avx512bf16", "avx512fp16", "avxvnni", "amx-tile",
                 "amx-int8", "amx-bf16")


class ArtifactError(ValueError):
    """A bad output folder, model or artifact: the message names it and the fix."""


def _log_to(log: Callable[[str], Any] | None) -> Callable[[str], Any]:
    return log if log is not None else (lambda _msg: None)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of an ``opsdk build`` folder, checked: format, files present, hash.

    Raises
    ------
    ArtifactError
        Not an artifact, another format, a missing library or one whose hash differs.
    """
    root = Path(folder)
    path = root / "manifest.json"
    if root.exists() and not root.is_dir():  # said "afile/manifest.json ... Not a directory"
        raise ArtifactError(f"{root}: not an artifact folder (a file); opsdk build writes "
                            "one: `opsdk build MODEL --target TARGET -o FOLDER`")
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{root} is not an opsdk artifact (no manifest.json); make one "
                            "with `opsdk build MODEL --target TARGET -o FOLDER`") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path} cannot be read ({e}); rebuild the artifact") from None
    if not isinstance(m, dict) or m.get("format") not in _READABLE:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ArtifactError(f"{path}: format {got!r}, this opsdk reads {MANIFEST_FORMAT!r}; "
                            "rebuild the artifact with this opsdk")
    try:
        lib = root / m["library"]["file"]
        want = str(m["library"]["sha256"])
        missing = [k for k in ("target", "inputs", "outputs", "check") if k not in m]
        if missing:
            raise KeyError(missing[0])
    except (KeyError, TypeError):
        raise ArtifactError(f"{path} is incomplete (written by hand or cut short); rebuild "
                            "the artifact") from None
    _check_file(lib, want, "library")
    w = m.get("weights") or {}
    if w.get("file"):
        try:
            _check_file(root / w["file"], str(w["sha256"]), "weights")
        except (KeyError, TypeError):
            raise ArtifactError(f"{path} is incomplete (weights without sha256); rebuild "
                                "the artifact") from None
    return m


def _check_file(path: Path, want: str, what: str) -> None:
    if not path.is_file():
        raise ArtifactError(f"{path} is missing (the artifact's {what}); copy the whole "
                            "artifact folder, or rebuild it")
    digest = sha256_file(path)
    if digest != want:
        raise ArtifactError(f"{path} does not match its manifest (sha256 {digest[:12]}..., "
                            f"manifest {want[:12]}...): the file was "
                            "changed or damaged; rebuild the artifact")


def read_weights(folder: str | os.PathLike, manifest: Mapping[str, Any] | None = None
                 ) -> list[np.ndarray] | None:
    """The original weights of an artifact, in ``main_transform_params``' order; None for an
    artifact whose weights are bundled in ``model.so`` (format 1, or a model without any).

    Raises
    ------
    ArtifactError
        The weights file is missing, damaged, or lacks a weight the manifest names.
    """
    import tvm  # heavy: TVM

    root = Path(folder)
    m = read_manifest(root) if manifest is None else manifest
    w = m.get("weights") or {}
    if not w.get("file"):
        return None
    path = root / w["file"]
    try:
        got = tvm.runtime.load_param_dict_from_file(str(path))
    except Exception as e:  # TVM's reader: a bad magic number, a short file
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ArtifactError(f"{path} cannot be read as weights ({first[:200]}); rebuild "
                            "the artifact") from None
    missing = [n for n in w["names"] if n not in got]
    if missing:
        raise ArtifactError(f"{path} lacks weight(s) {', '.join(missing[:5])} that the "
                            "manifest names; rebuild the artifact")
    return [got[n].numpy() for n in w["names"]]


# ------------------------------------------------------------------------- model facts
def _dims(shape: Any) -> list[int | str]:
    from tvm import tirx  # heavy: TVM

    return [int(d.value) if isinstance(d, tirx.IntImm) else str(d) for d in shape.values]


def _tensor_types(ty: Any) -> list[Any]:
    from tvm import relax  # heavy: TVM

    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in _tensor_types(f)]
    return [ty]


def _safe_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "input"
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out


def _io_specs(func: Any, inputs: Sequence[np.ndarray],
              outputs: Sequence[np.ndarray]) -> tuple[list[dict], list[dict]]:
    taken: set[str] = set()
    ins = []
    for p, a in zip(func.params, inputs):
        ins.append({"name": _safe_name(str(p.name), taken), "dtype": str(p.ty.dtype),
                    "shape": _dims(p.ty.shape) if p.ty.shape is not None else None,
                    "example_shape": list(a.shape)})
    outs = []
    for i, (t, a) in enumerate(zip(_tensor_types(func.ret_ty), outputs)):
        shape = getattr(t, "shape", None)
        outs.append({"name": f"out{i}", "dtype": str(a.dtype),
                     "shape": _dims(shape) if shape is not None else None,
                     "example_shape": list(a.shape)})
    return ins, outs


def _bindings(func: Any, inputs: Sequence[np.ndarray]) -> dict[Any, int]:
    """The symbolic dims of ``func``'s inputs, bound to the example inputs' sizes."""
    from tvm import tirx  # heavy: TVM

    out: dict[Any, int] = {}
    for p, a in zip(func.params, inputs):
        if p.ty.shape is None:
            continue
        for d, n in zip(p.ty.shape.values, a.shape):
            if isinstance(d, tirx.Var):
                out[d] = int(n)
    return out


def _planned_memory(planned: Any, inputs: Sequence[np.ndarray]) -> dict[str, Any]:
    """What the VM allocates per call of ``main``, read off the memory-planned module:
    the planned storage blocks of the intermediates (symbolic when sizes depend on the
    input) and the tensors allocated outside the plan (the outputs), at the example sizes."""
    import tvm  # heavy: TVM
    from tvm import tirx  # heavy: TVM
    from tvm.sym import Analyzer  # tvm.arith in TVM before 0.27

    from .._walk import calls_of  # heavy: TVM

    func = planned["main"]
    env = _bindings(func, inputs)
    ana = Analyzer()
    at_example = Analyzer()
    for v, n in env.items():
        at_example.bind(v, tirx.IntImm("int64", n))  # Relax shape vars are int64
    storage: list[Any] = []
    unplanned: list[Any] = []

    for e in calls_of(func.body, "relax.memory.alloc_storage", "relax.builtin.alloc_tensor"):
        if e.op.name == "relax.memory.alloc_storage":
            storage.append(e.args[0].values[0])
        else:
            dt = tvm.DataType(str(e.args[1].value))
            n: Any = tirx.IntImm("int64", max(1, dt.bits * dt.lanes // 8))
            for d in e.args[0].values:
                n = n * d
            unplanned.append(n)

    def total(sizes: list[Any]) -> tuple[str, int | None]:
        if not sizes:
            return "0", 0
        expr = sizes[0]
        for s in sizes[1:]:
            expr = expr + s
        expr = ana.simplify(expr)
        bound = at_example.simplify(expr)
        return str(expr), int(bound.value) if isinstance(bound, tirx.IntImm) else None

    s_expr, s_bytes = total(storage)
    u_expr, u_bytes = total(unplanned)
    bounds = (func.attrs or {}).get("tir_var_upper_bound", {}) or {}
    return {
        "planned_for": {str(k): int(v) for k, v in bounds.items()},
        "planned_intermediates_bytes": s_bytes,
        "planned_intermediates_formula": s_expr,
        "planned_blocks": len(storage),
        "outputs_bytes": u_bytes,
        "outputs_formula": u_expr,
        "peak_bytes": None if s_bytes is None or u_bytes is None else s_bytes + u_bytes,
        "at": {str(v): n for v, n in env.items()},
    }


def _symbolic_dims(func: Any) -> list[str]:
    from tvm import tirx  # heavy: TVM

    names: list[str] = []
    for p in func.params:
        for d in (p.ty.shape.values if p.ty.shape is not None else []):
            if isinstance(d, tirx.Var) and str(d) not in names:
                names.append(str(d))
    return names


def _with_upper_bounds(mod: Any, func: Any, bounds: dict[str, int],
                       inputs: Sequence[np.ndarray]) -> Any:
    """``mod`` with ``main``'s ``tir_var_upper_bound`` set from ``bounds`` (checked: known
    dims, at least the example's size)."""
    dims = _symbolic_dims(func)
    example = {str(v): n for v, n in _bindings(func, inputs).items()}
    for name, n in bounds.items():
        if name not in dims:
            raise ArtifactError(
                f"--max-dim {name}={n}: the model has no symbolic input dim {name!r}"
                + (f"; its symbolic dims are {', '.join(dims)}" if dims else
                   "; its inputs have static shapes"))
        if n < example.get(name, 1):
            raise ArtifactError(f"--max-dim {name}={n} is below the example input's "
                                f"{name}={example[name]}")
    old = dict((func.attrs or {}).get("tir_var_upper_bound", {}) or {})
    merged = {str(k): int(v) for k, v in old.items()} | {k: int(v) for k, v in bounds.items()}
    out = mod.copy() if hasattr(mod, "copy") else mod
    out["main"] = func.with_attr("tir_var_upper_bound", merged)
    return out


def _quantize(mod: Any, int8: Any, calibration: Any, inputs: Sequence[np.ndarray],
              say: Callable[[str], Any]) -> tuple[Any, dict[str, Any], list[np.ndarray]]:
    """The int8 module, what the manifest records of it, and the float model's outputs on
    ``inputs`` (the int8 host build, compiled once by the caller, is compared with them)."""
    from ..model import compile_model  # heavy: TVM
    from ..quant import QuantConfig, find_sites, quantize_model  # heavy: TVM

    cfg = int8 if isinstance(int8, QuantConfig) else QuantConfig()
    if calibration is None or isinstance(calibration, int):
        rng = np.random.default_rng(1)
        calibration = ([rng.standard_normal(a.shape).astype(a.dtype) for a in inputs]
                       for _ in range(32 if calibration is None else calibration))
    say("calibrating and quantizing to int8")
    if not find_sites(mod):
        raise ArtifactError("--int8: the model has no dense or conv2d layer with a constant "
                            "float32 weight to quantize")
    qm = quantize_model(mod, calibration, cfg)
    if not qm.quantized:
        raise ArtifactError("--int8: every layer is kept float: nothing to quantize")
    with LocalRunner() as host:
        float_out = host.run(compile_model(mod, "host").ex, inputs)
    info = {"int8_layers": qm.quantized, "float_layers": list(qm.config.keep_float),
            "config": {k: v for k, v in qm.config.__dict__.items() if k != "keep_float"},
            "layers": qm.sensitivity()}
    return qm.mod, info, float_out


def _constants_bytes(mod: Any) -> int:
    import tvm  # heavy: TVM
    from tvm import relax  # heavy: TVM

    from .._walk import relax_exprs  # heavy: TVM

    seen: set[int] = set()
    total = 0
    for _, f in mod.functions.items():
        if not isinstance(f, relax.Function):
            continue
        for e in relax_exprs(f.body):
            # GenericConst also wraps dtypes and strings: count the tensors only. Key by the
            # object's address: Python wrappers come and go, and their id()s are reused.
            if isinstance(e, tvm.ir.expr.GenericConst) and e.__chandle__() not in seen and \
                    isinstance(e.value, tvm.runtime.Tensor):
                seen.add(e.__chandle__())
                dt = tvm.DataType(str(e.value.dtype))
                total += int(np.prod(e.value.shape)) * max(1, dt.bits * dt.lanes // 8)
    return total


def _mark_load_kernels(kernels: list[dict[str, Any]], mod: Any) -> list[dict[str, Any]]:
    """``kernels`` with ``at_load: True`` on those only the weight transform calls (they run
    once, when the weights are loaded, not per inference)."""
    import tvm  # heavy: TVM
    from tvm import relax  # heavy: TVM

    from .._walk import calls_of  # heavy: TVM

    called: dict[bool, set[str]] = {True: set(), False: set()}  # by main / by the rest
    for gv, f in mod.functions.items():
        if not isinstance(f, relax.Function):
            continue
        called[gv.name_hint == "main"].update(
            e.args[0].name_hint for e in calls_of(f.body, "relax.call_tir")
            if isinstance(e.args[0], tvm.ir.GlobalVar))
    at_load = called[False] - called[True]
    return [{**k, "at_load": True} if k["name"] in at_load else k for k in kernels]


def _tensor_bytes(t: Any) -> int:
    import tvm  # heavy: TVM

    dt = tvm.DataType(str(t.dtype))
    return int(np.prod([int(d) for d in t.shape])) * max(1, dt.bits * dt.lanes // 8)


def _module_facts(cm: Any, inputs: Sequence[np.ndarray]) -> dict[str, Any]:
    """What the manifest states of the compiled modules (the constants' and the
    transformed weights' bytes, the planned memory at these inputs, the kernels), kept with
    the compile-cache entry: a rebuild of an unchanged model does not recompute the
    scheduled module for them."""
    from ..model import scheduled_kernels  # heavy: TVM

    def compute() -> dict[str, Any]:
        import tvm  # heavy: TVM

        main = cm.scheduled["main"]
        n_in = int(main.attrs["num_input"]) if "num_input" in (main.attrs or {}) else None
        # What main takes after its inputs: the weights as the kernels read them (static
        # shapes: they come from constants).
        transformed = 0
        for p in main.params[n_in:] if n_in is not None else []:
            dt = tvm.DataType(str(p.ty.dtype))
            transformed += int(np.prod([int(d) for d in p.ty.shape.values])) * max(1, dt.bits // 8)
        return {
            "bundled_bytes": _constants_bytes(cm.planned or cm.scheduled),
            "transformed_bytes": transformed,
            "memory": _planned_memory(cm.planned, inputs) if cm.planned is not None else None,
            "kernels": _mark_load_kernels(scheduled_kernels(cm.scheduled), cm.scheduled),
        }

    shapes = json.dumps([[str(a.dtype), list(a.shape)] for a in inputs])
    return cm.memo("artifact-" + hashlib.sha256(shapes.encode()).hexdigest()[:16], compute)


def _weights_digest(weights: Mapping[str, Any]) -> str:
    """SHA-256 of the weights themselves: each one's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in weights.items():
        a = np.ascontiguousarray(array_view(t))
        h.update(f"\0{name}\0{a.dtype}\0{a.shape}\0".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def _earlier_weights(earlier: Path | None, content: str) -> tuple[Path, str] | None:
    """The weights file of the artifact ``earlier`` (the one this build replaces) and its
    SHA-256, when it holds these weights (``content``: :func:`_weights_digest`) and its
    bytes are still those its manifest states."""
    if earlier is None:
        return None
    try:
        info = json.loads((earlier / "manifest.json").read_text())["weights"]
        path = earlier / str(info["file"])
        if info.get("content_sha256") != content or info.get("format") != "tvm-params" \
                or path.stat().st_size != int(info["bytes"]):
            return None
        digest = sha256_file(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (path, digest) if digest == info.get("sha256") else None


def _weights_info(folder: Path, weights: Mapping[str, Any], facts: Mapping[str, Any],
                  earlier: Path | None = None) -> dict[str, Any]:
    """Write ``weights`` (none: bundled) to ``folder/WEIGHTS_FILE``; the manifest's
    ``weights``: how they are stored, their bytes on disk and once loaded. The file of the
    artifact ``earlier`` is taken over (linked, else copied) where it holds the same
    weights: a rebuild after an edit to a layer's code writes 100 MB less."""
    import tvm  # heavy: TVM

    bundled = facts["bundled_bytes"]
    if not weights:
        return {"storage": "bundled", "file": None, "bundled_bytes": bundled,
                "loaded_bytes": bundled}
    path = folder / WEIGHTS_FILE
    content = _weights_digest(weights)
    same = _earlier_weights(earlier, content)
    if same is None:
        tvm.runtime.save_param_dict_to_file(dict(weights), str(path))
        digest = sha256_file(path)
    else:
        try:
            os.link(same[0], path)
        except OSError:  # another file system, or no hard links there
            shutil.copyfile(same[0], path)
        digest = same[1]
    loaded = facts["transformed_bytes"]
    return {
        "storage": "file", "file": WEIGHTS_FILE, "format": "tvm-params",
        "bytes": path.stat().st_size, "sha256": digest, "content_sha256": content,
        "names": list(weights), "tensor_bytes": sum(_tensor_bytes(t) for t in weights.values()),
        "bundled_bytes": bundled, "transform": "main_transform_params",
        "transformed_bytes": loaded, "loaded_bytes": loaded + bundled,
    }


def needed_features(tgt: Any) -> list[str]:
    """The CPU features the code for ``tgt`` may use, in manifest spelling (``neon``,
    ``dotprod``, ``avx512f``, ...): an aarch64 target's ``mattr``, an x86 target's ISA
    extensions enabled by its ``-mcpu``."""
    from ..targets import target_arch, target_features  # heavy: TVM

    arch = target_arch(tgt)
    if arch == "aarch64":
        return [str(m)[1:] for m in (tgt.attrs.get("mattr", []) or []) if str(m).startswith("+")]
    if arch == "x86_64":
        feats = target_features(tgt)
        return [f for f in _X86_FEATURES if f in feats]
    return []


def _target_facts(target: Any, tgt: Any, arch: str) -> dict[str, Any]:
    """The manifest's ``target``: the name given, TVM's target, the architecture, its
    ``-mcpu`` and the CPU features the code needs."""
    mcpu = str(tgt.attrs.get("mcpu", "") or "") if tgt.kind.name == "llvm" else ""
    return {"name": target if isinstance(target, str) else None, "target": str(tgt),
            "arch": arch, "mcpu": mcpu, "features": needed_features(tgt)}


def _versions() -> dict[str, str | None]:
    """The manifest's ``versions``."""
    return {"opsdk": __version__, "apache-tvm": _version("apache-tvm"),
            "apache-tvm-ffi": _version("apache-tvm-ffi")}


def _copy_runtime(folder: Path, arch: str) -> list[str]:
    """Copy TVM's runtime libraries for ``arch`` into ``folder/runtime/``; their paths
    relative to ``folder``."""
    from .runtime import runtime_paths

    try:
        libs = runtime_paths(arch)["libs"]
    except RuntimeError as e:
        raise ArtifactError(str(e)) from None
    (folder / "runtime").mkdir()
    for p in libs:
        shutil.copyfile(p, folder / "runtime" / p.name)
    return [f"runtime/{p.name}" for p in libs]


def _export(cm: Any, path: Path, arch: str) -> None:
    """Write the compiled model's library to ``path`` (from the compile cache: a copy of
    the cached file; a library loaded back cannot be exported again)."""
    from ..targets import LINK_OPTIONS  # heavy: TVM

    if cm.library is not None:
        shutil.copyfile(cm.library, path)
        return
    ex = cm.ex
    try:
        cc = cross_compiler(arch)
    except RuntimeError as e:
        raise ArtifactError(str(e)) from None
    if cc is None:
        ex.export_library(str(path), options=list(LINK_OPTIONS))
    else:
        ex.export_library(str(path), cc=cc, options=list(LINK_OPTIONS))


def _framework_outputs(loaded: Any, inputs: Sequence[np.ndarray]) -> tuple[str, list]:
    """The model's own outputs on the example inputs: torch eager, or onnxruntime for an
    ONNX file when it is installed; ("", []) when there is no framework to ask."""
    if loaded is None:
        return "", []
    if loaded.torch_module is not None:
        import torch

        from ..model import torch_outputs  # heavy: TVM

        with torch.no_grad():
            return "torch", torch_outputs(loaded.torch_module(*loaded.torch_args))
    if loaded.onnx is not None:
        try:
            import onnxruntime as ort
        except ImportError:
            return "", []
        sess = ort.InferenceSession(loaded.onnx, providers=["CPUExecutionProvider"])
        feed = {i.name: a for i, a in zip(sess.get_inputs(), inputs)}
        return "onnxruntime", list(sess.run(None, feed))
    return "", []


def _prepare_folder(out: Path, force: bool) -> bool:
    """Refuse an output folder that holds anything but an earlier artifact, and one whose
    parent takes no new files. True: ``out`` holds an earlier artifact and no ``force``
    was given (kept as it is if it is up to date, else refused by :func:`_refuse_replace`)."""

    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} is a file; name a folder for the artifact")
    held = False
    if out.is_dir() and any(out.iterdir()):
        if not (out / "manifest.json").is_file():
            raise ArtifactError(f"{out} holds files that are not an opsdk artifact (no "
                                "manifest.json); --force only replaces an artifact, so name "
                                "a new folder")
        held = not force
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        check_can_create(parent)
    except OSError as e:
        raise ArtifactError(f"cannot create {out}: {e.strerror or e}") from None
    return held


def _refuse_replace(out: Path) -> ArtifactError:
    return ArtifactError(f"{out} exists and is not empty: it holds an earlier artifact that "
                         "this build would replace (another model, other options or an "
                         "edit); pass --force to replace it, or name a new folder")


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out``; an earlier artifact there is replaced
    only once the new one is complete, and comes back if the move fails."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.opsdk-old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _load(model: Any, inputs: Sequence[np.ndarray] | None, entry: str,
          entry_args: Mapping[str, Any] | None, shapes: Mapping[str, Sequence[int]] | None,
          say: Callable[[str], Any], called: Any = None
          ) -> tuple[Any, str, Any, list[np.ndarray]]:
    """(module, its source's name, the loaded model or None, example inputs checked against
    ``main``): an IRModule as it is, a model file through :func:`opsdk.model.load_model`
    (``called``: the file's module and its entry's result, when the up-to-date check ran
    them)."""
    import tvm  # heavy: TVM

    from ..model import load_model  # heavy: TVM

    loaded = None
    if isinstance(model, tvm.IRModule):
        mod, source = model, "IRModule"
        if inputs is None:
            raise ArtifactError("an IRModule needs example inputs: pass inputs=[...]")
    else:
        source = str(model)
        say(f"importing {source}")
        loaded = load_model(source, entry=entry, entry_args=entry_args, shapes=shapes,
                            baselines=False, called=called)
        mod = loaded.opsdk_mod
        inputs = list(inputs) if inputs is not None else loaded.inputs
    inputs = [np.ascontiguousarray(a) for a in inputs]
    try:  # before compiling: TVM checks them only when the host build runs, in its words
        check_inputs(mod["main"], inputs)
    except InputMismatch as e:
        raise ArtifactError(str(e)) from None
    return mod, source, loaded, inputs


def build_artifact(
    model: Any,
    out_dir: str | os.PathLike,
    *,
    target: Any = "arm",
    entry: str = "build_model",
    entry_args: Mapping[str, Any] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    inputs: Sequence[np.ndarray] | None = None,
    max_dims: Mapping[str, int] | None = None,
    int8: Any = None,
    calibration: Any = None,
    force: bool = False,
    with_runtime: bool = False,
    winograd: bool = True,
    lift_weights: bool = True,
    log: Callable[[str], Any] | None = print,
    tuning: Sequence[Any] = (),
) -> dict[str, Any]:
    """Compile ``model`` for ``target`` and write a deployable folder ``out_dir``.

    Parameters
    ----------
    model
        A model file (a Python file or module with an ``entry`` function returning
        ``(torch module, example args)`` or an ``ExportedProgram``, a ``.pt2`` file, an
        ``.onnx`` file), or a Relax ``IRModule`` (then ``inputs`` are required).
    out_dir
        The folder to write; it must be new or empty, or an earlier artifact with ``force``
        (without it, an artifact up to date with this model and these options is kept and
        returned; any other is refused). The whole folder is written beside it and renamed
        into place when complete.
    target
        ``arm``, ``arm-dotprod``, ``arm-sve``, ``x86`` or a TVM target.
    entry, entry_args, shapes
        As :func:`opsdk.model.load_model` (the entry's keyword arguments; input shapes of an
        ONNX model with symbolic dims).
    inputs
        Example inputs (default: the model's own example inputs).
    max_dims
        Largest value of a symbolic input dim (``{"batch": 8}``): TVM plans the
        intermediates' memory for the largest inputs, and a torch.export batch dim allows up
        to 1024 unless told. The manifest gives the bounds used.
    int8
        Quantize the dense and conv layers to int8 first (:func:`opsdk.quant.quantize_model`): True
        or a :class:`opsdk.quant.QuantConfig`; ``calibration`` are its inputs (an iterable
        of input lists, or a count of random normal samples shaped like the example inputs;
        default 32). The manifest records the int8 layers and the model's agreement with
        float; ``opsdk run`` then checks the device against the int8 host build and reports
        the framework's float output as information.
    force
        Replace an earlier artifact in ``out_dir``.
    with_runtime
        Also copy TVM's runtime libraries for the target's architecture into
        ``out_dir/runtime/`` (what a board needs beside ``model.so``).
    winograd
        False: every conv direct (by default eligible 3x3 convs run Winograd F(2x2, 3x3),
        whose transformed weights take 16/9 the memory of the conv's own).
    lift_weights
        True: the weights (constants of 1 KiB or more) are stored once, as the model has
        them, in ``weights.params``; every transform of them (channels-last transposes,
        packing, Winograd's G·g·Gᵀ) runs once at load in ``main_transform_params``
        (:mod:`opsdk.transform._lift`). False: the weights are bundled in ``model.so``,
        transformed at compile time (format 1's way; larger with Winograd).
    log
        Progress messages (None: quiet).
    tuning
        Verified tuning records (``opsdk.tune.TuningDB(folder).records(target)``): each
        schedules its own kernel ahead of the hand rules. The records that scheduled a
        kernel are written to ``tuning/`` and listed in the manifest (``tuning``).

    Returns
    -------
    dict
        The manifest written to ``out_dir/manifest.json``.
    """
    say = _log_to(log)
    out = Path(out_dir).expanduser().absolute()
    held = _prepare_folder(out, force)
    t0 = time.perf_counter()
    # Before anything imports TVM: an unchanged model's artifact is left as it is.
    rec = None
    if inputs is None and not tuning and (calibration is None or isinstance(calibration, int)) \
            and isinstance(int8, (bool, type(None))):
        rec = open_build_record(model, out, target=target, entry=entry, entry_args=entry_args,
                                options={"shapes": shapes, "max_dims": max_dims, "int8": bool(int8),
                                         "calibration": calibration, "runtime": with_runtime,
                                         "winograd": winograd, "lift_weights": lift_weights})
    if rec is not None:
        up_to_date = check_up_to_date(rec, out, entry, entry_args)
        record_phases({"up-to-date check": time.perf_counter() - t0})
        if up_to_date:
            say(f"{out} is up to date: the model, what it imports and reads, its weights "
                "and the options are as when it was built")
            return read_manifest(out) | {"up_to_date": True}
    if held:  # an earlier artifact that this build would change
        raise _refuse_replace(out)

    with phase("import TVM"):
        from ..model import compile_model  # heavy: TVM
        from ..quant import agreement  # heavy: TVM
        from ..runners.local import host_arch  # heavy: TVM
        from ..targets import target as resolve_target  # heavy: TVM
        from ..targets import target_arch  # heavy: TVM

    try:
        tgt = resolve_target(target)
    except ValueError as e:
        raise ArtifactError(str(e)) from None
    arch = target_arch(tgt)

    mod, source, loaded, inputs = _load(model, inputs, entry, entry_args, shapes, say,
                                        rec.built if rec is not None else None)
    if max_dims:
        mod = _with_upper_bounds(mod, mod["main"], dict(max_dims), inputs)
    quant_info, float_out = None, None
    if int8:
        mod, quant_info, float_out = _quantize(mod, int8, calibration, inputs, say)
    func = mod["main"]

    mcpu = str(tgt.attrs.get("mcpu", "") or "") if tgt.kind.name == "llvm" else ""
    say(f"compiling for {target if isinstance(target, str) else tgt.kind.name} ({arch}"
        + (f", {mcpu}" if mcpu else "") + ")")
    weights: dict[str, Any] = {}
    if lift_weights:
        from ..transform import weights_as_params

        lifted, weights = weights_as_params(mod)
        if weights:  # else nothing to store apart: the module as it is
            mod = lifted
    w_arrays = [array_view(t) for t in weights.values()] if weights else None
    cm = compile_model(mod, tgt, winograd=winograd, tuning=tuning)
    host_tgt = resolve_target("host")
    same_host = arch == host_arch() and str(host_tgt) == str(tgt)
    host_cm = cm if same_host else compile_model(mod, host_tgt, winograd=winograd)

    with phase("check run"):
        with LocalRunner() as host:
            host_out = host.run(host_cm.ex, inputs, weights=w_arrays)
        if quant_info is not None:
            quant_info["vs_float"] = agreement(host_out[0], float_out[0])
        framework, fw_out = _framework_outputs(loaded, inputs)
    ins, outs = _io_specs(func, inputs, host_out)
    with phase("write artifact"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.opsdk-build-", dir=out.parent))
        try:
            lib = tmp / "model.so"
            say(f"exporting {lib.name} ({arch})")
            _export(cm, lib, arch)
            check = tmp / "check"
            (check / "inputs").mkdir(parents=True)
            if same_host:
                host_lib = "model.so"
            else:
                host_lib = "check/host.so"
                _export(host_cm, tmp / host_lib, host_arch())
            runtime_files = _copy_runtime(tmp, arch) if with_runtime else []
            _write_checks(check, ins, inputs, host_out, framework, fw_out)
            _write_io(tmp / "io.txt", ins, weights, outs)
            facts = _module_facts(cm, inputs)
            used = _ship_tuning(tmp, tuning, facts["kernels"])
            w_info = _weights_info(tmp, weights, facts, out if out.is_dir() else None)
            manifest = {
                "format": MANIFEST_FORMAT,
                "model": {"source": source, "entry": entry if loaded is not None else None,
                          "entry_args": dict(entry_args or {}), "framework": framework or None},
                "target": _target_facts(target, tgt, arch),
                "library": {"file": "model.so", "bytes": lib.stat().st_size,
                            "sha256": sha256_file(lib),
                            "weights": (f"{WEIGHTS_FILE}, transformed once at load by "
                                        "main_transform_params" if weights else
                                        "bundled in model.so (the VM constant pool)"),
                            "weights_bytes": w_info["loaded_bytes"],
                            "runtime": ["libtvm_runtime.so", "libtvm_ffi.so"],
                            "runtime_included": runtime_files},
                "weights": w_info,
                "entry": "main",
                "inputs": [{k: v for k, v in sp.items()} for sp in ins],
                "outputs": outs,
                "memory": facts["memory"],
                "kernels": facts["kernels"],
                "quantization": quant_info,
                "tuning": used,
                "check": {"host_library": host_lib, "host_target": str(host_tgt),
                          "inputs": "check/inputs", "expected": "check/expected.npz",
                          "framework": framework or None},
                "versions": _versions(),
                "build_seconds": round(time.perf_counter() - t0, 2),
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            _fix_modes(tmp)
            _swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if rec is not None:
            rec.write(out, {WEIGHTS_FILE: w_info["sha256"]} if weights else None)
    say(f"wrote {out}: {manifest['library']['bytes'] / 1e6:.2f} MB library, "
        f"{len(manifest['kernels'])} kernels")
    return manifest


def _ship_tuning(folder: Path, tuning: Sequence[Any],
                 kernels: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``tuning/<workload>.json`` for each record that scheduled a kernel (its rule in
    ``kernels``); the manifest's list of them (kernel, every kernel carrying the rule: the
    packing split off it too, rule, workload, speedup, file)."""
    rules: dict[str, list[str]] = {}
    for k in kernels:  # a packing split off a tuned kernel carries its rule too
        rules.setdefault(str(k.get("rule", "")), []).append(str(k.get("name", "")))
    used = []
    for r in tuning:
        if r.rule_name not in rules:
            continue
        (folder / "tuning").mkdir(exist_ok=True)
        rel = f"tuning/{r.workload}.json"
        (folder / rel).write_text(json.dumps(
            {"workload": r.workload, "kernel": r.kernel, "hand_rule": r.hand_rule,
             "speedup": r.speedup, "trace": r.trace}, indent=1) + "\n")
        names = sorted(rules[r.rule_name], key=lambda n: ("prepack" in n, n))
        used.append({"kernel": names[0], "kernels": names, "rule": r.rule_name,
                     "workload": r.workload, "hand_rule": r.hand_rule,
                     "speedup": round(r.speedup, 3), "file": rel})
    return used


def _write_checks(check: Path, ins: Sequence[dict[str, Any]], inputs: Sequence[np.ndarray],
                  host_out: Sequence[np.ndarray], framework: str,
                  fw_out: Sequence[Any]) -> None:
    """``check/``: the example inputs (raw, one file each) and the outputs to compare a
    device with (the host build's, and the framework's when there is one)."""
    for spec, a in zip(ins, inputs):
        a.tofile(check / "inputs" / f"{spec['name']}.bin")
    arrays = {f"host_{i}": a for i, a in enumerate(host_out)}
    arrays |= {f"{framework}_{i}": np.asarray(a) for i, a in enumerate(fw_out)}
    np.savez(check / "expected.npz", **arrays)


def _write_io(path: Path, ins: Sequence[dict[str, Any]], weights: Mapping[str, Any],
              outs: Sequence[dict[str, Any]]) -> None:
    """``io.txt``: one tensor a line (role, name, dtype, example dims), for a loader with no
    JSON parser (the C++ example)."""
    lines = ["# opsdk build: one tensor per line: role name dtype dims (example sizes)"]
    w_specs = [{"name": n, "dtype": str(t.dtype), "example_shape": list(t.shape)}
               for n, t in weights.items()]
    if weights:
        lines.append(f"# weight lines: {WEIGHTS_FILE}, in the order main_transform_params "
                     "takes them")
    for role, specs in (("input", ins), ("weight", w_specs), ("output", outs)):
        for sp in specs:
            lines.append(" ".join([role, sp["name"], sp["dtype"],
                                   *map(str, sp["example_shape"])]))
    path.write_text("\n".join(lines) + "\n")


def _fix_modes(root: Path) -> None:
    """``mkdtemp`` makes a 0700 folder: give the artifact the modes a copy would have."""

    fmode = new_file_mode()
    dmode = fmode | ((fmode & 0o444) >> 2)  # r -> x for folders
    with contextlib.suppress(OSError):
        os.chmod(root, dmode)
        for dirpath, dirnames, filenames in os.walk(root):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), dmode)
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), fmode)
