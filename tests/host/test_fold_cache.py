"""The folded constants kept beside the kernel cache (opsdk.transform._fold.fold_cache): a
recompile reads every fold back, an edited weight refolds only what it feeds, outputs stay
bit-identical to an uncached compile, and a damaged or stale entry is recomputed, never
trusted."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import tvm
from tvm import relax

from opsdk.model import compile_model, record_timings

RNG = np.random.default_rng(1)
W1 = RNG.standard_normal((16, 8, 3, 3)).astype("float32")
W2 = RNG.standard_normal((24, 16)).astype("float32")
B2 = RNG.standard_normal((24,)).astype("float32")
X = RNG.standard_normal((1, 8, 12, 12)).astype("float32")


def _module(w2: np.ndarray = W2) -> tvm.IRModule:
    """conv (its weight folded to HWIO and packed) + relu -> mean -> dense (a transposed
    weight, folded) + bias: a few folds of two independent weights."""
    x = relax.Var("x", relax.TensorType(X.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, relax.const(W1), padding=1)))
            y = bb.emit(relax.op.mean(y, axis=[2, 3]))
            y = relax.op.matmul(y, relax.op.permute_dims(relax.const(w2)))
            y = bb.emit_output(relax.op.add(y, relax.const(B2)))
        bb.emit_func_output(y)
    return bb.get()


def _run(ex) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(X)).numpy()


@pytest.fixture
def folds(tmp_path, monkeypatch) -> pathlib.Path:
    """The kernel cache (and so the fold cache) in a temporary folder, the whole-model
    cache off: every compile folds."""
    monkeypatch.delenv("OPSDK_NO_CACHE", raising=False)
    monkeypatch.delenv("OPSDK_NO_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("OPSDK_NO_MODEL_CACHE", "1")
    monkeypatch.setenv("OPSDK_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    return tmp_path / "kernels" / ".folds"


def _entries(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


def test_recompile_reads_folds_back_and_an_edit_refolds_only_its_weight(folds):
    ref = _run(compile_model(_module(), "x86", cache=False).ex)  # no cache at all
    with record_timings() as t:
        cold = compile_model(_module(), "x86")
    n = cold.fold_stats.computed
    assert n >= 2 and cold.fold_stats.reused == 0
    assert (t.folds_computed, t.folds_reused) == (n, 0)
    assert len(_entries(folds)) == n
    warm = compile_model(_module(), "x86")
    assert (warm.fold_stats.reused, warm.fold_stats.computed) == (n, 0)
    np.testing.assert_array_equal(_run(cold.ex), ref)
    np.testing.assert_array_equal(_run(warm.ex), ref)

    w2 = W2.copy()
    w2[3, 5] += 1.0
    edited = compile_model(_module(w2), "x86")
    # the dense weight's folds are new; the conv weight's are read back
    assert 1 <= edited.fold_stats.computed < n
    assert edited.fold_stats.reused >= 1
    np.testing.assert_array_equal(_run(edited.ex),
                                  _run(compile_model(_module(w2), "x86", cache=False).ex))


def test_damaged_and_stale_folds_are_recomputed(folds):
    first = compile_model(_module(), "x86")
    ref = _run(first.ex)
    entries = _entries(folds)
    assert len(entries) >= 2
    trunc, stale = entries[:2]
    good = {p: (p / "value.bin").read_bytes() for p in (trunc, stale)}
    (trunc / "value.bin").write_bytes(good[trunc][: len(good[trunc]) // 2])
    # another fold's whole entry under this key: its metadata names the other key
    other = next(p for p in entries if (p / "value.bin").read_bytes() != good[stale])
    (stale / "value.bin").write_bytes((other / "value.bin").read_bytes())
    (stale / "meta.json").write_text((other / "meta.json").read_text())

    again = compile_model(_module(), "x86")
    assert again.fold_stats.computed == 2
    assert again.fold_stats.reused == first.fold_stats.computed - 2
    np.testing.assert_array_equal(_run(again.ex), ref)
    for p, data in good.items():  # whole again
        assert (p / "value.bin").read_bytes() == data


def test_off_with_the_kernel_cache(folds, monkeypatch):
    monkeypatch.setenv("OPSDK_NO_KERNEL_CACHE", "1")
    cm = compile_model(_module(), "x86")
    assert cm.fold_stats.computed >= 2 and cm.fold_stats.reused == 0
    assert not folds.exists()


def test_folds_and_kernels_stay_within_their_bounds(folds, monkeypatch):
    # stores are evicted once per batch (not per entry): the bound still holds after it
    monkeypatch.setenv("OPSDK_CACHE_MAX_MB", "0.002")  # ~2 KB: a few folds at most
    monkeypatch.setenv("OPSDK_KERNEL_CACHE_MAX_MB", "0.01")
    cm = compile_model(_module(), "x86")
    assert cm.fold_stats.computed >= 2
    np.testing.assert_array_equal(_run(cm.ex), _run(compile_model(_module(), "x86",
                                                                  cache=False).ex))
    for root, bound in ((folds, 0.002), (folds.parent, 0.01)):
        size = sum(f.stat().st_size for p in _entries(root) for f in p.iterdir())
        assert size <= bound * 1024**2


def test_equal_folded_values_share_one_constant():
    """Two functions whose kernels fold the same weight to the same bytes (a decoder's
    prefill and decode steps) end up holding one constant, not two copies."""
    import numpy as np
    import tvm
    from tvm import relax

    from opsdk.transform._fold import fold_constants

    w = relax.const(np.arange(12, dtype="float32").reshape(4, 3))
    bb = relax.BlockBuilder()
    for name, op in (("prefill", relax.op.add), ("decode", relax.op.multiply)):
        x = relax.Var("x", relax.TensorType((3, 4), "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                y = bb.emit_output(op(x, relax.op.permute_dims(w)))
            bb.emit_func_output(y)
    mod = fold_constants(relax.transform.LegalizeOps()(bb.get()))
    found = []
    for gv in ("prefill", "decode"):
        relax.analysis.post_order_visit(
            mod[gv].body,
            lambda e: found.append(e) if isinstance(e, tvm.ir.expr.Constant)
            and hasattr(e.value, "numpy") else None)
    assert len(found) == 2 and found[0].same_as(found[1])
    assert np.array_equal(found[0].value.numpy(), np.arange(12, dtype="float32").reshape(4, 3).T)


def test_a_folded_scalar_stays_a_scalar():
    """A kernel folding to a 0-d value (a sum of a constant) gives a 0-d constant: it once
    came back (1,)-shaped, and a fused kernel reading it no longer matched its call (TVM's
    FuseTIR failed on GPT-2's attention scale)."""
    import numpy as np
    import tvm
    from tvm import relax

    from opsdk.transform._fold import fold_constants

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            s = relax.op.sum(relax.const(np.arange(4, dtype="float32")))
            y = bb.emit_output(relax.op.multiply(x, s))
        bb.emit_func_output(y)
    mod = fold_constants(relax.transform.LegalizeOps()(bb.get()))
    found = []
    relax.analysis.post_order_visit(
        mod["main"].body, lambda e: found.append(e.value) if isinstance(
            e, tvm.ir.expr.Constant) and hasattr(e.value, "numpy") else None)
    assert [tuple(t.shape) for t in found] == [()]
    assert float(found[0].numpy()) == 6.0
