"""Helpers shared by the arm tests."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _standalone_server(cpu: str = "cortex-a72", port: int | None = None
                       ) -> Iterator[tuple[subprocess.Popen, int]]:
    """``python -m opsdk.runners.emulated``: the RPC server a board would run (here under
    qemu), started on ``port`` (default: a free one); yields ``(process, port)`` once it
    listens, and stops it."""
    port = port or _free_port()
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "opsdk.runners.emulated", "--host", "127.0.0.1"]
    server = subprocess.Popen([*cmd, "--port", str(port), "--cpu", cpu],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in server.stdout], daemon=True).start()
    try:
        deadline, seen = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                assert server.poll() is None, "".join(seen)
                continue
            if f"listening on 127.0.0.1:{port}" in seen[-1]:
                break
        else:
            pytest.fail("standalone server did not come up:\n" + "".join(seen))
        yield server, port
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def standalone_server():
    """A function starting :func:`_standalone_server` (``with standalone_server(cpu) as
    (process, port):``)."""
    return _standalone_server
