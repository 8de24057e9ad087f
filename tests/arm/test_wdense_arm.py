"""The q8_0 weight-only dense kernels on ``sdot`` (``neon.qwdense_dotprod``) under emulated
aarch64 (cortex-a76): a decode GEMV and a prefill GEMM of each op within the error model, with
the quantized activations and integer block sums exact; on a CPU without dotprod the
generic lowering takes ``activations="q8_0"``."""

from __future__ import annotations

import pytest

import opsdk
from opsdk.verify import Case, run_case

pytestmark = pytest.mark.arm


@pytest.fixture(scope="module", autouse=True)
def _arm_env():
    from opsdk.runners import setup_arm

    setup_arm(log=lambda *_: None)


@pytest.mark.parametrize("op", ["dense_q4", "dense_w8"])
@pytest.mark.parametrize(("shape", "n", "act"), [((1, 768), 37, "gelu_tanh"),
                                                 ((19, 96), 21, "silu")])
@pytest.mark.parametrize(("target", "rule"), [("arm-dotprod", "neon.qwdense_dotprod"),
                                              ("arm", "generic")])
def test_q8_0_on_sdot_and_without_it(op: str, shape, n: int, act: str, target: str,
                                     rule: str) -> None:
    d = opsdk.get_op(op)
    case = Case(op, target, "float32", "q8_0", shape,
                {**d.default_attrs(), "activation": act, "activations": "q8_0"},
                ("bias",), {}, 0, static=True, free={"N": n})
    res = run_case(case)
    assert res.ok, res.format(tir=False)
    assert res.rule == rule
