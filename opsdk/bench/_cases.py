"""What ``opsdk bench`` measures: per op, the equivalent TVM Relax op and the torch eager call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tvm import relax

__all__ = ["DEFAULT_CASES", "SPECS", "Case", "OpSpec", "onnx_model"]


@dataclass(frozen=True)
class Case:
    """One benchmark case: an opsdk op (with a layout of its capability matrix) on a shape."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = ""  # a key of OpDef.layouts ("" = the op's defaults)
    attrs: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        name = self.op + (f"[{self.layout}]" if self.layout else "")
        return f"{name} {'x'.join(map(str, self.shape))} {self.dtype}"


@dataclass(frozen=True)
class OpSpec:
    """How to express an opsdk op with TVM's own Relax ops and with torch eager.

    ``relax_fn(inputs, attrs)`` builds the Relax expression from Relax vars (in the opsdk
    input order); ``torch_fn(tensors, attrs)`` returns a zero-argument callable.
    ``slice_axis(attrs)`` is the axis the bench's cache-resident ``hot`` slice cuts (the op's
    time must grow linearly along it); None means axis 0, the rows. ``onnx_fn`` gives the
    onnxruntime equivalent (its fused CPU kernel: LayerNormalization, SimplifiedLayer-
    Normalization, Gelu / FastGelu, BiasGelu, Softmax, GroupNormalization).
    """

    relax_fn: Callable[[list, dict], relax.Expr]
    torch_fn: Callable[[list, dict], Callable[[], Any]]
    slice_axis: Callable[[dict], int] | None = None
    #: ``onnx_fn(shapes, attrs)`` -> (node, opset imports) of the op in onnxruntime's own
    #: kernels, or None where it has none on CPU (see :func:`onnx_model`).
    onnx_fn: Callable[[list, dict], Any] | None = None


def _ln_relax(v: list, a: dict) -> relax.Expr:
    x, g, b = v
    nd = len(x.ty.shape)
    axes = list(range(a["begin_axis"] % nd, nd))
    return relax.op.nn.layer_norm(x, g, b, axes=axes, epsilon=a["epsilon"])


def _ln_torch(t: list, a: dict) -> Callable[[], Any]:
    import torch.nn.functional as F  # heavy: torch

    x, g, b = t
    shape = tuple(x.shape[a["begin_axis"] % x.dim() :])
    return lambda: F.layer_norm(x, shape, g, b, a["epsilon"])


def _rms_relax(v: list, a: dict) -> relax.Expr:
    x, g = v
    nd = len(x.ty.shape)
    return relax.op.nn.rms_norm(
        x, g, axes=list(range(a["begin_axis"] % nd, nd)), epsilon=a["epsilon"]
    )


def _rms_torch(t: list, a: dict) -> Callable[[], Any]:
    import torch.nn.functional as F  # heavy: torch

    x, g = t
    shape = tuple(x.shape[a["begin_axis"] % x.dim() :])
    return lambda: F.rms_norm(x, shape, g, a["epsilon"])


def _gelu_relax(v: list, a: dict) -> relax.Expr:
    x = v[0] if len(v) == 1 else relax.op.add(v[0], v[1])
    return relax.op.nn.gelu_tanh(x) if a["approximate"] == "tanh" else relax.op.nn.gelu(x)


def _gelu_torch(t: list, a: dict) -> Callable[[], Any]:
    import torch.nn.functional as F  # heavy: torch

    if len(t) == 1:
        return lambda: F.gelu(t[0], approximate=a["approximate"])
    x, b = t
    return lambda: F.gelu(x + b, approximate=a["approximate"])


def _softmax_relax(v: list, a: dict) -> relax.Expr:
    return relax.op.nn.softmax(v[0], axis=a["axis"])


def _softmax_torch(t: list, a: dict) -> Callable[[], Any]:
    import torch  # heavy: torch

    return lambda: torch.softmax(t[0], dim=a["axis"])


def _gn_relax(v: list, a: dict) -> relax.Expr:
    x, g, b = v
    nchw = a["layout"] == "NCHW"
    return relax.op.nn.group_norm(
        x,
        g,
        b,
        num_groups=a["num_groups"],
        channel_axis=1 if nchw else 3,
        axes=[2, 3] if nchw else [1, 2],
        epsilon=a["epsilon"],
    )


def _gn_torch(t: list, a: dict) -> Callable[[], Any]:
    import torch.nn.functional as F  # heavy: torch

    x, g, b = t
    if a["layout"] == "NHWC":
        x = x.permute(0, 3, 1, 2)  # a channels-last NCHW view: torch's NHWC kernel
    return lambda: F.group_norm(x, a["num_groups"], g, b, a["epsilon"])


