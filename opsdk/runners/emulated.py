"""Run aarch64 kernels on an x86 host: TVM's RPC server inside an aarch64 CPython under qemu-user.

The server is a small serving loop (``_GUEST_SERVER``) built from TVM's own pieces
(``tvm.rpc.server._server_env`` and ``ServerLoop``) but hardened for emulation:

- each session runs in a forked child; when the kernel kills it (e.g. ``SIGILL`` because the
  emulated CPU lacks dotprod or SVE), the loop reports the signal to the client as an RPC
  exception and keeps serving. TVM 0.27's own server stops accepting after such a crash and
  every later connect hangs;
- a session child dies with its parent (``PR_SET_PDEATHSIG``) and the server exits when its
  host parent is gone, so no process outlives the runner, even after ``kill -9``;
- the host side starts it in its own process group, kills the whole group on :meth:`close`,
  on an exception or at interpreter exit, and bounds every call with a time-out.

Standalone use, the way one serves from a board::

    python -m opsdk.runners.emulated --port 9090 --cpu cortex-a72

then point an :class:`~opsdk.runners.RPCRunner` (``--rpc HOST:9090``) at it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from .._cliargs import host_port
from ._base import DeviceTimeout
from ._provision import ArmEnv, arm_env, setup_arm
from .rpc import RPCRunner

__all__ = ["EmulatedRunner", "main", "serve"]

_READY_RE = re.compile(r"OPSDK_SERVER_READY port=(\d+)")

# Runs inside the emulated aarch64 CPython: argv = host port key parent_pid [tracker].
# With a tracker ("HOST:PORT") it registers there the way tvm.rpc.server._listen_loop does
# (UPDATE_INFO, then PUT of a fresh match key before each session, re-PUT when a key handed
# out by the tracker is not used), so TVM's tracker hands it out like a stock rpc_server.
_GUEST_SERVER = r"""
import ctypes, os, resource, shutil, signal, socket, struct, sys, tempfile, time, traceback

HOST, PORT, KEY, PARENT = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
TRACKER = sys.argv[5] if len(sys.argv) > 5 else ""
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no qemu core files for crashed kernels
_libc = ctypes.CDLL(None)
_child = 0
_work = None


def log(msg):
    sys.stdout.write("[opsdk-server %d] %s\n" % (os.getpid(), msg))
    sys.stdout.flush()


def _terminate(signum, frame):
    if _child:
        try:
            os.kill(_child, signal.SIGKILL)
            os.waitpid(_child, 0)
        except OSError:
            pass
    if _work:
        shutil.rmtree(_work, ignore_errors=True)
    if parent_gone():  # the host side was killed and cannot remove our folder: do it
        home = os.environ.get("TMPDIR", "")
        if os.path.basename(home).startswith("opsdk-qemu-"):
            shutil.rmtree(home, ignore_errors=True)
    os._exit(0)


signal.signal(signal.SIGTERM, _terminate)
signal.signal(signal.SIGINT, _terminate)

from tvm.rpc import _ffi_api, base  # noqa: E402
from tvm.rpc.server import _server_env  # noqa: E402


class WorkDir:
    def __init__(self, path):
        self.path = path

    def relpath(self, name):
        return os.path.join(self.path, name)


def parent_gone():
    return PARENT > 0 and os.getppid() != PARENT


def handshake(conn, matchkey):
    conn.settimeout(30)
    if struct.unpack("<i", base.recvall(conn, 4))[0] != base.RPC_MAGIC:
        return None
    size = struct.unpack("<i", base.recvall(conn, 4))[0]
    parts = base.recvall(conn, size).decode("utf-8").split()
    if not parts or parts[0] != "client:" + matchkey:
        conn.sendall(struct.pack("<i", base.RPC_CODE_MISMATCH))
        return None
    server_key = ("server:" + KEY).encode("utf-8")
    conn.sendall(struct.pack("<i", base.RPC_CODE_SUCCESS))
    conn.sendall(struct.pack("<i", len(server_key)) + server_key)
    conn.settimeout(None)
    timeout = 0.0
    for p in parts[1:]:
        if p.startswith("-timeout="):
            timeout = float(p[len("-timeout="):])
    return timeout


