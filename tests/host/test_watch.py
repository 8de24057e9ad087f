"""``opsdk build --watch``: one process rebuilds the artifact when the model file, a module
of the user's it imports or a data file it reads changes; a failed rebuild keeps the last
good artifact and the watch; SIGTERM stops it cleanly."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from opsdk.cli import main
from opsdk.deploy import build_artifact
from opsdk.deploy._watch import watch_build

NET = """\
import json, os
import torch
import helper_w

def build_model():
    torch.manual_seed(0)
    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "cfg.json")))
    act = getattr(torch.nn, ACT)()
    m = torch.nn.Sequential(torch.nn.Linear(8, cfg["width"]), act, helper_w.Scale())
    return m.eval(), (torch.randn(4, 8),)

ACT = "ReLU"
"""

HELPER = """\
import numpy as np
import torch
from tvm import te
import opsdk

K = {k}

class Scale(torch.nn.Module):
    def forward(self, x):
        return x * K

# An op of the user's, registered at import: imported afresh, it registers again.
@opsdk.op(reference=lambda x: x * {k})
def watch_probe(x: opsdk.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *i: x(*i) * {k})

opsdk.register(watch_probe)
"""


def _expected(out: pathlib.Path) -> np.ndarray:
    with np.load(out / "check" / "expected.npz") as z:
        return z["host_0"]


def _save(path: pathlib.Path, text: str) -> None:
    """Write ``text``, with a modification time that differs from the last one even on a
    coarse clock."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before + 10**7, before + 10**7))


@pytest.fixture
def project(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.delenv("OPSDK_NO_CACHE", raising=False)
    monkeypatch.setenv("OPSDK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cfg.json").write_text('{"width": 16}')
    (tmp_path / "helper_w.py").write_text(HELPER.format(k=2))
    (tmp_path / "net.py").write_text(NET)
    yield tmp_path
    import opsdk

    if opsdk.is_registered("watch_probe"):
        opsdk.unregister("watch_probe")


class _Watch:
    """``watch_build`` in a thread, its reports and lines kept."""

    def __init__(self, model: pathlib.Path, out: pathlib.Path) -> None:
        self.stop = threading.Event()
        self.builds: list[int] = []
        self.lines: list[str] = []
        self.rc: list[int] = []

        def build(force: bool) -> dict:
            return build_artifact(str(model), out, target="x86", force=force, log=None)

        def run() -> None:
            self.rc.append(watch_build(
                build, model, out, poll=0.05, stop=self.stop, say=self.lines.append,
                report=lambda m, t, s, n: self.builds.append(n)))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def next(self, what: str = "watching", timeout: float = 120) -> None:
        """Wait for one more ``what`` line than seen so far."""
        n = sum(what in ln for ln in self.lines)
        deadline = time.monotonic() + timeout
        while sum(what in ln for ln in self.lines) <= n:
            assert self.thread.is_alive() and time.monotonic() < deadline, self.lines
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def test_the_watch_rebuilds_on_each_kind_of_change_and_keeps_the_last_good_artifact(project):
    net, out = project / "net.py", project / "art"
    w = _Watch(net, out)
    try:
        w.next()
        assert w.builds == [0], w.lines
        watched = w.lines[-1]
        assert "watching 3 files" in watched, w.lines  # net.py, helper_w.py, cfg.json
        first = _expected(out)

        # the model file: another activation
        _save(net, NET.replace('ACT = "ReLU"', 'ACT = "Tanh"'))
        w.next()
        assert w.builds == [0, 1]
        tanh = _expected(out)
        assert not np.array_equal(tanh, first)

        # a module of the user's: imported afresh (K = 3), its op registered again
        _save(project / "helper_w.py", HELPER.format(k=3))
        w.next()
        assert w.builds == [0, 1, 2], w.lines
        np.testing.assert_allclose(_expected(out), tanh * 1.5, rtol=1e-6)

        # a data file the entry reads
        _save(project / "cfg.json", '{"width": 24}')
        w.next()
        assert _expected(out).shape == (4, 24)

        # a syntax error: one line, the artifact as it was, still watching
        good = (out / "manifest.json").read_bytes()
        _save(net, NET + "oops(\n")
        w.next()
        assert any("net.py:" in ln and "SyntaxError" in ln for ln in w.lines), w.lines[-4:]
        assert (out / "manifest.json").read_bytes() == good and len(w.builds) == 4
        _save(net, NET)
        w.next()
        assert len(w.builds) == 5 and _expected(out).shape == (4, 24)

        # saved unchanged: the up-to-date check keeps the artifact
        os.utime(net, ns=(time.time_ns(), time.time_ns()))
        w.next()
        assert (out / "manifest.json").read_bytes() != good  # the rebuild above wrote it
        assert len(w.builds) == 6
    finally:
        w.close()
    assert w.rc == [0]
    # the build's own folder beside the artifact is gone every time
    assert not [p for p in project.iterdir() if p.name.startswith(".art.opsdk-")]


def test_an_artifact_changed_under_the_watch_is_not_replaced(project):
    net, out = project / "net.py", project / "art"
    w = _Watch(net, out)
    try:
        w.next()
        build_artifact(str(net), out, target="x86", force=True, log=None, winograd=False)
        replaced = (out / "manifest.json").read_bytes()
        _save(net, NET.replace('ACT = "ReLU"', 'ACT = "Tanh"'))
        w.next()
        assert any("--force" in ln for ln in w.lines), w.lines
        assert (out / "manifest.json").read_bytes() == replaced
    finally:
        w.close()


def test_the_command_line_refuses_json_and_stops_cleanly_on_sigterm(project, capsys):
    net = project / "net.py"
    assert main(["build", str(net), "-o", str(project / "a"), "--watch", "--json"]) == 2
    assert "drop --json" in capsys.readouterr().err

    p = subprocess.Popen([sys.executable, "-m", "opsdk", "build", str(net), "-o",
                          str(project / "art"), "--target", "x86", "--watch"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=project)
    err = ""
    try:
        for line in p.stderr:
            err += line
            if "watching" in line:
                break
        p.send_signal(signal.SIGTERM)
        out, rest = p.communicate(timeout=60)
    finally:
        p.kill()
    err += rest
    assert p.returncode == 0, err
    assert "stopped watching" in err and "kernels:" in out
