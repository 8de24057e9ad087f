"""SIMD width and register count come from the CPU's features, never from an assumption.

TVM 0.27's ``llvm_get_vector_width`` answers 512 bits for every x86 CPU. Trusted, it gave an
AVX2-only CPU (Zen 3, Haswell) 16-lane vectors and 24-vector accumulator tiles: each
"vector" two ymm registers, 48 accumulators for 16 registers, a spill on every step (a
128x768x768 matmul at 20 GF/s on one Zen 3 core, 72 with 8 lanes and 12 accumulators). The
rules now size vectors and tiles from :func:`opsdk.targets.vector_bits` and
:func:`opsdk.targets.vector_registers`. Schedules for other CPUs are only inspected here, so
the checks hold on any host; the AVX2 one is also compiled (every x86-64 host the suite runs on
has AVX2) and its hot loop read.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, tirx

import opsdk
from opsdk._asm import asm_of
from opsdk.schedules import apply_schedule, kernel_for
from opsdk.schedules._core import accumulator_registers, vector_lanes
from opsdk.targets import target_arch, vector_bits, vector_registers

# The hot-loop finder lives beside the int8 schedule tests; pytest's importlib mode puts no
# test folder on sys.path, so this file puts its own there (as test_verify_power does).
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_int8_schedules import basic_blocks_with

# (mcpu, vector bits, registers): AVX2-only, AVX-512, and baseline SSE CPUs.
X86_CPUS = [
    ("haswell", 256, 16),
    ("znver3", 256, 16),
    ("skylake-avx512", 512, 32),
    ("znver4", 512, 32),
    ("x86-64", 128, 16),
]


def _x86(mcpu: str, **extra) -> tvm.target.Target:
    return opsdk.target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu, **extra})


@pytest.mark.parametrize(("mcpu", "bits", "regs"), X86_CPUS, ids=[c[0] for c in X86_CPUS])
def test_x86_width_and_registers_follow_the_cpu_features(mcpu, bits, regs):
    t = _x86(mcpu)
    assert (vector_bits(t), vector_registers(t)) == (bits, regs)
    assert vector_lanes(t, 32) == max(bits // 32, 4)
    assert accumulator_registers(t) == regs * 3 // 4


def test_an_mattr_that_removes_avx512_drops_to_avx2():
    t = _x86("skylake-avx512", mattr=["-avx512f"])
    assert (vector_bits(t), vector_registers(t)) == (256, 16)


@pytest.mark.parametrize("name", ["arm", "arm-dotprod"])
def test_aarch64_has_128_bit_vectors_in_32_registers(name):
    t = opsdk.target(name)
    assert (vector_bits(t), vector_registers(t), accumulator_registers(t)) == (128, 32, 24)


def _matmul(m: int, n: int, k: int) -> tirx.PrimFunc:
    a = te.placeholder((m, k), name="a")
    b = te.placeholder((k, n), name="b")
    r = te.reduce_axis((0, k), "k")
    y = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="y")
    return te.create_prim_func([a, b, y])


def _scheduled(f: tirx.PrimFunc, tgt) -> tirx.PrimFunc:
    with tgt:
        out = apply_schedule(kernel_for("mm", f), f, tgt)
    assert str(out.attrs["opsdk.rule"]) == "x86.matmul"
    return out


def _tile(func: tirx.PrimFunc) -> tuple[int, int]:
    """(vector lanes, accumulator vectors) of a scheduled matmul's update block: its
    vectorized loop, and the unrolled loops inside its reduction loop (rows x column
    vectors of the register tile)."""
    found: list[list] = []

    def visit(stmt, loops):
        if isinstance(stmt, tirx.For):
            visit(stmt.body, [*loops, stmt])
        elif isinstance(stmt, s_tir.SBlockRealize):
            if str(stmt.block.name_hint).endswith("_update"):
                found.append(loops)
            visit(stmt.block.body, loops)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                visit(s, loops)
        elif hasattr(stmt, "body"):
            visit(stmt.body, loops)

    visit(func.body, [])
    assert len(found) == 1, len(found)
    loops = found[0]
    assert loops[-1].kind == tirx.ForKind.VECTORIZED
    k = max(i for i, lp in enumerate(loops) if lp.kind == tirx.ForKind.SERIAL)
    vecs = 1
    for lp in loops[k + 1:-1]:
        assert lp.kind == tirx.ForKind.UNROLLED, lp.kind
        vecs *= int(lp.extent)
    return int(loops[-1].extent), vecs


@pytest.mark.parametrize(("mcpu", "bits", "regs"), X86_CPUS[:4], ids=[c[0] for c in X86_CPUS[:4]])
def test_the_matmul_tile_fits_the_register_file(mcpu, bits, regs):
    lanes, vecs = _tile(_scheduled(_matmul(128, 768, 768), _x86(mcpu)))
    assert lanes == bits // 32
    # The accumulator tile holds at most 3/4 of the registers, and uses them: a tile of a
    # few vectors would leave the FMA units waiting on loads.
    assert regs // 2 <= vecs <= regs * 3 // 4, (vecs, regs)


@pytest.mark.parametrize(("mcpu", "bits", "regs"), X86_CPUS[:4], ids=[c[0] for c in X86_CPUS[:4]])
def test_a_gemv_with_an_awkward_n_keeps_several_full_width_accumulators(mcpu, bits, regs):
    # A classifier head (1 x 1280 x 1000): 1000 = 125 x 8, so the dividing tile was one
    # 8-lane accumulator, its FMA latency exposed (30 GB/s of weights on a Zen 4 core); N is
    # padded to full-width tiles with at least 3 accumulators instead.
    lanes, vecs = _tile(_scheduled(_matmul(1, 1000, 1280), _x86(mcpu)))
    assert lanes == bits // 32 and vecs >= 3, (lanes, vecs)


def _check_matmul_numbers(m: int, n: int, k: int, seed: int) -> None:
    """The host's scheduled m x n x k matmul against float64 within a sum of k products'
    bound, gamma_k * sum |a||b| (float32 unit roundoff 2^-24): every column computed."""
    tgt = opsdk.target("x86")
    out = _scheduled(_matmul(m, n, k), tgt)
    f = tvm.compile(tvm.IRModule({"main": out.with_attr("global_symbol", "main")}), target=tgt)
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (m, k)).astype("float32")
    b = rng.uniform(-1, 1, (k, n)).astype("float32")
    y = tvm.runtime.empty((m, n), "float32")
    f(tvm.runtime.tensor(a), tvm.runtime.tensor(b), y)
    ref = a.astype("float64") @ b.astype("float64")
    bound = k * 2.0 ** -24 * (np.abs(a).astype("float64") @ np.abs(b).astype("float64"))
    assert np.all(np.abs(y.numpy() - ref) <= bound)


def test_the_padded_gemv_computes_every_column():
    _check_matmul_numbers(1, 1000, 1280, seed=2)


@pytest.mark.parametrize("mcpu", ["haswell", "znver4"])
def test_an_n_only_an_odd_vector_divides_is_padded_to_register_vectors(mcpu):
    # Swin's windows: 49 x 49 attention scores. N = 49 took one 49-lane vector, an
    # accumulator row LLVM kept on the stack (10 GFLOP/s); it is padded to whole register
    # vectors now (2.98 -> 0.22 ms for 192 windows, one Zen 4, 2 threads).
    tgt = _x86(mcpu)
    lanes, vecs = _tile(_scheduled(_matmul(49, 49, 32), tgt))
    assert lanes == vector_bits(tgt) // 32 and vecs >= 1, (lanes, vecs)


def test_the_odd_n_matmul_computes_every_column():
    _check_matmul_numbers(49, 49, 32, seed=3)


@pytest.mark.skipif(target_arch(opsdk.target("x86")) != "x86_64", reason="x86-64 host only")
def test_the_avx2_matmul_keeps_its_accumulators_in_registers():
    # The hot loop (the basic block with the most FMAs) has a 12-accumulator tile's FMAs
    # and touches no stack slot: a tile larger than the 16 ymm registers spills there.
    tgt = _x86("haswell")
    out = _scheduled(_matmul(128, 768, 768), tgt)
    ex = tvm.compile(tvm.IRModule({"main": out.with_attr("global_symbol", "main")}),
                     target=tgt)
    hot = max(basic_blocks_with(asm_of(ex), "vfmadd"),
              key=lambda b: sum(ln.startswith("vfmadd") for ln in b))
    fmas = [ln for ln in hot if ln.startswith("vfmadd")]
    assert len(fmas) >= 12, hot
    assert all("%ymm" in ln and "%zmm" not in ln for ln in fmas), fmas
    assert not [ln for ln in hot if "(%rsp)" in ln or "(%rbp)" in ln], hot
