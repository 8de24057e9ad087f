"""``opsdk run``: run an artifact on a board (RPC), the emulator or the host; check and time it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runners import KernelWeights, LocalRunner, runner_for
from ._artifact import ArtifactError, _log_to, read_manifest, read_weights
from ._decoder import read_kernel_weights

__all__ = ["FeatureMismatch", "device_features", "format_run", "run_artifact",
           "run_artifacts_sharded", "run_handler"]


# Linux aarch64 getauxval(AT_HWCAP = 16) / (AT_HWCAP2 = 26) bits -> LLVM feature names.
_HWCAP = {"neon": (0, 1), "fullfp16": (0, 10), "dotprod": (0, 20), "sve": (0, 22),
          "sve2": (1, 1), "i8mm": (1, 13), "bf16": (1, 14)}


class FeatureMismatch(ArtifactError):
    """The device lacks a CPU feature the artifact's code uses (it would die of SIGILL)."""


def _hwcap_probe() -> Any:
    """A tiny aarch64 kernel writing ``getauxval(AT_HWCAP)`` and ``getauxval(AT_HWCAP2)``:
    what the device's kernel says its CPU has (qemu-user reports the emulated CPU's)."""
    import tvm  # heavy: TVM
    from tvm import te, tirx  # heavy: TVM

    def f(i: Any) -> Any:
        which = tirx.if_then_else(i == 0, tirx.const(16, "int64"), tirx.const(26, "int64"))
        return tirx.call_extern("int64", "getauxval", which)

    out = te.compute((2,), f, name="hwcap")
    func = te.create_prim_func([out]).with_attr("global_symbol", "opsdk_hwcap")
    # No -mattr: the probe itself must run on any aarch64 CPU.
    return tvm.compile(func, target={"kind": "llvm", "mtriple": "aarch64-linux-gnu"})


