"""The sort kernel (opsdk.transform._sort): torch's ``topk`` / ``sort`` / ``argsort`` and
ONNX ``TopK`` compile (TVM 0.27 refused them on CPUs) and give torch's order exactly, NaN
above every number, ``-0.0`` equal to ``0.0``, ties in their positions' order; a top-k
cuts its merge runs to ``k`` and still matches a full sort."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import opsdk
from opsdk.model import compile_model


def _run(mod, *inputs):
    cm = compile_model(mod, "x86")
    vm = relax.VirtualMachine(cm.ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    outs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
    return cm, [o.numpy() for o in outs]


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and \
        np.array_equal(got, want, equal_nan=got.dtype.kind == "f")


def test_torch_topk_sort_argsort_match_torch_with_nans_ties_and_signed_zeros():
    class M(torch.nn.Module):
        def forward(self, x):
            v, i = torch.topk(x, 5, dim=1)  # the middle axis
            s, si = torch.sort(x, dim=-1, descending=True)
            return v, i, s, si, torch.argsort(x, dim=0)

    x = torch.randn(3, 40, 7)
    x[0, 3, 2] = float("nan")
    x[2, 11, 0] = float("nan")
    x[1, 5:9, 1] = 0.5  # ties
    x[1, 20, :] = -0.0
    x[1, 21, :] = 0.0
    x[0, 30, 4] = float("-inf")
    ep = torch.export.export(M().eval(), (x,))
    cm, got = _run(opsdk.frontend.from_torch(ep), x.numpy())
    want = [t.numpy() for t in M()(x)]
    for g, w in zip(got[:4], want[:4]):
        assert _same(g, w)
    # argsort against a stable sort (torch's default does not promise the ties' order)
    assert _same(got[4], np.argsort(x.numpy(), axis=0, kind="stable"))
    rules = {k["rule"] for k in cm.kernels if "sort_rows" in k["name"]}
    assert rules == {"x86.extern"}


@pytest.mark.parametrize(("n", "k", "largest"), [(1000, 7, True), (1000, 1000, False),
                                                  (513, 64, False), (1, 1, True)])
def test_long_rows_cut_to_k_match_a_full_sort(n, k, largest):
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal((4, n)).astype("float32")
    x[:, ::5] = np.round(x[:, ::5])  # many ties
    xv = relax.Var("x", relax.TensorType(x.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.topk(xv, k, axis=-1, largest=largest, dtype="int32"))
        bb.emit_func_output(y)
    _, (v, i) = _run(bb.get(), x)
    order = np.argsort(-x if largest else x, axis=-1, kind="stable")[:, :k]
    assert _same(i, order.astype("int32"))
    assert _same(v, np.take_along_axis(x, order, axis=-1))


@pytest.mark.parametrize("is_sorted", [1, 0])
def test_integer_input_and_onnx_topk(is_sorted):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    x = np.random.default_rng(0).integers(-50, 50, (3, 64)).astype("int32")
    graph = helper.make_graph(
        # sorted=0 (any order; TVM's converter refused it): the kernel's sorted order is one
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, largest=0,
                          sorted=is_sorted)], "topk",
        [helper.make_tensor_value_info("x", TensorProto.INT32, list(x.shape))],
        [helper.make_tensor_value_info("v", TensorProto.INT32, [3, 10]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [3, 10])],
        [helper.make_tensor("k", TensorProto.INT64, [1], [10])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    _, (v, i) = _run(opsdk.frontend.from_onnx(model), x)
    order = np.argsort(x, axis=1, kind="stable")[:, :10]
    assert _same(i, order.astype("int64"))
    assert _same(v, np.take_along_axis(x, order, axis=1))
