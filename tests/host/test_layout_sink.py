"""ChannelsLast carries the conv layout through a user's elementwise op and what follows it
(a squeeze-excite's mean, 1x1 convs and multiply): the same kernels as with the built-in
activation, no transposes inside, the same numbers. An op that only looks elementwise (same
shapes, but it reduces over the channels) keeps its layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, te, tirx

import opsdk
from opsdk.frontend import from_torch
from opsdk.model import compile_model, report, within_tolerance


def _hswish_ref(x):
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


@opsdk.op(reference=_hswish_ref, domain={"x": (-6.0, 6.0)})
def sink_hswish(x: opsdk.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *i: x(*i) * tirx.min(tirx.max(x(*i) + 3.0, 0.0), 6.0)
                      / 6.0, name="sink_hswish")


def _channel_softmax_ref(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@opsdk.op(reference=_channel_softmax_ref, ranks=(4, 4), domain={"x": (-3.0, 3.0)})
def sink_channel_softmax(x: opsdk.Tensor) -> te.Tensor:
    """Softmax over axis 1 (NCHW channels): elementwise in shape only (kind's default)."""
    c = te.reduce_axis((0, x.shape[1]), name="c")
    mx = te.compute((x.shape[0], x.shape[2], x.shape[3]),
                    lambda n, h, w: te.max(x[n, c, h, w], axis=c), name="mx")
    c2 = te.reduce_axis((0, x.shape[1]), name="c2")
    s = te.compute((x.shape[0], x.shape[2], x.shape[3]),
                   lambda n, h, w: te.sum(te.exp(x[n, c2, h, w] - mx[n, h, w]), axis=c2),
                   name="s")
    return te.compute(x.shape, lambda n, k, h, w: te.exp(x[n, k, h, w] - mx[n, h, w])
                      / s[n, h, w], name="sm")


sink_hswish.torch("hardswish.default")


class _SE(torch.nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.reduce, self.expand = torch.nn.Conv2d(c, 8, 1), torch.nn.Conv2d(8, c, 1)

    def forward(self, x):
        s = torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))
        return x * torch.nn.functional.hardsigmoid(self.expand(s))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.Hardswish(),
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.Hardswish(), _SE(16),
        torch.nn.Conv2d(16, 24, 1), torch.nn.Hardswish()).eval()


def _run(cm, x):
    out = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()


@pytest.fixture
def registered():
    ops = [opsdk.register(d, replace=True) for d in (sink_hswish, sink_channel_softmax)]
    yield ops
    for d in (sink_hswish, sink_channel_softmax):
        opsdk.unregister(d.name)


def test_a_users_elementwise_op_compiles_like_the_builtin_activation(registered):
    net, x = _net(), torch.randn(1, 3, 32, 32)
    kernels, outs = {}, {}
    for mapped in (False, True):
        mod = from_torch(torch.export.export(net, (x,)), op_mappings=mapped)
        assert opsdk.transform.op_counts(mod).get("opsdk.sink_hswish", 0) == 3 * mapped
        cm = compile_model(mod, "x86", cache=False)
        kernels[mapped] = sorted(k.kind for k in report(cm, "x86", profile=False, asm=False)
                                 .kernels)
        outs[mapped] = _run(cm, x.numpy())
    assert kernels[True] == kernels[False], kernels
    # The input and the output transpose only (into NHWC and back).
    assert kernels[True].count("elementwise") <= 2, kernels[True]
    want = net(x).detach().numpy()
    for mapped, got in outs.items():
        assert within_tolerance(got, want)["ok"], (mapped, np.abs(got - want).max())


