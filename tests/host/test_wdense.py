"""The weight-only dense ops (``dense_w8``, ``dense_q4``): their quantizers (ggml q4_0 byte
for byte), the K check, both shapes of the rule (GEMV for decode, dequantized-panel GEMM for
prefill) through verify's static builds, and the model path (packing folded at compile time,
activation in the kernel)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te

import opsdk
from opsdk.ops.dense_q4 import dequantize_q4_0, q4_0_from_blocks, quantize_q4_0
from opsdk.ops.dense_w8 import quantize_w8
from opsdk.verify import Case, run_case


def test_quantize_w8_is_symmetric_per_channel_with_ties_to_even() -> None:
    w = np.array([[0.5, -1.0, 0.25, 1.5 / 127], [0.0, 0.0, 0.0, 0.0]], "float32")
    q, s = quantize_w8(w)
    assert s.dtype == np.float32 and q.dtype == np.int8
    assert s[0] == np.float32(1.0) / np.float32(127) and s[1] == 1.0  # zero row: scale 1
    # 0.5 / s = 63.5 -> 64 (even), 0.25 / s = 31.75 -> 32, 1.5/127 / s = 1.5 -> 2 (even)
    assert q.tolist() == [[64, -127, 32, 2], [0, 0, 0, 0]]


def test_quantize_q4_0_hand_checked_example() -> None:
    # One group: max |x| is -4 (signed max), d = -4 / -8 = 0.5, id = 2;
    # q = min(15, int8(x * 2 + 8.5)): -4 -> 0, 2 -> 12, 1 -> 10, 0 -> 8, 0.3 -> 9 (9.1),
    # -0.3 -> 7 (7.9: truncation, not rounding).
    w = np.zeros((1, 32), "float32")
    w[0, [0, 1, 2, 3, 17]] = [-4.0, 2.0, 0.3, -0.3, 1.0]
    qs, d = quantize_q4_0(w)
    assert d.dtype == np.float16 and d.tolist() == [[0.5]]
    q = np.concatenate([qs[0] & 15, qs[0] >> 4])
    assert q[:4].tolist() == [0, 12, 9, 7] and q[17] == 10
    assert (np.delete(q, [0, 1, 2, 3, 17]) == 8).all()
    assert qs[0, 1] == (12 | 10 << 4)  # byte j: weight j low nibble, weight j + 16 high
    np.testing.assert_array_equal(dequantize_q4_0(qs, d)[0, :4], [-4.0, 2.0, 0.5, -0.5])
    # A zero group: d = 0, id = 0, every q = 8.
    qs0, d0 = quantize_q4_0(np.zeros((2, 64), "float32"))
    assert (qs0 == 0x88).all() and (d0 == 0).all()


def test_quantize_q4_0_matches_gguf_byte_for_byte() -> None:
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: the "
                               "byte-for-byte check against gguf.quants is skipped")
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 256)).astype("float32")
    w[0, :32] = 0  # a zero group
    w[1, 5] = -3 * np.abs(w[1]).max()  # a negative max
    w[2, :32] = 1.5
    w[2, 3] = -1.5  # equal magnitudes: ggml keeps the first
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_0)
    qs, d = quantize_q4_0(w)
    qs2, d2 = q4_0_from_blocks(raw)
    np.testing.assert_array_equal(qs, qs2)
    np.testing.assert_array_equal(d.view("uint16"), d2.view("uint16"))
    np.testing.assert_array_equal(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0), dequantize_q4_0(qs, d))


def test_q4_0_from_blocks_changes_no_byte() -> None:
    rng = np.random.default_rng(1)
    qs, d = quantize_q4_0(rng.standard_normal((3, 96)).astype("float32"))
    blocks = np.concatenate([d.reshape(3, 3, 1).view("uint8"), qs.reshape(3, 3, 16)], axis=2)
    for raw, rows in ((blocks, None), (blocks.reshape(3, 54), None), (blocks.tobytes(), 3)):
        qs2, d2 = q4_0_from_blocks(raw, rows)
        assert qs2.shape == (3, 48) and d2.shape == (3, 3) and d2.dtype == np.float16
        np.testing.assert_array_equal(qs2, qs)
        np.testing.assert_array_equal(d2.view("uint16"), d.view("uint16"))


def test_dense_q4_refuses_k_not_whole_groups() -> None:
    x = relax.Var("x", relax.TensorType((2, 40), "float32"))
    qs = relax.Var("qs", relax.TensorType((8, 20), "uint8"))
    d = relax.Var("d", relax.TensorType((8, 1), "float16"))
    with pytest.raises(ValueError, match=r"dense_q4.*'x'.*K = 40.*multiple of 32.*pad K"):
        relax.BlockBuilder().normalize(opsdk.relax.dense_q4(x, qs, d))


# Static builds through verify (reference, error model, generic-lowering invariance): decode
# rows (GEMV) and prefill rows (GEMM), N that no vector width divides, each activation.
_SHAPES = [((1, 768), 67, "gelu_tanh"), ((4, 3072), 24, "silu"), ((64, 768), 80, "gelu"),
           ((17, 96), 33, "relu"), ((1, 32), 1, "none")]


@pytest.mark.parametrize("op", ["dense_q4", "dense_w8"])
@pytest.mark.parametrize(("shape", "n", "act"), _SHAPES)
def test_static_gemv_and_gemm_verify(op: str, shape, n: int, act: str) -> None:
    d = opsdk.get_op(op)
    case = Case(op, "host", "float32", "float32", shape, {**d.default_attrs(), "activation": act},
                ("bias",), {}, 0, static=True, free={"N": n})
    res = run_case(case)
    assert res.status == "pass", res.message
    assert res.rule.endswith(".wdense")


def test_model_path_fuses_bias_and_activation_and_folds_the_packing() -> None:
    rng = np.random.default_rng(0)
    k, n = 256, 40
    wf = rng.standard_normal((n, k)).astype("float32")
    qs, d = quantize_q4_0(wf)
    w8, s8 = quantize_w8(wf[:, :n])
    b = rng.uniform(-1, 1, n).astype("float32")
    x = relax.Var("x", relax.TensorType((1, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            # A model's spelling: the bias add and the activation as TVM ops after the layer.
            y = bb.emit(opsdk.relax.dense_q4(x, relax.const(qs), relax.const(d)))
            y = bb.emit(relax.op.nn.gelu_tanh(relax.op.add(y, relax.const(b))))
            z = bb.emit(opsdk.relax.dense_w8(y, relax.const(w8), relax.const(s8)))
            bb.emit_output(z)
        bb.emit_func_output(z)
    # The pipeline's kernel fusion leaves an opsdk op's kernel whole; the ops' own fusion
    # rules (the model path's "fuse" step) take the bias and activation in.
    mod = opsdk.transform.FuseIntoOps()(bb.get())
    counts = opsdk.transform.op_counts(mod, "")
    assert counts.get("opsdk.dense_q4") == 1 and counts.get("opsdk.dense_w8") == 1, counts
    assert not any(k.startswith("relax.nn") or k == "relax.add" or k == "opsdk.bias_gelu"
                   for k in counts), counts
    t = opsdk.target("x86")
    with t:
        low = opsdk.pipeline(t)(mod)
    kernels = {gv.name_hint: f for gv, f in low.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    assert len(kernels) == 2  # the packing ran at compile time: no packing kernel is left
    for f in kernels.values():
        assert f.attrs["opsdk.rule"] == "x86.wdense"
        assert 'sblock("wp"' not in f.script()
    vm = relax.VirtualMachine(opsdk.compile(mod, "x86"), tvm.cpu())
    xv = rng.uniform(-2, 2, (1, k)).astype("float32")
    got = vm["main"](tvm.runtime.tensor(xv)).numpy()
    y = opsdk.get_op("dense_q4").run_reference({"x": xv, "qs": qs, "d": d, "bias": b},
                                                {"activation": "gelu_tanh"})
    want = opsdk.get_op("dense_w8").run_reference({"x": y, "w": w8, "w_scale": s8},
                                                   {"activation": "none"})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("mcpu", ["znver3", "znver4"])  # AVX2 (8 lanes), AVX-512 (16)
@pytest.mark.parametrize(("m", "n"), [(1, 33), (2, 768), (20, 40)])
def test_vector_width_comes_from_the_target(mcpu: str, m: int, n: int) -> None:
    from tvm import te

    from opsdk.schedules._core import accumulator_registers, vector_lanes
    from opsdk.schedules._wgemm import schedule_wdense

    tgt = opsdk.target({"kind": "llvm", "mcpu": mcpu})
    k = 96
    rng = np.random.default_rng(m * n)
    qs, d = quantize_q4_0(rng.standard_normal((n, k)).astype("float32"))
    if mcpu == "znver4":
        d = d.astype("float32")  # the group scales may come as float32 too
    xv = rng.uniform(-2, 2, (m, k)).astype("float32")
    x = te.placeholder((m, k), "float32", name="x")
    ins = [x, te.placeholder(qs.shape, "uint8", name="qs"),
           te.placeholder(d.shape, str(d.dtype), name="d")]
    op = opsdk.get_op("dense_q4")
    y = op.call_compute([*ins, None], {"activation": "silu"})
    sch = schedule_wdense(tvm.te.create_prim_func([*ins, y]), tgt,
                          acc_regs=accumulator_registers(tgt))
    mr, nv, lanes, gemm = (int(v) for v in sch.mod["main"].attrs["opsdk.wdense_tile"])
    assert lanes == vector_lanes(tgt) == (8 if mcpu == "znver3" else 16)
    assert nv * mr * (1 if gemm else 2) <= accumulator_registers(tgt) and gemm == (m >= 16)
    ex = tvm.compile(sch.mod, target=tgt)
    out = tvm.runtime.empty((m, n), "float32")
    ex["main"](*[tvm.runtime.tensor(a) for a in (xv, qs, d)], out)
    want = op.run_reference({"x": xv, "qs": qs, "d": d}, {"activation": "silu"})
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("op", ["dense_q4", "dense_w8"])
def test_symbolic_rows_run_the_gemm_over_whole_row_tiles(op: str) -> None:
    """An LLM's prefill has a symbolic row count: with float32 activations it runs the GEMM
    over a dequantized panel, its accumulator block over whole row tiles (the padded rows
    read the last row again), so the register tile has no row predicate (with one TVM kept
    every row's accumulators in memory: 37 against 110 GFLOP/s). One kernel for 1, 7
    (a partial tile) and 64 rows, each against the reference."""
    from tvm import te

    from opsdk.schedules._core import accumulator_registers
    from opsdk.schedules._wgemm import schedule_wdense

    tgt = opsdk.target("x86")
    k, n = 96, 40
    rng = np.random.default_rng(7)
    wf = rng.standard_normal((n, k)).astype("float32")
    ws = dict(zip(("qs", "d"), quantize_q4_0(wf))) if op == "dense_q4" else \
        dict(zip(("w", "w_scale"), quantize_w8(wf)))
    mvar = te.var("m", "int64")
    phs = [te.placeholder((mvar, k), "float32", name="x"),
           *(te.placeholder(v.shape, str(v.dtype), name=nm) for nm, v in ws.items())]
    d = opsdk.get_op(op)
    y = d.call_compute([*phs, None], {"activation": "gelu"})
    sch = schedule_wdense(te.create_prim_func([*phs, y]), tgt,
                          acc_regs=accumulator_registers(tgt))
    mr, _, _, gemm = (int(v) for v in sch.mod["main"].attrs["opsdk.wdense_tile"])
    assert gemm == 1 and mr > 1
    for name in ("acc_init", "acc_update"):  # no row predicate on the register tile
        loops = sch.get_loops(sch.get_sblock(name))
        realize = sch.get(loops[-1]).body
        assert isinstance(realize.predicate, tvm.tirx.IntImm), (name, realize.predicate)
        assert int(realize.predicate) == 1
    ex = tvm.compile(sch.mod, target=tgt)
    for rows in (1, 7, 64):
        xv = rng.uniform(-2, 2, (rows, k)).astype("float32")
        out = tvm.runtime.empty((rows, n), "float32")
        ex["main"](*[tvm.runtime.tensor(v) for v in (xv, *ws.values())], out)
        want = d.run_reference({"x": xv, **ws}, {"activation": "gelu"})
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- activations="q8_0"


def _has_vnni() -> bool:
    from opsdk.targets import target_features

    return "avx512vnni" in target_features(opsdk.target("x86"))


_VNNI = pytest.mark.skipif(not _has_vnni(), reason="the host has no AVX-512 VNNI: the "
                           "x86.qwdense_vnni kernels cannot run here")


def _hard_rows(k: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of activations with the quantizer's corner cases: a zero block, a constant
    block, exact ties of x / d (k + 1/2), tiny and large magnitudes, one huge outlier."""
    x = (rng.standard_normal((6, k)) * 10.0 ** rng.uniform(-4, 3, (6, 1))).astype("float32")
    x[0, :32] = 0
    x[1, 32:64] = -0.75
    x[2, :32] = (np.arange(32) - 15.5) / 127 * 4  # amax 62/127: x / d = 2 * (j - 15.5)
    x[2, 0] = 2.0  # d = 2 / 127: x * id hits k + 1/2 ties (modulo the float32 rounding)
    x[3, :32] *= 1e-30
    x[4, 5] = 3e4
    return x


def test_q8_0_quantization_is_bit_exact_against_the_reference() -> None:
    from tvm import te

    from opsdk.ops.dense_w8 import q8_0_te, quantize_q8_0

    rng = np.random.default_rng(3)
    k = 128
    x = te.placeholder((6, k), "float32", name="x")
    xq, xd = q8_0_te(x)
    f = tvm.compile(te.create_prim_func([x, xq, xd]), target=opsdk.target("x86"))
    for _ in range(5):
        xv = _hard_rows(k, rng)
        got_q = tvm.runtime.empty((6, k), "int8")
        got_d = tvm.runtime.empty((6, k // 32), "float32")
        f["main"](tvm.runtime.tensor(xv), got_q, got_d)
        want_q, want_d = quantize_q8_0(xv)
        np.testing.assert_array_equal(got_q.numpy(), want_q)
        np.testing.assert_array_equal(got_d.numpy().view("uint32"), want_d.view("uint32"))
    assert (want_d == want_d.astype("float16").astype("float32")).all()  # fp16 values


def test_quantize_q8_0_matches_gguf_off_ties() -> None:
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: the "
                               "check against gguf.quants' Q8_0 is skipped")
    from gguf.quants import quantize

    from opsdk.ops.dense_w8 import quantize_q8_0

    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 256)).astype("float32")
    x[0, :32] = 0
    raw = quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(9, 8, 34)
    d = np.ascontiguousarray(raw[:, :, :2]).view("<f2").reshape(9, 8)
    qs = raw[:, :, 2:].view("int8").reshape(9, 256)
    xq, d16 = quantize_q8_0(x)
    # ggml rounds ties away from zero, opsdk to even: equal wherever x * id is no exact tie.
    np.testing.assert_array_equal(d.astype("float32"), d16)
    np.testing.assert_array_equal(xq, qs)


