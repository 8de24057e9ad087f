"""qconv2d schedules: bit-exact against the reference through Relax (x86 ``vpdpbusd`` here; the
aarch64 ``sdot`` / NEON rules under qemu in ``tests/arm/test_int8_arm.py``, which imports
:func:`make_cases` / :func:`case_module` / :func:`check_cases` from this file).

One Relax module holds a function per case: both layouts x both activation dtypes over a list
of geometries (3 input channels as in a first layer, channel tails, 1x1 / 3x3 / 5x5 windows,
stride 2, padding wider than the window needs, a 1-pixel-wide row, more output channels than
one 64-channel tile), zero points at both ends of the range, int8 / float32 / int32 outputs,
per-channel and per-tensor weights, with and without bias; the batch is symbolic and run at 1
and 2. Depthwise cases are there too (their own rule: vectors along the contiguous axis).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import opsdk
from opsdk._asm import asm_of
from opsdk.ops._quant import QRANGE
from opsdk.ops.qconv2d import qconv2d
from opsdk.schedules import last_choices

#: (C, H, W, O, K, stride, padding)
GEOMETRIES = (
    (3, 7, 9, 32, 3, 1, 1),
    (17, 5, 13, 5, 3, 2, 1),
    (8, 6, 6, 70, 1, 1, 0),
    (4, 9, 1, 16, 3, 1, 2),
    (16, 8, 11, 33, 5, 2, 2),
    (64, 4, 7, 64, 3, 1, 1),
)
BATCHES = (1, 2)
OUTS = ("int8", "float32", "int32")


@dataclass
class ConvCase:
    """One Relax function of the matrix: its attributes and inputs for the largest batch."""

    name: str
    attrs: dict[str, Any]
    inputs: dict[str, np.ndarray]

    def at(self, n: int) -> dict[str, np.ndarray]:
        return {k: (v[:n] if k == "x" else v) for k, v in self.inputs.items()}


def _case(rng: np.random.Generator, name: str, xdt: str, layout: str, geom: tuple,
          i: int, depthwise: bool = False) -> ConvCase:
    c, h, w, o, k, stride, pad = geom
    if depthwise:
        o = c
    lo, hi = QRANGE[xdt]
    x = rng.integers(lo, hi + 1, (max(BATCHES), c, h, w))
    x[1, :, 0] = lo  # extreme rows in the second image
    x[1, :, -1] = hi
    if layout == "NHWC":
        x = x.transpose(0, 2, 3, 1)
    wt = rng.integers(-128, 128, (o, 1 if depthwise else c, k, k))
    wt[0] = -128
    per_channel = i % 3 != 1
    attrs = {**qconv2d.default_attrs(), "layout": layout, "stride": stride, "padding": pad,
             "depthwise": depthwise, "per_channel": per_channel, "out_dtype": OUTS[i % 3],
             "x_zero_point": (lo, hi)[i % 2], "x_scale": (0.05, 0.5, 1e-3)[i % 3],
             "out_zero_point": (-128, 127, 0, -3)[i % 4]}
    ins = {"x": np.ascontiguousarray(x).astype(xdt), "w": wt.astype("int8"),
           "w_scale": rng.uniform(0.001, 0.05, o if per_channel else 1).astype("float32")}
    if i % 4 != 3:
        ins["bias"] = rng.integers(-5000, 5001, o).astype("int32")
    if attrs["out_dtype"] == "int8":  # about the top quarter of |output| saturates
        raw = qconv2d.run_reference(ins, {**attrs, "out_dtype": "int32"})
        v = np.abs(raw.astype(np.float64) * attrs["x_scale"] * float(ins["w_scale"].max()))
        attrs["out_scale"] = float(max(np.percentile(v, 60), 1e-3) / 100.0)
    return ConvCase(name, attrs, ins)


def make_cases(seed: int = 0) -> list[ConvCase]:
    """Both layouts x both activation dtypes over every geometry, plus depthwise ones."""
    rng = np.random.default_rng(seed)
    cases = []
    combos = [(layout, xdt) for layout in ("NCHW", "NHWC") for xdt in ("int8", "uint8")]
    for j, (layout, xdt) in enumerate(combos):
        for i, geom in enumerate(GEOMETRIES):
            cases.append(_case(rng, f"c{j}_{i}_{layout}_{xdt}", xdt, layout, geom, i + j))
        cases.append(_case(rng, f"dw{j}_{layout}_{xdt}", xdt, layout, (6, 5, 7, 6, 3, 1, 1),
                           j, depthwise=True))
    return cases


def case_module(cases: Sequence[ConvCase], batch: int | None = None) -> tvm.IRModule:
    """A Relax module with one function per case calling qconv2d; the batch is symbolic
    unless ``batch`` is given."""
    bb = relax.BlockBuilder()
    for case in cases:
        n = tirx.Var("n", "int64") if batch is None else batch
        params = [relax.Var(name, relax.TensorType(
            [n, *a.shape[1:]] if name == "x" else list(a.shape), str(a.dtype)))
            for name, a in case.inputs.items()]
        with bb.function(case.name, params):
            with bb.dataflow():
                call = opsdk.relax.qconv2d(**dict(zip(case.inputs, params)), **case.attrs)
                out = bb.emit_output(bb.emit(call))
            bb.emit_func_output(out)
    return bb.get()


def check_cases(cases: Sequence[ConvCase],
                run: Callable[[str, list[np.ndarray]], np.ndarray],
                batches: Sequence[int] = BATCHES) -> dict[str, int]:
    """Mismatch counts per case and batch (empty when all exact), and the saturated int8
    outputs at each end (``sat_lo`` / ``sat_hi``)."""
    bad: dict[str, int] = {}
    sat = {"sat_lo": 0, "sat_hi": 0}
    for case in cases:
        for n in batches:
            ins = case.at(n)
            got = run(case.name, list(ins.values()))
            ref = qconv2d.run_reference(ins, case.attrs)
            if got.dtype != ref.dtype or got.shape != ref.shape or not np.array_equal(got, ref):
                same = got.shape == ref.shape
                bad[f"{case.name} N={n}"] = int(np.sum(got != ref)) if same else -1
            if ref.dtype == np.int8:
                sat["sat_lo"] += int((ref == -128).sum())
                sat["sat_hi"] += int((ref == 127).sum())
    return {**bad, **sat}


def compile_cases(cases: Sequence[ConvCase], target: Any,
                  batch: int | None = None) -> tuple[Any, Counter]:
    """Build the module for ``target``; also how many kernels each rule scheduled."""
    before = len(last_choices())
    ex = tvm.compile(case_module(cases, batch), target=opsdk.target(target)
                     if isinstance(target, str) else target)
    return ex, Counter(c.rule for c in last_choices()[before:] if c.op == "qconv2d")


needs_vnni = pytest.mark.skipif(
    "avx512vnni" not in opsdk.targets.target_features(opsdk.target("x86")),
    reason="host CPU lacks AVX-512 VNNI",
)


@pytest.fixture(scope="module")
def cases() -> list[ConvCase]:
    return make_cases()


@pytest.fixture(scope="module")
def x86_build(cases) -> tuple[Any, Counter]:
    return compile_cases(cases, "x86")


@needs_vnni
def test_x86_vnni_is_bit_exact(cases, x86_build) -> None:
    ex, rules = x86_build
    dw = sum(c.attrs["depthwise"] for c in cases)
    assert rules == Counter({"x86.qconv2d_vnni": len(cases) - dw, "x86.qconv2d_depthwise": dw})
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(cases, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    sat = {k: result.pop(k) for k in ("sat_lo", "sat_hi")}
    assert result == {}, f"mismatching cases: {result}"
    assert sat["sat_lo"] > 0 and sat["sat_hi"] > 0, sat


@needs_vnni
def test_x86_asm_has_vpdpbusd(x86_build) -> None:
    # (the depthwise kernels have no dot product: int32 multiply-adds in zmm vectors)
    asm = asm_of(x86_build[0])
    count = len(re.findall(r"^\s*vpdpbusd\s", asm, flags=re.M))
    assert count >= len(GEOMETRIES) * 4 * 4, count  # every dense case, a tile of 4+ groups


@pytest.mark.skipif("avx2" not in opsdk.targets.target_features(opsdk.target("x86")),
                    reason="host CPU lacks AVX2")
def test_x86_avx2_is_bit_exact(cases) -> None:
    # AVX2 without VNNI (haswell: runs on any AVX2 host): the dense convs on the vpmaddwd
    # rule, the depthwise ones on theirs, every case exact.
    haswell = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    ex, rules = compile_cases(cases, haswell)
    dw = sum(c.attrs["depthwise"] for c in cases)
    assert rules == Counter({"x86.qconv2d_avx2": len(cases) - dw, "x86.qconv2d_depthwise": dw})
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(cases, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    assert {k: v for k, v in result.items() if not k.startswith("sat_")} == {}


def test_generic_fallback_without_avx2_is_bit_exact(cases) -> None:
    # Baseline x86-64 (SSE2): neither int8 rule applies and the unscheduled lowering still
    # matches; the depthwise rule needs neither.
    subset = [c for c in cases if c.name.startswith(("c0_1", "c3_0", "dw1"))]
    base = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})
    ex, rules = compile_cases(subset, base)
    assert rules == Counter({"generic": 2, "x86.qconv2d_depthwise": 1})
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(subset, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    assert {k: v for k, v in result.items() if not k.startswith("sat_")} == {}


def test_bad_geometry_is_refused_with_the_argument_named() -> None:
    x = relax.Var("x", relax.TensorType((1, 4, 2, 2), "int8"))
    w = relax.Var("w", relax.TensorType((8, 4, 3, 3), "int8"))
    s = relax.Var("s", relax.TensorType((8,), "float32"))
    infer = relax.BlockBuilder().normalize
    with pytest.raises(ValueError, match=r"opsdk.qconv2d: argument 'w': its 3x3 window does "
                                         r"not fit the input's 2x2 with padding 0; pad more"):
        infer(opsdk.relax.qconv2d(x, w, s))
    with pytest.raises(ValueError, match=r"stride=0.*pass stride >= 1"):
        infer(opsdk.relax.qconv2d(x, w, s, padding=1, stride=0))
    xs = relax.Var("x", relax.TensorType((1, 4, tirx.Var("h", "int64"), 8), "int8"))
    with pytest.raises(ValueError, match=r"'x' \(NCHW\) has a symbolic H dim"):
        infer(opsdk.relax.qconv2d(xs, w, s, padding=1))
    wrong = relax.Var("w", relax.TensorType((8, 5, 3, 3), "int8"))  # 5 input channels, not 4
    with pytest.raises(ValueError, match=r"'w'"):
        infer(opsdk.relax.qconv2d(x, wrong, s, padding=1))


@needs_vnni
def test_x86_vnni_one_pixel_one_channel_block_is_bit_exact() -> None:
    # A squeeze-excite conv (timm's MobileNetV3-Small, 16 -> 8 channels on the pooled 1x1
    # map): a 1-pixel x 16-channel tile has one vpdpbusd per k step, whose loop body was a
    # SeqStmt of length 1, which TVM refuses; the rule raised and the layer fell back.
    rng = np.random.default_rng(7)
    geoms = [(16, 1, 1, 8, 1, 1, 0), (8, 1, 1, 16, 1, 1, 0)]
    cases = [_case(rng, f"se{i}_NHWC_{xdt}", xdt, "NHWC", g, i)
             for i, (g, xdt) in enumerate(zip(geoms, ("int8", "uint8")))]
    ex, rules = compile_cases(cases, "x86")
    assert rules == Counter({"x86.qconv2d_vnni": len(cases)})
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(cases, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy())
    assert {k: v for k, v in result.items() if not k.startswith("sat_")} == {}


@needs_vnni
def test_x86_vnni_one_output_channel_one_column_is_bit_exact() -> None:
    # One output channel and a 1-pixel output row at a static batch (W=3, a 2x2 window at
    # stride 2): the copy of the tile to the output has no loop of its own under the parallel
    # tile loop, and the rule vectorized that parallel loop (ScheduleError; the layer fell
    # back to the generic rule).
    rng = np.random.default_rng(11)
    geoms = [(8, 8, 3, 1, 2, 2, 0), (8, 5, 1, 1, 1, 2, 0)]
    cases = [_case(rng, f"o1_{i}_{layout}_{xdt}", xdt, layout, g, i)
             for i, (g, xdt, layout) in enumerate(zip(geoms, ("uint8", "int8"),
                                                      ("NCHW", "NHWC")))]
    ex, rules = compile_cases(cases, "x86", batch=max(BATCHES))
    assert rules == Counter({"x86.qconv2d_vnni": len(cases)})
    vm = relax.VirtualMachine(ex, tvm.cpu())
    result = check_cases(cases, lambda name, ins: vm[name](*map(tvm.runtime.tensor, ins)).numpy(),
                         batches=(max(BATCHES),))
    assert {k: v for k, v in result.items() if not k.startswith("sat_")} == {}
