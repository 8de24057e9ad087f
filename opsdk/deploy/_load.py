"""Load an ``opsdk build`` artifact in this process: its weights transformed once, then called
as often as wanted (the Python counterpart of ``examples/deploy/main.cc``)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runners import to_numpy, to_tensor
from ._artifact import ArtifactError, read_manifest, read_weights

__all__ = ["LoadedArtifact", "load_artifact"]


class LoadedArtifact:
    """An artifact's VM with its weights in the form the kernels read.

    ``load_seconds``: reading the weights file and running ``main_transform_params`` (0 for
    an artifact with its weights bundled); ``transform_runs``: how often that function ran
    (once, at load). Call it with numpy arrays (the manifest's inputs, in order); it
    returns the outputs as numpy arrays.
    """

    def __init__(self, vm: Any, manifest: dict[str, Any], weights: list[Any],
                 load_seconds: float, transform_runs: int) -> None:
        self.vm, self.manifest, self.weights = vm, manifest, weights
        self.load_seconds, self.transform_runs = load_seconds, transform_runs

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        if len(inputs) != len(self.manifest["inputs"]):
            raise ArtifactError(f"{len(inputs)} inputs given, the model takes "
                                f"{len(self.manifest['inputs'])} "
                                f"({', '.join(s['name'] for s in self.manifest['inputs'])})")
        dev = self.vm.devices[0] if getattr(self.vm, "devices", None) else None
        args = [to_tensor(np.asarray(a), dev) for a in inputs]
        return to_numpy(self.vm["main"](*args, *self.weights))


def load_artifact(folder: str | os.PathLike, device: Any = None) -> LoadedArtifact:
    """Load the artifact in ``folder`` for this host (an artifact built for its
    architecture): the library, then its weights file, transformed once by
    ``main_transform_params``; the original weights are dropped once it ran. TVM's pool
    gets opsdk's defaults (:func:`opsdk.runners.local.pool_defaults`: every core, workers
    not pinned) when it has not started yet and the environment does not set them.

    Raises
    ------
    ArtifactError
        Not an artifact, a damaged or missing library or weights file, or one built for
        another architecture.

    Examples
    --------
    >>> import numpy as np, pathlib, tempfile, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((2, 64), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         w = relax.const(np.full((64, 8), 0.5, "float32"))
    ...         y = bb.emit_output(relax.op.matmul(x, w))
    ...     _ = bb.emit_func_output(y)
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "art"
    >>> _ = opsdk.deploy.build_artifact(bb.get(), out, target="x86",
    ...                                 inputs=[np.ones((2, 64), "float32")], log=None)
    >>> model = opsdk.deploy.load_artifact(out)
    >>> model(np.ones((2, 64), "float32"))[0][0, :3].tolist(), model.transform_runs
    ([32.0, 32.0, 32.0], 1)
    """
    import tvm  # heavy: TVM

    from ..runners.local import host_arch, pool_defaults  # heavy: TVM

    pool_defaults()  # unpinned workers, every core (unless the environment says otherwise)
    root = Path(folder)
    m = read_manifest(root)
    if m.get("kind") == "decoder":
        raise ArtifactError(f"{root} is a decoder artifact: load it with "
                            "opsdk.deploy.load_decoder(folder)")
    if m["target"]["arch"] != host_arch():
        raise ArtifactError(f"{root} is built for {m['target']['arch']}, this host is "
                            f"{host_arch()}: run it with `opsdk run {root} --rpc HOST:PORT` "
                            "(or --emulate), or load it on the device")
    dev = device if device is not None else tvm.cpu()
    lib = tvm.runtime.load_module(str(root / m["library"]["file"]))
    vm = tvm.relax.VirtualMachine(lib, dev)
    t0 = time.perf_counter()
    originals = read_weights(root, m)
    transformed: Sequence[Any] = []
    runs = 0
    if originals is not None:
        fn = m["weights"].get("transform", "main_transform_params")
        ws = [tvm.runtime.tensor(a, dev) for a in originals]
        del originals  # the host copies; the device copies go once transformed
        transformed = list(vm[fn](*ws))
        runs = 1
        del ws
    return LoadedArtifact(vm, m, list(transformed), time.perf_counter() - t0, runs)
