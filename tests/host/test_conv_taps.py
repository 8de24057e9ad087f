"""``ConvLiveTaps``: convs that read mostly their padding run per region of the output with
only the taps that read the image (DeepLab's ASPP on a small map)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import opsdk
from opsdk.frontend import from_torch
from opsdk.model import compile_model, within_tolerance
from opsdk.transform import _taps
from opsdk.transform._taps import conv_calls, live_regions


def _reads_image(o: int, t: int, stride: int, dilation: int, pad: int, size: int) -> bool:
    return 0 <= o * stride + t * dilation - pad < size


def test_regions_cover_every_output_with_exactly_its_live_taps():
    checked = 0
    for size, stride, dilation, taps, pad in itertools.product(
            (1, 2, 5, 16, 17), (1, 2, 3), (1, 2, 6, 12, 24), (1, 3, 5), (0, 1, 6, 12, 24)):
        out = (size + 2 * pad - dilation * (taps - 1) - 1) // stride + 1
        if out < 1:
            continue
        regions = live_regions(size, out, stride, dilation, taps, pad)
        live = [[t for t in range(taps) if _reads_image(o, t, stride, dilation, pad, size)]
                for o in range(out)]
        case = (size, stride, dilation, taps, pad)
        if any(not lv for lv in live):
            assert regions is None, case
            continue
        assert regions[0].start == 0 and regions[-1].stop == out, case
        for a, b in itertools.pairwise(regions):
            assert a.stop == b.start and (a.first, a.last) != (b.first, b.last), case
        for r in regions:
            for o in range(r.start, r.stop):
                assert live[o] == list(range(r.first, r.last + 1)), (case, o, r)
        checked += 1
    assert checked > 250  # the grid is not vacuous


class _ASPP(torch.nn.Module):
    """DeepLabV3's atrous branches on a 16x16 map: dilation 12 (three quarters of the
    outer taps' reads are padding), 24 and 36 (all of them), and an ordinary 3x3 conv."""

    def __init__(self, cin: int = 96, cout: int = 64):
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Conv2d(cin, cout, 3, padding=d, dilation=d) for d in (12, 24, 36))
        self.plain = torch.nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x):
        return torch.cat([torch.relu(b(x)) for b in self.branches] + [self.plain(x)], 1)


def _taps_of(call) -> tuple[int, int, int, int]:
    """(kernel height, width, dilation) of a conv call after the layout pass (HWIO)."""
    w = [int(v) for v in call.args[1].ty.shape.values]
    return w[0], w[1], int(call.attrs.dilation[0]), int(call.attrs.dilation[1])


def test_atrous_convs_keep_only_the_taps_that_read_the_image():
    torch.manual_seed(0)
    net, x = _ASPP().eval(), torch.randn(1, 96, 16, 16)
    mod = from_torch(torch.export.export(net, (x,)))
    with opsdk.target("x86"):
        mod = opsdk.transform.ConvLiveTaps()(opsdk.transform.ChannelsLast()(mod))
    taps = sorted(_taps_of(c) for c in conv_calls(mod))
    # dilation 24 and 36: 1x1 each; dilation 12: 3 x 3 regions (taps 2 / 1 / 2 per axis);
    # the plain conv is left whole
    want = sorted([(1, 1, 1, 1)] * 2 + [(3, 3, 1, 1)] + [
        (r, c, 12 if r > 1 else 1, 12 if c > 1 else 1)
        for r, c in itertools.product((2, 1, 2), (2, 1, 2))])
    assert taps == want


@pytest.mark.parametrize("shape", [(1, 96, 16, 16), (1, 96, 23, 19)])
def test_atrous_convs_match_float64(shape):
    torch.manual_seed(0)
    net, x = _ASPP().eval(), torch.randn(*shape)
    cm = compile_model(from_torch(torch.export.export(net, (x,))), "x86", cache=False)
    got = _run(cm, x.numpy())
    want = net.double()(x.double()).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


def _run(cm, x: np.ndarray) -> np.ndarray:
    import tvm
    from tvm import relax

    out = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()


def test_a_bug_planted_in_the_regions_is_caught(monkeypatch):
    # a region that drops one more tap than is dead: the output is wrong where it read
    real = _taps.live_regions

    def drops_a_live_tap(*args):
        regions = real(*args)
        if regions is None or len(regions) < 2:
            return regions
        r = regions[0]
        return [_taps.Region(r.start, r.stop, r.first, r.last - 1), *regions[1:]] \
            if r.taps > 1 else regions

    monkeypatch.setattr(_taps, "live_regions", drops_a_live_tap)
    torch.manual_seed(0)
    net, x = _ASPP().eval(), torch.randn(1, 96, 16, 16)
    cm = compile_model(from_torch(torch.export.export(net, (x,))), "x86", cache=False)
    got = _run(cm, x.numpy())
    want = net.double()(x.double()).detach().numpy()
    assert not within_tolerance(got, want)["ok"]


@pytest.mark.parametrize("size,cin,cout", [(7, 96, 64), (2, 16, 16)], ids=["7x7", "tiny-2x2"])
def test_ordinary_and_tiny_convs_stay_whole(size, cin, cout):
    # a 3x3 conv with padding 1 reads padding only on its border (7x7: 74 % of its taps
    # read the image); on a 2x2 map half its taps read padding, but four kernels for a
    # conv of 9k multiply-adds cost more than they save
    net = torch.nn.Conv2d(cin, cout, 3, padding=1).eval()
    x = torch.randn(1, cin, size, size)
    mod = from_torch(torch.export.export(net, (x,)))
    with opsdk.target("x86"):
        mod = opsdk.transform.ChannelsLast()(mod)
    assert opsdk.transform.ConvLiveTaps()(mod).same_as(mod)
