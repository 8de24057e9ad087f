"""Attention's batched matmuls on the matmul rule: ``Q @ K^T`` (K read in place or along its
last axis) with a scale and mask epilogue, and ``P @ V``, at ViT's 197 tokens, a size no tile
divides. The kernel is on ``x86.matmul``, its k loop carries no predicate and is vectorized,
the numbers match float64 within the derived bound, and a bug planted in the remainder
handling (the padded rows, the epilogue pass over the real columns) is caught by verify.

The fused op (``opsdk.attention``): torch's ``F.scaled_dot_product_attention`` imports as one
call where it fits (masks, causal, scale) and as the decomposition where not; the many-query
schedule (register-tiled blocks of query rows) is chosen for 16 or more static queries and
for a symbolic query count, and its kernels verify against the float64 reference, with
grouped key/value heads (fewer than the queries') on both schedules too."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, tirx
from tvm_ffi.structural import structural_mutate, structural_walk

import opsdk
from opsdk.kernels import tvm_matmul
from opsdk.schedules import apply_schedule, kernel_for
from opsdk.schedules.cpu import x86
from opsdk.verify import Case, run_case

U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    from opsdk.registry import register_kernels

    register_kernels()


def _scores(b: int, m: int, n: int, k: int, transposed: bool, scale: float):
    """``Q @ K^T * scale + mask`` as FuseOps hands it over (the epilogue after the block)."""
    q = te.placeholder((b, m, k), name="q")
    kt = te.placeholder((b, n, k) if transposed else (b, k, n), name="kt")
    mask = te.placeholder((m, n), name="mask")
    r = te.reduce_axis((0, k), name="r")

    def dot(s, i, j):
        kv = kt[s, j, r] if transposed else kt[s, r, j]
        return te.sum(q[s, i, r] * kv, axis=r)

    mm = te.compute((b, m, n), dot, name="matmul")
    out = te.compute((b, m, n), lambda s, i, j: mm[s, i, j] * scale + mask[i, j], name="scores")
    return te.create_prim_func([q, kt, mask, out])


def _update_block(func: tirx.PrimFunc):
    """(realize, enclosing loops) of the reduction update block."""
    found = []

    def visit(stmt, loops):
        if isinstance(stmt, tirx.For):
            visit(stmt.body, [*loops, stmt])
        elif isinstance(stmt, s_tir.SBlockRealize):
            if stmt.block.name_hint.endswith("_update"):
                found.append((stmt, loops))
            visit(stmt.block.body, loops)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt:
                visit(s, loops)
        elif hasattr(stmt, "body"):
            visit(stmt.body, loops)

    visit(func.body, [])
    assert len(found) == 1, [r.block.name_hint for r, _ in found]
    return found[0]


@pytest.mark.parametrize("transposed", [False, True], ids=["k_n", "n_k"])
def test_scores_at_197_tokens_are_on_the_matmul_rule_unpredicated_and_right(transposed):
    b, m, n, k, scale = 3, 197, 197, 64, 0.125
    f = _scores(b, m, n, k, transposed, scale)
    tgt = opsdk.target("x86")
    with tgt:
        out = apply_schedule(kernel_for("scores", f), f, tgt)
    assert str(out.attrs["opsdk.rule"]) == "x86.matmul"
    realize, loops = _update_block(out)
    # Whole tiles of the padded operands: no row or column predicate inside the k loop.
    assert isinstance(realize.predicate, tirx.IntImm) and int(realize.predicate) == 1
    assert loops[-1].kind == tirx.ForKind.VECTORIZED and int(loops[-1].extent) >= 8
    assert any(lp.kind == tirx.ForKind.PARALLEL for lp in loops)

    rng = np.random.default_rng(0)
    qv = rng.uniform(-1, 1, (b, m, k)).astype("float32")
    kv = rng.uniform(-1, 1, (b, n, k) if transposed else (b, k, n)).astype("float32")
    mv = rng.uniform(-2, 2, (m, n)).astype("float32")
    lib = tvm.compile(tvm.IRModule({"main": out}), target=tgt)
    dev = tvm.cpu()
    got = tvm.runtime.tensor(np.zeros((b, m, n), "float32"), dev)
    lib(*[tvm.runtime.tensor(a, dev) for a in (qv, kv, mv)], got)
    kn = np.swapaxes(kv, -1, -2) if transposed else kv
    q64, k64 = qv.astype(np.float64), kn.astype(np.float64)
    ref = q64 @ k64 * scale + mv
    # A float32 dot product of length k (any summation order), a multiply and an add.
    g = (k + 2) * U / (1 - (k + 2) * U)
    bound = g * (np.abs(q64) @ np.abs(k64) * scale + np.abs(mv))
    err = np.abs(got.numpy() - ref)
    assert np.all(err <= bound), float((err / bound).max())


def _case(layout: str, shape: tuple[int, ...], n: int, seed: int = 3) -> Case:
    return Case("tvm_matmul", "x86", "float32", layout, shape,
                {"layout": layout, "n": n, "activation": "none"}, ("residual",), {}, seed,
                static=True)


@pytest.mark.parametrize(("layout", "shape", "n"), [
    ("batched", (3, 197, 64), 197),     # Q @ K^T, K^T materialized (N contiguous)
    ("batched_nk", (3, 197, 64), 197),  # Q @ K^T, K read along its last axis
    ("batched", (3, 197, 197), 64),     # P @ V: 197 rows, 197-long reduction
])
def test_attention_matmuls_verify_on_the_matmul_rule(layout, shape, n):
    res = run_case(_case(layout, shape, n), op=tvm_matmul)
    assert res.ok, res.format(tir=False)
    assert res.rule == "x86.matmul"


def _shorten_first(func: tirx.PrimFunc, pick) -> tuple[tirx.PrimFunc, bool]:
    """``func`` with the first loop ``pick`` selects one iteration shorter."""
    done: list = []

    def cut(node: tirx.For, mut) -> tirx.For:
        if done or not pick(node):
            return mut.default_mutate(node)
        done.append(node)
        return tirx.For(node.loop_var, node.min, node.extent - 1, node.kind,
                        mut.mutate(node.body), node.thread_binding, node.annotations)

    return structural_mutate(func, [(tirx.For, cut)]), bool(done)


def _blocks_under(loop: tirx.For) -> list[str]:
    names: list[str] = []
    structural_walk(loop, [(s_tir.SBlock, lambda b: names.append(b.name_hint))])
    return names


def _clamp_one_short(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, bool]:
    """``func`` with the clamp of A's padded rows (``min(i, M - 1)``) one row short, so
    the last real row reads the one before it."""
    done: list = []

    def short(node: tirx.Min, mut) -> tirx.PrimExpr:
        if isinstance(node.b, tirx.IntImm):
            done.append(node)
            return tirx.Min(mut.mutate(node.a), tirx.IntImm(str(node.b.ty.dtype),
                                                            int(node.b.value) - 1))
        return mut.default_mutate(node)

    return structural_mutate(func, [(tirx.Min, short)]), bool(done)


def _epilogue_chunks(node: tirx.For) -> bool:
    # The epilogue pass over the real columns: its loop of whole vectors (before the tail).
    return (node.kind == tirx.ForKind.SERIAL and isinstance(node.body, tirx.For)
            and node.body.kind == tirx.ForKind.VECTORIZED
            and any(b.startswith("T_add") for b in _blocks_under(node)))


@pytest.mark.parametrize(("plant", "shape", "n"), [
    (_clamp_one_short, (2, 37, 16), 128),  # 37 rows, two column tiles: the rows are padded
    (lambda f: _shorten_first(f, _epilogue_chunks), (2, 11, 24), 67),  # 67 columns
], ids=["padded_rows", "epilogue_pass"])
def test_a_bug_planted_in_the_remainder_handling_is_caught(monkeypatch, plant, shape, n):
    real = x86.schedule_matmul
    planted: list[bool] = []

    def buggy(func, target, **kw):
        sch = real(func, target, **kw)
        if sch is None:
            return None
        f, hit = plant(sch.mod["main"])
        planted.append(hit)
        return s_tir.Schedule(f)

    monkeypatch.setattr(x86, "schedule_matmul", buggy)
    res = run_case(_case("batched_nk", shape, n, seed=11), op=tvm_matmul)
    assert planted and all(planted)  # the bug is in the kernel that ran
    assert res.status == "mismatch", res.format(tir=False)


def _linears(x_shape: tuple[int, ...], *weights: np.ndarray):
    """A Relax module ``x @ w1 @ w2 ...`` with the weights as constants, ``x`` named "x"."""
    from tvm import relax

    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for w in weights[:-1]:
                y = bb.emit(relax.op.matmul(y, relax.const(w)))
            y = bb.emit_output(relax.op.matmul(y, relax.const(weights[-1])))
        bb.emit_func_output(y)
    return bb.get()


def test_constant_weights_with_padded_columns_are_packed_at_compile_time():
    # Linear layers with 67 and 197 output features on 37 tokens: the weights' padding copy
    # is the packing block, folded at compile time (no kernel left packing them per call).
    from tvm import relax

    from opsdk.model import compile_model, within_tolerance

    rng = np.random.default_rng(0)
    w1 = rng.uniform(-1, 1, (64, 67)).astype("float32")
    w2 = rng.uniform(-1, 1, (67, 197)).astype("float32")
    xv = rng.uniform(-1, 1, (1, 37, 64)).astype("float32")
    cm = compile_model(_linears(xv.shape, w1, w2), "x86", cache=False)
    assert cm.rule_counts() == {"x86.matmul": 2}
    assert all(k["name"].endswith("_prepacked") for k in cm.kernels), cm.kernels
    got = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()
    res = within_tolerance(got, xv.astype(np.float64) @ w1 @ w2)
    assert res["ok"], res


def test_padded_rows_read_the_last_row_in_place():
    # 197 tokens in 6-row tiles x a 1536x384 weight (column panels outer): the 198th row reads
    # row 196 again (its results are not written back) instead of a zero-padded copy of A,
    # which was made once per column panel.
    from tvm import relax

    from opsdk.model import compile_model

    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, (1536, 384)).astype("float32")
    xv = rng.uniform(-1, 1, (1, 197, 1536)).astype("float32")
    cm = compile_model(_linears(xv.shape, w), "x86", cache=False)
    assert cm.rule_counts() == {"x86.matmul": 1}
    (kernel,) = [f for f in cm.scheduled.functions.values() if isinstance(f, tirx.PrimFunc)]
    update, loops = _update_block(kernel)
    readers: list[str] = []  # the blocks that read the input "x"
    structural_walk(kernel.body, [(s_tir.SBlock, lambda b: readers.extend(
        [b.name_hint] * any(r.source.name == "x" for r in b.reads)))])
    assert readers == [update.block.name_hint], readers  # no copy of the input
    assert int(update.predicate) == 1 and loops[-1].kind == tirx.ForKind.VECTORIZED
    got = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(xv)).numpy()
    x64, w64 = xv.astype(np.float64), w.astype(np.float64)
    g = 1536 * U / (1 - 1536 * U)  # a float32 dot product of length 1536
    assert np.all(np.abs(got - x64 @ w64) <= g * (np.abs(x64) @ np.abs(w64)))


# ------------------------------------------------------------------ opsdk.attention


class _SDPA:
    """A torch module calling ``F.scaled_dot_product_attention`` (made when torch is asked)."""

    def __new__(cls, **kw):
        import torch

        class M(torch.nn.Module):
            def forward(self, q, k, v, *mask):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, *mask, **kw)

        return M().eval()


def _import_and_run(q_shape, k_shape, kw, mask=None):
    import torch

    from opsdk.frontend import from_torch
    from opsdk.model import compile_model, within_tolerance
    from opsdk.transform import FuseIntoOps, op_counts

    torch.manual_seed(0)
    args = [torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape)]
    args += [] if mask is None else [mask]
    model = _SDPA(**kw)
    mod = FuseIntoOps()(from_torch(torch.export.export(model, tuple(args))))
    cm = compile_model(mod, "x86", cache=False)
    from tvm import relax

    got = relax.VirtualMachine(cm.ex, tvm.cpu())["main"](
        *[tvm.runtime.tensor(a.numpy()) for a in args])
    got = got.numpy() if hasattr(got, "numpy") else got[0].numpy()
    with torch.no_grad():
        want = model(*[a.double() if a.is_floating_point() else a for a in args]).numpy()
    res = within_tolerance(got, want)
    assert res["ok"], res
    return op_counts(mod, "opsdk."), cm.rule_counts()


@pytest.mark.parametrize(("kw", "mask"), [
    ({}, None),                                             # DeiT's call
    ({"scale": 0.3, "is_causal": True}, None),
    ({"scale": 0.125}, "bool"),                             # BERT's padding mask (B, 1, 1, m)
    ({}, "float"),                                          # an additive (B, 1, n, m) mask
    ({"enable_gqa": True, "is_causal": True}, None),        # one k / v head for the 3 of q
], ids=["plain", "causal", "bool_mask", "float_mask", "grouped"])
def test_sdpa_imports_as_one_fused_attention_call(kw, mask):
    import torch

    b, h, n, d = 2, 3, 40, 16
    g = torch.Generator().manual_seed(1)
    m = {None: None, "bool": torch.rand(b, 1, 1, n, generator=g) > 0.3,
         "float": -2 * torch.rand(b, 1, n, n, generator=g)}[mask]
    kv = (b, 1 if kw.get("enable_gqa") else h, n, d)
    ops, rules = _import_and_run((b, h, n, d), kv, kw, m)
    assert ops == {"opsdk.attention": 1}, ops
    assert rules.get("x86.attention") == 1 and "x86.matmul" not in rules, rules


def test_sdpa_with_one_key_head_broadcast_over_the_query_heads_is_the_fused_op():
    # MobileNetV4's multi-query attention: k / v with one head, no enable_gqa (SDPA
    # broadcasts batch dims); TVM's import made it relax.nn.attention, on the fallback rule
    # (2.7 of 15 ms)
    ops, rules = _import_and_run((1, 4, 49, 16), (1, 1, 49, 16), {})
    assert ops == {"opsdk.attention": 1}, ops
    assert rules.get("x86.attention") == 1 and "x86.fallback" not in rules, rules


def test_sdpa_below_the_size_threshold_or_with_a_per_head_mask_is_decomposed():
    import torch

    from opsdk.ops.attention import TORCH_MIN_TOKENS

    n = TORCH_MIN_TOKENS // 2
    ops, rules = _import_and_run((1, 2, n, 16), (1, 2, n, 16), {})
    assert "opsdk.attention" not in ops and "opsdk.softmax" in ops, ops
    assert rules.get("x86.matmul") == 2, rules
    # a mask per head: not the op's (B, 1, n, m); the decomposition adds it to the scores
    ops, rules = _import_and_run((1, 2, 40, 16), (1, 2, 40, 16), {}, torch.randn(1, 2, 40, 40))
    assert "opsdk.attention" not in ops and "opsdk.softmax" in ops, ops
    assert rules.get("x86.matmul") == 2, rules
    # ... also as a 3-D per-head bias (TinyViT's relative positions), which TVM's import of
    # the call rejects (its attention op takes a 4-D bias only), and a per-head bool mask
    ops, _ = _import_and_run((1, 2, 40, 16), (1, 2, 40, 16), {}, torch.randn(2, 40, 40))
    assert "opsdk.softmax" in ops, ops
    keep = torch.rand(2, 40, 40, generator=torch.Generator().manual_seed(3)) > 0.2
    keep[..., 0] = True  # every row keeps a key (an all-masked row is NaN in torch too)
    ops, _ = _import_and_run((1, 2, 40, 16), (1, 2, 40, 16), {"scale": 0.2}, keep)
    assert "opsdk.softmax" in ops, ops


def _attention_func(q_shape, kv_shape, **attrs):
    from opsdk.registry import get_op

    d = get_op("attention")
    q = te.placeholder(q_shape, name="q")
    k = te.placeholder(kv_shape, name="k")
    v = te.placeholder(kv_shape, name="v")
    return te.create_prim_func([q, k, v, d.compute(q, k, v, **attrs)])


def _block_names(func) -> set[str]:
    names: set[str] = set()
    structural_walk(func, [(s_tir.SBlock, lambda b: names.add(b.name_hint))])
    return names


@pytest.mark.parametrize(("n", "many"), [(1, False), (15, False), (16, True), (197, True)])
def test_the_many_query_schedule_is_chosen_from_16_queries(n, many):
    from opsdk.schedules._attention import schedule_attention

    f = _attention_func((1, 2, n, 32), (1, 2, 40, 32), scale=0.0, causal=False, layout="BHSD")
    tgt = opsdk.target("x86")
    with tgt:
        sch = schedule_attention(f, tgt)
    # the many-query schedule's register tiles are cache_write stages of scores and P V
    assert ("scores_local" in _block_names(sch.mod["main"])) == many


@pytest.mark.parametrize(("layout", "shape", "m", "attrs", "present"), [
    ("BHSD", (1, 6, 197, 64), 197, {"causal": False, "scale": 0.0}, ()),       # DeiT-S
    ("BHSD", (2, 8, 128, 64), 128, {"causal": False, "scale": 0.125}, ("mask",)),  # BERT
    ("causal", (2, 37, 4, 16), 45, {"causal": True, "scale": 0.0}, ("mask",)),  # prefill
    ("full", (1, 20, 4, 8), 33, {"causal": False, "scale": 0.5}, ()),  # D under a vector
], ids=["deit", "bert_mask", "bshd_causal", "head_dim_8"])
def test_many_query_kernels_verify(layout, shape, m, attrs, present):
    lay = "BHSD" if layout == "BHSD" else "BSHD"
    case = Case("attention", "x86", "float32", layout, shape, {**attrs, "layout": lay},
                present, {}, 5, static=True, free={"M": m})
    res = run_case(case)
    assert res.ok, res.format(tir=False)
    assert res.rule == "x86.attention"


@pytest.mark.parametrize(("layout", "shape", "m", "kv_heads", "present"), [
    ("causal", (1, 1, 8, 64), 37, 2, ()),        # a Llama decode step: 4 query heads per kv head
    ("causal", (1, 1, 4, 16), 37, 2, ()),        # a head of one AVX-512 vector (8-lane chunks)
    ("BHSD", (2, 4, 3, 32), 21, 1, ("mask",)),   # decode schedule, one kv head for all
    ("causal", (1, 20, 4, 16), 29, 2, ("mask",)),  # many-query schedule (a prefill)
    ("BHSD", (1, 6, 40, 32), 40, 3, ()),         # many-query schedule, BHSD
], ids=["decode_bshd", "decode_head_dim_16", "decode_bhsd", "many_bshd", "many_bhsd"])
def test_grouped_heads_verify_on_both_schedules(layout, shape, m, kv_heads, present):
    # k / v with fewer heads than q (the declared "Hkv"): against the float64 reference,
    # which repeats each key / value head for its query heads.
    lay = "BHSD" if layout == "BHSD" else "BSHD"
    attrs = {"causal": layout == "causal", "scale": 0.0, "layout": lay}
    case = Case("attention", "x86", "float32", layout, shape, attrs, present, {}, 7,
                static=True, free={"M": m, "Hkv": kv_heads})
    res = run_case(case)
    assert res.ok, res.format(tir=False)
    assert res.rule == "x86.attention"


@pytest.mark.parametrize("d", [16, 32])
def test_one_static_key_is_declined_not_a_raise(d):
    # One key (verify's static M = 1): compute_at dropped P V's unit key loop and the decode
    # schedule's reorder raised (found by the suite's hypothesis draw [1, 1, 1, 16], causal,
    # with a mask). The rule declines; another takes it, within the bound.
    case = Case("attention", "x86", "float32", "causal", (1, 1, 1, d),
                {"causal": True, "scale": 0.0, "layout": "BSHD"}, ("mask",), {}, 0,
                static=True, free={"M": 1, "Hkv": 1})
    res = run_case(case)
    assert res.ok, res.format(tir=False)
    assert res.rule != "x86.attention"  # a rule that raised would have failed the case


@pytest.mark.parametrize(("shape", "m"), [
    ((1, 1, 1, 1000), 2),   # decode: 1000 = 62 vectors of 16 + 8 (found by the suite's draw)
    ((2, 3, 2, 40), 19),    # decode, a head of 2.5 AVX-512 vectors
    ((1, 24, 2, 40), 30),   # many queries, the same head dim
], ids=["decode_d1000", "decode_d40", "many_d40"])
def test_head_dims_off_the_vector_width_keep_the_rule(shape, m):
    # A head dim that is not a multiple of the lanes: the decode schedule partitioned P V's
    # head loop and raised ("the block no longer exists"); with that fixed, the output row's
    # partition hid the consumer from compute_at, which put every stage after it (all-zero
    # rows, 264x the bound). Now the rule keeps the kernel, within the bound.
    case = Case("attention", "x86", "float32", "causal", shape,
                {"causal": True, "scale": 0.0, "layout": "BSHD"}, ("mask",), {}, 0,
                static=True, free={"M": m, "Hkv": 1})
    res = run_case(case)
    assert res.ok, res.format(tir=False)
    assert res.rule == "x86.attention"


@pytest.mark.parametrize("batch", ["static", "symbolic"])
def test_many_query_schedule_with_a_symbolic_query_count(batch):
    # n (= m, a prefill) symbolic: int64 loops beside static int32 ones; one kernel for every
    # n, each run within the derived bound of the float64 reference.
    from opsdk.registry import get_op
    from opsdk.schedules._attention import schedule_attention
    from opsdk.verify import ModelInput, output_bound

    d = get_op("attention")
    n = tirx.Var("n", "int64")
    b = tirx.Var("b", "int64") if batch == "symbolic" else 2
    attrs = {"scale": 0.0, "causal": True, "layout": "BSHD"}
    f = _attention_func((b, n, 4, 32), (b, n, 2, 32), **attrs)  # grouped heads too
    tgt = opsdk.target("x86")
    with tgt:
        sch = schedule_attention(f, tgt)
    assert sch is not None and "scores_local" in _block_names(sch.mod["main"])
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=tgt)
    rng = np.random.default_rng(2)
    for size in (1, 17, 50):
        ins = {"q": rng.uniform(-2, 2, (2, size, 4, 32)),
               "k": rng.uniform(-2, 2, (2, size, 2, 32)),
               "v": rng.uniform(-2, 2, (2, size, 2, 32))}
        ins = {k: a.astype("float32") for k, a in ins.items()}
        out = tvm.runtime.tensor(np.zeros((2, size, 4, 32), "float32"))
        lib(*[tvm.runtime.tensor(ins[k]) for k in "qkv"], out)
        x64 = {**{k: a.astype(np.float64) for k, a in ins.items()}, "mask": None}
        ref = d.run_reference(x64, attrs)
        tol, _ = output_bound(d, ModelInput(d, x64, attrs, ref, U), "float32")
        err = np.abs(out.numpy() - ref)
        assert np.all(err <= tol), (size, float((err / tol).max()))



@pytest.mark.parametrize(("shape", "causal", "rule"), [
    # the rows rule's middle-axis reduction fused spatial loops a unit loop separated
    ([1, 16, 2, 1], True, "x86.rows"),
    # 17 queries over one key: compute_at drops the key's unit loops, and the attention
    # rule took the loops above them for them
    ([1, 17, 1, 16], False, "x86.attention"),
])
def test_one_key_shapes_keep_their_rule(shape, causal, rule) -> None:
    # Found by verify's draws: each rule raised (reorder / fuse) and the kernel fell to the
    # generic lowering.
    import json

    from opsdk.verify import Case, run_case

    c = Case.from_json(json.dumps({
        "attrs": {"causal": causal, "layout": "BSHD", "scale": 0.0},
        "data": {"k": "domain", "mask": "domain", "q": "domain", "v": "domain"},
        "dtype": "float32", "free": {"Hkv": 1, "M": 1},
        "layout": "causal" if causal else "full", "op": "attention", "packed": False,
        "present": ["mask"], "seed": 0, "shape": shape, "static": True, "target": "x86"}))
    r = run_case(c)
    assert r.ok and r.rule == rule, r.format(tir=False)
