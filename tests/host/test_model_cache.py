"""The compile cache of whole models (opsdk._modelcache): a hit returns the same executable
and the same kernel report; a changed weight, target or option misses; a damaged entry is
rebuilt, never trusted."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import opsdk
from opsdk._modelcache import ModelCache
from opsdk.model import compile_default, compile_model, report

W = np.arange(32 * 24, dtype="float32").reshape(32, 24) / 100


def _module(w: np.ndarray = W) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((16, 32), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, relax.const(w))))
        bb.emit_func_output(y)
    return bb.get()


def _run(ex, x: np.ndarray) -> np.ndarray:
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


X = np.random.default_rng(0).standard_normal((16, 32)).astype("float32")


def test_second_compile_hits_with_identical_outputs_and_report(tmp_path):
    first = compile_model(_module(), "x86", cache=tmp_path)
    second = compile_model(_module(), "x86", cache=tmp_path)  # a new, equal module
    assert (first.cached, second.cached) == (False, True)
    assert len(_entries(tmp_path)) == 1
    np.testing.assert_array_equal(_run(second.ex, X), _run(first.ex, X))
    assert second.kernels == first.kernels
    assert [k["rule"] for k in second.kernels] == ["x86.matmul"]
    # The scheduled module of a hit is recomputed on use: the same kernels.
    assert opsdk.model.kernel_facts(second.scheduled) == first.kernels

    fresh = report(_module(), "x86", profile=False, cache=False)
    cached = report(_module(), "x86", profile=False, cache=tmp_path)  # asm facts stored
    again = report(_module(), "x86", profile=False, cache=tmp_path)  # ... and read back
    assert (fresh.cached, cached.cached, again.cached) == (False, True, True)
    rows = [asdict(k) for k in fresh.kernels]
    assert [asdict(k) for k in cached.kernels] == rows
    assert [asdict(k) for k in again.kernels] == rows
    assert sum(rows[0]["vector_ops"].values()) > 0
    assert (tmp_path / _entries(tmp_path)[0] / "asm.json").is_file()


def test_changed_weight_target_or_option_misses(tmp_path):
    compile_model(_module(), "x86", cache=tmp_path)
    w = W.copy()
    w[3, 5] = np.nextafter(w[3, 5], np.float32(np.inf))  # one ulp of one weight
    changed = compile_model(_module(w), "x86", cache=tmp_path)
    assert not changed.cached
    np.testing.assert_allclose(_run(changed.ex, X), np.maximum(X @ w, 0), rtol=1e-5, atol=1e-5)
    other = {"kind": "llvm", "mcpu": "x86-64"}  # another CPU: another code
    assert not compile_model(_module(), other, cache=tmp_path).cached
    assert not compile_model(_module(), "x86", winograd=False, cache=tmp_path).cached
    assert len(_entries(tmp_path)) == 4
    assert compile_model(_module(w), "x86", cache=tmp_path).cached
    meta = json.loads((_entries(tmp_path)[0] / "meta.json").read_text())["data"]
    assert set(meta["material"]) >= {"module", "target", "options", "versions", "code"}


@pytest.mark.parametrize("damage", ["library", "library_size", "meta", "asm"])
def test_damaged_entry_is_rebuilt(tmp_path, damage):
    report(_module(), "x86", profile=False, cache=tmp_path)
    (entry,) = _entries(tmp_path)
    lib, meta, asm = entry / "lib.so", entry / "meta.json", entry / "asm.json"
    if damage == "library":  # same size, one byte flipped
        b = bytearray(lib.read_bytes())
        b[len(b) // 2] ^= 0xFF
        lib.write_bytes(bytes(b))
    elif damage == "library_size":
        lib.write_bytes(lib.read_bytes()[:-100])
    elif damage == "meta":
        meta.write_text(meta.read_text().replace('"x86.matmul"', '"x86.generic"'))
    else:
        asm.write_text(asm.read_text().replace("zmm", "ymm"))
    rep = report(_module(), "x86", profile=False, cache=tmp_path)
    fresh = report(_module(), "x86", profile=False, cache=False)
    assert [asdict(k) for k in rep.kernels] == [asdict(k) for k in fresh.kernels]
    assert rep.cached == (damage == "asm")  # the library was still good: only asm redone
    again = compile_model(_module(), "x86", cache=tmp_path)
    assert again.cached
    want = _run(compile_model(_module(), "x86", cache=False).ex, X)
    np.testing.assert_array_equal(_run(again.ex, X), want)


def test_default_pipeline_baseline_is_cached_too(tmp_path):
    a = compile_default(_module(), "x86", cache=tmp_path)
    b = compile_default(_module(), "x86", cache=tmp_path)
    assert isinstance(b, tvm.runtime.Module) and not isinstance(a, tvm.runtime.Module)
    np.testing.assert_array_equal(_run(b, X), _run(a, X))
    assert len(_entries(tmp_path)) == 1  # its own entry, not compile_model's
    compile_model(_module(), "x86", cache=tmp_path)
    assert len(_entries(tmp_path)) == 2


def test_environment_turns_it_off_and_moves_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSDK_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("OPSDK_NO_CACHE", "1")
    assert not compile_model(_module(), "x86").cached
    assert not (tmp_path / "c").exists()
    monkeypatch.setenv("OPSDK_NO_CACHE", "0")
    compile_model(_module(), "x86")
    assert compile_model(_module(), "x86").cached
    assert len(_entries(tmp_path / "c")) == 1


def _writer(payload: bytes):
    return lambda path: Path(path).write_bytes(payload)


def test_store_is_atomic_first_writer_wins_and_size_is_bounded(tmp_path):
    c = ModelCache(tmp_path, max_bytes=11_000)
    a = c.store("a" * 64, _writer(b"1" * 3000), {"kernels": []})
    again = c.store("a" * 64, _writer(b"2" * 3000), {"kernels": []})  # a concurrent writer
    assert again is not None and again.meta["lib_sha256"] == a.meta["lib_sha256"]
    assert (tmp_path / ("a" * 64) / "lib.so").read_bytes() == b"1" * 3000
    assert not list(tmp_path.glob(".tmp-*"))  # no temporary folders left
    for k in "bcd":
        c.store(k * 64, _writer(b"x" * 3000), {"kernels": []})
        c.load("a" * 64)  # used: stays
    # 4 x ~3.4 kB > 11 kB: the least recently used (b) went, the one in use (a) stayed
    assert [p.name[0] for p in _entries(tmp_path)] == ["a", "c", "d"]
    assert c.load("b" * 64) is None
    assert c.store("e" * 64, lambda path: 1 / 0, {"kernels": []}) is None  # export failed
    assert not (tmp_path / ("e" * 64)).exists()


def test_an_edited_plugin_rule_is_a_new_key(tmp_path, monkeypatch):
    import sys
    import types

    from opsdk import schedules
    from opsdk._modelcache import code_fingerprint

    src = tmp_path / "my_rules.py"
    src.write_text("def rule(func, target):\n    return None\n")
    mod = types.ModuleType("my_rules")
    mod.__file__ = str(src)
    exec(compile(src.read_text(), str(src), "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, "my_rules", mod)
    before = code_fingerprint()
    fake = schedules.Rule(name="x86.mine", fn=mod.rule, target_key="cpu", kinds=("never",))
    monkeypatch.setattr(schedules, "_RULES", [*schedules._RULES, fake])
    registered = code_fingerprint()
    src.write_text("def rule(func, target):\n    return None  # edited\n")
    assert len({before, registered, code_fingerprint()}) == 3


def test_concurrent_writers_of_one_key_leave_one_whole_entry(tmp_path):
    import threading

    c = ModelCache(tmp_path)
    both_exporting = threading.Barrier(2)
    got: dict[int, object] = {}

    def export(payload: bytes):
        def write(path: str) -> None:
            Path(path).write_bytes(payload)
            both_exporting.wait(timeout=10)  # both mid-write before either renames

        return write

    def writer(i: int) -> None:
        got[i] = c.store("f" * 64, export(bytes([65 + i]) * 5000), {"kernels": []})

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entry = c.load("f" * 64)
    assert entry is not None and got[0] is not None and got[1] is not None
    assert got[0].meta["lib_sha256"] == got[1].meta["lib_sha256"] == entry.meta["lib_sha256"]
    assert entry.library.read_bytes() in (b"A" * 5000, b"B" * 5000)
    assert [p.name for p in tmp_path.iterdir()] == ["f" * 64]  # no temporary folder left


def test_explain_of_an_unchanged_model_file_is_read_back_and_a_changed_helper_is_not(tmp_path):
    # The second `explain --model` of the same source reads its report back (no import);
    # editing a file the model imports makes it import and compile again.
    import os
    import subprocess
    import sys

    (tmp_path / "widths.py").write_text("WIDTH = 16\n")
    (tmp_path / "net.py").write_text(
        "import torch\n"
        "import widths\n"
        "def build_model():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, widths.WIDTH), torch.nn.ReLU())\n"
        "    return m.eval(), (torch.randn(4, 8),)\n")
    env = {k: v for k, v in os.environ.items() if k != "OPSDK_NO_CACHE"}
    env["OPSDK_CACHE_DIR"] = str(tmp_path / "cache")

    def explain() -> list[str]:
        r = subprocess.run([sys.executable, "-m", "opsdk", "explain", "--model",
                            str(tmp_path / "net.py"), "--no-profile"], capture_output=True,
                           text=True, timeout=300, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    first, second = explain(), explain()
    assert "(cached)" not in first[0] and "(cached)" in second[0]
    assert first[1:] == second[1:]  # the same kernels, rules and facts
    assert len(list((tmp_path / "cache" / "records").glob("*.json"))) == 1
    (tmp_path / "widths.py").write_text("WIDTH = 24\n")
    third = explain()
    assert "(cached)" not in third[0]
    assert any(" 96 " in ln for ln in third[1:]) and third[1:] != first[1:]  # 4 x 24 outputs


def test_compiling_leaves_the_module_as_it_was_so_a_recompile_hits(tmp_path):
    # A conv with a ReLU6 (clip): ChannelsLast rewrote the caller's module in place (clip as
    # maximum/minimum), so the second compile of the same object in one process missed.
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w = relax.const(np.ones((4, 4, 3, 3), "float32") / 9)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            y = bb.emit_output(relax.op.clip(y, 0.0, 6.0))
        bb.emit_func_output(y)
    mod = bb.get()
    text = mod.script()
    first = compile_model(mod, "x86", cache=tmp_path)
    assert mod.script() == text
    second = compile_model(mod, "x86", cache=tmp_path)
    assert (first.cached, second.cached) == (False, True)
