"""Run kernels on a remote TVM RPC server (a board) or through an RPC tracker."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._base import (
    DeviceCrash,
    DeviceTimeout,
    IdentityCache,
    OutputSpec,
    Runner,
    RunnerUnavailable,
    _CallTimeout,
    call_with_timeout,
    run_on_device,
)
from ._provision import cross_compiler

__all__ = ["RPCRunner", "describe_signal"]

# Written by opsdk's own server (see emulated.py) when a session process dies.
_CRASH_RE = re.compile(r"OPSDK_DEVICE_CRASH (?:signal=(\d+)|exit=(-?\d+))")
# What the client sees when the remote end of the session vanished without a word.
_LOST_PATTERNS = (
    "kShutdown",
    "connection was previously closed",
    "SockChannel::Recv",
    "SockChannel::Send",
    "Connection reset",
    "Broken pipe",
)

_SIGNAL_HINTS = {
    signal.SIGILL: ("illegal instruction", "the kernel uses an instruction this CPU lacks"),
    signal.SIGSEGV: ("segmentation fault", "the kernel accessed memory it does not own"),
    signal.SIGBUS: ("bus error", "misaligned or invalid memory access"),
    signal.SIGFPE: ("arithmetic exception", "e.g. an integer division by zero"),
    signal.SIGABRT: ("abort", "the runtime aborted"),
    signal.SIGKILL: ("killed", "by a time-out, the OOM killer or a user"),
}


def describe_signal(signum: int, where: str) -> str:
    """Human wording for a session process killed by ``signum`` on ``where``.

    >>> describe_signal(4, "emulated cortex-a72")
    'illegal instruction on emulated cortex-a72 (the kernel uses an instruction this CPU lacks)'
    """
    try:
        sig = signal.Signals(signum)
    except ValueError:
        return f"the kernel process on {where} died with signal {signum}"
    what, hint = _SIGNAL_HINTS.get(sig, (f"signal {signum} ({sig.name})", "the kernel crashed"))
    return f"{what} on {where} ({hint})"


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _socket_fds() -> set[int]:
    """The file descriptors of this process's sockets (Linux /proc; empty elsewhere)."""
    fds = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    fds.add(int(name))
    return fds


def _shut_down(fds: set[int]) -> None:
    """Shut the sockets down (not close: TVM still owns the descriptors), so a call blocked
    on one returns with an error instead of holding its session's lock forever; else the
    interpreter hangs at exit freeing that session."""

    for fd in fds:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class _Session:
    """One RPC session and the modules loaded into it (dropped together)."""

    def __init__(self, sess: Any) -> None:
        self.sess = sess
        self.dev = sess.cpu()
        self.loaded = IdentityCache()  # executable -> [remote module, VirtualMachine | None]
        self.names = itertools.count()


