"""A device farm: boards shared through TVM's RPC tracker, and a local one of emulated boards.

Real boards run ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``; the
tracker (``python -m tvm.exec.rpc_tracker``) hands each free board of a key to one client
session at a time. This module speaks that protocol from the client side (the tracker's
summary, a session request that names the board it got) and starts a local farm:
``tvm.exec.rpc_tracker`` on 127.0.0.1 and N emulated aarch64 servers
(``python -m opsdk.runners.emulated --tracker ... --key ...``) registered to it, bound to the
loopback address only, with their pids in a state file so ``opsdk setup farm --stop`` stops
exactly what it started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._cliargs import split_host_port
from .._files import cache_dir
from .rpc import RPCRunner

__all__ = [
    "DEFAULT_KEY",
    "FarmError",
    "FarmRunner",
    "FarmState",
    "farm_state",
    "farm_status",
    "probe_board",
    "request_board",
    "start_farm",
    "stop_farm",
    "tracker_boards",
    "tracker_summary",
]

#: The key a local farm registers its boards under (``opsdk setup farm --key`` changes it).
DEFAULT_KEY = "opsdk-farm"
_LOOPBACK = "127.0.0.1"


class FarmError(RuntimeError):
    """A farm or tracker problem with a one-line message naming the flag and the fix."""


# ---------------------------------------------------------------------------------------------
# The tracker's client protocol (tvm.rpc.base: magic, then length-prefixed JSON messages)


def _tracker_socket(host: str, port: int, timeout: float) -> socket.socket:
    from tvm.rpc import base  # heavy: TVM

    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as e:
        raise FarmError(
            f"tracker {host}:{port}: cannot connect ({e.strerror or e}); check --tracker "
            "HOST:PORT and that the tracker runs (python -m tvm.exec.rpc_tracker, or "
            "`opsdk setup farm N` for a local one)") from None
    try:
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        magic = struct.unpack("<i", base.recvall(sock, 4))[0]
    except (OSError, struct.error) as e:
        sock.close()
        raise FarmError(f"tracker {host}:{port}: no TVM tracker handshake ({e}); is --tracker "
                        "the tracker's port, not a board's?") from None
    if magic != base.RPC_TRACKER_MAGIC:
        sock.close()
        raise FarmError(f"tracker {host}:{port} is not a TVM RPC tracker; is --tracker the "
                        "tracker's port, not a board's?")
    return sock


def tracker_summary(host: str, port: int, timeout: float = 10.0) -> dict[str, Any]:
    """The tracker's summary: ``{"queue_info": {key: {"free", "pending"}}, "server_info":
    [{"key": "server:KEY", "addr": [host, port]}, ...]}`` (``TrackerSession.summary``),
    within ``timeout`` seconds; :class:`FarmError` when the tracker is unreachable.

    Examples
    --------
    >>> tracker_summary("127.0.0.1", 9190)["queue_info"]  # doctest: +SKIP
    {'opsdk-farm': {'free': 4, 'pending': 0}}
    """
    from tvm.rpc import base  # heavy: TVM

    with _tracker_socket(host, port, timeout) as sock:
        try:
            base.sendjson(sock, [base.TrackerCode.SUMMARY])
            value = base.recvjson(sock)
        except OSError as e:
            raise FarmError(f"tracker {host}:{port}: no summary ({e})") from None
    if not isinstance(value, list) or value[0] != base.TrackerCode.SUCCESS:
        raise FarmError(f"tracker {host}:{port}: unexpected summary {value!r}")
    return value[1]


def tracker_boards(host: str, port: int, key: str, timeout: float = 10.0
                   ) -> tuple[list[str], int]:
    """The boards registered under ``key`` (``"host:port"``, sorted) and how many are free.

    Examples
    --------
    >>> tracker_boards("127.0.0.1", 9190, "opsdk-farm")  # doctest: +SKIP
    (['127.0.0.1:40113', '127.0.0.1:41705'], 2)
    """
    summary = tracker_summary(host, port, timeout)
    boards = sorted(":".join(map(str, s["addr"])) for s in summary.get("server_info", [])
                    if s.get("key") == f"server:{key}")
    free = int(summary.get("queue_info", {}).get(key, {}).get("free", 0))
    return boards, free


def request_board(host: str, port: int, key: str, session_timeout: float = 0.0,
                  wait: float | None = None) -> tuple[Any, str]:
    """A session on a free board of ``key`` from the tracker, and the board (``host:port``).

    ``TrackerSession.request`` keeps the board's address to itself; this sends the same
    ``REQUEST`` and opens the session with ``rpc.connect`` and the match key, so a sharded
    run can name the board a cell ran on. Waits at most ``wait`` seconds for a free board
    (``TimeoutError`` then), or for ever with None.

    Examples
    --------
    >>> sess, board = request_board("127.0.0.1", 9190, "opsdk-farm")  # doctest: +SKIP
    """
    from tvm import rpc  # heavy: TVM
    from tvm.rpc import base  # heavy: TVM

    with _tracker_socket(host, port, 30.0) as sock:
        sock.settimeout(wait)  # the tracker answers when a board is free
        base.sendjson(sock, [base.TrackerCode.REQUEST, key, "", 1])
        try:
            value = base.recvjson(sock)
        except TimeoutError:
            raise TimeoutError(f"no board of key {key!r} became free at tracker "
                               f"{host}:{port} within {wait:.0f} s") from None
    if not isinstance(value, list) or value[0] != base.TrackerCode.SUCCESS:
        raise RuntimeError(f"tracker {host}:{port}: request for {key!r} failed: {value!r}")
    url, bport, matchkey = value[1]
    return rpc.connect(url, bport, matchkey, session_timeout), f"{url}:{bport}"


def probe_board(board: str, timeout: float = 10.0) -> str:
    """How the RPC server at ``board`` (``host:port``) answers a handshake within ``timeout``
    s: ``"ok"`` (it answered), ``"refused"`` (nothing listens: the server is dead) or
    ``"silent"`` (it accepted but said nothing: hung, or serving another session; a TVM RPC
    server serves one session at a time). The key is deliberately wrong, so a live server
    refuses it at once and the match key the tracker holds for it stays unspent.

    Examples
    --------
    >>> probe_board("127.0.0.1:1", timeout=1.0)
    'refused'
    """
    from tvm.rpc import base  # heavy: TVM

    host, port = split_host_port(board)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            key = b"client:opsdk-probe"
            sock.sendall(struct.pack("<i", base.RPC_MAGIC) + struct.pack("<i", len(key)) + key)
            code = struct.unpack("<i", base.recvall(sock, 4))[0]
    except ConnectionRefusedError:
        return "refused"
    except (OSError, struct.error):
        return "silent"
    return "ok" if code in (base.RPC_CODE_MISMATCH, base.RPC_CODE_SUCCESS) else "silent"


class FarmRunner(RPCRunner):
    """An :class:`RPCRunner` on one board of a tracker's key that knows which board it is on.

    Each session comes from the tracker (:func:`request_board`) and ``board`` names the
    board it runs on. After a failed call (a lost session, a time-out) the board is checked:
    when it is no longer registered with the tracker, refuses connections or (after a
    time-out) does not answer a handshake within ``probe_timeout`` s, the runner gives up
    at once with :class:`~opsdk.runners.RunnerUnavailable` naming the board (``lost`` says why)
    instead of waiting for another board, so a sharded run can requeue the cell.

    Examples
    --------
    >>> board = FarmRunner.from_tracker("127.0.0.1", 9190, "opsdk-farm")  # doctest: +SKIP
    """

    name = "rpc-farm"
    probe_timeout = 10.0
    board_wait = 60.0  # seconds a (re)connect waits for a free board

    def __init__(self, host: str, port: int, **kwargs: Any) -> None:
        super().__init__(host, port, **kwargs)
        self.board: str | None = None
        #: Called with the board's name on each new session (from the call's thread).
        self.on_board: Callable[[str], None] | None = None
        self._why: str | None = None  # why the board is lost

    @property
    def lost(self) -> str | None:
        """Why the runner gave its board up (None while it runs): a sharded run then
        requeues the cell on another board."""
        return self._why or self._gone

    def _where(self) -> str:
        if self._tracker is None or self.board is None:
            return super()._where()
        return f"board {self.board} (key {self._tracker[2]})"

    def _board_gone(self, timed_out: bool) -> str | None:
        """Why the current board is lost, or None while it is still there."""
        if self.board is None or self._tracker is None:
            return None
        host, port, key = self._tracker
        with contextlib.suppress(FarmError):
            if self.board not in tracker_boards(host, port, key)[0]:
                return "no longer registered with the tracker"
        # A dead server refuses at once. A silent one is hung, or busy with another client's
        # session (its own was dropped): lost only when our call timed out on it.
        answer = probe_board(self.board, self.probe_timeout if timed_out else 3.0)
        if answer == "refused":
            return "refused the connection"
        if answer == "silent" and timed_out:
            return f"stopped answering (no handshake within {self.probe_timeout:.0f} s)"
        return None

    def preflight(self, timeout: float = 20.0) -> None:
        super().preflight(timeout)
        self.board = None  # the probe session's board is free again, maybe someone else's

    def _connect(self) -> Any:
        if self._tracker is None:
            return super()._connect()
        if self.board is not None and self._why is None:
            why = self._board_gone(False)
            if why:  # a reconnect would wait for another board instead
                self._why = why
                raise ConnectionRefusedError(f"board {self.board} {why}")
        host, port, key = self._tracker
        sess, self.board = request_board(host, port, key, self.session_timeout,
                                         wait=self.board_wait)
        if self.on_board is not None:
            self.on_board(self.board)
        return sess

    def _after_failure(self, timed_out: bool) -> None:
        super()._after_failure(timed_out)
        why = self._why or self._board_gone(timed_out)
        if why:
            self._why = why
            self._gone = f"board {self.board} lost: {why}"


# ---------------------------------------------------------------------------------------------
# A local farm of emulated boards


@dataclass
class FarmState:
    """What ``opsdk setup farm`` started: the tracker and the boards' wrapper processes.

    Each process leads its own process group (the group is what is stopped); ``cmd`` is a
    word of its command line, checked before a signal so a recycled pid is never hit.
    """

    tracker_port: int
    key: str
    cpu: str
    tracker_pid: int
    board_pids: list[int] = field(default_factory=list)
    boards: list[str] = field(default_factory=list)  # "127.0.0.1:PORT", in board_pids' order
    logs: str = ""
    started: float = 0.0

    @property
    def tracker(self) -> str:
        return f"{_LOOPBACK}:{self.tracker_port}"


def _farm_dir(state_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(state_dir) if state_dir is not None else cache_dir() / "farm"


def _state_path(state_dir: str | os.PathLike[str] | None = None) -> Path:
    return _farm_dir(state_dir) / "state.json"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ours(pid: int, word: str) -> bool:
    """``pid`` is alive and still the process we started (its command line has ``word``)."""
    return word in _cmdline(pid)


_TRACKER_WORD = "tvm.exec.rpc_tracker"
_BOARD_WORD = "opsdk.runners.emulated"


def farm_state(state_dir: str | os.PathLike[str] | None = None) -> FarmState | None:
    """The running local farm (from its state file in ``state_dir``, default
    ``$OPSDK_CACHE/farm``), or None when there is none.

    Examples
    --------
    >>> from opsdk.runners._farm import farm_state
    >>> state = farm_state()  # None unless `opsdk setup farm N` runs
    """
    try:
        raw = json.loads(_state_path(state_dir).read_text())
        state = FarmState(**raw)
    except (OSError, ValueError, TypeError):
        return None
    if not (_ours(state.tracker_pid, _TRACKER_WORD)
            or any(_ours(p, _BOARD_WORD) for p in state.board_pids)):
        return None  # everything it names is gone (a reboot, a kill): stale
    return state


def _python_env() -> dict[str, str]:
    # The children import opsdk from wherever this process did (a checkout, too).
    root = str(Path(__file__).resolve().parents[2])
    path = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                env=_python_env(), start_new_session=True)


def _kill_group(pid: int, word: str, wait: float = 10.0) -> bool:
    """SIGTERM then SIGKILL the process group ``pid`` leads, if it is still ours."""
    if not _ours(pid, word):
        return False
    for sig, limit in ((signal.SIGTERM, wait), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if not _alive(pid):
            break
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
    return True


def _alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2:].split()[0] != "Z"


def start_farm(boards: int, *, key: str = DEFAULT_KEY, port: int = 9190,
               cpu: str = "cortex-a72", timeout: float = 300.0,
               log: Callable[[str], None] | None = None,
               state_dir: str | os.PathLike[str] | None = None) -> FarmState:
    """Start a local farm: TVM's tracker on ``127.0.0.1:port`` and ``boards`` emulated
    aarch64 RPC servers registered to it under ``key``; return when all are free.

    Everything binds the loopback address only. The processes outlive this call (stop them
    with :func:`stop_farm`); their pids are in ``state.json`` in ``state_dir`` (default
    ``$OPSDK_CACHE/farm``) and their logs beside it. Raises :class:`FarmError` when a farm
    already runs, the port is taken or a board does not come up (then everything started
    is stopped again).

    Examples
    --------
    >>> state = start_farm(2)  # doctest: +SKIP
    >>> state.tracker  # doctest: +SKIP
    '127.0.0.1:9190'
    """
    if boards < 1:
        raise FarmError(f"opsdk setup farm {boards}: give the number of boards, at least 1")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", key):
        raise FarmError(f"--key {key!r}: use letters, digits, '.', '-' and '_' only")
    running = farm_state(state_dir)
    if running is not None:
        raise FarmError(f"a farm already runs (tracker {running.tracker}, key {running.key}, "
                        f"{len(running.board_pids)} boards); stop it first with "
                        "`opsdk setup farm --stop`")
    if importlib.util.find_spec("tornado") is None:
        raise FarmError("TVM's RPC tracker needs tornado: pip install 'opsdk[farm]' (or "
                        "tornado), then run `opsdk setup farm` again")
    from .emulated import arm_env  # heavy: TVM (checks the emulation environment first)

    try:
        arm_env()
    except RuntimeError as e:
        raise FarmError(f"{e} (the farm's boards are emulated: run `opsdk setup arm` "
                        "first)") from None
    say = log or (lambda m: None)
    d = _farm_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.log"):
        old.unlink()
    with socket.socket() as s:  # a clear error instead of the tracker's own traceback
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the tracker binds
        try:
            s.bind((_LOOPBACK, port))
        except OSError:
            raise FarmError(f"port {port} on {_LOOPBACK} is in use; pass --port with a free "
                            "one (or stop what uses it)") from None
    tracker = _spawn([sys.executable, "-m", _TRACKER_WORD, "--host", _LOOPBACK, "--port",
                      str(port), "--port-end", str(port + 1)], d / "tracker.log")
    state = FarmState(tracker_port=port, key=key, cpu=cpu, tracker_pid=tracker.pid,
                      logs=str(d), started=time.time())
    _save(state, state_dir)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                tracker_summary(_LOOPBACK, port, timeout=2.0)
                break
            except FarmError:
                if tracker.poll() is not None or time.monotonic() > deadline:
                    raise FarmError(f"the tracker did not start; log: {d / 'tracker.log'}"
                                    ) from None
                time.sleep(0.2)
        say(f"tracker {state.tracker} (python -m {_TRACKER_WORD})")
        for i in range(boards):
            p = _spawn([sys.executable, "-m", _BOARD_WORD, "--host", _LOOPBACK, "--port", "0",
                        "--cpu", cpu, "--tracker", state.tracker, "--key", key],
                       d / f"board{i}.log")
            state.board_pids.append(p.pid)
            _save(state, state_dir)
        deadline = time.monotonic() + timeout
        while True:
            found, free = tracker_boards(_LOOPBACK, port, key)
            if len(found) >= boards and free >= boards:
                break
            dead = [i for i, p in enumerate(state.board_pids) if not _alive(p)]
            if dead or time.monotonic() > deadline:
                why = (f"board {dead[0]} exited" if dead else
                       f"only {len(found)} of {boards} boards registered within {timeout:.0f} s")
                raise FarmError(f"{why}; log: {d / f'board{dead[0] if dead else 0}.log'}")
            time.sleep(0.5)
        state.boards = [_board_addr(d / f"board{i}.log") for i in range(boards)]
        _save(state, state_dir)
        say(f"{boards} emulated boards (qemu -cpu {cpu}) registered under key {key}: "
            f"{', '.join(found)}")
        return state
    except BaseException:
        stop_farm(state_dir)
        raise


def _board_addr(log: Path) -> str:
    """The address a board's wrapper says it listens on (its log's latest start)."""
    found = re.findall(r"listening on (\S+?),", log.read_text(errors="replace"))
    return found[-1] if found else ""


def _save(state: FarmState, state_dir: str | os.PathLike[str] | None) -> None:
    path = _state_path(state_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)


def stop_farm(state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Stop the local farm's processes (only those its state file names, each checked to be
    the process started) and remove the state file; returns what was stopped.

    Examples
    --------
    >>> stop_farm()  # doctest: +SKIP
    ['board 12345', 'board 12346', 'tracker 12340']
    """
    try:
        state = FarmState(**json.loads(_state_path(state_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return []
    stopped = [f"board {p}" for p in state.board_pids if _kill_group(p, _BOARD_WORD)]
    if _kill_group(state.tracker_pid, _TRACKER_WORD):
        stopped.append(f"tracker {state.tracker_pid}")
    for pid in [*state.board_pids, state.tracker_pid]:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # reap those this process started (a zombie lingers)
    with contextlib.suppress(OSError):
        _state_path(state_dir).unlink()
    return stopped


def farm_status(tracker: str | None = None, key: str | None = None,
                state_dir: str | os.PathLike[str] | None = None) -> str:
    """A text summary of a tracker's boards (default: the local farm's): TVM's own
    ``text_summary`` layout, with the local farm's pids when it is the local farm.

    Examples
    --------
    >>> print(farm_status())  # doctest: +SKIP
    tracker 127.0.0.1:9190, key opsdk-farm: 2 boards, 2 free
      127.0.0.1:40113
      127.0.0.1:41705
    """
    state = farm_state(state_dir)
    if tracker is None:
        if state is None:
            raise FarmError("no local farm runs; start one with `opsdk setup farm N` (or pass "
                            "--tracker HOST:PORT for another tracker)")
        tracker = state.tracker
    host, port = split_host_port(tracker)
    summary = tracker_summary(host, port)
    keys = sorted({s["key"].split(":", 1)[1] for s in summary.get("server_info", [])
                   if ":" in s.get("key", "")} | set(summary.get("queue_info", {})))
    if key is not None:
        keys = [key]
    lines = []
    for k in keys:
        boards, free = tracker_boards(host, port, k)
        pending = summary.get("queue_info", {}).get(k, {}).get("pending", 0)
        lines.append(f"tracker {tracker}, key {k}: {len(boards)} board"
                     f"{'s' if len(boards) != 1 else ''}, {free} free"
                     + (f", {pending} requests waiting" if pending else ""))
        lines += [f"  {b}" for b in boards]
    if not keys:
        lines.append(f"tracker {tracker}: no boards registered")
    if state is not None and state.tracker == tracker:
        pids = " ".join(f"{p}" if _ours(p, _BOARD_WORD) else f"{p} (gone)"
                        for p in state.board_pids)
        lines.append(f"local farm: tracker pid {state.tracker_pid}, board pids {pids}; logs "
                     f"in {state.logs}")
    return "\n".join(lines)
