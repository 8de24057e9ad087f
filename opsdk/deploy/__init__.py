"""Deployable artifacts: build a model for a device, run it there, load it from C++.

``opsdk build MODEL --target arm -o out/`` (:func:`build_artifact`) imports a model (a Python
file with a ``build_model`` entry like the examples, a ``torch.export`` ``.pt2`` file or an
``.onnx`` file), applies the opsdk rewrites, compiles it with every kernel scheduled and
writes a folder:

- ``model.so``: the Relax VM executable, cross-compiled for the target; load it with
  ``libtvm_runtime``;
- ``weights.params``: the model's weights, stored once as the model has them (TVM's
  parameter format); ``main_transform_params`` turns them into the form the kernels read
  (packed, Winograd-transformed) once at load (:func:`load_artifact`, ``opsdk run``, the
  C++ example), and ``main`` takes them after the inputs;
- ``manifest.json``: target, the CPU features the code needs, every kernel with its rule,
  inputs and outputs (symbolic dims named), the memory the VM plans, versions, sizes and the
  artifact's hash (see :data:`MANIFEST_FORMAT`);
- ``io.txt``: the same inputs and outputs, one line each, for the C++ example
  (``examples/deploy/``);
- ``check/``: example inputs, the host build's and the framework's outputs on them, and a
  host build of the same model (``check/host.so``), which ``opsdk run`` checks the device
  against. Nothing in ``check/`` is needed on the device.

``opsdk build gpt2 --weights int4 --target arm -o out/`` (:func:`build_decoder_artifact`)
builds a decoder LLM (a name of :data:`opsdk.llm.MODELS` or a Hugging Face checkpoint
folder) the same way: ``model.so`` with ``prefill``, ``decode``, ``create_cache`` and a
stateless ``check`` entry; ``weights.bin``, the weights in the form the kernels read, each
once, which :func:`load_decoder` maps without a copy.

``opsdk run out/ --rpc HOST:PORT`` (or ``--emulate``, the built-in qemu server)
(:func:`run_artifact`) checks the device's CPU features against the manifest, uploads and
runs the artifact, compares its outputs with the host build and the framework, and reports
the first-run latency and the median of warm runs timed on the device.

Examples
--------
>>> import numpy as np, pathlib, tempfile, opsdk
>>> from tvm import relax
>>> x = relax.Var("x", relax.TensorType((8, 16), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         y = bb.emit_output(relax.op.matmul(x, relax.const(np.ones((16, 32), "float32"))))
...     _ = bb.emit_func_output(y)
>>> out = pathlib.Path(tempfile.mkdtemp()) / "art"
>>> m = opsdk.deploy.build_artifact(bb.get(), out, target="x86",
...                                  inputs=[np.ones((8, 16), "float32")], log=None)
>>> m["outputs"][0]["shape"], sorted(p.name for p in out.iterdir())
([8, 32], ['check', 'io.txt', 'manifest.json', 'model.so', 'weights.params'])
>>> opsdk.deploy.run_artifact(out, log=None)["ok"]
True
"""

from __future__ import annotations

from typing import Any

from ._artifact import MANIFEST_FORMAT, ArtifactError, build_artifact, read_manifest
from ._decoder import DECODER_FORMAT, build_decoder_artifact, load_decoder
from ._load import LoadedArtifact, load_artifact
from ._run import FeatureMismatch, device_features, run_artifact, run_artifacts_sharded

__all__ = [
    "DECODER_FORMAT",
    "MANIFEST_FORMAT",
    "ArtifactError",
    "FeatureMismatch",
    "LoadedArtifact",
    "build_artifact",
    "build_decoder_artifact",
    "device_features",
    "load_artifact",
    "load_decoder",
    "read_manifest",
    "run_artifact",
    "run_artifacts_sharded",
    "runtime_paths",
]


def __getattr__(name: str) -> Any:
    # Bound on first use: `python -m opsdk.deploy.runtime` must not find it imported already.
    if name == "runtime_paths":
        from .runtime import runtime_paths

        return runtime_paths
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
