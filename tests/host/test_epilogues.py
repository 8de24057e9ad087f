"""Transcendental epilogues in every kernel family: SiLU (a DAG: the pre-activation read
twice), hardswish, sigmoid and tanh are folded into the matmul / conv / depthwise / Winograd
write-back, verified against float64 with the derived bound, and vectorized (no scalar
math-library call left in any kernel)."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax

from opsdk.kernels import tvm_conv2d, tvm_conv2d_winograd, tvm_matmul
from opsdk.model import LoadedModel, compile_model, report, within_tolerance
from opsdk.verify import Case, run_case

TRANSCENDENTAL = ("silu", "hardswish", "sigmoid", "tanh")

# One case per family and layout: (op, layout, shape, attrs), static dims, bias present.
FAMILIES = [
    (tvm_matmul, "kn", (5, 24), {"layout": "kn", "n": 33}),
    (tvm_conv2d, "NHWC", (1, 6, 7, 8), {"layout": "NHWC", "channels": 20, "kernel": 1,
                                        "stride": 1, "padding": 0}),
    (tvm_conv2d, "NHWC_dw", (1, 9, 8, 16), {"layout": "NHWC_dw", "channels": 16, "kernel": 3,
                                            "stride": 2, "padding": 1}),
    (tvm_conv2d_winograd, "NHWC", (1, 6, 6, 16), {"channels": 16, "padding": 1}),
]


def _case(d, layout, shape, attrs, activation, seed=3):
    return Case(d.name, "x86", "float32", layout, shape, {**attrs, "activation": activation},
                ("bias",), {}, seed, static=True)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    from opsdk.registry import register_kernels

    register_kernels()


@pytest.mark.parametrize("activation", TRANSCENDENTAL)
@pytest.mark.parametrize(("d", "layout", "shape", "attrs"), FAMILIES,
                         ids=lambda v: getattr(v, "name", None) or str(v))
def test_family_takes_the_epilogue_and_matches_float64(d, layout, shape, attrs, activation):
    res = run_case(_case(d, layout, shape, attrs, activation), op=d)
    assert res.ok, res.message or (res.got, res.expected)
    assert res.rule == f"x86.{d.kind}"  # the family's rule, not the catch-all


def test_a_wrong_polynomial_in_the_epilogue_is_caught(monkeypatch):
    # A planted bug in the vector tanh (one coefficient off by 1 %) must fail verification of
    # a matmul with a tanh epilogue; a new shape so that no earlier build is reused.
    from opsdk import _vecmath

    bad = list(_vecmath._TANH_POLY)
    bad[-1] *= 1.01
    monkeypatch.setattr(_vecmath, "_TANH_POLY", tuple(bad))
    case = _case(tvm_matmul, "kn", (7, 29), {"layout": "kn", "n": 24}, "tanh", seed=5)
    res = run_case(case, op=tvm_matmul)
    assert not res.ok


class _Net(torch.nn.Module):
    """Every family with one activation: 1x1 conv, depthwise 3x3, dense 3x3 (Winograd),
    global mean, Linear."""

    def __init__(self, act: type[torch.nn.Module]):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(8, 32, 1), act(),
            torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), act(),
            torch.nn.Conv2d(32, 16, 3, padding=1), act())
        self.fc = torch.nn.Linear(16, 24)
        self.act = act()

    def forward(self, x):
        return self.act(self.fc(self.body(x).mean((2, 3))))


@pytest.mark.parametrize(("act", "target"), [
    (torch.nn.SiLU, "x86"), (torch.nn.Hardswish, "x86"), (torch.nn.Sigmoid, "x86"),
    (torch.nn.Tanh, "x86"), (torch.nn.SiLU, "arm"), (torch.nn.Tanh, "arm")],
    ids=lambda v: getattr(v, "__name__", v))
def test_a_model_with_the_epilogue_has_every_family_on_its_rule_and_no_libm_call(act, target):
    # arm is cross-compiled: its structure (rules, NEON in every kernel, no `bl expf`) here,
    # its numbers under qemu in tests/arm.
    torch.manual_seed(0)
    net = _Net(act).eval()
    x = torch.randn(1, 8, 20, 20)
    m = LoadedModel.from_torch(act.__name__, net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, target, cache=False)
    rep = report(cm, target, profile=False)
    prefix = "x86" if target == "x86" else "neon"
    by_kind: dict[str, set] = {}
    for k in rep.kernels:
        by_kind.setdefault(k.kind, set()).add(k.rule)
        assert not k.math_calls, (k.name, k.math_calls)
        assert not k.problems, (k.name, k.problems)
    assert by_kind["matmul"] == {f"{prefix}.matmul"}
    assert by_kind["winograd"] == {f"{prefix}.winograd"}
    assert by_kind["conv2d"] == {f"{prefix}.conv2d"}  # the 1x1 and the depthwise
    if target == "arm":
        assert all(k.vector_ops.get("neon") for k in rep.kernels
                   if k.kind in ("matmul", "winograd", "conv2d")), rep.kernels
        return
    out = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    got = (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()
    want = net(x).detach().numpy()
    check = within_tolerance(got, want)
    assert check["ok"], check


@pytest.mark.parametrize(("exponent", "libm"), [(3.0, False), (2.0, False), (0.5, False),
                                                (2.5, True)])
def test_small_integer_powers_multiply_and_others_stay_with_libm(exponent, libm):
    # GPT-2's tanh-GELU has pow(x, 3): one powf per lane, 95 % of a tiny GPT-2's time.
    import numpy as np
    from tvm import s_tir, te, tirx

    from opsdk._asm import asm_of, kernel_math_calls
    from opsdk._vecmath import polynomial_math

    x = te.placeholder((64,), "float32", name="x")
    y = te.compute((64,), lambda i: tirx.pow(x[i], tirx.const(exponent, "float32")), name="y")
    f = polynomial_math(te.create_prim_func([x, y]).with_attr("global_symbol", "powk"))
    sch = s_tir.Schedule(f)
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(inner)
    ex = tvm.compile(sch.mod, target={"kind": "llvm", "mcpu": "x86-64-v3"})
    assert bool(kernel_math_calls(asm_of(ex), "powk")) == libm
    a = np.linspace(-3 if exponent == int(exponent) else 0, 3, 64).astype("float32")
    out = tvm.runtime.empty((64,), "float32")
    ex["powk"](tvm.runtime.tensor(a), out)
    want = np.power(a.astype(np.float64), exponent)
    # n - 1 multiplications (or one correctly rounded sqrt / powf): n float32 roundings
    bound = max(exponent, 1.0) * 2.0**-24 * np.abs(want) + 1e-45
    assert np.all(np.abs(out.numpy() - want) <= bound)


class _Chain(torch.nn.Module):
    """A linear layer whose epilogue nests three transcendentals, and the same chain alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(24, 32)

    def forward(self, x):
        y = torch.tanh(torch.sigmoid(torch.exp(self.fc(x))))
        return y, torch.exp(torch.exp(torch.exp(x - 1.0))) * x


