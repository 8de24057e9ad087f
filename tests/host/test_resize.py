"""Bilinear upsampling in two passes (:mod:`opsdk.kernels.resize`): the same bits as TVM's
one-kernel resize, and a permute after an upsampling moves before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import opsdk
from opsdk.frontend import from_torch
from opsdk.kernels import resize
from opsdk.model import compile_model, within_tolerance

_CASES = [  # (input NCHW, output size, layout, mode, dtype)
    ((1, 21, 16, 16), (256, 256), "NCHW", "half_pixel", "float32"),
    ((2, 5, 7, 9), (23, 17), "NCHW", "align_corners", "float32"),
    ((1, 8, 3, 5), (10, 4), "NCHW", "asymmetric", "float32"),
    ((1, 3, 1, 1), (6, 6), "NCHW", "pytorch_half_pixel", "float32"),
    ((1, 6, 5, 7), (15, 21), "NCHW", "half_pixel", "float16"),
]


def _module(shape, size, layout, mode, dtype):
    if layout == "NHWC":
        shape = (shape[0], shape[2], shape[3], shape[1])
    x = relax.Var("x", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.image.resize2d(
                x, size, layout=layout, method="linear", coordinate_transformation_mode=mode))
        bb.emit_func_output(y)
    return bb.get(), shape


def _run(ex, x: np.ndarray) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _compiled(mod, passes: int):
    """``mod`` through the model pipeline (no caches), checked to resize in ``passes``
    kernels (1: TVM's legalization)."""
    cm = compile_model(mod, "x86", cache=False)
    names = [gv.name_hint for gv, f in cm.scheduled.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc)]
    assert sum(n.startswith("resize2d_") for n in names) == (2 if passes == 2 else 0), names
    return cm.ex


def _tvms(mod, monkeypatch):
    """``mod`` compiled the same way with TVM's legalization of the resize (one kernel)."""
    with monkeypatch.context() as m:
        m.setattr(resize, "separable", lambda call: False)
        return _compiled(mod, 1)


@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"{c[2]}-{c[3]}-{c[4]}-{c[1][0]}")
def test_two_passes_give_tvms_bits(case, monkeypatch):
    mod, shape = _module(*case)
    x = np.random.default_rng(0).standard_normal(shape).astype(case[4])
    kernels = sorted(n.name_hint for n, f in relax.transform.LegalizeOps(
        {"relax.image.resize2d": resize.legalize_resize2d})(mod).functions_items()
        if isinstance(f, tvm.tirx.PrimFunc))
    assert kernels == ["resize2d_h", "resize2d_w"]
    assert np.array_equal(_run(_compiled(mod, 2), x), _run(_tvms(mod, monkeypatch), x))


@pytest.mark.parametrize("size,layout", [((8, 24), "NCHW"), ((32, 32), "NHWC")],
                         ids=["downsampling", "nhwc"])
def test_downsampling_and_nhwc_keep_tvms_kernel(size, layout):
    mod, _ = _module((1, 4, 16, 16), size, layout, "half_pixel", "float32")
    call = mod["main"].body.blocks[0].bindings[0].value
    assert not resize.separable(call)


def test_a_bug_planted_in_the_passes_is_caught(monkeypatch):
    # the second neighbour not clamped at the last row / column: reads past the image
    real = resize._lerp_index

    def unclamped(o, size, target, mode):
        first, _second, t = real(o, size, target, mode)
        return first, tvm.tirx.min(first + 1, size - 1) * 0 + first, t

    mod, shape = _module(*_CASES[2])
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    want = _run(_tvms(mod, monkeypatch), x)
    monkeypatch.setattr(resize, "_lerp_index", unclamped)
    assert not np.array_equal(_run(_compiled(mod, 2), x), want)


class _Head(torch.nn.Module):
    """A segmentation head: a 1x1 conv to class maps, then bilinear upsampling to the
    image's size (DeepLab, FCN, LR-ASPP)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(32, 21, 1)

    def forward(self, x):
        y = self.conv(x)
        return torch.nn.functional.interpolate(y, scale_factor=8, mode="bilinear",
                                               align_corners=False)


def test_an_upsampling_head_resizes_in_the_layout_it_returns():
    torch.manual_seed(0)
    net, x = _Head().eval(), torch.randn(1, 32, 12, 10)
    mod = from_torch(torch.export.export(net, (x,)))
    with opsdk.target("x86"):
        cl = opsdk.transform.ChannelsLast()(mod)
    calls = []
    relax.analysis.post_order_visit(cl["main"], lambda e: calls.append(e) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    names = [c.op.name for c in calls]
    # the conv runs NHWC; its small output is permuted back before the resize, not after
    (rz,) = [c for c in calls if c.op.name == "relax.image.resize2d"]
    assert str(rz.attrs.layout) == "NCHW"
    assert names.index("relax.permute_dims", names.index("relax.nn.conv2d")) < \
        names.index("relax.image.resize2d")
    assert "relax.permute_dims" not in names[names.index("relax.image.resize2d"):]
    cm = compile_model(mod, "x86", cache=False)
    out = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    got = (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()
    want = net.double()(x.double()).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()


class _TokenHead(torch.nn.Module):
    """SegFormer's decode head: token maps (N, H*W, C) of two scales, each projected,
    brought to NCHW, upsampled to the larger size, concatenated, then a 1x1 conv."""

    def __init__(self):
        super().__init__()
        self.p1, self.p2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.fuse = torch.nn.Conv2d(32, 8, 1)

    def forward(self, t1, t2):
        maps = []
        for t, proj, side in ((t1, self.p1, 16), (t2, self.p2, 8)):
            m = proj(t).permute(0, 2, 1).reshape(1, 16, side, side)
            maps.append(torch.nn.functional.interpolate(m, size=(16, 16), mode="bilinear",
                                                        align_corners=False))
        return self.fuse(torch.cat(maps, dim=1))


def test_upsampled_maps_concatenated_for_a_conv_resize_in_its_layout():
    torch.manual_seed(0)
    net = _TokenHead().eval()
    args = (torch.randn(1, 256, 16), torch.randn(1, 64, 16))
    mod = from_torch(torch.export.export(net, args))
    with opsdk.target("x86"):
        cl = opsdk.transform.ChannelsLast()(mod)
    calls = []
    relax.analysis.post_order_visit(cl["main"], lambda e: calls.append(e) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    # the conv's NHWC permute moved above the concat and both resizes: they run NHWC
    # (their vectors over the channels) and the concat joins channels-last maps
    assert [str(c.attrs.layout) for c in calls if c.op.name == "relax.image.resize2d"] == \
        ["NHWC", "NHWC"]
    (cat,) = [c for c in calls if c.op.name == "relax.concat"]
    assert int(cat.attrs.axis) == 3
    cm = compile_model(mod, "x86", cache=False)
    vm = relax.VirtualMachine(cm.ex, tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(a.numpy()) for a in args))
    got = (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()
    want = net.double()(*(a.double() for a in args)).detach().numpy()
    assert within_tolerance(got, want)["ok"], np.abs(got - want).max()
