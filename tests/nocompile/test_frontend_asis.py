"""``opsdk.frontend.from_torch`` skips torch's second trace (``run_decompositions``) only
where it would change nothing the importer sees: each op it takes as it is imports exactly
(structurally) as TVM imports the op's decomposition, and any program outside those
conditions is decomposed as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

import opsdk
from opsdk.frontend import _asis
from opsdk.frontend import _torch as ft


class _Net(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.lin = torch.nn.Linear(8, 4)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.up3 = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return self.fn(self, x)


#: One program per op of AS_IS (and the core ops it meets), each taken as it is.
AS_IS_CASES = {
    "conv2d": lambda s, x: s.conv(x),
    "batch_norm": lambda s, x: s.bn(s.conv(x)),
    "relu_": lambda s, x: F.relu(s.conv(x), inplace=True),
    "add_": lambda s, x: s.conv(x).add_(x),
    "relu_ of add_": lambda s, x: F.relu(s.bn(s.conv(x)).add_(x), inplace=True),
    "in-place result read again": lambda s, x: (lambda y: F.relu(y, inplace=True) + y)(
        s.conv(x)),
    "max_pool2d": lambda s, x: F.max_pool2d(x, 3, 2, 1),
    "max_pool2d ceil": lambda s, x: F.max_pool2d(x, 3, 2, 0, ceil_mode=True),
    "adaptive_avg_pool2d 1x1": lambda s, x: F.adaptive_avg_pool2d(x, 1),
    "adaptive_avg_pool2d 5x5": lambda s, x: F.adaptive_avg_pool2d(x, 5),
    "adaptive_avg_pool2d channels-last":
        lambda s, x: F.adaptive_avg_pool2d(x.contiguous(memory_format=torch.channels_last), 1),
    "flatten + linear": lambda s, x: s.lin(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)),
    "flatten of a permute": lambda s, x: x.permute(0, 2, 3, 1).flatten(1),
    "reshape": lambda s, x: x.reshape(1, 80, 10),
    "reshape of a transpose": lambda s, x: x.transpose(1, 2).reshape(1, 10, 80),
    "contiguous": lambda s, x: x.permute(0, 2, 3, 1).contiguous(),
    "dropout (eval)": lambda s, x: F.dropout(x, 0.1, training=False),
    "silu": lambda s, x: F.silu(x),
    "silu_": lambda s, x: F.silu(s.conv(x), inplace=True),
    "hardswish": lambda s, x: F.hardswish(x),
    "hardswish_": lambda s, x: F.hardswish(s.conv(x), inplace=True),
    "hardsigmoid": lambda s, x: F.hardsigmoid(x) * x,
    "relu6": lambda s, x: F.relu6(x),
    "relu6_": lambda s, x: F.relu6(s.conv(x), inplace=True),
    "hardtanh_": lambda s, x: F.hardtanh(s.conv(x), -2.0, 2.0, inplace=True),
    "leaky_relu_": lambda s, x: F.leaky_relu(s.conv(x), 0.1, inplace=True),
    "core ops": lambda s, x: torch.cat([torch.sigmoid(x) * x - 1, (x / 3).mean((2, 3),
                                                                             keepdim=True)
                                        .expand(1, 8, 10, 10)], 1),
    "kept ops": lambda s, x: F.gelu(F.layer_norm(x, (10,))).softmax(-1),
    "upsample": lambda s, x: F.interpolate(x, scale_factor=2, mode="nearest"),
    "a reshape to the same shape": lambda s, x: x.reshape(1, -1, 10, 10) * 2,
    "a reshape of a transpose to its shape": lambda s, x: x.transpose(2, 3).reshape(1, 8, 10, 10),
    "a reshape of a transpose to its shape, -1": lambda s, x: x.transpose(2, 3).reshape(
        1, -1, 10, 10) + 1,
    "a reshape of an attention's output, -1": lambda s, x: F.scaled_dot_product_attention(
        x, x, x).reshape(1, -1, 10, 10).transpose(1, 2),
    "a split's pieces": lambda s, x: torch.cat(list(x.chunk(2, 1))[::-1], 1),
    "chunk, uneven": lambda s, x: torch.cat(list(x.chunk(3, 1))[::-1], 1),
    "chunk, fewer pieces than asked": lambda s, x: torch.cat(list(x[:, :6].chunk(4, 1)), 2),
    "chunk, one piece read, negative dim": lambda s, x: x.chunk(2, -1)[1] * 2,
    "split by size": lambda s, x: torch.cat(list(x.split(3, 1))[::-1], 1),
    "split by sizes": lambda s, x: torch.cat(list(x.split([2, 6], 1))[::-1], 1),
    "unbind": lambda s, x: sum(x.unbind(1)),
    "unbind of a view of a new tensor": lambda s, x: sum((x * 2).permute(1, 0, 2, 3).unbind(0)),
    "unbind, one piece read, negative dim": lambda s, x: x.unbind(-2)[3] * 2,
    "conv_transpose2d": lambda s, x: s.up(x),
    "conv_transpose2d, padded": lambda s, x: s.up3(x),
    "pad": lambda s, x: F.pad(x, (1, 2)),
    "pad with a value": lambda s, x: F.pad(x, (1, 2, 0, 1), value=1.5),
    "arange": lambda s, x: x + torch.arange(10),
    "arange, float": lambda s, x: x + torch.arange(10, dtype=torch.float32),
    "arange, start": lambda s, x: x * torch.arange(2, 12).expand(1, 10),
    "new_ones": lambda s, x: x + x.new_ones(10),
    "zeros": lambda s, x: x + torch.zeros(1, 8, 10, 10),
}

def _view_then_relu_(y):
    v = y.view(1, -1)  # shares y's memory: it must see the ReLU
    F.relu(y, inplace=True)
    return v * 2


#: Programs that must take the second trace, and why.
DECOMPOSED_CASES = {
    "in-place on a view": lambda s, x: F.relu(x[:, :4], inplace=True),
    "in-place on an input": lambda s, x: x.relu_(),
    "in-place under an earlier view": lambda s, x: _view_then_relu_(s.conv(x)),
    "a flatten to the same shape": lambda s, x: x.reshape(8, 100).flatten(1) * 2,
    "a split of an in-place result": lambda s, x: torch.cat(
        list(F.relu(s.conv(x), inplace=True).split([3, 5], 1))[::-1], 1),
    "a chunk of a view of an in-place result": lambda s, x: torch.cat(
        list(F.relu(s.conv(x), inplace=True).transpose(2, 3).chunk(2, 1))[::-1], 1),
    "another op's outputs": lambda s, x: F.max_pool2d(x, 2, return_indices=True)[0],
    "reflect padding": lambda s, x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
    "an op with a decomposition": lambda s, x: F.mish(x),
    "matmul": lambda s, x: x @ x.transpose(-1, -2),
}


def _export(fn, x=None):
    torch.manual_seed(0)
    net = _Net(fn).eval()
    return torch.export.export(net, (torch.randn(1, 8, 10, 10) if x is None else x,))


def _canonical(mod: tvm.IRModule) -> relax.Function:
    # the decomposed import leaves dead bindings (max_pool2d's indices) and aliases behind
    return tvm.transform.Sequential([relax.transform.CanonicalizeBindings(),
                                     relax.transform.DeadCodeElimination(["main"])])(mod)["main"]


def _traces(ep) -> int:
    """How many times ``from_torch(ep)`` ran torch's second trace."""
    calls = []
    real = type(ep).run_decompositions

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    type(ep).run_decompositions = counted
    try:
        opsdk.frontend.from_torch(ep)
    finally:
        type(ep).run_decompositions = real
    return len(calls)