def device_features(runner: Any, arch: str) -> set[str] | None:
    """The CPU features of the device behind ``runner`` in manifest spelling, or None when
    they cannot be asked (a remote x86 device).

    aarch64 devices run a probe reading the kernel's hardware capabilities; the host answers
    through LLVM's view of its own CPU.
    """
    from ..runners.local import LocalRunner  # heavy: TVM
    from ..targets import target as resolve_target  # heavy: TVM
    from ..targets import target_features  # heavy: TVM

    if isinstance(runner, LocalRunner):
        return {f for f in target_features(resolve_target("host")) if ":" not in f}
    if arch != "aarch64":
        return None
    (caps,) = runner.run(_hwcap_probe(), [], entry="opsdk_hwcap", outputs=[((2,), "int64")])
    words = [int(caps[0]), int(caps[1])]
    return {name for name, (w, bit) in _HWCAP.items() if words[w] >> bit & 1}


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _compare(got: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    if got.shape != ref.shape:
        return {"ok": False, "problem": f"shape {list(got.shape)}, expected {list(ref.shape)}"}
    if np.issubdtype(ref.dtype, np.integer):
        diff = int(np.max(np.abs(got.astype(np.int64) - ref.astype(np.int64)), initial=0))
        return {"ok": diff == 0, "max_abs": diff}
    # Float outputs: the same float32 math summed in other orders (another ISA, other tile
    # edges) is within the model tolerance; the same library on the same ISA is bit-exact.
    from ..model import within_tolerance  # heavy: TVM

    return {**within_tolerance(got, ref),
            "bitexact": bool(np.array_equal(got, ref, equal_nan=True))}


def _stored_inputs(root: Path, m: dict[str, Any]) -> list[np.ndarray]:
    out = []
    for sp in m["inputs"]:
        path = root / m["check"]["inputs"] / f"{sp['name']}.bin"
        dt = _np_dtype(sp["dtype"])
        try:
            a = np.fromfile(path, dtype=dt)
        except OSError as e:
            raise ArtifactError(f"{path}: {e.strerror or e}; rebuild the artifact") from None
        n = int(np.prod(sp["example_shape"]))
        if a.size != n:
            raise ArtifactError(f"{path} holds {a.size} values, input {sp['name']!r} needs {n}")
        out.append(a.reshape(sp["example_shape"]))
    return out


def _given_inputs(m: dict[str, Any], given: Any) -> list[np.ndarray]:
    """Inputs from a ``.npz`` file or mapping (by input name, or ``arr_0``...), checked
    against the manifest's dtypes and (static) dims."""
    if isinstance(given, (str, os.PathLike)):
        try:
            with np.load(given) as z:
                given = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:
            raise ArtifactError(f"--inputs {given}: cannot read it as .npz ({e})") from None
    if isinstance(given, Mapping):
        arrays = []
        for i, sp in enumerate(m["inputs"]):
            for key in (sp["name"], f"arr_{i}"):
                if key in given:
                    arrays.append(np.asarray(given[key]))
                    break
            else:
                raise ArtifactError(f"inputs: no array named {sp['name']!r} (or arr_{i}); "
                                    f"the model takes {', '.join(s['name'] for s in m['inputs'])}")
        known = {s["name"] for s in m["inputs"]} | {f"arr_{i}" for i in range(len(m["inputs"]))}
        extra = [k for k in given if k not in known]
        if extra:  # an extra array (a misspelt name) was ignored and the run passed
            raise ArtifactError(f"inputs: {', '.join(map(repr, extra))} name no input of the "
                                f"model; it takes {', '.join(s['name'] for s in m['inputs'])}")
    else:
        arrays = [np.asarray(a) for a in given]
    if len(arrays) != len(m["inputs"]):
        raise ArtifactError(f"{len(arrays)} inputs given, the model takes {len(m['inputs'])}")
    for a, sp in zip(arrays, m["inputs"]):
        if str(a.dtype) != sp["dtype"]:
            raise ArtifactError(f"input {sp['name']!r}: dtype {a.dtype}, the model takes "
                                f"{sp['dtype']}")
        dims = sp["shape"]
        if dims is not None and (len(dims) != a.ndim or any(
                isinstance(d, int) and d != n for d, n in zip(dims, a.shape))):
            raise ArtifactError(f"input {sp['name']!r}: shape {list(a.shape)}, the model "
                                f"takes {dims}")
        bounds = (m.get("memory") or {}).get("planned_for") or {}
        for d, n in zip(dims or [], a.shape):
            if isinstance(d, str) and d in bounds and n > bounds[d]:
                raise ArtifactError(
                    f"input {sp['name']!r}: {d}={n}, but the artifact's memory is planned "
                    f"for {d} <= {bounds[d]}; rebuild with --max-dim {d}={n} (or larger)")
    return [np.ascontiguousarray(a) for a in arrays]


def _random_inputs(m: dict[str, Any], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for sp in m["inputs"]:
        dt = _np_dtype(sp["dtype"])
        if np.issubdtype(dt, np.integer):
            out.append(rng.integers(-8, 8, size=sp["example_shape"]).astype(dt))
        else:
            out.append(rng.standard_normal(sp["example_shape"]).astype(dt))
    return out


def _runner(m: dict[str, Any], rpc: str | None, tracker: str | None, key: str | None,
            emulate: bool, qemu_cpu: str | None) -> Any:
    from ..runners.local import LocalRunner, host_arch  # heavy: TVM

    arch = m["target"]["arch"]
    name = m["target"]["name"] or ("arm" if arch == "aarch64" else "x86")
    if sum(bool(x) for x in (rpc, tracker, emulate)) > 1:
        raise ArtifactError("pass one of --rpc, --tracker and --emulate")
    if rpc or tracker:
        return runner_for(name, rpc=rpc, tracker=tracker, key=key)
    if emulate:
        if arch != "aarch64":
            raise ArtifactError(f"--emulate runs aarch64 artifacts; this one is for {arch}: "
                                "drop --emulate to run it on this host")
        if host_arch() == "aarch64":
            return LocalRunner()
        return runner_for(name, qemu_cpu=qemu_cpu)
    if arch == host_arch():
        return LocalRunner()
    raise ArtifactError(f"this artifact is for {arch}: pass --rpc HOST:PORT (a board running "
                        "python -m tvm.exec.rpc_server) or --emulate (qemu on this host)")


def run_artifact(
    folder: str | os.PathLike,
    *,
    rpc: str | None = None,
    tracker: str | None = None,
    key: str | None = None,
    emulate: bool = False,
    qemu_cpu: str | None = None,
    inputs: Any = None,
    random_inputs: bool = False,
    seed: int = 0,
    repeats: int = 10,
    log: Callable[[str], Any] | None = print,
    runner: Any = None,
) -> dict[str, Any]:
    """Run an ``opsdk build`` artifact on its device, check its outputs and time it.

    Parameters
    ----------
    folder
        The artifact.
    rpc, tracker, key
        A board: ``HOST:PORT`` of a TVM RPC server, or of a tracker with the device ``key``.
    emulate
        Run an aarch64 artifact under qemu on this host (``qemu_cpu`` overrides the CPU the
        target implies: ``cortex-a72`` for ``arm``, ``cortex-a76`` for ``arm-dotprod``).
        Emulated timings are not performance.
    inputs
        A ``.npz`` file or mapping (by input name), or a sequence of arrays; default: the
        example inputs stored at build time. ``random_inputs`` draws them instead (``seed``).
        With other than the stored inputs the host build in the artifact gives the expected
        outputs, and the framework is not compared.
    repeats
        Warm runs timed on the device (their median is reported). On the host TVM's pool
        decides the threads (``TVM_NUM_THREADS``, set before TVM's first parallel call; the
        CLI sets every core); the result's ``latency.threads`` says how many ran.
    runner
        A runner already holding the device (a farm board's, :func:`run_artifacts_sharded`)
        instead of ``rpc`` / ``tracker`` / ``emulate``; it is left open.

    Returns
    -------
    dict
        ``ok`` (every output within tolerance of the host build and the framework),
        ``device``, ``features`` (needed, device, missing), ``outputs`` (one comparison per
        output), ``latency`` (``first_ms``, ``median_ms``, ``samples_ms``; ``load_ms``: the
        weights' upload and their transform at load, for an artifact that stores them apart),
        ``emulated``.

    Raises
    ------
    ArtifactError
        A bad artifact or input; :class:`FeatureMismatch` when the device lacks a feature the
        code needs (before anything of the model runs there).
    """
    from ..quant import agreement  # heavy: TVM

    say = _log_to(log)
    root = Path(folder)
    m = read_manifest(root)
    lib = root / m["library"]["file"]
    if inputs is not None and random_inputs:
        raise ArtifactError("pass either inputs or random_inputs")
    if inputs is not None:
        arrays, stored = _given_inputs(m, inputs), False
    elif random_inputs:
        arrays, stored = _random_inputs(m, seed), False
    else:
        arrays, stored = _stored_inputs(root, m), True
    entry = m.get("entry", "main")
    if m.get("kind") == "decoder":
        if not stored:  # its host build's weights would be another target's packing
            raise ArtifactError(f"{root} is a decoder: opsdk run checks it on its stored "
                                "prompt only (drop --inputs / --random); generate with "
                                "opsdk.deploy.load_decoder on the device")
        arrays_w = read_kernel_weights(root, m)
        weights: Any = KernelWeights(arrays_w[i] for i in m["weights"]["uses"].get(entry, []))
    else:
        weights = read_weights(root, m)  # None: bundled in the library (format 1)
    given = runner is not None
    if not given:
        runner = _runner(m, rpc, tracker, key, emulate, qemu_cpu)
    arch = m["target"]["arch"]
    with contextlib.nullcontext(runner) if given else runner:
        info = runner.device_info()
        say(f"device: {info['device']}")
        preflight = getattr(runner, "preflight", None)
        if (rpc or tracker) and preflight is not None and not given:
            preflight()
        have = device_features(runner, arch)
        need = list(m["target"]["features"])
        missing = sorted(set(need) - have) if have is not None else []
        if missing:
            raise FeatureMismatch(
                f"{root}: the code needs {', '.join('+' + f for f in need)} but "
                f"{info['device']} lacks {', '.join('+' + f for f in missing)}; it would die "
                f"of an illegal instruction. Rebuild for this device (e.g. --target arm for "
                "NEON only) or run it on one that has them")
        say("features: " + (f"needs {', '.join(need) or 'nothing'}; device has them"
                            if have is not None else "not checked (remote x86 device)"))
        got, timing = runner.run_timed(lib, arrays, entry=entry, repeats=repeats,
                                       weights=weights)
    expected: dict[str, list[np.ndarray]] = {}
    framework = m["check"].get("framework")
    if stored:
        path = root / m["check"]["expected"]
        try:
            with np.load(path) as z:
                for prefix in ("host", framework):
                    if prefix:
                        n = sum(1 for k in z.files if k.startswith(f"{prefix}_"))
                        expected[prefix] = [z[f"{prefix}_{i}"] for i in range(n)]
        except (OSError, ValueError, KeyError) as e:
            # (an artifact built before 2026-12-07 stored a dict output as an object array)
            raise ArtifactError(f"{path}: cannot read the expected outputs ({e}); rebuild the "
                                "artifact with opsdk build --force") from None
    else:
        with LocalRunner() as host:
            expected["host"] = host.run(root / m["check"]["host_library"], arrays,
                                        weights=weights)
    outputs = []
    ok = len(got) == len(m["outputs"])
    int8 = bool(m.get("quantization"))
    for i, (sp, g) in enumerate(zip(m["outputs"], got)):
        row: dict[str, Any] = {"name": sp["name"], "shape": list(g.shape), "dtype": str(g.dtype)}
        for what, refs in expected.items():
            if i < len(refs):
                c = _compare(g, np.asarray(refs[i]))
                if int8 and what != "host":
                    # An int8 model differs from the float framework by its quantization
                    # error: information (the build measured it), not a pass/fail check.
                    c = {**agreement(g, np.asarray(refs[i])), "informational": True}
                else:
                    ok = ok and c["ok"]
                row[f"vs_{what}"] = c
        outputs.append(row)
    emulated = "qemu" in str(info.get("device", ""))
    if isinstance(runner, LocalRunner):
        import tvm_ffi

        timing = {**timing, "threads": int(tvm_ffi.get_global_func("runtime.NumThreads")())}
    return {
        "ok": bool(ok),
        "artifact": str(root),
        "device": info["device"],
        "emulated": emulated,
        "features": {"needed": need, "device": sorted(have) if have is not None else None,
                     "missing": missing},
        "inputs": "stored" if stored else ("random" if random_inputs else "given"),
        "kind": m.get("kind", "model"),
        "outputs": outputs,
        "latency": timing,
        "warning": ("emulated timings are not performance: run on the board (--rpc) to "
                    "measure latency" if emulated else None),
    }


def run_artifacts_sharded(
    folders: Sequence[str | os.PathLike],
    *,
    tracker: str,
    key: str,
    boards: int | str = "all",
    inputs: Any = None,
    random_inputs: bool = False,
    seed: int = 0,
    repeats: int = 10,
    cell_timeout: float = 900.0,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`run_artifact` for several artifacts, spread over up to ``boards`` (a number or
    ``"all"``) free boards of ``key`` at ``tracker``: one worker per board, an artifact
    whose board dies or hangs is run again on another (the farm queue of ``verify
    --boards``).

    Returns one result per artifact in ``folders``' order (:func:`run_artifact`'s, with the
    ``board`` it ran on; an artifact that could not be run has ``ok`` False and an ``error``)
    and the device facts: ``device``, ``boards`` (artifacts per board) and ``lost``. Raises
    :class:`ArtifactError` when an artifact cannot be read or the artifacts are for
    different architectures (one key is one kind of board), ``ValueError`` as the farm
    queue does (no tracker, no free board).

    Examples
    --------
    >>> from opsdk.deploy import run_artifacts_sharded
    >>> results, device = run_artifacts_sharded(
    ...     ["mnv2-arm", "yolo-arm"], tracker="127.0.0.1:9190",
    ...     key="opsdk-farm")  # doctest: +SKIP
    >>> [r["ok"] for r in results]  # doctest: +SKIP
    [True, True]
    """
    from ..runners import FarmCell, run_on_farm

    paths = [str(f) for f in folders]
    targets = {}
    for f in paths:
        m = read_manifest(Path(f))
        targets[f] = (m["target"]["arch"],
                      m["target"]["name"] or ("arm" if m["target"]["arch"] == "aarch64"
                                              else "x86"))
    archs = sorted({a for a, _ in targets.values()})
    if len(archs) > 1:
        raise ArtifactError("the artifacts are for different architectures ("
                            + ", ".join(f"{f}: {targets[f][0]}" for f in paths)
                            + "); one --key is one kind of board: run each group apart")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = str(inputs)
    elif inputs is not None:
        raise ArtifactError("a sharded run takes inputs as a .npz path (the workers read it)")

    def failed(idx: int, why: str, gave_up: bool) -> dict[str, Any]:
        return {"ok": False, "artifact": paths[idx],
                "error": f"not run: {why}" if gave_up else why}

    out = run_on_farm(
        [FarmCell(f, f) for f in paths], handler="opsdk.deploy._run:run_handler",
        failed=failed, target=targets[paths[0]][1], tracker=tracker, key=key, boards=boards,
        cfg={"inputs": inputs, "random_inputs": random_inputs, "seed": seed,
             "repeats": repeats},
        progress=(lambda label, _n: progress(label)) if progress else None,
        cell_timeout=cell_timeout)
    return out.results, out.facts()


def run_handler(cfg: dict[str, Any], folder: str, runner: Any,
                tick: Callable[[], None]) -> dict[str, Any]:
    """One artifact on a farm worker's board (:func:`run_artifact` with its runner)."""
    tick()
    res = run_artifact(folder, inputs=cfg["inputs"], random_inputs=cfg["random_inputs"],
                       seed=cfg["seed"], repeats=cfg["repeats"], log=None, runner=runner)
    return {**res, "board": runner.board}


def format_run(res: Mapping[str, Any]) -> str:
    """``opsdk run``'s text report."""
    lines = [f"artifact: {res['artifact']}   device: {res['device']}"]
    for o in res["outputs"]:
        checks = []
        for k, v in o.items():
            if k.startswith("vs_"):
                what = k[3:]
                if "problem" in v:
                    checks.append(f"vs {what}: {v['problem']}")
                elif v.get("informational"):
                    checks.append(f"vs {what} (float): relative RMSE {v['rel_rmse'] * 100:.2f}%"
                                  " (int8 model)")
                else:
                    tag = "bit-exact" if v.get("bitexact") else f"max abs {v['max_abs']:.3g}"
                    checks.append(f"vs {what}: {tag} {'ok' if v['ok'] else 'OUT OF TOLERANCE'}")
        lines.append(f"  {o['name']} {o['dtype']}{o['shape']}: " + "; ".join(checks))
    lat = res["latency"]
    # A decoder's weights are in the kernels' form already: uploaded, not transformed.
    verb = "uploaded" if res.get("kind") == "decoder" else "loaded and transformed"
    if res.get("kind") == "decoder":
        lines.append("(the check entry: a fresh KV cache, the prompt's prefill and the decode "
                     "steps, timed as one call)")
    if lat.get("median_ms") is not None:
        n = lat.get("threads")
        threads = f", {n} thread{'s' if n != 1 else ''}" if n else ""
        lines.append(f"latency: first run {lat['first_ms']:.3f} ms (host wall clock), warm "
                     f"median {lat['median_ms']:.3f} ms over {len(lat['samples_ms'])} runs "
                     f"(timed on the device{threads})"
                     + (f"; weights {verb} once in {lat['load_ms']:.1f} ms"
                        if lat.get("load_ms") is not None else ""))
    if res.get("warning"):
        lines.append(f"warning: {res['warning']}")
    from ..model import ATOL, RTOL  # heavy: TVM

    lines.append("PASS" if res["ok"] else f"FAIL: outputs outside tolerance (atol={ATOL:g}*"
                 f"max(1,|ref|max) + rtol={RTOL:g}*|ref|)")
    return "\n".join(lines)