_MS = "com.microsoft"  # onnxruntime's contrib ops (its fused CPU kernels)


def _ln_onnx(shapes: list, a: dict) -> Any:
    from onnx import helper  # heavy: onnx

    node = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"],
                            axis=a["begin_axis"], epsilon=a["epsilon"])
    return node, [("", 17)]


def _rms_onnx(shapes: list, a: dict) -> Any:
    from onnx import helper  # heavy: onnx

    node = helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"],
                            axis=a["begin_axis"], epsilon=a["epsilon"])
    return node, [("", 17)]


def _gelu_onnx(shapes: list, a: dict) -> Any:
    from onnx import helper  # heavy: onnx

    ins = ["x"] if len(shapes) == 1 else ["x", "bias"]
    op = "FastGelu" if a["approximate"] == "tanh" else ("Gelu" if len(ins) == 1 else "BiasGelu")
    return helper.make_node(op, ins, ["y"], domain=_MS), [("", 17), (_MS, 1)]


def _softmax_onnx(shapes: list, a: dict) -> Any:
    from onnx import helper  # heavy: onnx

    return helper.make_node("Softmax", ["x"], ["y"], axis=a["axis"]), [("", 13)]


def _gn_onnx(shapes: list, a: dict) -> Any:
    from onnx import helper  # heavy: onnx

    if a["layout"] != "NCHW":
        return None  # onnxruntime's CPU GroupNormalization is NCHW only
    node = helper.make_node("GroupNormalization", ["x", "gamma", "beta"], ["y"],
                            num_groups=a["num_groups"], epsilon=a["epsilon"])
    return node, [("", 21)]


#: TVM-Relax, torch and onnxruntime equivalents of the built-in ops.
SPECS: dict[str, OpSpec] = {
    "layer_norm": OpSpec(_ln_relax, _ln_torch, onnx_fn=_ln_onnx),
    "rms_norm": OpSpec(_rms_relax, _rms_torch, onnx_fn=_rms_onnx),
    "gelu": OpSpec(_gelu_relax, _gelu_torch, onnx_fn=_gelu_onnx),
    "bias_gelu": OpSpec(_gelu_relax, _gelu_torch, onnx_fn=_gelu_onnx),
    "softmax": OpSpec(_softmax_relax, _softmax_torch, onnx_fn=_softmax_onnx),
    # One sample of the benchmark shape is larger than the hot slice's budget: cut H instead
    # (every (sample, group) statistic then covers fewer pixels; the work per pixel is equal).
    "group_norm": OpSpec(_gn_relax, _gn_torch, lambda a: 2 if a["layout"] == "NCHW" else 1,
                         onnx_fn=_gn_onnx),
}


def onnx_model(op: str, arrays: list, attrs: dict) -> bytes | None:
    """A one-node ONNX model of ``op`` over inputs shaped like ``arrays`` (float32/float16),
    or None where onnxruntime has no CPU kernel for it."""
    from onnx import TensorProto, helper  # heavy: onnx

    spec = SPECS.get(op)
    if spec is None or spec.onnx_fn is None:
        return None
    made = spec.onnx_fn([a.shape for a in arrays], attrs)
    if made is None:
        return None
    node, opsets = made
    tp = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}.get(str(arrays[0].dtype))
    if tp is None:
        return None
    inputs = [helper.make_tensor_value_info(n, tp, list(a.shape))
              for n, a in zip(node.input, arrays)]
    output = helper.make_tensor_value_info("y", tp, None)
    graph = helper.make_graph([node], op, inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 9
    return model.SerializeToString()

_ROWS = ((4096, 768), (16384, 1024))  # L3-resident / DRAM-sized transformer activations
_GN = {"num_groups": 32}

#: The issue's benchmark matrix (float32 and float16 are added by the runner).
DEFAULT_CASES: tuple[tuple[str, str, tuple[int, ...], dict], ...] = (
    *(("layer_norm", "", s, {}) for s in _ROWS),
    *(("rms_norm", "", s, {}) for s in _ROWS),
    *(("gelu", "", s, {}) for s in _ROWS),
    *(("bias_gelu", "", s, {}) for s in _ROWS),
    *(("softmax", "", s, {}) for s in _ROWS),
    ("group_norm", "NCHW", (8, 64, 56, 56), _GN),
    ("group_norm", "NHWC", (8, 56, 56, 64), _GN),
)
