"""Multi-output ops end to end, on the op ``opsdk new-op add_layer_norm --kind residual_norm``
writes in a fresh folder (with its own rules, and without, so that the built-in row rules'
side-output path runs): definition checks, Relax type, verify of every output (and a broken
output caught), the fusion rule on a torch.export model (op in place, later uses of ``x + r``
read its first output) and agreement with torch."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, te

import opsdk
from opsdk import OpDefinitionError
from opsdk.verify import verify_op


@pytest.fixture(scope="module", params=["builtin-rules", "own-rules"])
def op(request, tmp_path_factory):
    from opsdk import schedules
    from opsdk._scaffold import new_op

    pkg = tmp_path_factory.mktemp("userpkg")
    own = request.param == "own-rules"
    new_op("add_layer_norm", kind="residual_norm", directory=pkg,
           targets=("x86", "arm") if own else ())
    sys.path.insert(0, str(pkg))
    try:
        opsdk.load_plugins(["add_layer_norm"])
        d = opsdk.get_op("add_layer_norm")
        rules = {r.name for r in schedules.rules_for(d)}
        assert ("add_layer_norm.x86" in rules) == own
        yield d
    finally:
        sys.path.remove(str(pkg))
        opsdk.unregister("add_layer_norm")
        for m in [m for m in sys.modules if m.startswith("add_layer_norm")]:
            sys.modules.pop(m)
        schedules._RULES[:] = [r for r in schedules._RULES
                               if not r.name.startswith("add_layer_norm.")]


def test_relax_call_is_a_tuple_of_both_outputs(op):
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float16"))
    g = relax.Var("g", relax.TensorType((16,), "float16"))
    ty = relax.BlockBuilder().normalize(op(x, x, g, g)).ty
    assert isinstance(ty, relax.TupleType) and len(ty.fields) == 2
    assert [str(f.dtype) for f in ty.fields] == ["float16", "float16"]
    assert op.n_outputs == 2 and op.declared_dtypes({"x": "float16"}, {}) == ["float16"] * 2


def test_verify_checks_every_output_and_catches_a_broken_one(op):
    rep = verify_op(op, target="x86", dtypes=["float32", "float16"], max_examples=6, seed=1,
                    database=None)
    assert rep.ok, [f.format(tir=False) for f in rep.failures]
    assert all(c.model.startswith("author's (per output") for c in rep.cells)
    # Output 0 forgets the residual: only the first output is wrong, and verify says so.
    broken = opsdk.op(reference=op.reference, ranks=(2, 4), input_shapes=op.input_shapes,
                      domain=op.domain, kind="norm", examples=[(2, 3, 8)],
                      name="add_layer_norm_broken")(_drop_residual(op))
    opsdk.register(broken)
    try:
        bad = verify_op(broken, target="x86", dtypes=["float32"], max_examples=4, seed=1,
                        database=None)
    finally:
        opsdk.unregister(broken)
    assert not bad.ok
    assert "(output 0 of 2)" in bad.failures[0].format(tir=False)


def _drop_residual(op):
    def add_layer_norm_broken(x: opsdk.Tensor, r: opsdk.Tensor, gamma: opsdk.Tensor,
                              beta: opsdk.Tensor, *, epsilon: float = 1e-5):
        _, y = op.compute(x, r, gamma, beta, epsilon=epsilon)
        return te.compute(x.shape, lambda *i: x(*i), name="residual"), y
    return add_layer_norm_broken


class _PreLN(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x, r):
        h = x + r
        return h + self.fc(self.ln(h))


def test_torch_model_compiles_with_the_fused_op_and_matches_torch(op):
    torch.manual_seed(0)
    model = _PreLN(32).eval()
    with torch.no_grad():
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.bias.uniform_(-0.5, 0.5)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    mod = opsdk.frontend.from_torch(torch.export.export(model, (x, r)))
    fused = opsdk.transform.FuseIntoOps()(mod)
    counts = opsdk.transform.op_counts(fused)
    assert counts.get("opsdk.add_layer_norm") == 1 and "opsdk.layer_norm" not in counts
    # x + r is computed once: the later residual add reads the op's first output.
    assert counts.get("relax.add", 0) == opsdk.transform.op_counts(mod)["relax.add"] - 1
    sites = opsdk.transform.rewrite_sites(fused)
    assert [s.op for s in sites if s.rule == "fuse.add_layer_norm"] == ["opsdk.add_layer_norm"]
    ex = opsdk.compile(fused, "x86")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()), tvm.runtime.tensor(r.numpy()))
    got = got[0] if isinstance(got, (tuple, list)) or hasattr(got, "__getitem__") else got
    with torch.no_grad():
        want = model(x, r).numpy()
    np.testing.assert_allclose(np.asarray(got.numpy()), want, rtol=1e-5, atol=1e-5)


@torch.library.custom_op("opsdk_test::residual_ln", mutates_args=())
def _residual_ln(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + r
    return h, torch.nn.functional.layer_norm(h, h.shape[-1:], w, b)


@_residual_ln.register_fake
def _(x, r, w, b):
    return torch.empty_like(x), torch.empty_like(x)


class _UsesCustomOp(torch.nn.Module):
    """A model that calls a torch custom op returning two tensors (as a user's own kernel
    library would), reading both through ``getitem``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.b = torch.nn.Parameter(torch.rand(d) - 0.5)
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x, r):
        h, y = torch.ops.opsdk_test.residual_ln(x, r, self.w, self.b)
        return h + self.fc(y)


def test_torch_mapping_onto_a_two_output_op(op):
    """``OpDef.torch`` onto a multi-output op: the tuple-returning torch op becomes one call
    of the opsdk op, and each ``getitem`` reads the matching output."""
    torch.manual_seed(0)
    model = _UsesCustomOp(32).eval()
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    op.torch("residual_ln.default")
    try:
        mod = opsdk.frontend.from_torch(torch.export.export(model, (x, r)))
    finally:
        op.torch_maps.pop("residual_ln.default")
    assert opsdk.frontend.mapping_counts(mod) == {"residual_ln.default": 1}
    assert opsdk.transform.op_counts(mod, "opsdk.") == {"opsdk.add_layer_norm": 1}
    vm = relax.VirtualMachine(opsdk.compile(mod, "x86"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()), tvm.runtime.tensor(r.numpy()))[0]
    with torch.no_grad():
        want = model(x, r).numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_definition_errors_name_the_op_and_the_fix():
    def ref_one(x):
        return x

    with pytest.raises(OpDefinitionError, match=r"one array per output|returns 1 arrays"):
        @opsdk.op(reference=ref_one, name="two_out_bad_ref")
        def two_out_bad_ref(x: opsdk.Tensor):
            return (te.compute(x.shape, lambda *i: x(*i), name="a"),
                    te.compute(x.shape, lambda *i: x(*i), name="b"))

    with pytest.raises(OpDefinitionError, match=r"output_dtype gives 2 rules but the "
                                                r"compute has 1 outputs"):
        @opsdk.op(reference=ref_one, name="one_out_two_rules", output_dtype=(None, "float32"))
        def one_out_two_rules(x: opsdk.Tensor):
            return te.compute(x.shape, lambda *i: x(*i), name="a")

    with pytest.raises(OpDefinitionError, match=r"tuple of two or more te\.Tensor"):
        @opsdk.op(reference=ref_one, name="list_of_one")
        def list_of_one(x: opsdk.Tensor):
            return [te.compute(x.shape, lambda *i: x(*i), name="a"), 3]
