"""qdense on aarch64 under qemu: the sdot rule (Cortex-A76) and the plain NEON rule (Cortex-A72)
bit-exact against the reference over the host tests' case matrix, and an sdot kernel on a CPU
without the dot-product extension failing loudly (illegal instruction), not silently.

Needs the cross compiler, qemu-user and the aarch64 sysroot (``opsdk setup arm``); skipped
cleanly when :func:`opsdk.runners.arm_ready` is false.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tvm

import opsdk
from opsdk._asm import asm_of
from opsdk.ops.qdense import qdense
from opsdk.runners import DeviceCrash, EmulatedRunner, arm_ready
from opsdk.schedules import last_choices

pytestmark = [
    pytest.mark.arm,
    pytest.mark.skipif(not arm_ready(), reason="aarch64 emulation not set up (opsdk setup arm)"),
]


def _host_module(filename: str) -> Any:
    """A test module of tests/host (its case matrix and helpers), loaded once by path."""
    name = f"opsdk_host_{Path(filename).stem}"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "host" / filename
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being built
        spec.loader.exec_module(module)
    return sys.modules[name]


C = _host_module("test_int8_schedules.py")  # the qdense case matrix
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def timings() -> Iterator[None]:
    yield
    print("\nint8 arm timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def cases() -> list:
    return C.make_cases()


def _build(cases: list, target: str) -> tuple[Any, set[str], str]:
    t0 = time.monotonic()
    before = len(last_choices())
    ex = tvm.compile(C.case_module(cases), target=opsdk.target(target))
    rules = {c.rule for c in last_choices()[before:] if c.op == "qdense"}
    TIMINGS[f"compile {target}"] = time.monotonic() - t0
    return ex, rules, asm_of(ex)


def _runner(cpu: str) -> Iterator[EmulatedRunner]:
    t0 = time.monotonic()
    runner = EmulatedRunner(cpu=cpu)
    runner.start()
    TIMINGS[f"start {cpu}"] = time.monotonic() - t0
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def a76() -> Iterator[EmulatedRunner]:
    yield from _runner("cortex-a76")


@pytest.fixture(scope="module")
def a72() -> Iterator[EmulatedRunner]:
    yield from _runner("cortex-a72")


@pytest.fixture(scope="module")
def dotprod_build(cases) -> tuple[Any, set[str], str]:
    return _build(cases, "arm-dotprod")


def _check_on(runner: EmulatedRunner, ex: Any, cases: list, label: str) -> None:
    t0 = time.monotonic()
    result = C.check_cases(cases, lambda name, ins: runner.run(ex, ins, entry=name)[0])
    TIMINGS[f"run {label} ({len(cases) * len(C.MS)} calls)"] = time.monotonic() - t0
    sat = {k: result.pop(k) for k in ("sat_lo", "sat_hi")}
    assert result == {}, f"mismatching cases: {result}"
    assert sat["sat_lo"] > 0 and sat["sat_hi"] > 0, sat


def test_sdot_rule_is_bit_exact_on_cortex_a76(cases, dotprod_build, a76) -> None:
    ex, rules, asm = dotprod_build
    assert rules == {"neon.qdense_dotprod"}
    assert len(re.findall(r"^\s*sdot\s+v\d+\.4s", asm, flags=re.M)) >= len(cases)
    _check_on(a76, ex, cases, "sdot on cortex-a76")


def test_neon_rule_is_bit_exact_on_cortex_a72(cases, a72) -> None:
    subset = cases[::3]  # every layout and activation dtype, a third of the shapes
    ex, rules, asm = _build(subset, "arm")
    assert rules == {"neon.qdense"}
    assert not re.search(r"^\s*[su]dot\s", asm, flags=re.M), "dot-product code for plain NEON"
    assert re.search(r"^\s*smull\s+v\d+\.8h", asm, flags=re.M)
    _check_on(a72, ex, subset, "neon on cortex-a72")


def test_sdot_kernel_on_cortex_a72_is_an_illegal_instruction(cases, dotprod_build, a72) -> None:
    ex, _, _ = dotprod_build
    case = cases[0]
    with pytest.raises(DeviceCrash, match="illegal instruction"):
        a72.run(ex, list(case.at(7).values()), entry=case.name)
    # The runner recovers: a NEON kernel still runs on the same emulated CPU afterwards.
    neon, _, _ = _build([case], "arm")
    (out,) = a72.run(neon, list(case.at(7).values()), entry=case.name)
    assert np.array_equal(out, qdense.run_reference(case.at(7), case.attrs))


# ----------------------------------------------------------------------------- qconv2d


@pytest.mark.parametrize(
    ("target", "rule", "insn", "absent"),
    [("arm-dotprod", "neon.qconv2d_dotprod", r"sdot\s+v\d+\.4s", r"smull\s+v\d+\.8h"),
     ("arm", "neon.qconv2d", r"smull\s+v\d+\.8h", r"[su]dot\s")],
)
def test_qconv2d_rules_are_bit_exact(target, rule, insn, absent, a76) -> None:
    # Both rules on the Cortex-A76 emulation (it has the dot product; the plain NEON rule
    # does not use it, checked in the asm). Depthwise cases get their own NEON rule.
    Q = _host_module("test_qconv2d.py")
    cases = Q.make_cases()
    if target == "arm":
        cases = cases[::2]  # every layout and dtype, half the geometries
    t0 = time.monotonic()
    ex, rules = Q.compile_cases(cases, target)
    TIMINGS[f"qconv2d compile {target}"] = time.monotonic() - t0
    dw = sum(c.attrs["depthwise"] for c in cases)
    assert rules == {rule: len(cases) - dw, **({"neon.qconv2d_depthwise": dw} if dw else {})}
    asm = asm_of(ex)
    assert re.search(rf"^\s*{insn}", asm, flags=re.M), f"no {insn} in the {target} kernels"
    assert not re.search(rf"^\s*{absent}", asm, flags=re.M)
    t0 = time.monotonic()
    result = Q.check_cases(cases, lambda name, ins: a76.run(ex, ins, entry=name)[0])
    TIMINGS[f"qconv2d run {target}"] = time.monotonic() - t0
    sat = {k: result.pop(k) for k in ("sat_lo", "sat_hi")}
    assert result == {}, f"mismatching cases: {result}"
    assert sat["sat_lo"] > 0 and sat["sat_hi"] > 0, sat
