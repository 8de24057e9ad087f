"""Runners: aarch64 kernels executed under qemu-user through TVM RPC, checked against numpy.

Needs the cross compiler and qemu-user (installed by ``opsdk setup arm`` when run as root) and
the aarch64 Python sysroot that :func:`opsdk.runners.setup_arm` prepares once per user cache.
One emulated server is shared by the module to keep the run short.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, te

from opsdk.runners import (
    DeviceCrash,
    DeviceTimeout,
    EmulatedRunner,
    LocalRunner,
    RPCRunner,
    arm_ready,
    arm_tools_available,
    runner_for,
    setup_arm,
)

pytestmark = pytest.mark.arm

N = 1024
ARM_NEON = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
ARM_DOTPROD = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]}
ARM_SVE = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+sve"]}
TIMINGS: dict[str, float] = {}


# -- kernels -----------------------------------------------------------------------------------


def _fma_kernel(target: dict, lanes: object = 4) -> tvm.runtime.Executable:
    """c = a * b + a, the inner loop split by ``lanes`` and vectorized."""
    a = te.placeholder((N,), "float32", name="a")
    b = te.placeholder((N,), "float32", name="b")
    c = te.compute((N,), lambda i: a[i] * b[i] + a[i], name="c")
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    (i,) = sch.get_loops(sch.get_sblock("c"))
    _, inner = sch.split(i, [None, lanes])
    sch.vectorize(inner)
    return tvm.compile(sch.mod, target=tvm.target.Target(target))


def _copy_kernel(dtype: str, target: dict) -> tvm.runtime.Executable:
    a = te.placeholder((64,), dtype, name="a")
    b = te.compute((64,), lambda i: a[i], name="b")
    return tvm.compile(te.create_prim_func([a, b]), target=tvm.target.Target(target))


def _relax_kernel(dtype: str, target: dict) -> tvm.runtime.Executable:
    """main(x: dtype, y: f32) -> (cast(2x + y) to dtype, 2x + y in f32), built with emit_te."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), dtype))
    y = relax.Var("y", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            xf = bb.emit_te(
                lambda t: te.compute(t.shape, lambda i, j: t[i, j].astype("float32") * 2.0), x
            )
            s = bb.emit_te(lambda p, q: te.compute(p.shape, lambda i, j: p[i, j] + q[i, j]), xf, y)
            o = bb.emit_te(lambda p: te.compute(p.shape, lambda i, j: p[i, j].astype(dtype)), s)
            gv = bb.emit_output(relax.Tuple([o, s]))
        bb.emit_func_output(gv)
    return tvm.compile(bb.get(), target=tvm.target.Target(target))


def _sdot_kernel(n: int = 16, k: int = 32) -> tvm.runtime.Executable:
    """int8 matrix-vector product with the NEON dot-product instruction (``sdot``).

    ``C[4*i0 + i1] = sum_{k0,k1} A[4*k0 + k1] * Bp[i0, k0, i1, k1]`` (B packed in 4x4 tiles).
    """
    from tvm.script import tirx as T

    @T.prim_func
    def main(
        A: T.Buffer((k,), "int8"),
        Bp: T.Buffer((n // 4, k // 4, 4, 4), "int8"),
        C: T.Buffer((n,), "int32"),
    ):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i0 in range(n // 4):
            C[T.ramp(i0 * 4, 1, 4)] = T.broadcast(T.int32(0), 4)
            for k0 in range(k // 4):
                a32 = T.reinterpret(A.vload([k0 * 4], "int8x4"), dtype="int32")
                C[T.ramp(i0 * 4, 1, 4)] = T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id("llvm.aarch64.neon.sdot.v4i32.v16i8"),
                    C[T.ramp(i0 * 4, 1, 4)],
                    T.reinterpret(T.broadcast(a32, 4), dtype="int8x16"),
                    Bp.vload([i0, k0, 0, 0], "int8x16"),
                    dtype="int32x4",
                )

    return tvm.compile(tvm.IRModule({"main": main}), target=tvm.target.Target(ARM_DOTPROD))


def _spin_kernel() -> tvm.runtime.Executable:
    """Loops while x[1] < 1: never returns for x = 0."""
    from tvm.script import tirx as T

    @T.prim_func
    def main(x: T.Buffer((4,), "float32"), c: T.Buffer((4,), "float32")):
        T.func_attr({"global_symbol": "main"})
        c[0] = T.float32(0)
        while x[1] < T.float32(1.0):
            c[0] = c[0] + x[0]

    return tvm.compile(tvm.IRModule({"main": main}), target=tvm.target.Target(ARM_NEON))


def _asm(ex: tvm.runtime.Executable) -> str:
    return ex.mod.inspect_source("asm")


# -- process helpers ---------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arm_env() -> Path:
    if not arm_tools_available() and os.geteuid() != 0:
        pytest.skip("needs qemu-user-static and g++-aarch64-linux-gnu (run `opsdk setup arm`)")
    fresh = not arm_ready()
    t0 = time.monotonic()
    root = setup_arm(log=lambda msg: print(f"[setup_arm] {msg}"))
    TIMINGS["setup_arm (fresh)" if fresh else "setup_arm (cached)"] = time.monotonic() - t0
    return root


@pytest.fixture(scope="module")
def emu(arm_env: Path):
    runner = EmulatedRunner(cpu="cortex-a72")
    t0 = time.monotonic()
    runner.start()
    TIMINGS["server start"] = time.monotonic() - t0
    pids = runner.server_pids()
    yield runner
    runner.close()
    assert _wait_gone(pids) == [], "processes of the shared emulated server survived close()"
    print("\nrunner timings: " + ", ".join(f"{k} {v:.3f} s" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def vectors() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal(N).astype("float32"), rng.standard_normal(N).astype("float32")


# -- tests -------------------------------------------------------------------------------------


def test_setup_arm_is_idempotent(arm_env: Path) -> None:
    t0 = time.monotonic()
    assert setup_arm(log=lambda msg: None) == arm_env
    assert time.monotonic() - t0 < 1.0
    assert arm_ready()
    assert (arm_env / "stamp.json").is_file()
    site = arm_env / "sysroot" / "usr" / "local" / "lib" / "python3.11" / "dist-packages"
    assert (site / "tvm" / "lib" / "libtvm_runtime.so").is_file()
    assert not list(site.glob("tvm/lib/libtvm_compiler*"))


def test_vectorized_neon_kernel_matches_numpy(emu: EmulatedRunner, vectors) -> None:
    ex = _fma_kernel(ARM_NEON)
    assert re.search(r"\b(fmla|fmul|fadd)\s+v\d+\.4s", _asm(ex)), "no NEON vector arithmetic"
    a, b = vectors
    t0 = time.monotonic()
    (c,) = emu.run(ex, [a, b], outputs=[((N,), "float32")])
    TIMINGS["first run (export+upload+load+call)"] = time.monotonic() - t0
    np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)  # fmla fuses
    t0 = time.monotonic()
    for _ in range(5):
        (c2,) = emu.run(ex, [a, b], outputs=[((N,), "float32")])
    TIMINGS["warm run"] = (time.monotonic() - t0) / 5
    np.testing.assert_array_equal(c2, c)
    assert emu.export(ex) == emu.export(ex)  # exported once per executable
    info = emu.device_info()
    assert info["device"] == "qemu-aarch64 -cpu cortex-a72"
    assert info["arch"] == "aarch64"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_relax_vm_with_half_input(emu: EmulatedRunner, dtype: str) -> None:
    ex = _relax_kernel(dtype, ARM_NEON)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 8)) * 3).astype(np_dtype)
    y = rng.standard_normal((4, 8)).astype("float32")
    out, total = emu.run(ex, [x, y])  # tuple output -> list
    want = x.astype("float32") * 2 + y
    assert out.dtype == np_dtype and total.dtype == np.float32
    np.testing.assert_allclose(total, want, rtol=1e-6)
    np.testing.assert_array_equal(out.astype("float32"), want.astype(np_dtype).astype("float32"))


def test_bfloat16_bits_round_trip(emu: EmulatedRunner) -> None:
    bits = np.array(
        [0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x807F, 0x4049, 0x1234],
        dtype=np.uint16,
    )
    x = np.resize(bits, 64).view(ml_dtypes.bfloat16)
    for runner, target in ((emu, ARM_NEON), (LocalRunner(), {"kind": "llvm"})):
        (y,) = runner.run(_copy_kernel("bfloat16", target), [x], outputs=[((64,), "bfloat16")])
        assert y.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))