def serve(lsock, conn, timeout):
    global _child, _work
    work = _work = tempfile.mkdtemp(prefix="opsdk-rpc-")
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the serving loop
            if os.getppid() != me:
                os._exit(1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            lsock.close()
            os.chdir(work)
            _server_env(None, WorkDir(work))
            _ffi_api.ServerLoop(conn.fileno())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _child = pid
    log("session %d started" % pid)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if parent_gone():
            _terminate(0, None)
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            timed_out = True
            break
        time.sleep(0.02)
    _child = 0
    msg = None
    if timed_out:
        msg = "RPCSessionTimeoutError: the %gs session has expired" % timeout
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        msg = "OPSDK_DEVICE_CRASH signal=%d (%s): the session process was killed" % (
            sig, signal.Signals(sig).name)
    elif os.WEXITSTATUS(status) != 0:
        msg = "OPSDK_DEVICE_CRASH exit=%d: the session process failed" % os.WEXITSTATUS(status)
    if msg:
        log(msg)
        try:  # tell a client still waiting for a reply what happened
            _ffi_api.ReturnException(conn.fileno(), msg)
        except Exception:
            pass
    log("session %d ended" % pid)
    conn.close()
    shutil.rmtree(work, ignore_errors=True)
    _work = None


class Tracker:
    # This server's registration with a TVM RPC tracker (tvm.rpc.server's protocol).

    def __init__(self, addr, port):
        host, _, tport = addr.rpartition(":")
        self.addr, self.port, self.sock = (host, int(tport)), port, None
        self.matchkey, self.used, self.unmatched = None, set(), 0

    def connect(self):
        sock = socket.create_connection(self.addr, timeout=30)
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        if struct.unpack("<i", base.recvall(sock, 4))[0] != base.RPC_TRACKER_MAGIC:
            raise RuntimeError("%s:%d is not a TVM RPC tracker" % self.addr)
        base.sendjson(sock, [base.TrackerCode.UPDATE_INFO,
                             {"key": "server:" + KEY, "addr": [None, self.port]}])
        assert base.recvjson(sock) == base.TrackerCode.SUCCESS
        self.sock = sock
        log("registered with tracker %s:%d key %s" % (self.addr + (KEY,)))

    def put(self):
        # A fresh match key: the one handed out for the last session is spent.
        if self.matchkey:
            self.used.add(self.matchkey)
        self.matchkey = base.random_key(KEY, cmap=self.used)
        base.sendjson(self.sock, [base.TrackerCode.PUT, KEY, (self.port, self.matchkey), None])
        assert base.recvjson(self.sock) == base.TrackerCode.SUCCESS
        self.unmatched = 0

    def idle(self):
        # As _accept_conn: a key the tracker gave a client that never came is replaced.
        base.sendjson(self.sock, [base.TrackerCode.GET_PENDING_MATCHKEYS])
        if self.matchkey in base.recvjson(self.sock):
            self.unmatched = 0
        else:
            self.unmatched += 1
            if self.unmatched * 2 > 6:
                self.put()

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None


def main():
    lsock = socket.socket(base.get_addr_family((HOST, PORT)), socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((HOST, PORT))
    lsock.listen(8)
    lsock.settimeout(2.0)
    port = lsock.getsockname()[1]
    tracker = Tracker(TRACKER, port) if TRACKER else None
    log("OPSDK_SERVER_READY port=%d" % port)
    fresh = True  # a match key must be put before the next accept
    while not parent_gone():
        if tracker is not None:
            try:
                if tracker.sock is None:
                    tracker.connect()
                    fresh = True
                if fresh:
                    tracker.put()
                    fresh = False
            except (OSError, AssertionError, ValueError) as e:
                log("tracker %s:%d: %s; retrying" % (tracker.addr + (e,)))
                tracker.close()
                time.sleep(1.0)
                continue
        try:
            conn, addr = lsock.accept()
        except socket.timeout:
            if tracker is not None:
                try:
                    tracker.idle()
                except (OSError, AssertionError, ValueError):
                    tracker.close()
            continue
        try:
            timeout = handshake(conn, tracker.matchkey if tracker is not None else KEY)
        except Exception as e:
            log("bad handshake from %s: %s" % (addr, e))
            timeout = None
        if timeout is None:
            conn.close()
            continue
        log("connection from %s:%s" % addr[:2])
        serve(lsock, conn, timeout)
        fresh = True
    log("parent %d is gone, exiting" % PARENT)
    if tracker is not None:
        tracker.close()
    _terminate(0, None)


main()
"""


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None and st[2] == pgid and st[0] != "Z":
                pids.append(int(entry))
    return pids


_LIVE: set[_GuestServer] = set()  # servers running in this process, stopped at exit


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class _GuestServer:
    """One emulated RPC server process (group) and its log."""

    def __init__(self, env: ArmEnv, cpu: str | None, host: str, port: int, key: str,
                 tracker: str = "") -> None:
        self.env, self.cpu, self.host, self.key, self.tracker = env, cpu, host, key, tracker
        self.requested_port = port
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="opsdk-qemu-"))
        self.log_path = self.dir / "server.log"

    def _env(self) -> dict[str, str]:
        drop = ("PYTHON", "QEMU_", "LD_PRELOAD", "LD_LIBRARY_PATH")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env.update(TVM_USE_RUNTIME_LIB="1", PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1")
        env["TMPDIR"] = str(self.dir)  # session work dirs go where cleanup() removes them
        if self.cpu:
            env["QEMU_CPU"] = self.cpu
        return env

    def start(self, timeout: float) -> int:
        """Launch the server and wait until it listens; return its port."""
        self.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        script = self.dir / "opsdk_rpc_server.py"
        script.write_text(_GUEST_SERVER)
        cmd = [str(self.env.python), str(script)]
        cmd += [self.host, str(self.requested_port), self.key, str(os.getpid())]
        if self.tracker:
            cmd.append(self.tracker)
        with open(self.log_path, "ab") as log:
            offset = log.tell()  # the log is appended across restarts
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                env=self._env(),
                start_new_session=True,  # own process group: stop() kills all of it
            )
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY_RE.search(self.log_since(offset))
            if m:
                self.port = int(m.group(1))
                return self.port
            rc = self.proc.poll()
            if rc is not None:
                tail = self.log_tail()
                self.stop()
                # The guest's last word (e.g. a library it could not load) says why.
                lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
                last = next((ln for ln in reversed(lines)
                             if re.match(r"\w+(Error|Exception)\b", ln)),
                            lines[-1] if lines else "no output")
                # An OPSDK_QEMU that is executable but no qemu fails here, not in arm_env().
                qemu = os.environ.get("OPSDK_QEMU")
                suspect = (f"check that OPSDK_QEMU={qemu} is qemu-aarch64(-static) (or unset "
                           "it); else, " if qemu else "")
                raise RuntimeError(
                    f"the emulated RPC server exited with status {rc} during start-up "
                    f"({last[:300]}); {suspect}if the environment in {self.env.root} is "
                    "damaged, rebuild it with `opsdk setup arm --force`"
                )
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise DeviceTimeout(
            f"the emulated RPC server did not start within {timeout} s; log tail:\n{tail}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, nchars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - nchars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                return fh.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """Processes of the server's group still alive (server and session children)."""
        return group_pids(self.proc.pid) if self.proc is not None else []

    def stop(self) -> None:
        """Kill the server's process group and reap it; idempotent."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        pgid = proc.pid
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and (proc.poll() is None or group_pids(pgid)):
                time.sleep(0.02)
            if proc.poll() is not None and not group_pids(pgid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # reap the group leader

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class EmulatedRunner(RPCRunner):
    """Run aarch64 kernels under qemu-user through a local TVM RPC server.

    Needs :func:`~opsdk.runners.setup_arm` (host tools and the aarch64 Python sysroot).

    Parameters
    ----------
    cpu : str
        qemu ``-cpu`` model; decides which instructions trap. ``cortex-a72``: NEON only;
        ``cortex-a76``/``neoverse-n1``: + dotprod; ``a64fx``: SVE, no dotprod; ``max``: all.
    timeout : float
        Bound, in seconds, on each call; a call that runs longer raises
        :class:`~opsdk.runners.DeviceTimeout` and the server is restarted.
    start_timeout : float
        Bound on the server start-up (an emulated ``import tvm`` takes 3-12 s).
    cc : str, optional
        Cross compiler for ``export_library`` (default ``aarch64-linux-gnu-g++``).

    Examples
    --------
    >>> from opsdk.runners import EmulatedRunner
    >>> with EmulatedRunner(cpu="cortex-a72") as arm:  # doctest: +SKIP
    ...     (out,) = arm.run(ex, [a, b], outputs=[((1024,), "float32")])
    """

    name = "qemu-aarch64"

    def __init__(
        self,
        cpu: str = "cortex-a72",
        *,
        timeout: float | None = 120.0,
        start_timeout: float = 120.0,
        cc: str | None = None,
    ) -> None:
        super().__init__("127.0.0.1", 0, arch="aarch64", cc=cc, timeout=timeout)
        self.cpu = cpu
        self.start_timeout = start_timeout
        self._server: _GuestServer | None = None
        self._finalizer: weakref.finalize | None = None
        self.server_starts = 0
        self.last_start_seconds = 0.0

    def _where(self) -> str:
        return f"emulated {self.cpu}"

    def device_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "device": f"qemu-aarch64 -cpu {self.cpu}",
            "arch": "aarch64",
            "cpu": self.cpu,
            "runner": self.name,
        }
        if self._server is not None:
            info.update(qemu=self._server.env.qemu, port=self.port)
        return info

    def start(self) -> None:
        with self._lock:
            if self._server is not None and self._server.alive():
                return
            if self._server is None:
                self._server = _GuestServer(arm_env(), self.cpu, "127.0.0.1", 0, "")
                # Also stop it if the runner is dropped without close().
                self._finalizer = weakref.finalize(self, self._server.cleanup)
            self._drop_session()
            t0 = time.monotonic()
            self.port = self._server.start(self.start_timeout)
            self.last_start_seconds = time.monotonic() - t0
            self.server_starts += 1

    def _lost_hint(self) -> str:
        return ""  # the server is restarted automatically

    def _ensure_started(self) -> None:
        # Runs in the caller's thread, never in a helper thread.
        self.start()

    def _after_failure(self, timed_out: bool) -> None:
        # A crash leaves the serving loop running; a time-out or a dead server needs a restart.
        if self._server is not None and (timed_out or not self._server.alive()):
            self._server.stop()
            self.start()

    def _abort(self) -> None:
        # Interrupted mid-call: kill the server (this also unblocks the helper thread); the
        # next run starts a new one.
        if self._server is not None:
            self._server.stop()

    def server_pids(self) -> list[int]:
        """Host processes of the running server (its group); empty when stopped."""
        return self._server.pids() if self._server is not None else []

    def server_log(self, nchars: int = 3000) -> str:
        """Tail of the server's log (qemu and TVM messages)."""
        return self._server.log_tail(nchars) if self._server is not None else ""

    def close(self) -> None:
        with self._lock:
            super().close()
            if self._server is not None:
                if self._finalizer is not None:
                    self._finalizer.detach()
                self._server.cleanup()
                self._server = None


def serve(port: int = 9090, cpu: str | None = "cortex-a72", host: str = "127.0.0.1",
          key: str = "", start_timeout: float = 120.0, tracker: str = "") -> None:  # fmt: skip
    """Serve emulated aarch64 TVM RPC on ``host:port`` until Ctrl-C or SIGTERM.

    Behaves like ``python -m tvm.exec.rpc_server`` on a board, so ``RPCRunner(host, port)``
    can be tested against it. The server is restarted if it ever dies. With ``tracker``
    (``HOST:PORT`` of ``python -m tvm.exec.rpc_tracker``) it registers there under ``key``,
    as ``rpc_server --tracker HOST:PORT --key KEY`` does, and is handed out by the tracker.

    Examples
    --------
    >>> serve(port=9090, cpu="cortex-a72")  # doctest: +SKIP
    >>> serve(port=0, tracker="127.0.0.1:9190", key="opsdk-farm")  # doctest: +SKIP
    """
    try:
        env = arm_env()
    except RuntimeError:
        setup_arm(log=lambda m: print(m, file=sys.stderr, flush=True))
        env = arm_env()

    def _sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)
    server = _GuestServer(env, cpu, host, port, key, tracker)
    try:
        while True:
            bound = server.start(start_timeout)
            where = f", registered with tracker {tracker} key {key}" if tracker else ""
            print(
                f"opsdk: emulated aarch64 TVM RPC server (qemu -cpu {cpu or 'default'}) "
                f"listening on {host}:{bound}{where}",
                flush=True,
            )
            while server.alive():
                time.sleep(0.5)
            print(f"opsdk: server died, restarting; log tail:\n{server.log_tail(1500)}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        server.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m opsdk.runners.emulated --port 9090 [--cpu cortex-a72]``."""
    parser = argparse.ArgumentParser(
        prog="python -m opsdk.runners.emulated",
        description="Serve TVM RPC from an emulated aarch64 CPU (qemu-user) until Ctrl-C.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; use 0.0.0.0 to serve other machines)",
    )
    parser.add_argument("--port", type=int, default=9090, help="port to bind (0: any free one)")
    parser.add_argument("--cpu", default="cortex-a72", help="qemu -cpu model (default cortex-a72)")
    parser.add_argument("--key", default="", help="RPC key clients must present (default none); "
                        "with --tracker, the device key the tracker hands this server out by")
    parser.add_argument("--tracker", metavar="HOST:PORT", type=host_port,
                        help="register with this TVM RPC tracker (python -m "
                        "tvm.exec.rpc_tracker), as rpc_server --tracker does; needs --key")
    args = parser.parse_args(argv)
    if args.tracker and not args.key:
        parser.error("--tracker needs --key (the device key clients request, e.g. "
                     "--key opsdk-farm)")
    serve(port=args.port, cpu=args.cpu, host=args.host, key=args.key,
          tracker=args.tracker or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
