"""The kernel cache (opsdk._kernelcache): a second compile of a model reuses every compiled
kernel with bit-identical outputs, an edited layer recompiles only its kernel, a damaged or
stale entry is rebuilt, never trusted, and ``opsdk build --timings`` states the phases."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tvm
from tvm import relax

import opsdk
from opsdk.cli import main as cli
from opsdk.model import compile_model, record_timings

ROOT = pathlib.Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((16, 8, 3, 3)).astype("float32")
W2 = RNG.standard_normal((24, 16)).astype("float32")
X = RNG.standard_normal((1, 8, 12, 12)).astype("float32")


def _module(act: str = "silu") -> tvm.IRModule:
    """conv + relu -> mean over H, W -> dense + ``act``: a few kernels, small shapes."""
    x = relax.Var("x", relax.TensorType(X.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, relax.const(W1), padding=1)))
            y = bb.emit(relax.op.mean(y, axis=[2, 3]))
            y = relax.op.matmul(y, relax.op.permute_dims(relax.const(W2)))
            y = bb.emit_output(getattr(relax.op.nn, act)(y))
        bb.emit_func_output(y)
    return bb.get()


def _run(ex) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(X)).numpy()


@pytest.fixture
def kcache(tmp_path, monkeypatch) -> pathlib.Path:
    """The kernel cache on in a temporary folder, the whole-model cache off (so that every
    compile goes through the kernel cache)."""
    monkeypatch.delenv("OPSDK_NO_CACHE", raising=False)
    monkeypatch.delenv("OPSDK_NO_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("OPSDK_NO_MODEL_CACHE", "1")
    root = tmp_path / "kernels"
    monkeypatch.setenv("OPSDK_KERNEL_CACHE_DIR", str(root))
    return root


def _entries(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


def test_warm_compile_reuses_every_kernel_with_bit_identical_outputs(kcache):
    ref = _run(opsdk.compile(_module(), "x86"))  # one tvm.compile of the whole model
    cold = compile_model(_module(), "x86")
    warm = compile_model(_module(), "x86")  # a new, equal module
    n = len(cold.kernels)
    assert n >= 3
    assert (len(cold.kernel_build.hits), len(cold.kernel_build.misses)) == (0, n)
    assert (len(warm.kernel_build.hits), len(warm.kernel_build.misses)) == (n, 0)
    assert len(_entries(kcache)) == n
    np.testing.assert_array_equal(_run(cold.ex), ref)
    np.testing.assert_array_equal(_run(warm.ex), ref)
    assert warm.kernels == cold.kernels
    assert warm.library.is_file()  # what an artifact copies
    assert warm.timings["kernel codegen"] < cold.timings["kernel codegen"]


def test_an_edited_layer_recompiles_only_its_kernel(kcache):
    compile_model(_module("silu"), "x86")
    edited = compile_model(_module("relu"), "x86")
    assert len(edited.kernel_build.misses) == 1
    assert "matmul" in edited.kernel_build.misses[0]
    assert len(edited.kernel_build.hits) == len(edited.kernels) - 1
    ref = _run(compile_model(_module("relu"), "x86", cache=False).ex)
    np.testing.assert_array_equal(_run(edited.ex), ref)


def test_key_ignores_names_and_holds_structure(tmp_path):
    """Parameter and buffer names come from the model's variables, which an edit earlier in
    the model renumbers: the same kernel under other names is the same entry; another dtype,
    shape or constant is not."""
    from tvm import te

    from opsdk._kernelcache import KernelCache

    def kernel(a_name: str, b_name: str, n: int = 64, dtype: str = "float32", c: float = 2.0):
        a = te.placeholder((n,), dtype, name=a_name)
        b = te.compute((n,), lambda i: a[i] * tvm.tirx.const(c, dtype), name=b_name)
        return te.create_prim_func([a, b]).with_attr("global_symbol", "k")

    kc = KernelCache(tmp_path)
    tgt = tvm.target.Target("llvm")
    key = kc.key(kernel("lv200", "T_multiply"), tgt)[0]
    assert kc.key(kernel("lv201", "T_multiply1"), tgt)[0] == key
    assert kc.key(kernel("lv200", "T_multiply").with_attr("global_symbol", "k2"), tgt)[0] == key
    for other in (kernel("lv200", "T_multiply", n=65), kernel("lv200", "T_multiply", c=3.0),
                  kernel("lv200", "T_multiply", dtype="float16")):
        assert kc.key(other, tgt)[0] != key
    znver3 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})
    assert kc.key(kernel("lv200", "T_multiply"), znver3)[0] != key


def test_damaged_and_stale_entries_are_rebuilt(kcache):
    first = compile_model(_module(), "x86")
    ref = _run(first.ex)
    entries = _entries(kcache)
    assert len(entries) >= 4
    trunc, flip, stale, other = entries[:4]
    good = {p: (p / "kernel.o").read_bytes() for p in (trunc, flip, stale)}
    data = good[trunc]
    (trunc / "kernel.o").write_bytes(data[: len(data) // 2])
    data = good[flip]
    (flip / "kernel.o").write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    # another kernel's entry under this key: whole, but its metadata names the other key
    (stale / "kernel.o").write_bytes((other / "kernel.o").read_bytes())
    (stale / "meta.json").write_text((other / "meta.json").read_text())

    again = compile_model(_module(), "x86")
    assert len(again.kernel_build.misses) == 3  # the three, recompiled
    assert len(again.kernel_build.hits) == len(first.kernels) - 3
    np.testing.assert_array_equal(_run(again.ex), ref)
    for p, data in good.items():  # whole again
        assert json.loads((p / "meta.json").read_text())["data"]["key"] == p.name
        assert (p / "kernel.o").read_bytes() == data
    assert compile_model(_module(), "x86").kernel_build.misses == []


@pytest.mark.parametrize("var", ["OPSDK_NO_CACHE", "OPSDK_NO_KERNEL_CACHE"])
def test_environment_turns_it_off(kcache, monkeypatch, var):
    """Off, nothing is kept, but the kernels are still compiled apart (in chunks, in
    parallel): the same outputs, bit for bit, as one ``tvm.compile`` of the whole model."""
    monkeypatch.setenv(var, "1")
    cm = compile_model(_module(), "x86")
    assert not kcache.exists()
    assert cm.kernel_build.hits == [] and len(cm.kernel_build.misses) >= 3
    assert "kernel codegen" in cm.timings and cm.library.exists()
    np.testing.assert_array_equal(_run(cm.ex), _run(opsdk.compile(_module(), "x86")))


def test_timings_cover_the_compile(kcache):
    with record_timings() as t:
        cm = compile_model(_module(), "x86")
    for phase in ("legalize", "fold constants", "schedule", "kernel codegen", "link"):
        assert phase in t.seconds and t.seconds[phase] >= 0
    assert sum(t.seconds.values()) <= cm.seconds + 1e-6
    assert (t.kernels_reused, t.kernels_compiled) == (0, len(cm.kernels))


def test_build_timings_prints_the_phases(kcache, tmp_path, capsys):
    out = tmp_path / "art"
    rc = cli(["build", str(ROOT / "examples" / "conv_net.py"), "-o", str(out), "--target",
              "x86", "--model-arg", "channels=8", "--model-arg", "size=16", "--timings"])
    assert rc == 0
    text = capsys.readouterr().out
    lines = text[text.index("timings:"):].splitlines()
    seconds = {ln.split("  ")[1].strip(): float(ln.split()[-2]) for ln in lines[1:]
               if ln.endswith(" s")}
    for phase in ("torch.export", "from_torch", "legalize", "schedule", "kernel codegen",
                  "link", "other", "total"):
        assert phase in seconds, phase
    # The phases and "other" add up to the total, each printed to 0.01 s.
    parts = [v for k, v in seconds.items() if k != "total"]
    assert abs(sum(parts) - seconds["total"]) <= 0.005 * (len(parts) + 1) + 1e-9
    assert "kernels reused" in text
    assert "fold cache:" in text and "folded constants reused" in text  # conv_net folds BN


def test_kernels_compile_in_forked_workers_with_the_same_objects(tmp_path, monkeypatch):
    # Several workers take the kernels from one queue; every object is written whole, the
    # same bytes a one-process compile writes, and the model links and runs from them.
    from opsdk._kernelcache import compile_objects
    from opsdk.targets import target as resolve

    tgt = resolve("x86")
    funcs = [f for f in compile_model(_module(), "x86", cache=False).scheduled.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc)]
    todo = [(f"{i:032x}" + "0" * 32, f.with_attr("global_symbol", f"k{i}"))
            for i, f in enumerate(funcs)]
    objs = {}
    for jobs in ("1", "3"):
        monkeypatch.setenv("OPSDK_COMPILE_JOBS", jobs)
        folder = tmp_path / jobs
        folder.mkdir()
        compile_objects(todo, tgt, folder)
        objs[jobs] = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert len(objs["1"]) == len(todo) >= 3
    assert objs["3"] == objs["1"]  # no partial file left, nothing missing or different


def test_a_kernel_that_fails_in_a_worker_raises_its_own_error(tmp_path, monkeypatch):
    # A worker that cannot compile a kernel leaves it; the caller compiles it in its own
    # process, where the kernel's error is raised (not a worker's exit status).
    from opsdk._kernelcache import _compile_kernel, compile_objects
    from opsdk.targets import target as resolve

    funcs = [f for f in compile_model(_module(), "x86", cache=False).scheduled.functions.values()
             if isinstance(f, tvm.tirx.PrimFunc)]
    todo = [(f"{i:032x}" + "0" * 32, f.with_attr("global_symbol", f"k{i}"))
            for i, f in enumerate(funcs)]

    def build(func, target):
        if str(func.attrs["global_symbol"]) == "k1":
            raise RuntimeError("kernel k1 does not compile")
        return _compile_kernel(func, target)

    monkeypatch.setenv("OPSDK_COMPILE_JOBS", "2")
    with pytest.raises(RuntimeError, match="kernel k1 does not compile"):
        compile_objects(todo, resolve("x86"), tmp_path, build)
    assert not list(tmp_path.glob("*.part.o"))