def test_an_op_that_reduces_over_channels_keeps_its_layout(registered):
    # Shapes say elementwise (and the kind defaults to it); the lowered kernel does not, so
    # the transposes stay and the softmax runs over the channels, not the width.
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).eval()
    x = torch.randn(1, 4, 6, 5)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType((1, 4, 6, 5), "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(xv, relax.const(conv.weight.detach().numpy()),
                                           padding=1))
            y = bb.emit(sink_channel_softmax(y))
            y = bb.emit_output(relax.op.nn.conv2d(
                y, relax.const(np.ones((8, 8, 1, 1), "float32") / 8)))
        bb.emit_func_output(y)
    cm = compile_model(bb.get(), "x86", cache=False)
    got = _run(cm, x.numpy())
    with torch.no_grad():
        y = torch.softmax(torch.nn.functional.conv2d(x, conv.weight, padding=1), dim=1)
        want = torch.nn.functional.conv2d(y, torch.ones(8, 8, 1, 1) / 8).numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


class _PoolMixer(torch.nn.Module):
    """A PoolFormer block's token mixer: GroupNorm(1, C), ``pool(y) - y`` (3x3 average,
    padding not counted), a per-channel layer scale of shape (C, 1, 1), the residual."""

    def __init__(self, c: int, pool: torch.nn.Module):
        super().__init__()
        self.norm, self.pool = torch.nn.GroupNorm(1, c), pool
        self.scale = torch.nn.Parameter(torch.rand(c, 1, 1) + 0.5)

    def forward(self, x):
        y = self.norm(x)
        return x + self.scale * (self.pool(y) - y)


@pytest.mark.parametrize("pool", [
    torch.nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    torch.nn.MaxPool2d(3, 1, 1),
])
def test_pools_norms_and_layer_scales_between_convs_stay_channels_last(pool):
    # ConvertLayout stops at the opsdk group norm: the pool after it ran NCHW (its window
    # predicates per lane: 3-7 % of the roof in PoolFormer-S12) and the (C, 1, 1) layer
    # scale, of lower rank than the tensor, kept a transpose pair around every block.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), _PoolMixer(16, pool),
                              torch.nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(1, 3, 20, 20)
    mod = from_torch(torch.export.export(net, (x,)))
    cm = compile_model(mod, "x86", cache=False)
    rows = report(cm, "x86", profile=False, asm=False).kernels
    names = [k.name for k in rows]
    # Transposes: the input's and the output's only (into NHWC and back).
    assert sum("transpose" in n for n in names) == 2, names
    rules = {k.kind: k.rule for k in rows}
    # NHWC group norm with one group: its own rule (it had fallen to the generic row rule)
    assert rules["opsdk.group_norm"] == "x86.group_norm", rules
    assert rules["pool"] == "x86.pool", rules
    got = _run(cm, x.numpy())
    want = net(x).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