def _both(ep) -> tuple[relax.Function, relax.Function]:
    """(from_torch's import, the import after torch's decompositions)."""
    fast = opsdk.frontend.from_torch(ep)
    real = ft.importable_as_is
    try:
        ft.importable_as_is = lambda *a: False
        slow = opsdk.frontend.from_torch(ep)
    finally:
        ft.importable_as_is = real
    return _canonical(fast), _canonical(slow)


def _taken_as_is(ep) -> bool:
    return _asis.importable_as_is(ep, opsdk.frontend.decomposition_table(),
                                  ft._kept_ops(None, True, []))


@pytest.mark.parametrize("case", list(AS_IS_CASES))
def test_an_op_taken_as_it_is_imports_as_its_decomposition(case):
    ep = _export(AS_IS_CASES[case])
    assert _taken_as_is(ep) and _traces(ep) == 0, case
    fast, slow = _both(ep)
    tvm.ir.assert_structural_equal(fast, slow)


@pytest.mark.parametrize("case", list(DECOMPOSED_CASES))
def test_a_program_outside_the_conditions_is_decomposed(case):
    ep = _export(DECOMPOSED_CASES[case])
    assert not _taken_as_is(ep) and _traces(ep) == 1, case


def test_every_as_is_op_has_a_case():
    names = {getattr(n.target, "__name__", "") for fn in AS_IS_CASES.values()
             for n in _export(fn).graph.nodes if n.op == "call_function"}
    assert set(_asis.AS_IS) <= names, set(_asis.AS_IS) - names


def test_training_batch_norm_dropout_buffers_and_symbolic_dims_are_decomposed():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(8).train()  # batch statistics, running stats updated
    ep = torch.export.export(bn, (torch.randn(2, 8, 4, 4),))
    assert not _taken_as_is(ep)
    no_stats = torch.nn.BatchNorm2d(8, track_running_stats=False).eval()
    assert not _taken_as_is(torch.export.export(no_stats, (torch.randn(2, 8, 4, 4),)))
    ep = _export(lambda s, x: F.dropout(x, 0.5, training=True))
    assert not _taken_as_is(ep)
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(torch.nn.ReLU(), (torch.randn(2, 8),),
                             dynamic_shapes=({0: batch},))
    assert not _taken_as_is(ep)


def test_a_wrong_as_is_converter_is_caught(monkeypatch):
    """The equality above is what guards each converter: a silu built as
    ``sigmoid(x) * x`` (the operands swapped) no longer matches torch's ``x * sigmoid(x)``."""

    def swapped(node, imp):
        bb, x = imp.block_builder, imp.env[node.args[0]]
        return bb.emit(relax.op.multiply(bb.emit(relax.op.sigmoid(x)), x))

    monkeypatch.setitem(_asis.AS_IS, "silu.default", swapped)
    fast, slow = _both(_export(AS_IS_CASES["silu"]))
    with pytest.raises(ValueError):
        tvm.ir.assert_structural_equal(fast, slow)


@pytest.mark.parametrize("name", ["yolov8_tiny", "unet_tiny"])
def test_a_zoo_model_imports_as_its_decomposition(name):
    """Whole programs: the detector's C2f chunks and splits, the UNet's transposed convs."""
    from opsdk.bench._zoo import select_zoo

    model, args = select_zoo(name)[0].build()
    ep = torch.export.export(model, args)
    assert _taken_as_is(ep), name
    fast, slow = _both(ep)
    tvm.ir.assert_structural_equal(fast, slow)