def test_missing_instruction_raises_device_crash_and_recovers(emu: EmulatedRunner, vectors) -> None:
    rng = np.random.default_rng(2)
    a8 = rng.integers(-128, 128, 32, dtype=np.int8)
    bp = rng.integers(-128, 128, (4, 8, 4, 4), dtype=np.int8)
    want = bp.transpose(0, 2, 1, 3).reshape(16, 32).astype(np.int32) @ a8.astype(np.int32)
    sdot = _sdot_kernel()
    assert re.search(r"\bsdot\s+v\d+\.4s", _asm(sdot)), "the kernel has no sdot instruction"
    sve = _fma_kernel(ARM_SVE, lanes=4 * tvm.tirx.vscale())
    assert re.search(r"\b(fmad|fmla)\s+z\d+\.s", _asm(sve)), "the kernel has no SVE instruction"
    a, b = vectors

    t0 = time.monotonic()
    with pytest.raises(DeviceCrash, match=r"illegal instruction on emulated cortex-a72") as err:
        emu.run(sdot, [a8, bp], outputs=[((16,), "int32")])
    TIMINGS["crash report"] = time.monotonic() - t0
    assert "lacks" in str(err.value)
    (c,) = emu.run(_fma_kernel(ARM_NEON), [a, b], outputs=[((N,), "float32")])
    np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)

    with pytest.raises(DeviceCrash, match="illegal instruction"):
        emu.run(sve, [a, b], outputs=[((N,), "float32")])
    (c,) = emu.run(_fma_kernel(ARM_NEON), [a, b], outputs=[((N,), "float32")])
    np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)

    # A CPU with dotprod and SVE runs both; closing it leaves no process behind.
    with EmulatedRunner(cpu="max") as full:
        (got,) = full.run(sdot, [a8, bp], outputs=[((16,), "int32")])
        np.testing.assert_array_equal(got, want)
        (c,) = full.run(sve, [a, b], outputs=[((N,), "float32")])
        np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)
        pids = full.server_pids()
        assert pids and all("qemu-aarch64" in _cmdline(p) for p in pids)
    assert full.server_pids() == []
    assert _wait_gone(pids) == [], "qemu processes survived close()"
    full.close()  # idempotent


