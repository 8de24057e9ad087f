"""``opsdk build`` of a decoder LLM: one library (``prefill``, ``decode``, ``create_cache`` and a
stateless ``check``), its weights apart in the form the kernels read, and the check data.

A decoder's functions share their weights, and its int4 / int8 weights are packed for the
kernels at compile time (:mod:`opsdk.schedules._qwgemm`). So unlike a model artifact (the
weights as the model has them, transformed once at load by ``main_transform_params``), a
decoder artifact stores the packed tensors themselves, each once, in ``weights.bin``: raw
bytes, every tensor at a page-aligned offset. :func:`load_decoder` maps that file and hands
the kernels views of it (no copy, nothing to transform), so a loaded decoder holds its
weights once, as file pages the system can share and drop, as llama.cpp's mmap does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._files import sha256_file
from .._timings import record_phases
from ..runners import KernelWeights, LocalRunner
from ._artifact import (
    ArtifactError,
    _copy_runtime,
    _export,
    _fix_modes,
    _io_specs,
    _log_to,
    _prepare_folder,
    _refuse_replace,
    _swap_into_place,
    _target_facts,
    _versions,
    _write_checks,
    read_manifest,
)
from ._uptodate import check_recorded, open_decoder_record

__all__ = ["DECODER_FORMAT", "RAW_WEIGHTS_FILE", "build_decoder_artifact", "load_decoder",
           "read_kernel_weights"]

#: ``manifest.json``'s ``format`` of a decoder artifact: format 2 plus ``kind: "decoder"``,
#: the decoder's shape and entries, and raw weights in the kernels' form.
DECODER_FORMAT = "opsdk-artifact/3"
#: A decoder artifact's weights: raw tensors, each at an offset that is a multiple of
#: :data:`ALIGN` (the manifest's ``weights.tensors`` gives offset, dtype and shape).
RAW_WEIGHTS_FILE = "weights.bin"
#: The tensors' alignment in the file: a page, so a loader may map each one alone.
ALIGN = 4096


def _write_raw(path: Path, tensors: Sequence[Any]) -> list[dict[str, Any]]:
    """Write ``tensors`` one after the other at :data:`ALIGN`-ed offsets; their specs."""
    specs = []
    off = 0
    with open(path, "wb") as f:
        for t in tensors:
            a = np.ascontiguousarray(t.numpy())  # one tensor's host copy at a time
            pad = -off % ALIGN
            f.write(b"\0" * pad)
            off += pad
            f.write(a.tobytes())
            specs.append({"offset": off, "dtype": str(a.dtype), "shape": list(a.shape),
                          "bytes": int(a.nbytes)})
            off += a.nbytes
    return specs


def _write_decoder_io(path: Path, ins: Sequence[dict[str, Any]],
                      specs: Sequence[dict[str, Any]], uses: dict[str, list[int]],
                      outs: Sequence[dict[str, Any]], cfg: Any) -> None:
    """``io.txt`` for a loader with no JSON parser (the C++ example): the ``check`` entry
    and its inputs and outputs; every tensor of the weights file (``rawweight OFFSET DTYPE
    DIMS``, its index the line's order); the tensors each entry takes, in order (``uses
    ENTRY I J ...``); and the sizes a generate loop needs (``config vocab N``, ``config
    positions P``)."""
    lines = ["# opsdk build (decoder): one line per tensor: role name dtype dims (example "
             f"sizes); rawweight lines give the byte offset in {RAW_WEIGHTS_FILE}, uses "
             "lines the rawweight indices an entry takes after its inputs",
             "entry check", f"config vocab {cfg.vocab}", f"config positions {cfg.positions}"]
    lines += [" ".join(["input", sp["name"], sp["dtype"], *map(str, sp["example_shape"])])
              for sp in ins]
    lines += [" ".join(["rawweight", str(sp["offset"]), sp["dtype"], *map(str, sp["shape"])])
              for sp in specs]
    lines += [" ".join(["uses", entry, *map(str, idx)]) for entry, idx in sorted(uses.items())]
    lines += [" ".join(["output", sp["name"], sp["dtype"], *map(str, sp["example_shape"])])
              for sp in outs]
    path.write_text("\n".join(lines) + "\n")


def read_kernel_weights(folder: str | os.PathLike, manifest: dict[str, Any] | None = None
                        ) -> list[np.ndarray]:
    """A decoder artifact's weights as copy-on-write views of its mapped ``weights.bin``
    (in the manifest's order; nothing is read until a kernel touches it).

    Raises
    ------
    ArtifactError
        Not a decoder artifact, or a weights file shorter than its manifest says.
    """
    root = Path(folder)
    m = read_manifest(root) if manifest is None else manifest
    w = m.get("weights") or {}
    if m.get("kind") != "decoder" or w.get("layout") != "raw":
        raise ArtifactError(f"{root}: not a decoder artifact (no raw weights); build one with "
                            "`opsdk build MODEL --weights int4 ...` for a decoder MODEL")
    path = root / w["file"]
    size = path.stat().st_size
    if w["tensors"] and size < max(t["offset"] + t["bytes"] for t in w["tensors"]):
        raise ArtifactError(f"{path} is shorter than its manifest says; rebuild the artifact")
    # Mode "c": writable views (DLPack exports no read-only array) whose pages stay the
    # file's, shared and droppable, as long as nothing writes them (no kernel does).
    mm = np.memmap(path, dtype=np.uint8, mode="c") if size else np.zeros(0, np.uint8)
    return [mm[t["offset"]:t["offset"] + t["bytes"]].view(t["dtype"]).reshape(t["shape"])
            for t in w["tensors"]]


def _check_ids(cfg: Any, seed: int, prompt_len: int, steps: int) -> tuple[list[int],
                                                                          list[int]]:
    if prompt_len + steps > cfg.positions:
        raise ArtifactError(f"the check's prompt ({prompt_len}) and steps ({steps}) exceed the "
                            f"model's {cfg.positions} positions")
    rng = np.random.default_rng(seed + 1)
    return (rng.integers(0, cfg.vocab, prompt_len).tolist(),
            rng.integers(0, cfg.vocab, steps).tolist())


def build_decoder_artifact(
    model: Any,
    out_dir: str | os.PathLike,
    *,
    weights: str = "float32",
    activations: str | None = None,
    target: Any = "arm",
    force: bool = False,
    with_runtime: bool = False,
    seed: int = 0,
    check_prompt: int = 8,
    check_steps: int = 4,
    reference: bool = True,
    log: Callable[[str], Any] | None = print,
) -> dict[str, Any]:
    """Compile a decoder for ``target`` and write a deployable folder ``out_dir``.

    Parameters
    ----------
    model
        A name from :data:`opsdk.llm.MODELS` (random weights of ``seed``), a Hugging Face
        checkpoint folder, or :class:`opsdk.llm.DecoderWeights`.
    out_dir, force, with_runtime
        As :func:`opsdk.deploy.build_artifact`.
    weights, activations
        The linear layers' weights (``float32``, ``int8``, ``int4``) and what the quantized
        ones multiply (None: :func:`opsdk.llm.default_activations` for ``target``).
    check_prompt, check_steps
        The check's random prompt length and decode steps: ``opsdk run`` runs them through
        the ``check`` entry and compares every step's logits with the host's.
    reference
        Also compare the host's check logits with the float64 references (of the weights
        the kernels use, and of the float model) and record both in the manifest (False:
        skipped, for a benchmark's build).

    Returns
    -------
    dict
        The manifest written to ``out_dir/manifest.json``.

    Examples
    --------
    >>> import pathlib, tempfile, opsdk
    >>> from opsdk.llm import DecoderConfig, random_weights
    >>> w = random_weights(DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16))
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "dec"
    >>> m = opsdk.deploy.build_decoder_artifact(w, out, weights="int4", target="x86",
    ...                                         log=None)
    >>> m["kind"], sorted(m["decoder"]["entries"])
    ('decoder', ['check', 'create_cache', 'decode', 'prefill'])
    >>> dec = opsdk.deploy.load_decoder(out)
    >>> dec.forward([1, 2, 3]).shape
    (50,)
    """
    from ..llm import (
        WEIGHT_MODES,
        DecoderWeights,
        add_check_entry,
        build_decoder,
        default_activations,
        dequantized_weights,
        load_decoder_weights,
        reference_logits,
    )  # heavy: TVM
    from ..model import compile_model  # heavy: TVM
    from ..runners.local import host_arch  # heavy: TVM
    from ..targets import target as resolve_target  # heavy: TVM
    from ..targets import target_arch  # heavy: TVM
    from ..transform import FuseIntoOps  # heavy: TVM

    say = _log_to(log)
    out = Path(out_dir).expanduser().absolute()
    try:
        tgt = resolve_target(target)
    except ValueError as e:
        raise ArtifactError(str(e)) from None
    if weights not in WEIGHT_MODES:
        raise ArtifactError(f"weights={weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    act = activations or ("float32" if weights == "float32"
                          else default_activations(weights, target))
    arch = target_arch(tgt)
    held = _prepare_folder(out, force)
    t0 = time.perf_counter()
    rec = open_decoder_record(model, out, target=target, options={
        "weights": weights, "activations": act, "runtime": with_runtime, "seed": seed,
        "check_prompt": check_prompt, "check_steps": check_steps, "reference": reference})
    if rec is not None:
        up_to_date = check_recorded(rec, out)
        record_phases({"up-to-date check": time.perf_counter() - t0})
        if up_to_date:
            say(f"{out} is up to date: the decoder, opsdk and the options are as when it "
                "was built")
            return read_manifest(out) | {"up_to_date": True}
    if held:  # an earlier artifact that this build would change
        raise _refuse_replace(out)
    if isinstance(model, DecoderWeights):
        w, source = model, None
    else:
        try:
            w = load_decoder_weights(str(model), seed)
        except ValueError as e:
            raise ArtifactError(str(e)) from None
        source = str(model)
    cfg = w.config
    prompt, follow = _check_ids(cfg, seed, check_prompt, check_steps)
    try:
        built = build_decoder(w, weights_mode=weights, activations=act)
    except ValueError as e:
        raise ArtifactError(str(e)) from None
    mod = FuseIntoOps()(add_check_entry(built, cfg, len(prompt), len(follow)))
    say(f"compiling the decoder ({cfg.weight_count() / 1e6:.0f}M parameters, {weights} "
        f"weights, {act} activations) for {target if isinstance(target, str) else 'target'} "
        f"({arch})")
    cm = compile_model(mod, tgt, weights_apart=True)
    kw = cm.weights
    inputs = [np.asarray([prompt], np.int32), np.asarray([follow], np.int32)]
    host_tgt = resolve_target("host")
    same_host = arch == host_arch() and str(host_tgt) == str(tgt)
    # The host's expected logits: a target build's packed weights are the target's, so
    # another target's check runs a host build of its own.
    host_cm = cm if same_host else compile_model(mod, host_tgt, weights_apart=True)
    with LocalRunner() as local:
        hw = host_cm.weights
        host_out = local.run(host_cm.ex, inputs, entry="check",
                             weights=KernelWeights(hw.tensors[i].numpy()
                                                  for i in hw.uses["check"]))

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))

    checked: dict[str, Any] = {"prompt_tokens": len(prompt), "decode_steps": len(follow)}
    if reference:
        ref_own = reference_logits(dequantized_weights(w, weights), prompt + follow,
                                   activations=act)[len(prompt) - 1:]
        ref_float = ref_own if weights == "float32" else \
            reference_logits(w, prompt + follow)[len(prompt) - 1:]
        checked |= {"host_vs_reference": rel(host_out[0], ref_own),
                    "host_vs_float_model": rel(host_out[0], ref_float)}

    ins, outs = _io_specs(cm.scheduled["check"], inputs, host_out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.opsdk-build-", dir=out.parent))
    try:
        lib = tmp / "model.so"
        say(f"exporting {lib.name} ({arch}) and {RAW_WEIGHTS_FILE} "
            f"({kw.nbytes / 2**20:.1f} MiB, {len(kw.tensors)} tensors)")
        _export(cm, lib, arch)
        specs = _write_raw(tmp / RAW_WEIGHTS_FILE, kw.tensors)
        (tmp / "check" / "inputs").mkdir(parents=True)
        _write_checks(tmp / "check", ins, inputs, host_out, "", [])
        _write_decoder_io(tmp / "io.txt", ins, specs,
                          {k: list(v) for k, v in kw.uses.items()
                           if k in ("check", "prefill", "decode")}, outs, cfg)
        runtime_files = _copy_runtime(tmp, arch) if with_runtime else []
        raw = tmp / RAW_WEIGHTS_FILE
        entries = {gv.name_hint: len(f.params) - len(kw.uses.get(gv.name_hint, []))
                   for gv, f in cm.scheduled.functions.items()
                   if gv.name_hint in ("prefill", "decode", "create_cache", "check")}
        manifest = {
            "format": DECODER_FORMAT,
            "kind": "decoder",
            "model": {"source": source, "entry": None, "entry_args": {}, "framework": None},
            "decoder": {
                "config": dict(cfg.__dict__), "weights": weights, "activations": act,
                "entries": entries, "check": checked},
            "target": _target_facts(target, tgt, arch),
            "library": {"file": "model.so", "bytes": lib.stat().st_size,
                        "sha256": sha256_file(lib),
                        "weights": f"{RAW_WEIGHTS_FILE}, in the form the kernels read",
                        "weights_bytes": kw.nbytes,
                        "runtime": ["libtvm_runtime.so", "libtvm_ffi.so"],
                        "runtime_included": runtime_files},
            "weights": {"storage": "kernel form", "file": RAW_WEIGHTS_FILE, "layout": "raw",
                        "align": ALIGN, "bytes": raw.stat().st_size,
                        "sha256": sha256_file(raw), "loaded_bytes": kw.nbytes,
                        "tensors": specs,
                        "uses": {k: v for k, v in kw.uses.items() if k in entries}},
            "entry": "check",
            "inputs": ins,
            "outputs": outs,
            "memory": {},
            "kernels": [{"name": k["name"], "rule": k["rule"]} for k in cm.kernels],
            "quantization": None,
            "check": {"host_library": None, "host_target": str(host_tgt),
                      "inputs": "check/inputs", "expected": "check/expected.npz",
                      "framework": None},
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
        rec.write(out)
    say(f"wrote {out}: {manifest['library']['bytes'] / 1e6:.2f} MB library + "
        f"{kw.nbytes / 1e6:.2f} MB weights, {len(manifest['kernels'])} kernels")
    return manifest


def load_decoder(folder: str | os.PathLike, device: Any = None, *,
                 capacity: int | None = None) -> Any:
    """Load a decoder artifact built for this host: an :class:`opsdk.llm.Decoder` whose
    kernels read the weights from the mapped ``weights.bin`` (no copy, nothing transformed).

    Raises
    ------
    ArtifactError
        Not a decoder artifact, damaged, or built for another architecture.
    """
    import tvm  # heavy: TVM

    from ..llm import Decoder, DecoderConfig  # heavy: TVM
    from ..runners.local import host_arch, pool_defaults  # heavy: TVM
    from ..transform import KernelFormWeights  # heavy: TVM

    pool_defaults()
    root = Path(folder)
    m = read_manifest(root)
    arrays = read_kernel_weights(root, m)
    if m["target"]["arch"] != host_arch():
        raise ArtifactError(f"{root} is built for {m['target']['arch']}, this host is "
                            f"{host_arch()}: check it with `opsdk run {root} --emulate` (or "
                            "--rpc HOST:PORT), or load it on the device")
    dev = device if device is not None else tvm.cpu()
    if dev.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        tensors = [tvm.runtime.from_dlpack(a) for a in arrays]  # the file's pages, no copy
    else:
        tensors = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]
    lib = tvm.runtime.load_module(str(root / m["library"]["file"]))
    uses = {k: list(v) for k, v in m["weights"]["uses"].items()}
    return Decoder(lib, DecoderConfig(**m["decoder"]["config"]), capacity=capacity,
                   device=dev, weights=KernelFormWeights(tensors, uses))
