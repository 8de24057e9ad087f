"""Copy-only views (reshape / permute / unbind / transpose) read through inside the opsdk op
kernels they feed (opsdk.transform.FoldViewsIntoOps), on x86 and arm: fewer kernels, the
same rule, the same numbers; a view that would make the op's inner reads strided, or that
computes, stays a kernel of its own."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from opsdk._pipeline import schedule_passes
from opsdk.model import compile_model, within_tolerance

torch = pytest.importorskip("torch")
F = torch.nn.functional


class _TimmAttention(torch.nn.Module):
    """timm's ViT attention: one qkv projection, reshape + permute + unbind."""

    def __init__(self, dim: int = 64, heads: int = 4, also_return_qkv: bool = False) -> None:
        super().__init__()
        self.heads, self.also = heads, also_return_qkv
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return (y, q) if self.also else y


class _HFAttention(torch.nn.Module):
    """transformers' BERT attention: one projection each, view + transpose(1, 2)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        b, n, c = x.shape

        def split(t):
            return t.view(b, n, self.heads, c // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return y.transpose(1, 2).reshape(b, n, c)


class _Strided(torch.nn.Module):
    """q arrives head-dim-major: read through, the attention's inner loads would be strided."""

    def forward(self, qt, k, v):
        return F.scaled_dot_product_attention(qt.transpose(-1, -2), k, v)


class _Computed(torch.nn.Module):
    """q is computed (x * 2 + 1) on its way: not a copy."""

    def forward(self, x, k, v):
        return F.scaled_dot_product_attention(x * 2.0 + 1.0, k, v)


def _import(model, args):
    from opsdk.frontend import from_torch
    from opsdk.transform import FuseIntoOps

    return FuseIntoOps()(from_torch(torch.export.export(model.eval(), tuple(args))))


def _attention_sources(mod: tvm.IRModule) -> list[list[str]]:
    """For each attention call of the scheduled ``main``: what made each of its tensor
    arguments (the callee's kind / op, ``param`` for a function parameter)."""
    main = mod["main"]
    var2val = relax.analysis.get_var2val(main)
    out = []
    for val in var2val.values():
        if not (isinstance(val, relax.Call) and getattr(val.op, "name", "") == "relax.call_tir"):
            continue
        callee = mod[val.args[0]]
        if (callee.attrs or {}).get("opsdk.op") != "attention":
            continue
        srcs = []
        for a in val.args[1].fields:
            made = var2val.get(a)
            while isinstance(made, relax.Var):  # an alias
                made = var2val.get(made)
            if made is None:
                srcs.append("param")
                continue
            f = mod[made.args[0]]
            srcs.append(str((f.attrs or {}).get("opsdk.kind", (f.attrs or {}).get("opsdk.op"))))
        rule = str(callee.attrs["opsdk.rule"])
        out.append([rule, *srcs])
    return out


def _scheduled(mod: tvm.IRModule, target: str) -> tvm.IRModule:
    from opsdk.targets import target as resolve

    tgt = resolve(target)
    with tgt:
        return tvm.transform.Sequential(schedule_passes(tgt))(mod)


def _run(model, args, mod):
    cm = compile_model(mod, "x86", cache=False)
    got = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](
        *[tvm.runtime.tensor(a.numpy()) for a in args])
    got = [got] if isinstance(got, tvm.runtime.Tensor) else list(got)
    with torch.no_grad():
        want = model.double()(*[a.double() for a in args])
    want = list(want) if isinstance(want, tuple) else [want]
    for g, w in zip(got, want, strict=True):
        res = within_tolerance(g.numpy(), w.numpy())
        assert res["ok"], res
    return cm


@pytest.mark.parametrize("target", ["x86", "arm"])
@pytest.mark.parametrize("model_cls", [_TimmAttention, _HFAttention], ids=["timm", "hf"])
def test_views_into_attention_fold_into_its_kernel(model_cls, target):
    torch.manual_seed(0)
    model, args = model_cls(), [torch.randn(2, 40, 64)]
    mod = _import(model, args)
    sched = _scheduled(mod, target)
    rule = "x86.attention" if target == "x86" else "neon.attention"
    # q, k and v are read straight from the projection(s): no copy kernel in between
    assert _attention_sources(sched) == [[rule, "matmul", "matmul", "matmul"]]
    if target == "x86":
        cm = _run(model, args, mod)
        names = [k["name"] for k in cm.kernels]
        # the views after it too: the attention writes (B, n, H * D) itself
        assert not any(w in n for n in names for w in ("slice", "squeeze", "transpose")), names