class _BnAfterGelu(torch.nn.Module):
    """FastViT's RepMixer shape: a BatchNorm after an activation (no conv to fold into), its
    output read by two convs."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.a, self.b = torch.nn.Conv2d(16, 8, 1), torch.nn.Conv2d(16, 8, 3, padding=1)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        y = self.bn(torch.nn.functional.gelu(self.conv(x)))
        return self.a(y) + self.b(y)


def test_a_batch_norm_after_an_activation_stays_channels_last():
    # The GELU (an opsdk op) stopped ConvertLayout, so the BN after it ran NCHW between a
    # transpose back and one transpose into NHWC per conv reading it: in FastViT-T8, 45
    # transposes took 3.6 of 12.5 ms. The BN is now carried in NHWC (its axis renumbered).
    torch.manual_seed(0)
    net, x = _BnAfterGelu().eval(), torch.randn(1, 3, 16, 16)
    mod = from_torch(torch.export.export(net, (x,)))
    with opsdk.target("x86"):
        cl = opsdk.transform.ChannelsLast()(mod)
    (bn,) = [c for c in _calls(cl) if c.op.name == "relax.nn.batch_norm"]
    assert int(bn.attrs.axis) == 3
    _assert_two_transposes_and_torchs_numbers(mod, net, x)


def test_a_value_two_convs_read_is_transposed_once(registered):
    # An op that keeps its layout (a softmax over NCHW channels) read by two convs:
    # ConvertLayout gives each conv its own transpose of it; one is left.
    torch.manual_seed(0)
    x = torch.randn(1, 4, 6, 5)
    ws = [torch.randn(8, 4, 3, 3), torch.randn(6, 8, 1, 1), torch.randn(6, 8, 3, 3)]
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType((1, 4, 6, 5), "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(xv, relax.const(ws[0].numpy()), padding=1))
            y = bb.emit(sink_channel_softmax(y))
            a = bb.emit(relax.op.nn.conv2d(y, relax.const(ws[1].numpy())))
            b = bb.emit(relax.op.nn.conv2d(y, relax.const(ws[2].numpy()), padding=1))
            out = bb.emit_output(relax.op.add(a, b))
        bb.emit_func_output(out)
    with opsdk.target("x86"):
        cl = opsdk.transform.ChannelsLast()(bb.get())
    moved = [c for c in _calls(cl) if c.op.name == "relax.permute_dims"
             and isinstance(c.args[0], relax.Var)]
    # into NHWC, back to NCHW for the softmax, into NHWC once for both convs, back out
    assert len(moved) == 4, [str(c.args[0].ty) for c in moved]
    cm = compile_model(bb.get(), "x86", cache=False)
    with torch.no_grad():
        y = torch.softmax(torch.nn.functional.conv2d(x, ws[0], padding=1), dim=1)
        want = (torch.nn.functional.conv2d(y, ws[1])
                + torch.nn.functional.conv2d(y, ws[2], padding=1)).numpy()
    got = _run(cm, x.numpy())
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


def _calls(mod: tvm.IRModule) -> list:
    return [b.value for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


@pytest.mark.parametrize("stride", [1, 2])
def test_a_depthwise_conv_with_a_channel_multiplier_reads_a_repeated_input(stride):
    # 8 -> 24 channels in 8 groups: output channel o reads input channel o // 3, which
    # vectors of output channels gathered at every tap (FastViT's 7x7 downsampling, 5 % of
    # the roof); the input is repeated once instead and the conv is depthwise.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 24, 3, stride, padding=1, groups=8),
                              torch.nn.Conv2d(24, 8, 1)).eval()
    x = torch.randn(1, 3, 14, 14)
    mod = from_torch(torch.export.export(net, (x,)))
    with opsdk.target("x86"):
        cl = opsdk.transform.ChannelsLast()(mod)
    calls = _calls(cl)
    (rep,) = [c for c in calls if c.op.name == "relax.repeat"]
    assert int(rep.attrs.repeats) == 3 and int(rep.attrs.axis) == 3
    groups = sorted(int(c.attrs.groups) for c in calls if c.op.name == "relax.nn.conv2d")
    assert groups == [1, 1, 24], groups
    cm = compile_model(mod, "x86", cache=False)
    got = _run(cm, x.numpy())
    want = net(x).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


class _PadConcatStem(torch.nn.Module):
    """HGNetV2's stem: pads between convs, a max pool and a conv branch concatenated, a
    learnable scalar affine (``a * relu(y) + b``) after every conv."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.Conv2d(16, 8, 2)
        self.c3, self.c4 = torch.nn.Conv2d(8, 16, 2), torch.nn.Conv2d(32, 16, 3, 2, 1)
        self.pool = torch.nn.MaxPool2d(2, 1, ceil_mode=True)
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))
        self.shift = torch.nn.Parameter(torch.tensor([-0.25]))

    def forward(self, x):
        act = lambda y: self.scale * torch.relu(y) + self.shift  # noqa: E731
        x = torch.nn.functional.pad(act(self.c1(x)), (0, 1, 0, 1))
        x2 = act(self.c3(torch.nn.functional.pad(act(self.c2(x)), (0, 1, 0, 1))))
        return self.c4(torch.cat([self.pool(x), x2], 1))


