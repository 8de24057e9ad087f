"""ONNX import: TVM's ONNX frontend, then :func:`opsdk.transform.ReplaceTVMOps`."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import tvm
from tvm import relax

from .. import ops as op_library  # the explicit op list, read when used
from .._userfile import load_onnx_file
from ..registry import builder, registered_ops
from ..transform import FuseIntoOps, ReplaceTVMOps
from ._recurrent import onnx_recurrent

if TYPE_CHECKING:
    import onnx

__all__ = ["ONNX_OPS", "from_onnx", "onnx_mapping_counts"]

#: ONNX operator -> the TVM op its importer emits -> the opsdk op it becomes. The opset is the
#: first one whose version TVM 0.27's importer implements. Read, when first asked for (module
#: ``__getattr__``), from the built-in ops' ``OpDef.replaces`` declarations.
ONNX_OPS: dict[str, dict[str, Any]]


def _onnx_ops() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for d in op_library.BUILTIN_OPS:
        for tvm_op, _, info in d.replacements:
            if info is None:
                continue
            onnx_type, since = info
            short = tvm_op.removeprefix("relax.nn.")
            if onnx_type in out:  # one ONNX operator, several TVM ops (Gelu: gelu, gelu_tanh)
                out[onnx_type]["tvm"] += f" / {short}"
            else:
                out[onnx_type] = {"since": since, "tvm": short, "opsdk": d.name}
    return out


def __getattr__(name: str) -> Any:
    if name == "ONNX_OPS":
        return _onnx_ops()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_onnx(
    model: onnx.ModelProto | str | os.PathLike,
    shape_dict: dict[str, list] | None = None,
    dtype_dict: str | dict[str, str] | None = "float32",
    opset: int | None = None,
    *,
    ops: Iterable[str] | None = None,
    fuse: bool = False,
    op_mappings: bool = True,
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
    op_mappings : bool
        Apply the registered ops' own mappings (``OpDef.onnx``); False gives TVM's import
        alone (``opsdk drift`` measures the mappings' drift against it).
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
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx  # heavy: onnx

    if isinstance(model, (str, os.PathLike)):  # a corrupt file: one error naming it
        model = load_onnx_file(model)
    with _op_mappings(op_mappings) as hits:
        try:
            mod = tvm_from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict,
                                opset=opset, **kwargs)
        except tvm.error.OpNotImplemented as e:  # the operators, and what to do, in words
            raise ValueError(f"{str(e).strip().splitlines()[-1]}: neither TVM's ONNX importer "
                             "nor opsdk converts them; map each to an op of yours with "
                             "OpDef.onnx (docs/model-compile.md), or export the model "
                             "without them") from None
    if any(hits.values()):
        mod = mod.with_attr("opsdk.onnx_mappings", {k: n for k, n in hits.items() if n})
    names = None if ops is None else list(ops)
    if names is None or names:
        mod = ReplaceTVMOps(names)(mod)
    if fuse:
        mod = FuseIntoOps()(mod)
    return mod


def onnx_mapping_counts(mod: tvm.IRModule) -> dict[str, int]:
    """How many nodes each ONNX mapping (an op's ``OpDef.onnx``) converted when
    :func:`from_onnx` made ``mod``.

    Examples
    --------
    >>> import tvm, opsdk
    >>> opsdk.frontend.onnx_mapping_counts(tvm.IRModule())
    {}
    """
    counts = (mod.attrs or {}).get("opsdk.onnx_mappings", {}) if mod.attrs else {}
    return {str(k): int(v) for k, v in counts.items()}


@contextlib.contextmanager
def _op_mappings(enabled: bool = True):
    """TVM's ONNX importer has no custom converter hook: its table of converters is
    extended, for this import only, with opsdk's converters for operators it lacks
    (:func:`_fixes`) and the registered ops' ``OpDef.onnx`` mappings."""

    from tvm.relax.frontend.onnx import onnx_frontend as fe  # heavy: onnx

    hits: dict[str, int] = {}
    extra: dict[str, Any] = dict(_fixes())
    for d in registered_ops() if enabled else ():
        for op_type, fn in d.onnx_maps.items():
            hits[op_type] = 0
            extra[op_type] = _converter(d, op_type, fn, builder(d), hits)

    original = fe._get_convert_map
    with _LOCK:
        fe._get_convert_map = lambda: {**original(), **extra}
        try:
            yield hits
        finally:
            fe._get_convert_map = original


_LOCK = threading.Lock()


def _fixes() -> dict[str, type]:
    """Converters for ONNX operators TVM 0.27's importer lacks: ``LSTM`` and ``GRU`` on the
    recurrence kernels (:func:`._recurrent.onnx_recurrent`), ``Celu``; and ``TopK`` with
    ``sorted=0``, which it refuses."""
    from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter  # heavy: onnx

    def converter(kind: str) -> type:
        def impl(cls, bb, inputs, attr, params):
            return onnx_recurrent(kind, bb, list(inputs), dict(attr))

        return type(f"_Opsdk_{kind}", (OnnxOpConverter,), {"_impl_v7": classmethod(impl)})

    def celu(cls, bb, inputs, attr, params):
        # max(0, x) + min(0, alpha * (exp(x / alpha) - 1)) (ONNX's definition)
        x = inputs[0]
        alpha = relax.const(float(attr.get("alpha", 1.0)), x.ty.dtype)
        neg = relax.op.multiply(alpha, relax.op.subtract(
            relax.op.exp(relax.op.divide(x, alpha)), relax.const(1.0, x.ty.dtype)))
        zero = relax.const(0.0, x.ty.dtype)
        return relax.op.add(relax.op.maximum(x, zero), relax.op.minimum(neg, zero))

    def topk(cls, bb, inputs, attr, params):
        # TVM's converter refuses sorted=0; the sort kernel's order is one such order
        attr = dict(attr)
        attr["sorted"] = 1
        return fe.TopK._impl_v11(bb, inputs, attr, params)

    from tvm.relax.frontend.onnx import onnx_frontend as fe  # heavy: onnx

    return {"LSTM": converter("lstm"), "GRU": converter("gru"),
            "Celu": type("_Opsdk_celu", (OnnxOpConverter,), {"_impl_v12": classmethod(celu)}),
            "TopK": type("_Opsdk_topk", (OnnxOpConverter,), {
                "_impl_v1": fe.TopK._impl_v1, "_impl_v11": classmethod(topk)})}


def _converter(d: Any, op_type: str, fn: Any, build: Any, hits: dict[str, int]) -> type:
    from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter  # heavy: onnx

    attr_names = {p.name for p in d.attr_params}
    tensors = [p.name for p in d.tensor_params]

    def impl(cls, bb, inputs, attr, params):
        hits[op_type] += 1
        if fn is not None:
            return fn(list(inputs), dict(attr))
        present = [x for x in inputs if x is not None]
        if len(present) > len(tensors):
            raise ValueError(f"ONNX {op_type} node has {len(present)} inputs; {d.op_name} "
                             f"takes {len(tensors)} ({', '.join(tensors)}): pass convert= to "
                             f"{d.name}.onnx(...)")
        kw = {k: _py(v) for k, v in attr.items() if k in attr_names}
        return build(*present, **kw)

    return type(f"_Opsdk_{d.name}_{op_type}", (OnnxOpConverter,), {"_impl_v1": classmethod(impl)})


def _py(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