def test_a_view_with_another_reader_stays_for_it():
    torch.manual_seed(0)
    model, args = _TimmAttention(also_return_qkv=True), [torch.randn(1, 40, 64)]
    mod = _import(model, args)
    assert _attention_sources(_scheduled(mod, "x86")) == [
        ["x86.attention", "matmul", "matmul", "matmul"]]
    cm = _run(model, args, mod)  # q is still written for the model's second output
    assert any("squeeze" in k["name"] for k in cm.kernels), [k["name"] for k in cm.kernels]


class _BothOutputs(torch.nn.Module):
    """The attention's output is read twice (returned as is, and through a view)."""

    def forward(self, q, k, v):
        y = F.scaled_dot_product_attention(q, k, v)
        return y, y.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def test_an_output_view_stays_where_the_output_has_another_reader():
    torch.manual_seed(0)
    args = [torch.randn(1, 2, 40, 16) for _ in range(3)]
    cm = _run(_BothOutputs(), args, _import(_BothOutputs(), args))
    assert any("transpose" in k["name"] for k in cm.kernels), [k["name"] for k in cm.kernels]


@pytest.mark.parametrize(("model", "shapes"), [
    (_Strided(), [(1, 2, 16, 40), (1, 2, 40, 16), (1, 2, 40, 16)]),
    (_Computed(), [(1, 2, 40, 16)] * 3),
], ids=["strided_inner_axis", "computed"])
def test_views_that_stride_or_compute_stay_kernels(model, shapes):
    torch.manual_seed(0)
    args = [torch.randn(s) for s in shapes]
    mod = _import(model, args)
    (row,) = _attention_sources(_scheduled(mod, "x86"))
    assert row[0] == "x86.attention" and row[1] != "param", row  # q: through its own kernel
    assert row[2:] == ["param", "param"], row
    _run(model, args, mod)


def test_the_folded_kernel_reads_the_source_at_the_views_index():
    # one layer of two: the folded function is shared (structurally equal consumers fold
    # once), and its q / k / v parameters have the projection's shape
    torch.manual_seed(0)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _TimmAttention(), _TimmAttention()

        def forward(self, x):
            return self.b(self.a(x))

    model, args = Two(), [torch.randn(1, 40, 64)]
    sched = _scheduled(_import(model, args), "x86")
    funcs = {gv.name_hint: f for gv, f in sched.functions.items()
             if isinstance(f, tirx.PrimFunc) and (f.attrs or {}).get("opsdk.op") == "attention"}
    assert len(funcs) == 1, sorted(funcs)
    (f,) = funcs.values()
    assert [tuple(int(d) for d in p.shape) for p in f.params[:3]] == [(1, 40, 192)] * 3
    assert np.isfinite(_run(model, args, _import(model, args)).seconds)


def test_a_rule_that_rebuilds_its_kernel_keeps_the_copy(monkeypatch):
    # qdense's rules rebuild the kernel from the op's attributes: a view folded into the
    # function they were given would be dropped (the output reshape of a quantized MLP
    # failed to compile). The folded and unfolded builds must agree bit for bit.
    import opsdk
    import opsdk._pipeline as pipeline
    from opsdk.quant import quantize_model

    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((2, 8, 64), "float32"))
    w1 = relax.const(rng.standard_normal((64, 96)).astype("float32"))
    w2 = relax.const(rng.standard_normal((96, 32)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w1)))
            y = bb.emit_output(relax.op.matmul(h, w2))
        bb.emit_func_output(y)
    data = [rng.standard_normal((2, 8, 64)).astype("float32") for _ in range(4)]
    qm = quantize_model(bb.get(), data)
    arg = tvm.runtime.tensor(data[0])
    got = relax.VirtualMachine(opsdk.compile(qm.mod, "x86"), tvm.cpu())["main"](arg).numpy()
    monkeypatch.setattr(pipeline, "FoldViewsIntoOps", lambda tgt: tvm.transform.Sequential([]))
    want = relax.VirtualMachine(opsdk.compile(qm.mod, "x86"), tvm.cpu())["main"](arg).numpy()
    assert got.shape == (2, 8, 32) and np.array_equal(got, want)