class _GlobalResponseNorm(torch.nn.Module):
    """ConvNeXt-V2's block tail: GRN over the spatial axes, then a 1x1 conv; its ``gamma``
    enters as ``gamma * 1.0``, computed from constants only."""

    def __init__(self, c: int):
        super().__init__()
        self.conv, self.out = torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.Conv2d(c, 8, 1)
        self.gamma = torch.nn.Parameter(torch.rand(1, c, 1, 1))
        self.beta = torch.nn.Parameter(torch.rand(1, c, 1, 1))

    def forward(self, x):
        y = torch.nn.functional.gelu(self.conv(x))
        g = y.abs().pow(2).sum(dim=(2, 3), keepdim=True).pow(0.5)
        n = g / (g.mean(dim=1, keepdim=True) + 1e-6)
        return self.out(self.gamma * 1.0 * (y * n) + self.beta + y)


@pytest.mark.parametrize("net", [_PadConcatStem, lambda: _GlobalResponseNorm(16)],
                         ids=["pad_concat", "grn"])
def test_pads_concats_and_constant_operands_stay_channels_last(net):
    # A pad or concat of channels-last values, and a binary op whose other operand is
    # computed from constants, kept transposes around them (HGNetV2: 18, ConvNeXt-V2: 44).
    torch.manual_seed(0)
    net, x = net().eval(), torch.randn(1, 3, 24, 24)
    mod = from_torch(torch.export.export(net, (x,)))
    _assert_two_transposes_and_torchs_numbers(mod, net, x)


def _assert_two_transposes_and_torchs_numbers(mod, net, x) -> None:
    """Compiled, ``mod`` has the input's and the output's transpose only, and matches
    ``net`` on ``x``."""
    cm = compile_model(mod, "x86", cache=False)
    names = [k.name for k in report(cm, "x86", profile=False, asm=False).kernels]
    assert sum("transpose" in n for n in names) == 2, names
    got = _run(cm, x.numpy())
    want = net(x).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


class _PoolOverTokens(torch.nn.Module):
    """NextViT's spatial reduction: tokens from a conv, ``AvgPool1d`` over them (torch
    exports ``expand_dims``, ``avg_pool2d``, ``squeeze(-2)``), then a linear."""

    def __init__(self):
        super().__init__()
        self.conv, self.pool = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.AvgPool1d(4, 4)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        t = self.conv(x).flatten(2)  # (1, 8, 64)
        return self.fc(self.pool(t).transpose(1, 2))


def test_a_negative_squeeze_axis_after_a_channels_last_op_converts():
    # TVM's squeeze layout inference indexed the layout with axis -2: std::bad_alloc out of
    # ConvertLayout, and the model did not compile. The axis is made positive first.
    torch.manual_seed(0)
    net, x = _PoolOverTokens().eval(), torch.randn(1, 3, 8, 8)
    mod = from_torch(torch.export.export(net, (x,)))
    assert any(c.op.name == "relax.squeeze" and int(c.attrs.axis[0]) < 0 for c in _calls(mod))
    with opsdk.target("x86"):
        cl = opsdk.transform.ChannelsLast()(mod)
    (conv,) = [c for c in _calls(cl) if c.op.name == "relax.nn.conv2d"]
    assert conv.attrs.data_layout == "NHWC"
    cm = compile_model(mod, "x86", cache=False)
    want = net(x).detach().numpy()
    got = _run(cm, x.numpy())
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


def test_a_failing_convertlayout_leaves_the_model_nchw_with_a_warning(monkeypatch):
    # A graph TVM's own pass mishandles costs speed, not the compile: the convs stay in the
    # model's layout and the user is told which pass failed.
    def broken(layouts):
        def run(mod):
            raise tvm.error.InternalError("std::bad_alloc")
        return run

    torch.manual_seed(0)
    net, x = _BnAfterGelu().eval(), torch.randn(1, 3, 16, 16)
    mod = from_torch(torch.export.export(net, (x,)))
    monkeypatch.setattr(relax.transform, "ConvertLayout", broken)
    with pytest.warns(UserWarning, match=r"stay in the model's layout.*ConvertLayout "
                      r"failed.*std::bad_alloc"):
        cm = compile_model(mod, "x86", cache=False)
    rep = report(cm, "x86", profile=False, asm=False)
    assert not any("transpose" in k.name for k in rep.kernels), [k.name for k in rep.kernels]
    got = _run(cm, x.numpy())
    want = net(x).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()