@pytest.mark.timeout(300, method="thread")  # a hang guard: unstaged, this test ran past 10 minutes
def test_nested_transcendentals_are_staged_not_nested():
    # TVM's LLVM code generator simplifies every Let value with the earlier variables
    # expanded, so nested polynomial math grew with the product of the uses: three nested
    # exp in one kernel took 136 s of code generation. Each level's argument now goes
    # through the element the kernel stores (a register), one store per level.
    from tvm_ffi.structural import structural_walk

    from opsdk._vecmath import has_let

    torch.manual_seed(0)
    net = _Chain().eval()
    x = torch.rand(5, 24) * 1.5 - 1.0
    m = LoadedModel.from_torch("chain", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    assert {k["rule"] for k in cm.kernels} <= {"x86.matmul", "x86.elementwise"}
    levels = {}
    for gv, f in cm.scheduled.functions.items():
        if isinstance(f, tvm.tirx.PrimFunc):
            stores: list = []
            structural_walk(f, [(tvm.tirx.BufferStore, stores.append)])
            levels[gv.name_hint] = sum(has_let(st.value) for st in stores)
    # Three stores per copy of the statement (a vectorized part and its tail each have one).
    assert len(levels) == 2 and all(n >= 3 and n % 3 == 0 for n in levels.values()), levels
    outs = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    want = net.double()(x.double())
    for got, ref in zip(outs, want):
        check = within_tolerance(got.numpy(), ref.detach().numpy())
        assert check["ok"], check


class _SqueezeExcite(torch.nn.Module):
    """EfficientNet's squeeze-excite between two convs (so that the feature map stays
    channels-last): the excite conv (one pixel) has an epilogue that multiplies its sigmoid
    into the whole feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = torch.nn.Conv2d(16, 32, 1)
        self.squeeze = torch.nn.Conv2d(32, 8, 1)
        self.excite = torch.nn.Conv2d(8, 32, 1)
        self.project = torch.nn.Conv2d(32, 16, 1)

    def forward(self, x):
        f = torch.nn.functional.silu(self.expand(x))
        s = self.squeeze(f.mean((2, 3), keepdim=True))
        return self.project(f * torch.sigmoid(self.excite(torch.nn.functional.silu(s))))


@pytest.mark.timeout(300, method="thread")  # a hang guard: unrolled, 120x120 took 83 s
def test_a_writeback_spanning_the_feature_map_is_not_unrolled():
    # The write-back is unrolled inside a register tile (constant indices keep the tile in
    # registers); one that spans a whole feature map stays a loop.
    from tvm_ffi.structural import structural_walk

    torch.manual_seed(0)
    net = _SqueezeExcite().eval()
    x = torch.randn(1, 16, 40, 40)
    m = LoadedModel.from_torch("se", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    convs = {gv.name_hint: f for gv, f in cm.scheduled.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint}
    assert {k["rule"] for k in cm.kernels if k["name"] in convs} == {"x86.conv2d"}
    for name, f in convs.items():
        loops: list = []
        structural_walk(f, [(tvm.tirx.For, loops.append)])
        unrolled = [int(lp.extent) for lp in loops if lp.kind == tvm.tirx.ForKind.UNROLLED]
        assert max(unrolled, default=1) < 40, (name, unrolled)
    out = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    got = (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()
    check = within_tolerance(got, net.double()(x.double()).detach().numpy())
    assert check["ok"], check


@pytest.mark.parametrize("target", ["x86", "arm"])
def test_winograd_tables_fold_away_before_the_late_tir_passes(target):
    """Each transform's 16-entry table (one expression per tile element) is resolved once the
    rule unrolls the element loop: after opsdk's TIR pipeline no select or if_then_else has a
    constant condition. A select chain did not fold (vectorizing turned its condition into a
    broadcast), and every unrolled copy kept all 16 cases through the late passes: a
    ResNet-50-sized Winograd kernel with SiLU compiled in 0.7-0.8 s instead of 0.5."""
    from tvm import te, tirx
    from tvm_ffi.structural import structural_walk

    import opsdk
    from opsdk._kernelcache import _compile_kernel
    from opsdk.kernels.winograd import winograd_conv2d
    from opsdk.schedules import Kernel, choose, load_builtin_rules

    x, w = te.placeholder((1, 14, 14, 32), name="x"), te.placeholder((3, 3, 32, 32), name="w")
    y = winograd_conv2d(x, w, 1)
    silu = te.compute(y.shape, lambda *i: y(*i) * tirx.sigmoid(y(*i)), name="silu")
    func = te.create_prim_func([x, w, silu])
    tgt = opsdk.target(target)
    load_builtin_rules()
    ch = choose(Kernel("wino", "winograd"), func, tgt)
    assert ch.rule.endswith(".winograd"), ch.rule
    seen: list = []

    @tvm.ir.instrument.pass_instrument
    class _Last:
        def run_after_pass(self, mod, info):
            if info.name == "tirx.MakePackedAPI":
                seen.append(mod)

    with tvm.transform.PassContext(opt_level=3, instruments=[_Last()]):
        _compile_kernel(ch.func.with_attr("global_symbol", "k"), tgt)
    choice = tvm.ir.Op.get("prim.if_then_else")
    conditions = []

    def visit(node):
        if isinstance(node, tirx.Select):
            conditions.append(node.condition)
        elif node.op.same_as(choice):
            conditions.append(node.args[0])

    structural_walk(seen[-1], [(tirx.Select, visit), (tvm.ir.expr.Call, visit)])
    constant = [c for c in conditions
                if isinstance(c.value if isinstance(c, tirx.Broadcast) else c, tirx.IntImm)]
    assert conditions, "the padding guards are gone: the walk saw no kernel"
    assert not constant, f"{len(constant)} of {len(conditions)} choices left unresolved"
