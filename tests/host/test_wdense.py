"""The weight-only dense ops (``dense_w8``, ``dense_q4``): their quantizers (ggml q4_0 byte
for byte), the K check, both shapes of the rule (GEMV for decode, dequantized-panel GEMM for
prefill) through verify's static builds, and the model path (packing folded at compile time,
activation in the kernel)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

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
