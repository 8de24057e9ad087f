"""ONNX import: TVM's ONNX frontend, then :func:`opsdk.transform.ReplaceTVMOps`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import tvm

from ..transform import FuseIntoOps, ReplaceTVMOps

if TYPE_CHECKING:
    import onnx

__all__ = ["ONNX_OPS", "from_onnx"]

#: ONNX operator -> the TVM op its importer emits -> the opsdk op it becomes. The opset is the
#: first one whose version TVM 0.27's importer implements.
ONNX_OPS: dict[str, dict[str, Any]] = {
    "LayerNormalization": {"since": 17, "tvm": "layer_norm", "opsdk": "layer_norm"},
    "RMSNormalization": {"since": 23, "tvm": "rms_norm", "opsdk": "rms_norm"},
    "Gelu": {"since": 20, "tvm": "gelu / gelu_tanh", "opsdk": "gelu"},
    "Softmax": {"since": 13, "tvm": "softmax", "opsdk": "softmax"},
    "GroupNormalization": {"since": 18, "tvm": "group_norm", "opsdk": "group_norm"},
}


def from_onnx(
    model: onnx.ModelProto | str | os.PathLike,
    shape_dict: dict[str, list] | None = None,
    dtype_dict: str | dict[str, str] | None = "float32",
    opset: int | None = None,
    *,
    ops: Iterable[str] | None = None,
    fuse: bool = False,
    **kwargs: Any,
) -> tvm.IRModule:
    """Import an ONNX model into Relax with opsdk ops for LayerNormalization, RMSNormalization,
    Gelu, Softmax and GroupNormalization.

    TVM's ONNX frontend imports these as ``R.nn.layer_norm``, ``rms_norm``, ``gelu`` /
    ``gelu_tanh``, ``softmax`` and ``group_norm``; :func:`opsdk.transform.ReplaceTVMOps` then
    swaps in the opsdk ops wherever they compute the same thing.

    Parameters
    ----------
    model : onnx.ModelProto or path
        The model, or the path of an ``.onnx`` file.
    shape_dict, dtype_dict, opset
        As for ``tvm.relax.frontend.onnx.from_onnx``: input shapes (for symbolic inputs),
        input dtypes and an opset override.
    ops : iterable of str, optional
        TVM ops to replace (names as in :data:`opsdk.transform.REPLACEABLE_OPS`); all by
        default, ``()`` for TVM's plain import.
    fuse : bool
        Also run :func:`opsdk.transform.FuseIntoOps` (decomposed LayerNorm as older exporters
        emit it, bias + GELU, Conv + BatchNormalization).
    **kwargs
        Passed to TVM's ``from_onnx`` (``keep_params_in_input``, ``sanitize_input_names``).

    Returns
    -------
    tvm.IRModule

    Notes
    -----
    TVM 0.27's importer implements ``LayerNormalization`` from opset 17, ``GroupNormalization``
    18 and 21 (only float32 inputs and ``stash_type=1``), ``Gelu`` 20 (and the onnxruntime
    contrib ``Gelu``/``FastGelu``/``BiasGelu``), ``RMSNormalization`` 23 and ``Softmax`` 1/11/13
    (opset < 13 flattens to 2-D first, so the opsdk softmax then runs on the flattened
    tensor). An operator at an opset below its first version there is not importable.

    Examples
    --------
    >>> import onnx, opsdk
    >>> from onnx import TensorProto, helper
    >>> g = helper.make_graph(
    ...     [helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")], "g",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    >>> opsdk.transform.op_counts(opsdk.frontend.from_onnx(model))
    {'opsdk.gelu': 1}
    """
    import onnx
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx

    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model))
    mod = tvm_from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict, opset=opset, **kwargs)
    names = None if ops is None else list(ops)
    if names is None or names:
        mod = ReplaceTVMOps(names)(mod)
    if fuse:
        mod = FuseIntoOps()(mod)
    return mod
