"""A model quantized by ``opsdk.quant.quantize_model`` compiles for aarch64 (NEON ``smull``
and dot-product ``sdot`` rules) and, run under emulation, gives the host's result bit for bit
(quantize, the int8 dot products and the float32 rescale are the same IEEE operations)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import opsdk
from opsdk.quant import quantize_model
from opsdk.runners import runner_for

pytestmark = pytest.mark.arm


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)


def test_quantized_mlp_is_bit_exact_on_arm_and_arm_dotprod():
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((2, 8, 64), "float32"))
    w1 = relax.const(rng.standard_normal((64, 96)).astype("float32"))
    w2 = relax.const(rng.standard_normal((96, 32)).astype("float32"))
    b2 = relax.const(rng.standard_normal(32).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.relu(relax.op.matmul(x, w1)))
            y = bb.emit(relax.op.matmul(h, w2))
            y = bb.emit_output(relax.op.add(y, b2))
        bb.emit_func_output(y)
    data = [rng.standard_normal((2, 8, 64)).astype("float32") for _ in range(4)]
    qm = quantize_model(bb.get(), data)
    assert qm.quantized == ["dense0", "dense1"]
    host = relax.VirtualMachine(opsdk.compile(qm.mod, "x86"), tvm.cpu())
    want = host["main"](tvm.runtime.tensor(data[0])).numpy()
    for target, rule in (("arm", "neon.qdense"), ("arm-dotprod", "neon.qdense_dotprod")):
        rep = opsdk.model.report(qm.mod, target, profile=False, asm=False)
        assert not rep.problems, rep.problems
        assert {k.rule for k in rep.kernels if k.kind == "opsdk.qdense"} == {rule}, target
        with runner_for(target) as r:
            (got,) = r.run(opsdk.compile(qm.mod, target), [data[0]])
        assert np.array_equal(got, want), target


def test_quantized_convs_are_bit_exact_on_arm_and_arm_dotprod():
    # conv -> ReLU6 -> depthwise -> ReLU6 -> conv, all int8 between (a chain), run in NHWC.
    rng = np.random.default_rng(0)
    w1 = relax.const((rng.standard_normal((24, 5, 3, 3)) * 0.3).astype("float32"))
    wd = relax.const((rng.standard_normal((24, 1, 3, 3)) * 0.3).astype("float32"))
    w3 = relax.const(rng.standard_normal((8, 24, 1, 1)).astype("float32"))
    x = relax.Var("x", relax.TensorType((1, 5, 10, 11), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.clip(relax.op.nn.conv2d(x, w1, padding=1), 0.0, 6.0))
            y = bb.emit(relax.op.nn.conv2d(y, wd, strides=2, padding=1, groups=24))
            y = bb.emit(relax.op.clip(y, 0.0, 6.0))
            y = bb.emit_output(relax.op.nn.conv2d(y, w3))
        bb.emit_func_output(y)
    data = [rng.standard_normal((1, 5, 10, 11)).astype("float32") for _ in range(4)]
    qm = quantize_model(bb.get(), data)
    assert qm.quantized == ["conv0", "conv1", "conv2"]
    host = relax.VirtualMachine(opsdk.compile(qm.mod, "x86"), tvm.cpu())
    want = host["main"](tvm.runtime.tensor(data[0])).numpy()
    for target, rule in (("arm", "neon.qconv2d"), ("arm-dotprod", "neon.qconv2d_dotprod")):
        rep = opsdk.model.report(qm.mod, target, profile=False, asm=False)
        assert not rep.problems, rep.problems
        rules = sorted(k.rule for k in rep.kernels if k.kind == "opsdk.qconv2d")
        assert rules == sorted([rule, rule, "neon.qconv2d_depthwise"]), (target, rules)
        with runner_for(target) as r:
            (got,) = r.run(opsdk.compile(qm.mod, target), [data[0]])
        assert np.array_equal(got, want), target
