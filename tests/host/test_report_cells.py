"""The model report links every kernel to the verify cell that covers it (issue #35): the
kernel family or opsdk op, layout, shape class, what of the class verify never draws, and the
case of the kernel's own shapes, which verifies (``explain --model --verify-kernels``)."""

from __future__ import annotations

import json

import pytest
import torch
from tvm import te, topi

import opsdk
from opsdk.kernels import KERNEL_OPS, tvm_matmul
from opsdk.model import LoadedModel, report
from opsdk.schedules import vector_lanes
from opsdk.verify import Case, KernelCell, corner_cases, kernel_cell

_FAMILY_KINDS = {"matmul": "tvm_matmul", "conv2d": "tvm_conv2d",
                 "winograd": "tvm_conv2d_winograd", "pool": "tvm_pool2d"}


class _Net(torch.nn.Module):
    """Each kernel family once, and a kernel of an opsdk op, a transpose, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1)  # direct (3 inputs)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.wino = torch.nn.Conv2d(16, 16, 3, padding=1)  # Winograd: 16 -> 16, 3x3, stride 1
        self.pw = torch.nn.Conv2d(16, 24, 1)
        self.norm = torch.nn.LayerNorm(24)  # an opsdk op
        self.fc = torch.nn.Linear(24, 10)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = torch.nn.functional.relu6(self.dw(y))
        y = torch.relu(self.wino(y) + y)  # bias, residual, then ReLU: the family's order
        y = torch.nn.functional.max_pool2d(self.pw(y), 3, 2, 1)
        return self.fc(self.norm(y.mean((2, 3))))


@pytest.fixture(scope="module")
def verified():
    torch.manual_seed(0)
    m = LoadedModel.from_torch("cells", _Net().eval(), (torch.randn(1, 3, 16, 16),),
                               baselines=False)
    return report(m, "x86", profile=False, asm=False, cache=False, verify_kernels=True)


def test_every_kernel_has_its_cell_or_says_it_has_none(verified):
    rep = verified
    for k in rep.kernels:
        v = k.verify
        assert v is not None and v["kernel"] == k.name, k.name
        if k.kind in _FAMILY_KINDS:  # a family kind: linked to that family's cell
            assert v["family"] == _FAMILY_KINDS[k.kind], (k.name, v)
            assert v["target"] == "x86" and v["dtype"] == "float32" and v["layout"], v
            assert v["case"] is not None and v["command"].startswith(
                f"opsdk verify --kernels {v['family']} --target x86 --case "), v
        elif k.kind.startswith("opsdk."):  # an opsdk op: its own cells
            assert v["family"] == k.kind.removeprefix("opsdk.")
            assert v["command"].startswith(f"opsdk verify {v['family']} --target x86"), v
        elif v["family"] is None:  # said plainly
            assert v["verified_by"] == "none" and v["case"] is None, v
    kinds = {k.kind for k in rep.kernels}
    assert {"conv2d", "winograd", "pool", "matmul", "opsdk.layer_norm"} <= kinds, kinds
    assert any(k.verify["verified_by"] == "none" for k in rep.kernels)  # the input transpose


def test_the_cells_state_the_models_shapes_and_attributes(verified):
    convs = {k.verify["layout"]: k.verify for k in verified.kernels if k.kind == "conv2d"}
    stem, dw = convs["NHWC"], convs["NHWC_dw"]
    # what _Net declares, read back from the fused kernels
    assert stem["case"]["shape"] == [1, 16, 16, 3] and stem["case"]["packed"]
    assert {k: stem["case"]["attrs"][k] for k in ("kernel", "stride", "padding", "channels",
                                                  "activation")} == {
        "kernel": 3, "stride": 2, "padding": 1, "channels": 16, "activation": "relu"}
    assert dw["case"]["attrs"]["activation"] == "relu6" and dw["case"]["present"] == ["bias"]
    wino = next(k.verify for k in verified.kernels if k.kind == "winograd")
    assert wino["case"]["present"] == ["bias", "residual"] and wino["exact"], wino
    fc = next(k.verify for k in verified.kernels if k.kind == "matmul")
    assert fc["layout"] == "kn" and fc["case"]["attrs"]["n"] == 10 and fc["covered"], fc
    for v in (stem, dw, wino, fc):
        assert v["exact"] and v["covered"] and not v["gaps"], v


def test_each_kernels_own_case_passes_on_the_models_rule(verified):
    rep = verified
    with_case = [k for k in rep.kernels if k.verify["case"] is not None]
    assert rep.verified == {"cases": len({json.dumps(k.verify["case"], sort_keys=True)
                                          for k in with_case}), "failed": 0}
    for k in with_case:
        assert k.verify["status"] == "pass", (k.name, k.verify["message"])
        assert k.verify["case_rule"] == k.rule, k.name  # the case ran the model's rule
    # the command reruns exactly that case
    one = with_case[0].verify
    assert Case.from_json(one["command"].split("--case ", 1)[1].strip("'")).to_dict() == \
        one["case"]
    # the text and the JSON carry the link
    data = json.loads(rep.to_json())
    assert [k["verify"]["cell"] for k in data["kernels"]] == \
        [k.verify["cell"] for k in rep.kernels]
    text = rep.format()
    assert "verify cell" in text and f"{rep.verified['cases']} distinct run, 0 failed" in text
    for k in with_case:
        line = next(ln for ln in text.splitlines() if ln.startswith(k.name + " "))
        assert k.verify["cell"] in line and "pass" in line, line


def _matmul_func(n: int, k: int = 32):
    x, w = te.placeholder((8, k), name="x"), te.placeholder((k, n), name="w")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((8, n), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="matmul")
    return te.create_prim_func([x, w, y])


def test_a_class_verify_never_draws_is_named():
    lanes = vector_lanes(opsdk.target("x86"), 32)
    # what verify draws for N: the family's domain and the cell's corner cases
    corners = corner_cases(tvm_matmul, "x86", "float32", "kn", lanes)
    drawn = {v % lanes for v in [*tvm_matmul.attr_domain["n"],
                                 *(c.attrs["n"] for c in corners)]}
    missing = [v for v in range(1, lanes) if v not in drawn]
    if missing:  # an N verify never draws is named
        c = kernel_cell("dense", _matmul_func(missing[0]), "x86", lanes=lanes)
        assert c.family == "tvm_matmul" and c.covered is False and c.exact, c
        assert any(g.startswith(f"n {missing[0]}:") for g in c.gaps), c.gaps
    # a residue verify draws: covered
    ok = kernel_cell("dense", _matmul_func(max(tvm_matmul.attr_domain["n"])), "x86",
                     lanes=lanes)
    assert ok.covered and not ok.gaps
    # a window no conv family expresses (neither square nor one row): named, and its case
    # is the nearest
    x, w = te.placeholder((1, 8, 8, 16), name="x"), te.placeholder((2, 3, 16, 16), name="w")
    conv = te.create_prim_func([x, w, topi.nn.conv(x, w, 1, (0, 1, 0, 1), 1, 1, "NHWC",
                                                   "HWIO")])
    c = kernel_cell("conv", conv, "x86", lanes=lanes)
    assert c.family == "tvm_conv2d" and not c.exact and any("2x3" in g for g in c.gaps), c
    # a conv1d as ChannelsLast runs it: a 1x3 window over a one-row image, stride (1, 2)
    # and dilation (1, 2), is the family's kernel_h 1 exactly
    x, w = te.placeholder((1, 1, 40, 16), name="x"), te.placeholder((1, 3, 16, 16), name="w")
    conv = te.create_prim_func([x, w, topi.nn.conv(x, w, (1, 2), (0, 1, 0, 1), (1, 2), 1,
                                                   "NHWC", "HWIO")])
    c = kernel_cell("conv", conv, "x86", lanes=lanes)
    assert c.family == "tvm_conv2d" and c.exact and not c.gaps, c
    assert c.case["attrs"]["kernel_h"] == 1 and c.case["attrs"]["kernel"] == 3, c.case
    assert c.case["attrs"]["stride"] == 2 and c.case["attrs"]["dilation"] == 2, c.case


def test_a_kernel_of_no_family_says_so_and_cells_need_the_module():
    x = te.placeholder((4, 8), name="x")
    c = kernel_cell("t", te.create_prim_func([x, te.compute((8, 4), lambda i, j: x[j, i])]),
                    "arm", lanes=4)
    assert c.family is None and c.verified_by == "none" and c.covered is None
    assert c.as_dict()["cell"] == "-"
    assert {d.name for d in KERNEL_OPS} >= set(_FAMILY_KINDS.values())
    assert isinstance(c, KernelCell)
    cm = opsdk.model.compile_model(_tiny_module(), "x86", cache=False)
    with pytest.raises(ValueError, match="source="):
        report(cm, "x86", profile=False, asm=False, cells=True)


def _tiny_module():
    from tvm import relax

    v = relax.Var("x", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [v]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(v))
        bb.emit_func_output(out)
    return bb.get()


def test_verify_kernels_needs_a_model():
    from opsdk.cli import main

    assert main(["explain", "softmax", "--verify-kernels"]) == 2  # a usage error


def test_the_zoo_check_counts_the_kernel_cases(verified):
    from opsdk._explain import ZooCheck, _kernel_cases, format_zoo_check

    kc = _kernel_cases(verified)
    cells = [k.verify for k in verified.kernels]
    assert kc["linked"] + kc["no_family"] == len(cells) and kc["failed"] == []
    assert kc["cases"] == verified.verified["cases"]
    row = ZooCheck("cells", "x86", compiled=True, kernels=len(cells), kernel_cases=kc)
    assert not row.failed()
    assert f"{kc['cases']} distinct cases run, 0 failed" in format_zoo_check([row])
    bad = ZooCheck("cells", "x86", compiled=True, kernel_cases={
        **kc, "failed": [f"{cells[0]['kernel']} mismatch: {cells[0]['command']}"]})
    assert bad.failed() and "kernel case failed" in format_zoo_check([bad])


def _stated(c, name, value):
    """``value`` of attribute ``name`` is in the cell's case, or named among its gaps when
    this family version has no such attribute."""
    d = next(d for d in KERNEL_OPS if d.name == c.family)
    if name in {p.name for p in d.attr_params}:
        return c.case is not None and c.case["attrs"][name] == value
    return any(g.startswith(f"{name} {value}:") for g in c.gaps)


@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize("ceil", [True, False])
def test_pool_attributes_are_read_off_the_kernel(include, ceil):
    x = te.placeholder((1, 13, 13, 8), name="x")
    y = topi.nn.pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), "avg", ceil, "NHWC",
                       count_include_pad=include)
    c = kernel_cell("pool", te.create_prim_func([x, y]), "x86", lanes=16)
    assert c.family == "tvm_pool2d" and c.layout == "NHWC_avg", c
    assert c.shape_class["kernel"] == 3 and c.shape_class["stride"] == 2
    assert c.shape_class["padding"] == 1 and c.shape_class["ceil_mode"] == ceil
    assert c.shape_class["count_include_pad"] == include
    assert _stated(c, "ceil_mode", ceil) or not ceil
    assert _stated(c, "count_include_pad", include) or not include


@pytest.mark.parametrize("dilation,groups", [(2, 1), (1, 4), (1, 8)])
def test_conv_dilation_and_groups_are_read_off_the_kernel(dilation, groups):
    x = te.placeholder((1, 9, 9, 8), name="x")
    w = te.placeholder((3, 3, 8 // groups, 16), name="w")  # 8 groups of 8: multiplier 2
    y = topi.nn.conv(x, w, 1, 1, dilation, groups, "NHWC", "HWIO")
    c = kernel_cell("conv", te.create_prim_func([x, w, y]), "x86", lanes=16)
    assert c.family == "tvm_conv2d" and c.shape_class["dilation"] == dilation, c
    if groups == 8:  # depthwise with two outputs per channel
        assert c.layout == "NHWC_dw" and _stated(c, "multiplier", 2), c
    else:
        assert c.layout == "NHWC" and c.shape_class["channels"] == 16
        assert _stated(c, "groups", groups) or groups == 1
    assert _stated(c, "dilation", dilation) or dilation == 1


def test_the_cells_are_kept_with_the_compile_cache_entry(tmp_path, monkeypatch):
    import numpy as np
    from tvm import relax

    x = relax.Var("x", relax.TensorType((8, 32), "float32"))
    w = relax.const(np.ones((32, 24), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    mod = bb.get()
    first = report(mod, "x86", profile=False, asm=False, cells=True, cache=tmp_path)

    def refuse(*a, **k):
        raise AssertionError("the cells were computed again")

    monkeypatch.setattr("opsdk.model.kernel_cells", refuse)
    second = report(mod, "x86", profile=False, asm=False, cells=True, cache=tmp_path)
    assert (first.cached, second.cached) == (False, True)
    assert [k.verify for k in second.kernels] == [k.verify for k in first.kernels]
    assert [k.verify["cell"] for k in first.kernels] == ["tvm_matmul/kn"]


def _family_kernel(d, case):
    """The PrimFunc of family ``d`` for ``case`` (its TE, unscheduled: what FuseTIR leaves of
    the same computation in a model)."""
    optional = {p.name for p in d.tensor_params if p.optional}
    shapes = {k: v for k, v in d.example_shapes(case.shape, case.attrs).items()
              if k not in optional or k in case.present}
    out = d.trace(shapes, d.dtypes_for(case.dtype, list(shapes)), case.attrs)
    found = {}

    def collect(t):
        if isinstance(t.op, te.PlaceholderOp):
            found[t.op.name] = t
        for i in t.op.input_tensors:
            collect(i)

    collect(out)
    return te.create_prim_func([*(found[p.name] for p in d.tensor_params if p.name in found),
                                out])


def test_a_family_kernels_cell_builds_that_kernel_again():
    # Every fifth corner of every cell: the cell read off the family's own kernel gives a
    # case whose kernel is the same TIR (the reader states what verify would build).
    import numpy as np
    import tvm

    lanes, n = 16, 0
    for d in KERNEL_OPS:
        for layout in d.layouts:
            for case in corner_cases(d, "x86", "float32", layout, lanes)[::5]:
                if d.name == "tvm_mean" and case.shape[1:] in ((1, 1, 1),):
                    continue  # a mean over 1x1 reduces nothing: no axis to read back
                f = _family_kernel(d, case)
                c = kernel_cell("k", f, "x86", lanes=lanes)
                assert c.family == d.name and c.case is not None, (case, c)
                again = Case.from_dict(c.case)
                try:
                    tvm.ir.assert_structural_equal(f, _family_kernel(d, again))
                except ValueError:
                    # an average whose windows never reach the padding: either
                    # count_include_pad is the same average (the reader says False)
                    assert {k for k in case.attrs if case.attrs[k] != again.attrs.get(k)} \
                        == {"count_include_pad"}, (case, again)
                    x = np.random.default_rng(0).standard_normal(case.shape)
                    np.testing.assert_array_equal(d.run_reference({"x": x}, case.attrs),
                                                  d.run_reference({"x": x}, again.attrs))
                n += 1
    assert n > 15


def test_a_target_without_a_runner_fails_its_cases_with_the_reason(monkeypatch):
    from opsdk.verify import verify_cells

    def no_runner(name, **kw):
        raise RuntimeError(f"no emulator for {name}")

    monkeypatch.setattr("opsdk.verify._engine._runner_for", no_runner)
    c = kernel_cell("dense", _matmul_func(24), "arm", lanes=4)
    assert verify_cells([c]) == {"cases": 1, "failed": 1}
    assert c.status == "error" and "no emulator for arm" in c.message