def _bound(op: str, inputs: dict, attrs: dict, ref: np.ndarray) -> np.ndarray:
    from opsdk._errmodel import MODELS, ModelInput

    d = opsdk.get_op(op)
    ins = {k: (None if v is None else np.asarray(v).astype(np.float64)
               if np.asarray(v).dtype.kind == "f" else np.asarray(v)) for k, v in inputs.items()}
    u = 2.0 ** -24
    return MODELS[d.reference](ModelInput(d, ins, dict(attrs), ref, u)) + u * np.abs(ref)


def _q8_case(op: str, m: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    wf = (rng.standard_normal((n, k)) * 0.05).astype("float32")
    a, b = quantize_q4_0(wf) if op == "dense_q4" else quantize_w8(wf)
    x = _hard_rows(k, rng)
    x = np.concatenate([x, rng.uniform(-2, 2, (max(0, m - 6), k)).astype("float32")])[:m]
    names = [p.name for p in opsdk.get_op(op).tensor_params]
    return dict(zip(names, (x, a, b, rng.uniform(-1, 1, n).astype("float32"))))


@_VNNI
@pytest.mark.parametrize("op", ["dense_q4", "dense_w8"])
@pytest.mark.parametrize(("shape", "n", "act"), [((1, 768), 67, "gelu_tanh"),
                                                 ((1, 3072), 24, "none"),
                                                 ((64, 768), 80, "silu"),
                                                 ((17, 96), 33, "relu")])
def test_q8_0_static_decode_and_prefill_verify(op: str, shape, n: int, act: str) -> None:
    d = opsdk.get_op(op)
    case = Case(op, "host", "float32", "q8_0", shape,
                {**d.default_attrs(), "activation": act, "activations": "q8_0"},
                ("bias",), {}, 0, static=True, free={"N": n})
    res = run_case(case)
    assert res.status == "pass", res.message
    assert res.rule == "x86.qwdense_vnni"


@_VNNI
@pytest.mark.parametrize("op", ["dense_q4", "dense_w8"])
@pytest.mark.parametrize("rows", [1, 64])
def test_q8_0_symbolic_rows_through_the_rule(op: str, rows: int) -> None:
    """The prefill of opsdk.llm has a symbolic row count: the rule pads it to whole row
    tiles (a decode step's one row and a 64-token prefill through the same kernel)."""
    from tvm import te

    from opsdk.schedules._qwgemm import schedule_qwdense
    from opsdk.schedules.cpu.vnni import Q8_VNNI

    k, n = 256, 70
    ins = _q8_case(op, rows, k, n, rows)
    tgt = opsdk.target("x86")
    mvar = te.var("m", "int64")
    phs = [te.placeholder((mvar, k), "float32", name="x"),
           *(te.placeholder(v.shape, str(v.dtype), name=nm) for nm, v in list(ins.items())[1:])]
    d = opsdk.get_op(op)
    attrs = {"activation": "gelu", "activations": "q8_0"}
    y = d.call_compute(phs, attrs)
    sch = schedule_qwdense(te.create_prim_func([*phs, y]), tgt, Q8_VNNI)
    # 3 rows x 4 vectors: the decode step's 4-vector packing, so both hold one copy
    assert [int(v) for v in sch.mod["main"].attrs["opsdk.qwdense_tile"]] == [3, 4]
    ex = tvm.compile(sch.mod, target=tgt)
    out = tvm.runtime.empty((rows, n), "float32")
    ex["main"](*[tvm.runtime.tensor(v) for v in ins.values()], out)
    want = d.run_reference(ins, attrs)
    err = np.abs(out.numpy() - want)
    assert (err <= _bound(op, ins, attrs, want)).all(), err.max()


@_VNNI
def test_q8_0_rule_without_the_nibble_offset_fails_verify(monkeypatch) -> None:
    """A planted bug: the q4 kernel without its ``-8 * sum(xq)`` start (sum of nibble * xq,
    the nibbles' offset forgotten) must fail verify, and pass again when restored."""
    from opsdk.schedules import _qwgemm

    d = opsdk.get_op("dense_q4")
    case = Case("dense_q4", "host", "float32", "q8_0", (1, 768),
                {**d.default_attrs(), "activations": "q8_0"}, ("bias",), {}, 0, static=True,
                free={"N": 40})
    from opsdk.verify import _builds

    monkeypatch.setattr(_builds, "_BUILDS", type(_builds._BUILDS)())  # build afresh
    monkeypatch.setattr(_qwgemm, "Q4_ZERO", 0)
    res = run_case(case)
    assert res.status == "mismatch" and res.rule == "x86.qwdense_vnni", res.status
    monkeypatch.setattr(_builds, "_BUILDS", type(_builds._BUILDS)())
    monkeypatch.setattr(_qwgemm, "Q4_ZERO", 8)
    assert run_case(case).status == "pass"


def test_q8_0_w8_refuses_k_not_whole_blocks() -> None:
    x = relax.Var("x", relax.TensorType((2, 40), "float32"))
    w = relax.Var("w", relax.TensorType((8, 40), "int8"))
    s = relax.Var("s", relax.TensorType((8,), "float32"))
    bb = relax.BlockBuilder()
    bb.normalize(opsdk.relax.dense_w8(x, w, s))  # float32 activations: any K
    with pytest.raises(ValueError, match=r"dense_w8.*'x'.*K = 40.*multiple of 32.*"
                       r"activations='float32'"):
        bb.normalize(opsdk.relax.dense_w8(x, w, s, activations="q8_0"))


def test_without_vnni_q8_0_takes_the_generic_lowering() -> None:
    """x86.wdense declines activations="q8_0" (it computes float32 numerics) and the VNNI
    rule needs the feature: an AVX2 CPU gets the generic lowering, which is correct."""
    from tvm import te

    from opsdk.schedules import choose

    op = opsdk.get_op("dense_q4")
    x = te.placeholder((1, 64), "float32", name="x")
    ins = [x, te.placeholder((8, 32), "uint8", name="qs"),
           te.placeholder((8, 2), "float16", name="d")]
    for acts, rule in (("q8_0", "generic"), ("float32", "x86.wdense")):
        y = op.call_compute([*ins, None], {"activation": "none", "activations": acts})
        ch = choose(op, tvm.te.create_prim_func([*ins, y]),
                    opsdk.target({"kind": "llvm", "mcpu": "znver3"}))  # AVX2, no VNNI
        assert ch.rule == rule, ch.reasons


@_VNNI
@pytest.mark.parametrize("rows", [1, None])  # a decode step; a symbolic prefill (64 rows)
def test_q8_0_model_path_folds_the_packing_and_keeps_the_numerics(rows) -> None:
    """As opsdk.llm calls them: the fusion rules keep ``activations``, the packing of the
    constant weights, scales and bias is folded at compile time, and the kernels run the
    VNNI rule."""
    rng = np.random.default_rng(5)
    k, n, n2 = 256, 64, 40
    qs, d = quantize_q4_0((rng.standard_normal((n, k)) * 0.1).astype("float32"))
    w8, s8 = quantize_w8((rng.standard_normal((n2, n)) * 0.1).astype("float32"))
    b = rng.uniform(-1, 1, n).astype("float32")
    x = relax.Var("x", relax.TensorType((rows or tvm.tirx.Var("n", "int64"), k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(opsdk.relax.dense_q4(x, relax.const(qs), relax.const(d),
                                             activations="q8_0"))
            y = bb.emit(relax.op.nn.gelu_tanh(relax.op.add(y, relax.const(b))))
            z = bb.emit(opsdk.relax.dense_w8(y, relax.const(w8), relax.const(s8),
                                             activations="q8_0"))
            bb.emit_output(z)
        bb.emit_func_output(z)
    mod = opsdk.transform.FuseIntoOps()(bb.get())
    counts = opsdk.transform.op_counts(mod, "")
    assert counts.get("opsdk.dense_q4") == 1 and "relax.add" not in counts, counts
    t = opsdk.target("x86")
    with t:
        low = opsdk.pipeline(t)(mod)
    funcs = {f.attrs["opsdk.op"]: f for f in low.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and "opsdk.op" in f.attrs}
    assert set(funcs) == {"dense_q4", "dense_w8"}
    for f in funcs.values():
        assert f.attrs["opsdk.rule"] == "x86.qwdense_vnni"
        assert 'sblock("wp"' not in f.script() and 'sblock("bp"' not in f.script()
    vm = relax.VirtualMachine(opsdk.compile(mod, "x86"), tvm.cpu())
    xv = rng.uniform(-2, 2, (rows or 64, k)).astype("float32")
    got = vm["main"](tvm.runtime.tensor(xv)).numpy()
    y = opsdk.get_op("dense_q4").run_reference(
        {"x": xv, "qs": qs, "d": d, "bias": b},
        {"activation": "gelu_tanh", "activations": "q8_0"}).astype("float32")
    want = opsdk.get_op("dense_w8").run_reference(
        {"x": y, "w": w8, "w_scale": s8}, {"activation": "none", "activations": "q8_0"})
    # The second layer quantizes the first one's float32 output: a last-bit difference there
    # may move one int8 step, so compare at the q8_0 resolution.
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * np.abs(want).max())


def test_dim_multiples_follow_the_attributes() -> None:
    """dense_w8 needs whole 32-blocks of K only with q8_0 activations: verify rounds the K it
    draws for those cells, and keeps odd K for the float32 ones."""
    from opsdk.verify._strategies import round_dims

    d = opsdk.get_op("dense_w8")
    assert round_dims(d, [3, 17], {"activations": "q8_0"}) == [3, 32]
    assert round_dims(d, [3, 17], {"activations": "float32"}) == [3, 17]
    assert round_dims(opsdk.get_op("dense_q4"), [3, 17]) == [3, 32]


@pytest.mark.parametrize(("target", "rule", "claim"), [("x86", "x86.qwdense_vnni", "vpdpbusd"),
                                                       ("arm-dotprod", "neon.qwdense_dotprod",
                                                        "sdot")])
def test_explain_names_the_integer_rule_for_the_q8_0_layout(capsys, target, rule, claim):
    from opsdk.cli import main

    if target == "x86" and not _has_vnni():
        pytest.skip("the host has no AVX-512 VNNI")
    assert main(["explain", "dense_q4", "--target", target, "--layout", "q8_0",
                 "--no-asm"]) == 0
    out = capsys.readouterr().out
    assert f"rule    {rule}" in out and f"insn:{claim}" in out
    assert main(["explain", "dense_q4", "--target", target, "--layout", "q9", "--no-asm"]) == 2
    assert "has the layouts float32, q8_0" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [1, 4])
def test_residual_add_after_a_bias_free_layer(rows):
    """``x + dense(x)`` (a residual): with one row the residual reads as a per-feature bias
    and joins the kernel (it used to crash on the untyped reshape); with more rows it is not
    a bias and stays an add. Numbers right either way."""
    from opsdk.ops.dense_q4 import dense_q4 as q4op
    from opsdk.transform import FuseIntoOps

    rng = np.random.default_rng(0)
    qs, d = quantize_q4_0((rng.standard_normal((64, 64)) * 0.1).astype("float32"))
    x = relax.Var("x", relax.TensorType((rows, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(opsdk.relax.dense_q4(x, relax.const(qs), relax.const(d), None))
            z = bb.emit_output(relax.op.add(x, y))
        bb.emit_func_output(z)
    mod = FuseIntoOps()(bb.get())
    assert ("R.add(" in mod["main"].script()) == (rows > 1)
    xv = rng.standard_normal((rows, 64)).astype("float32")
    vm = relax.VirtualMachine(opsdk.compile(mod, "x86"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(xv)).numpy()
    ref = xv + q4op.run_reference({"x": xv, "qs": qs, "d": d}, {})
    assert np.abs(got - ref).max() < 1e-5


# ------------------------------------------------------------------ take_q4: the table's rows
# 16 x 4 and 4 x 4 channels (q8_0), the float rules' GEMV packing (16 lanes), unpacked
_TAKE_PACKINGS = ["vpdpbusd", "sdot", "float", None]


def _take_schedule(schedule, op, phs, kernel):
    """``op``'s function on ``phs`` scheduled for ``kernel``'s packing (see above), with the
    ``activations`` attribute that packing serves."""
    from opsdk.schedules._core import accumulator_registers
    from opsdk.schedules.arm_cpu.dotprod import Q8_SDOT
    from opsdk.schedules.cpu.vnni import Q8_VNNI

    tgt = opsdk.target("x86")
    qk = {"vpdpbusd": Q8_VNNI, "sdot": Q8_SDOT}.get(kernel)
    acts = "q8_0" if qk is not None else "float32"
    func = te.create_prim_func([*phs, op.call_compute(phs, {"activations": acts})])
    sch = schedule(func, tgt, qk, acc_regs=accumulator_registers(tgt) if kernel else None)
    assert ('sblock("wp"' in sch.mod["main"].script()) == (kernel is not None)
    return sch, tgt


@pytest.mark.parametrize("kernel", _TAKE_PACKINGS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_take_q4_gathers_rows_bit_exactly_from_every_packing(kernel, dtype) -> None:
    """Each rule's gather against the reference, bit for bit: rows from the VNNI and the sdot
    packings (the gather itself uses no dot-product instruction, so both run on any x86
    host; the table is packed in the kernel here, a runtime input), from the float32
    rules' GEMV packing and from the plain bytes; N not a multiple of any channel tile,
    indices clipped at both ends, a symbolic count."""
    from opsdk.schedules._qwgemm import schedule_take_q4

    rng = np.random.default_rng(3)
    n, k = 70, 96
    qs, d = quantize_q4_0(rng.standard_normal((n, k)).astype("float32"))
    ids = np.array([0, 69, -3, 70, 1000, 5, 64, 63, 16], "int32")
    d = d.astype(dtype)
    op = opsdk.get_op("take_q4")
    phs = [te.placeholder(qs.shape, "uint8", name="qs"), te.placeholder(d.shape, dtype, name="d"),
           te.placeholder((te.var("t", "int64"),), "int32", name="indices")]
    sch, tgt = _take_schedule(schedule_take_q4, op, phs, kernel)
    out = tvm.runtime.empty((len(ids), k), "float32")
    tvm.compile(sch.mod, target=tgt)["main"](*[tvm.runtime.tensor(a) for a in (qs, d, ids)],
                                             out)
    want = op.run_reference({"qs": qs, "d": d, "indices": ids}, {})
    np.testing.assert_array_equal(out.numpy(), want.astype("float32"))


@pytest.mark.parametrize("kernel", _TAKE_PACKINGS)
def test_take_w8_gathers_rows_bit_exactly_from_every_packing(kernel) -> None:
    """take_w8 as take_q4 above: rows from the VNNI packing (weights stored + 128), the sdot
    one, the float rules' GEMV packing and the plain bytes, bit for bit; N not a multiple of
    a channel tile, indices clipped at both ends, a symbolic count."""
    from opsdk.ops.dense_w8 import quantize_w8
    from opsdk.schedules._qwgemm import schedule_take_w8

    rng = np.random.default_rng(4)
    n, k = 70, 96
    w, s = quantize_w8(rng.standard_normal((n, k)).astype("float32"))
    ids = np.array([0, 69, -3, 70, 1000, 5, 64, 63, 16], "int64")
    op = opsdk.get_op("take_w8")
    phs = [te.placeholder(w.shape, "int8", name="w"), te.placeholder(s.shape, "float32",
                                                                     name="w_scale"),
           te.placeholder((te.var("t", "int64"),), "int64", name="indices")]
    sch, tgt = _take_schedule(schedule_take_w8, op, phs, kernel)
    out = tvm.runtime.empty((len(ids), k), "float32")
    tvm.compile(sch.mod, target=tgt)["main"](*[tvm.runtime.tensor(a) for a in (w, s, ids)],
                                             out)
    want = op.run_reference({"w": w, "w_scale": s, "indices": ids}, {})
    np.testing.assert_array_equal(out.numpy(), want.astype("float32"))


@pytest.mark.parametrize("activations", [pytest.param("q8_0", marks=_VNNI), "float32"])
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_decoder_embedding_reads_the_lm_heads_packed_table(mode, activations) -> None:
    """GPT-2 ties its embedding and LM head: the gather runs on the head's packing (q8_0
    activations: x86.take_q4_vnni / x86.take_w8_vnni; float32: x86.take_q4 / x86.take_w8 on
    x86.wdense's one-row GEMV packing), so after the folding both kernels read the same
    packed bytes and the table's plain bytes are no constant of the module (float32 held
    them beside the head's packing: GPT-2-small int4 97.7 MiB for 69.6 of weights)."""
    from opsdk.llm import DecoderConfig, build_decoder, random_weights

    take_op, dense_op = {"int4": ("take_q4", "dense_q4"), "int8": ("take_w8", "dense_w8")}[mode]
    cfg = DecoderConfig(vocab=200, width=64, layers=1, heads=2, positions=16)
    mod = opsdk.transform.FuseIntoOps()(build_decoder(random_weights(cfg), weights_mode=mode,
                                                      activations=activations))
    q8 = activations == "q8_0"
    t = opsdk.target("x86")
    with t:
        low = opsdk.pipeline(t)(mod)
    reads: dict[str, list] = {}  # the gather's and the head's kernel -> constants read

    def visit(e) -> None:  # the VM's calls: kernel(inputs..., output)
        if not (isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.GlobalVar)):
            return
        f = low[e.op]
        op = str((f.attrs or {}).get("opsdk.op", ""))
        if op == take_op or (op == dense_op and int(f.params[-1].shape[-1]) == cfg.vocab):
            rule = {take_op: f"x86.{take_op}" + ("_vnni" if q8 else ""),
                    dense_op: "x86.qwdense_vnni" if q8 else "x86.wdense"}[op]
            assert f.attrs["opsdk.rule"] == rule
            reads.setdefault(op, []).extend(a.value for a in e.args
                                            if isinstance(a, tvm.ir.expr.GenericConst))

    shapes = []
    for name in ("prefill", "decode"):
        relax.analysis.post_order_visit(low[name].body, visit)
        relax.analysis.post_order_visit(low[name].body, lambda e: shapes.append(
            tuple(e.value.shape)) if isinstance(e, tvm.ir.expr.GenericConst)
            and isinstance(e.value, tvm.runtime.Tensor) else None)
    take = {a.__chandle__() for a in reads[take_op]}
    head = {a.__chandle__() for a in reads[dense_op]}
    if mode == "int4":
        assert (cfg.vocab, cfg.width // 2) not in shapes, "the table's plain bytes are kept"
        assert (cfg.vocab, cfg.width // 32) not in shapes, "the table's plain scales are kept"
        assert len(take) == 2 and take <= head  # wp, dp: the head's own
    else:
        assert (cfg.vocab, cfg.width) not in shapes, "the table's plain bytes are kept"
        # wp is the head's own; the per-row scales (vocab floats) are read as they are, and
        # the float kernel reads them so too (the q8_0 one pads its own copy)
        assert len(take) == 2 and len(take & head) == (1 if q8 else 2)
