"""The INT8 ops through verify on the host: bit-exact (integer and float32 outputs alike), static
builds keyed by their free dims, and a failure on a log-uniform attribute whose printed
reproducer replays the exact value."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
from tvm import te, tirx

import opsdk
from opsdk.verify import Case, Profile, StrategyKnobs, run_case, verify

INT8 = [d.name for d in opsdk.ops.INT8_OPS]


def test_int8_ops_are_builtin_and_verify_bit_exactly() -> None:
    assert all(opsdk.get_op(n).source == "builtin" for n in INT8)
    report = verify(INT8, "host", seed=0, max_examples=3, database=None, lints=False,
                    refusals=False)
    bad = [f.format(tir=False) for f in report.failures]
    bad += [f"{c.op} {c.dtype} {c.layout}: {c.error}" for c in report.cells if c.error]
    assert report.ok, "\n\n".join(bad)
    assert len(report.cells) == 28  # qconv2d: 5 layouts x 2 activation dtypes
    # exact: no cell has any error, including the float32 outputs of dequantize, qdense and
    # qconv2d
    assert all(c.max_ulps == 0 and c.ratio == 0 for c in report.cells), [
        (c.op, c.dtype, c.layout, c.max_ulps) for c in report.cells if c.max_ulps or c.ratio
    ]


def test_static_builds_are_keyed_by_their_free_dims() -> None:
    # Two static builds of qdense with the same x shape but another N are different kernels
    # (the cache once handed the N=5 kernel to the N=1 case).
    attrs = {**opsdk.get_op("qdense").default_attrs(), "out_dtype": "float32"}
    base = Case("qdense", "host", "uint8", "float32", (128, 1), attrs, ("bias",), {}, 0,
                static=True)
    for n in (5, 1):
        res = run_case(Case(**{**base.__dict__, "free": {"N": n}}))
        assert res.status == "pass", res.message


def _ref(x, *, scale=1.0):
    return x * np.float32(scale)


def demo_f16_scale(x: opsdk.Tensor, *, scale: float = 1.0) -> te.Tensor:
    # bug: the scale is rounded to float16 (exact for the first value, 1.0, not for most)
    s = tirx.const(float(np.float16(scale)), "float32")
    return te.compute(x.shape, lambda *i: x(*i) * s, name="y")


_MUTANT = opsdk.op(reference=_ref, dtypes=("float32",), domain={"x": (-2.0, 2.0)},
                   attr_domain={"scale": opsdk.log_uniform(1e-3, 1e3)})(demo_f16_scale)


@pytest.fixture
def mutant():
    opsdk.register(_MUTANT)
    yield _MUTANT
    opsdk.unregister(_MUTANT)


def test_failure_on_a_log_uniform_attribute_replays_exactly(mutant) -> None:
    profile = Profile("random", 40, StrategyKnobs(p_common=50, p_long=0), corners=False,
                      invariance="corners")
    report = verify([mutant], "host", profile=profile, seed=1, database=None, lints=False,
                    refusals=False, fail_fast=True)
    assert not report.ok
    f = report.failures[0]
    scale = f.case.attrs["scale"]
    # shrunk towards the first value (1.0), but not to it: the bug needs a non-float16 scale
    assert scale != 1.0 and float(np.float16(scale)) != scale
    argv = shlex.split(f.reproducer)
    case = Case.from_json(argv[argv.index("--case") + 1])
    assert case == f.case and case.attrs["scale"].hex() == scale.hex()
    again = run_case(case, op=mutant)
    assert (again.status, again.index, again.got, again.expected) == (
        f.status, f.index, f.got, f.expected
    )