def test_timeout_raises_and_recovers(emu: EmulatedRunner, vectors) -> None:
    saved, emu.timeout = emu.timeout, 3.0
    starts = emu.server_starts
    try:
        t0 = time.monotonic()
        with pytest.raises(DeviceTimeout, match=r"did not finish within 3\.0 s"):
            emu.run(_spin_kernel(), [np.zeros(4, "float32")], outputs=[((4,), "float32")])
        TIMINGS["time-out + server restart"] = time.monotonic() - t0
    finally:
        emu.timeout = saved
    assert emu.server_starts == starts + 1
    a, b = vectors
    (c,) = emu.run(_fma_kernel(ARM_NEON), [a, b], outputs=[((N,), "float32")])
    np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)


def test_rpc_runner_against_standalone_server(arm_env: Path, vectors, standalone_server) -> None:
    with standalone_server("cortex-a72") as (server, port):
        qemu = [p for p in _descendants(server.pid) if "qemu-aarch64" in _cmdline(p)]
        assert qemu, "no qemu process under the standalone server"

        a, b = vectors
        with runner_for("arm", rpc=f"127.0.0.1:{port}") as remote:
            assert isinstance(remote, RPCRunner)
            assert remote.device_info() == {
                "device": f"rpc 127.0.0.1:{port}",
                "arch": "aarch64",
                "runner": "rpc",
            }
            (c,) = remote.run(_fma_kernel(ARM_NEON), [a, b], outputs=[((N,), "float32")])
            np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)
            x = np.linspace(-4, 4, 32, dtype="float32").reshape(4, 8).astype(ml_dtypes.bfloat16)
            y = np.ones((4, 8), "float32")
            out, total = remote.run(_relax_kernel("bfloat16", ARM_NEON), [x, y])
            np.testing.assert_allclose(total, x.astype("float32") * 2 + 1, rtol=1e-6)
            assert out.dtype == np.dtype(ml_dtypes.bfloat16)
            with pytest.raises(DeviceCrash, match=r"illegal instruction on rpc 127\.0\.0\.1"):
                remote.run(
                    _sdot_kernel(),
                    [np.zeros(32, "int8"), np.zeros((4, 8, 4, 4), "int8")],
                    outputs=[((16,), "int32")],
                )
            (c,) = remote.run(_fma_kernel(ARM_NEON), [a, b], outputs=[((N,), "float32")])
            np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)
    assert server.returncode == 0
    assert _wait_gone(qemu) == [], "qemu processes survived the standalone server"


def test_runner_for_picks_the_runner() -> None:
    assert isinstance(runner_for("x86"), LocalRunner)
    emulated = runner_for("arm")
    assert isinstance(emulated, EmulatedRunner) and emulated.cpu == "cortex-a72"
    assert runner_for("arm", qemu_cpu="max").cpu == "max"
    assert runner_for("arm-dotprod").cpu in ("cortex-a76", "neoverse-n1", "max")
    tracked = runner_for("arm", tracker="10.0.0.1:9190", key="rk3588")
    assert isinstance(tracked, RPCRunner) and "key rk3588" in tracked.device_info()["device"]
    with pytest.raises(ValueError):
        runner_for("arm", tracker="10.0.0.1:9190")


def test_local_runner_prim_func_and_relax(vectors) -> None:
    a, b = vectors
    host = {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}
    with LocalRunner() as local:
        (c,) = local.run(_fma_kernel(host), [a, b], outputs=[((N,), "float32")])
        np.testing.assert_allclose(c, a * b + a, rtol=1e-5, atol=1e-6)
        x = np.arange(32, dtype="float32").reshape(4, 8).astype("float16")
        out, total = local.run(_relax_kernel("float16", host), [x, np.ones((4, 8), "float32")])
        np.testing.assert_array_equal(total, x.astype("float32") * 2 + 1)
        assert out.dtype == np.float16
        assert local.device_info()["device"].startswith("host ")