class RPCRunner(Runner):
    """Run kernels on a remote TVM RPC server (e.g. a board running ``tvm.exec.rpc_server``).

    Each executable is exported once per runner with the cross compiler, uploaded once per
    RPC session, loaded and called on ``remote.cpu()``. One session is kept open between
    calls; it is reopened after a crash or a time-out.

    Parameters
    ----------
    host, port : str, int
        Address of the RPC server.
    key : str
        Server key (empty for a plain ``rpc_server``).
    arch : str
        Remote architecture; selects the default cross compiler.
    cc : str, optional
        Compiler used by ``export_library``. Default: ``aarch64-linux-gnu-g++`` when
        ``arch`` is ``aarch64`` and the host is not, else TVM's default (``g++``).
    timeout : float
        Bound, in seconds, on each call (connect, upload, run and copy back). After a call
        times out or loses its session, the next one first re-checks the server with
        :meth:`preflight` (at most 25 s); when that fails the runner is given up and every
        later call raises :class:`~opsdk.runners.RunnerUnavailable` at once, so a device that
        stops answering costs one time-out and one re-check, not one time-out per call.
    session_timeout : float
        Passed to the server: it kills a session older than this (0: never). Lets a board
        recover from a hung kernel on its own.

    Examples
    --------
    >>> from opsdk.runners import RPCRunner
    >>> with RPCRunner("192.168.1.20", 9090) as board:  # doctest: +SKIP
    ...     out = board.run(ex, [a, b], outputs=[((1024,), "float32")])
    """

    name = "rpc"
    recheck_timeout = 20.0  # seconds for the re-check after a failed call (see timeout)

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key: str = "",
        arch: str = "aarch64",
        cc: str | None = None,
        timeout: float | None = 120.0,
        session_timeout: float = 0.0,
    ) -> None:
        self.host = host
        self.port = int(port)
        self.key = key
        self.arch = arch
        self.cc = cc
        self.timeout = timeout
        self.session_timeout = session_timeout
        self._tracker: tuple[str, int, str] | None = None
        self._exports = IdentityCache()  # executable -> exported shared library
        self._export_counter = itertools.count()
        self._tmp: Path | None = None
        self._session: _Session | None = None
        self._generation = 0  # bumped when a session is dropped
        self._phase = "connect"  # what the current call is doing, for time-out messages
        self._lock = threading.RLock()
        self._recheck = False  # the last call timed out or lost its session
        self._session_fds: set[int] = set()  # the sockets the kept session was opened on
        self._gone: str | None = None  # why the runner was given up

    @classmethod
    def from_tracker(cls, host: str, port: int, key: str, **kwargs: Any) -> RPCRunner:
        """Runner whose sessions are requested from an RPC tracker under ``key``.

        Examples
        --------
        >>> board = RPCRunner.from_tracker("10.0.0.2", 9190, "rk3588")  # doctest: +SKIP
        """
        runner = cls(host, port, **kwargs)
        runner._tracker = (host, int(port), key)
        return runner

    # -- description -------------------------------------------------------------------------

    def _where(self) -> str:
        if self._tracker:
            return f"rpc tracker {self.host}:{self.port} key {self._tracker[2]}"
        return f"rpc {self.host}:{self.port}"

    def device_info(self) -> dict[str, Any]:
        return {"device": self._where(), "arch": self.arch, "runner": self.name}

    def device_threads(self) -> int | None:
        """The TVM runtime's thread count on the device (``runtime.NumThreads`` there), read
        on the session an earlier call left open; None without one."""
        session = self._session
        if session is None:
            return None
        try:
            return int(session.sess.get_function("runtime.NumThreads")())
        except Exception:
            return None

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._drop_session()
            self._exports.clear()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def _drop_session(self) -> None:
        # Every remote object must be gone before the next connect: a live session object
        # keeps the server busy and the next rpc.connect would wait for it.
        self._session = None
        self._generation += 1
        gc.collect()

    def _after_failure(self, timed_out: bool) -> None:
        """Hook: bring the server back after a crash or a time-out (emulated runner). A
        plain server is re-checked before the next call (see ``timeout``)."""
        self._recheck = True

    def _check_still_there(self) -> None:
        # A wedged board accepts connections and never answers: without this each later
        # call (every example of a verify run) would wait out its own time-out.
        if self._gone is None and self._recheck:
            try:
                self.preflight(timeout=self.recheck_timeout)
            except RuntimeError as e:
                self._gone = (f"{self._where()} stopped answering after a failed call ({e}); "
                              "restart the server on the device and run again")
            self._recheck = False
        if self._gone is not None:
            raise RunnerUnavailable(self._gone)

    def _abort(self) -> None:
        """Hook: a call was interrupted (Ctrl-C) while the remote may still be busy."""

    # -- export / connect ----------------------------------------------------------------------

    def _compiler(self) -> str | None:
        if self.cc is not None:
            return self.cc
        return cross_compiler(self.arch)

    def export(self, executable: Any) -> Path:
        """Export ``executable`` to a shared library for the remote (cached per executable);
        a path is a library exported already (an ``opsdk build`` artifact) and is used as it
        is."""
        if isinstance(executable, (str, os.PathLike)):
            return Path(executable)
        with self._lock:
            path = self._exports.get(executable)
            if path is not None and path.exists():
                return path
            if self._tmp is None:
                self._tmp = Path(tempfile.mkdtemp(prefix="opsdk-export-"))
                weakref.finalize(self, shutil.rmtree, self._tmp, True)  # if never closed
            path = self._tmp / f"kernel{next(self._export_counter)}.so"
            cc = self._compiler()
            if cc is None:
                executable.export_library(str(path))
            else:
                executable.export_library(str(path), cc=cc)
            self._exports[executable] = path
            with contextlib.suppress(TypeError):  # delete it with the executable
                weakref.finalize(executable, _unlink, path)
            return path

    def _connect(self) -> Any:
        from tvm import rpc  # heavy: TVM

        if self._tracker is not None:
            host, port, key = self._tracker
            return rpc.connect_tracker(host, port).request(
                key, session_timeout=self.session_timeout
            )
        return rpc.connect(self.host, self.port, key=self.key, session_timeout=self.session_timeout)

    def preflight(self, timeout: float = 20.0) -> None:
        """Check, within ``timeout`` seconds in all, that the server (or the tracker and a
        device with the key) answers, so a wrong address fails at once with a clear
        ``RuntimeError`` instead of every call waiting out its own time-out.

        A refused or unroutable address fails in at most 5 s; a port that accepts but never
        speaks TVM RPC (or a tracker with no free device for the key) after ``timeout``.
        """

        host, port = (self._tracker[0], self._tracker[1]) if self._tracker else (
            self.host, self.port)
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout)):
                pass
        except OSError as e:
            serve = ("the tracker runs there (python -m tvm.exec.rpc_tracker --host 0.0.0.0 "
                     f"--port {port})" if self._tracker else
                     "the server runs there (python -m tvm.exec.rpc_server --host 0.0.0.0 "
                     f"--port {port} on the device)")
            raise RuntimeError(f"{self._where()}: cannot connect ({e.strerror or e}); check "
                               f"HOST:PORT and that {serve}") from None
        found: dict[str, Any] = {}

        def attempt() -> None:
            try:
                found["session"] = self._connect()
            except Exception as e:  # reported below, in the caller's thread
                found["error"] = e

        before = _socket_fds()
        t = threading.Thread(target=attempt, name="opsdk-rpc-preflight", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            _shut_down(_socket_fds() - before)
            what = (f"no device with key {self._tracker[2]!r} became free"
                    if self._tracker else "it did not answer the TVM RPC handshake")
            raise RuntimeError(
                f"{self._where()}: connected, but {what} within {timeout:.0f} s; is it a TVM "
                "RPC server (or tracker), and is the device idle?")
        if "error" in found:
            raise RuntimeError(f"{self._where()}: {found['error']}") from None
        found.clear()
        gc.collect()  # drop the probe session before the first real one

    def _ensure_started(self) -> None:
        """Hook: make sure the server runs (emulated runner)."""

    # -- run -----------------------------------------------------------------------------------

    def _remote_call(
        self,
        session: _Session | None,
        generation: int,
        executable: Any,
        lib: Path,
        inputs: Sequence[np.ndarray],
        entry: str,
        outputs: Sequence[OutputSpec] | None,
        timing: dict[str, Any] | None = None,
        weights: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        # Runs in a helper thread (see call_with_timeout).
        self._phase = "connect"
        if session is not None and not self._alive(session):
            # The server went away between calls (restarted, the board rebooted): the old
            # session is dead before anything of this call ran, so open a new one.
            session = None
            if generation == self._generation:
                self._session = None
        if session is None:
            if generation != self._generation:  # abandoned by a time-out: connect no more
                raise RuntimeError("abandoned call")
            session = _Session(self._connect())
            if generation == self._generation:  # not abandoned by a time-out meanwhile
                self._session = session
        slot = session.loaded.get(executable)
        self._phase = "upload"
        if slot is None:
            name = f"opsdk_kernel{next(session.names)}.so"
            session.sess.upload(str(lib), name)
            slot = [session.sess.load_module(name), None]
            session.sess.remove(name)  # loaded already; keeps the remote temp dir small
            session.loaded[executable] = slot

        def vm() -> Any:
            from tvm import relax  # heavy: TVM

            if slot[1] is None:
                slot[1] = relax.VirtualMachine(slot[0], session.dev)
            return slot[1]

        self._phase = "run"
        return run_on_device(slot[0], vm, session.dev, inputs, entry, outputs, timing,
                             weights)

    @staticmethod
    def _alive(session: _Session) -> bool:
        """One round trip on a kept session (a lookup of a function every TVM RPC server
        registers); False when the other end is gone."""
        try:
            session.sess.get_function("tvm.rpc.server.upload")
        except Exception:
            return False
        return True

    def _lost_hint(self) -> str:
        return (
            "; TVM 0.27's rpc_server stops serving after a crashed session, so restart it "
            "before the next run"
        )

    def _timeout_message(self, entry: str) -> str:
        where, t = self._where(), self.timeout
        if self._phase == "connect":
            return (
                f"could not open an RPC session on {where} within {t} s: the server is "
                "unreachable, busy with another session, or wedged by an earlier crash"
                + self._lost_hint()
            )
        if self._phase == "upload":
            return f"uploading and loading the kernel on {where} took more than {t} s"
        return f"{entry!r} did not finish within {t} s on {where}"

    def _classify(self, err: BaseException) -> tuple[type[RuntimeError], str] | None:
        """Map a remote failure to DeviceCrash/DeviceTimeout; None for ordinary errors."""
        text = str(err)
        m = _CRASH_RE.search(text)
        if m:
            if m.group(1):
                return DeviceCrash, describe_signal(int(m.group(1)), self._where())
            return DeviceCrash, f"the kernel process on {self._where()} exited with {m.group(2)}"
        if "RPCSessionTimeoutError" in text:
            return DeviceTimeout, f"the RPC session on {self._where()} timed out: {text[:300]}"
        if any(p in text for p in _LOST_PATTERNS) or isinstance(err, OSError):
            first = text.strip().splitlines()[-1] if text.strip() else type(err).__name__
            return DeviceCrash, (
                f"the RPC session on {self._where()} was lost during the call; the kernel "
                f"probably crashed the remote process ({first[:200]}){self._lost_hint()}"
            )
        return None

    def _run(
        self,
        executable: Any,
        inputs: Sequence[np.ndarray],
        entry: str,
        outputs: Sequence[OutputSpec] | None,
        timing: dict[str, Any] | None,
        weights: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        with self._lock:
            self._ensure_started()
            self._check_still_there()
            lib = self.export(executable)
            session, generation = self._session, self._generation
            before = _socket_fds()
            try:
                result = call_with_timeout(
                    lambda: self._remote_call(
                        session, generation, executable, lib, inputs, entry, outputs, timing,
                        weights,
                    ),
                    self.timeout,
                    "rpc-run",
                )
                if self._session is not session:  # this call opened a new session
                    self._session_fds = _socket_fds() - before
                return result
            except KeyboardInterrupt:
                self._drop_session()
                self._abort()
                raise
            except _CallTimeout:
                # Unblock the abandoned call (on the kept session or a new connection); the
                # generation is bumped first, so once unblocked it does not connect again.
                self._drop_session()
                _shut_down(self._session_fds | (_socket_fds() - before))
                self._session_fds = set()
                failure: tuple[type[RuntimeError], str] | None = (
                    DeviceTimeout,
                    self._timeout_message(entry),
                )
            except Exception as err:
                failure = self._classify(err)
                if failure is None:
                    raise
                del err
            # Crash or time-out: the session is unusable; start afresh on the next call.
            self._drop_session()
            self._after_failure(timed_out=failure[0] is DeviceTimeout)
            raise failure[0](failure[1])
