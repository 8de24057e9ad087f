"""The command line's own behaviour: fast top-level help, clear errors for a common slip."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opsdk.cli import COMMANDS, main


def _python(code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_top_level_help_and_version_import_no_tvm(argv):
    # Only the chosen subcommand's modules are imported: `opsdk --help` stays instant.
    r = _python("import sys\nfrom opsdk.cli import main\ntry:\n"
                f"    main({argv!r})\nexcept SystemExit:\n    pass\n"
                "print('TVM' if 'tvm' in sys.modules else 'no tvm', 'torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "no tvm False", r.stdout


def test_top_level_help_lists_every_command_in_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("new-op", "verify", "explain", "list", "bench", "drift", "setup"):
        assert name in COMMANDS and f"    {name} " in out
    assert "``" not in out


def test_new_op_kind_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["new-op", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kind {elementwise,binary,reduction,norm,residual_norm}" in out
    assert "the template:" in out


def test_unknown_op_next_to_its_file_says_how_to_load_it(tmp_path, capsys, monkeypatch):
    # Right after `opsdk new-op swish`, `opsdk verify swish` names the missing --module.
    (tmp_path / "swish_x.py").write_text("OPS = []\n")
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "swish_x", "--target", "x86", "--quiet", "--no-db"]) == 2
    err = capsys.readouterr().err
    assert "no opsdk op named 'swish_x'" in err and "--module swish_x" in err


_FIRST_IMPORTS = [
    "import opsdk.te_utils", "from opsdk.verify import error_model", "import opsdk.ops",
    "import opsdk.transform", "import opsdk.frontend", "import opsdk.relax",
    "from opsdk.schedules import rule", "import opsdk.kernels", "import opsdk.quant",
    "from opsdk import op", "import opsdk.model", "import opsdk.bench", "import opsdk.deploy",
]


_IMPORT_FIRST = """
import os, sys, traceback
import tvm  # the heavy third-party import, once; every fork starts with no opsdk module
bad = []
for stmt in STMTS:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            assert not any(m.startswith("opsdk") for m in sys.modules)
            exec(stmt + "\\nimport opsdk\\nassert opsdk.get_op('softmax')\\n", {})
        except BaseException:
            os.write(w, traceback.format_exc()[-600:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    if os.waitpid(pid, 0)[1] or err:
        bad.append((stmt, err))
print(repr(bad))
"""


def test_any_module_can_be_imported_first():
    # `import opsdk` is lazy, so a user module's first opsdk import decides the import order;
    # each must work on its own and leave the built-in ops registered on first lookup. TVM is
    # imported once and each statement runs in a fork with no opsdk module loaded (a fresh
    # interpreter per statement spent minutes importing TVM again).
    r = _python(f"STMTS = {_FIRST_IMPORTS!r}\n" + _IMPORT_FIRST)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-3000:]


def _silent_port():
    """A port that accepts connections and never says a word (a wedged board)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []

    def accept():
        while True:
            try:
                held.append(srv.accept())
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[1]


def _closed_port() -> int:
    import socket

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    return port


def _stuck_call(runner, monkeypatch):
    # A call that hangs on a socket to the silent server (as one on a board that stopped
    # answering mid-run does): it must time out, be unblocked, and the runner be given up
    # after one re-check instead of every later call waiting out its own time-out.
    import socket

    def remote_call(*args, **kwargs):
        s = socket.create_connection((runner.host, runner.port))
        s.recv(1)  # returns only when the runner shuts the socket down
        raise RuntimeError("abandoned call")

    monkeypatch.setattr(runner, "_remote_call", remote_call)
    runner.timeout, runner.recheck_timeout = 1.0, 1.0
    runner.run("kernel.so", [])


# One table per boundary: each RPC fault is one clear RuntimeError within a stated bound.
RPC_FAULTS = [
    ("silent server", lambda r, mp: r.preflight(timeout=1.0), False,
     "did not answer the TVM RPC handshake within 1 s", 10),
    ("refused tracker", lambda r, mp: r.preflight(timeout=1.0), True,
     "cannot connect .*tvm.exec.rpc_tracker", 10),
    ("stops answering mid-run", _stuck_call, False, "could not open an RPC session .* within 1.0 s",
     10),
]


@pytest.mark.parametrize(("fault", "action", "tracker", "message", "bound"), RPC_FAULTS,
                         ids=[f[0] for f in RPC_FAULTS])
def test_rpc_faults_fail_fast_and_clearly(fault, action, tracker, message, bound,
                                          monkeypatch):
    import threading
    import time

    from opsdk.runners._base import RunnerUnavailable
    from opsdk.runners.rpc import RPCRunner

    srv, port = _silent_port()
    try:
        runner = (RPCRunner.from_tracker("127.0.0.1", _closed_port(), "k", arch="x86_64")
                  if tracker else RPCRunner("127.0.0.1", port, arch="x86_64"))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=message):
            action(runner, monkeypatch)
        assert time.monotonic() - t0 < bound
        if fault == "stops answering mid-run":
            t0 = time.monotonic()
            for _ in range(2):  # one re-check (1 s), then at once
                with pytest.raises(RunnerUnavailable,
                                   match=r"stopped answering after a failed call.*restart"):
                    runner.run("kernel.so", [])
            assert time.monotonic() - t0 < 5
            time.sleep(0.5)  # the abandoned call was unblocked: nothing left to hang the exit
            assert not [t for t in threading.enumerate() if t.name == "opsdk-rpc-run"]
    finally:
        srv.close()


# One table per boundary: each bad argument is a usage error (exit 2) that names the flag and
# says what was wrong, before any work (none of these loads TVM's kernels or runs anything).
BAD_ARGUMENTS = [
    (["new-op", "swt", "--targets", ""], "--targets '': name at least one of x86, arm"),
    (["new-op", "swt", "--targets", ","], "--targets ',': name at least one of x86, arm"),
    (["bench", "gelu", "--repeats", "0"], "--repeats: must be a whole number >= 1"),
    (["bench", "gelu", "--repeats", "-3"], "--repeats: must be a whole number >= 1"),
    (["bench", "gelu", "--threads", "0"], "--threads: must be a whole number >= 1"),
    (["bench", "gelu", "--budget-ms", "-5"], "--budget-ms: must be a finite number > 0"),
    (["bench", "gelu", "--budget-ms", "nan"], "--budget-ms: must be a finite number > 0"),
    (["bench", "gelu", "--json", "/nonexistent/r.json"], "its directory does not exist"),
    (["bench", "gelu", "--plot", "/proc/r.png"], "cannot create files in /proc"),
    (["verify", "gelu", "--rpc", ""], "--rpc: expected HOST:PORT"),
    (["verify", "gelu", "--rpc", "127.0.0.1:99999"], "port 99999 of '127.0.0.1:99999' is outside"),
    (["verify", "gelu", "--tracker", "host"], "--tracker: expected HOST:PORT"),
    (["verify", "gelu", "--examples", "-1"], "--examples: must be a whole number >= 0"),
    (["verify", "gelu", "--report", "/tmp"], "/tmp is a directory"),
    (["verify", "gelu", "--junit", "/nonexistent/j.xml"], "its directory does not exist"),
    (["explain", "gelu", "--json", "/proc/e.json"], "cannot create files in /proc"),
    (["explain", "gelu", "--shape", "4096,,768"], "--shape '4096,,768': write positive dims"),
    (["explain", "gelu", "--shape", "99999999999999999999,4"], "more than an int64 index"),
    (["explain", "gelu", "--shape", ""], "--shape '': write positive dims"),
    (["bench", "gelu", "--shapes", "4x,3"], "bad shape '4x,3': write positive dims"),
    (["bench", "gelu", "--shapes", "99999999999999999999x4"], "more than an int64 index"),
    (["verify", "gelu", "--dtypes", ""], "--dtypes: empty; name at least one"),
    (["verify", "gelu", "--layouts", ","], "--layouts: empty; name at least one"),
    (["drift", "m.py", "--json", "/nonexistent/d.json"], "its directory does not exist"),
    (["quantize", __file__, "--json", "q.out", "--plot", "q.out"],  # any .py that exists
     "--json and --plot name the"),
    (["quantize"], "name one model: a MODEL file or --zoo MODEL"),
    (["quantize", __file__, "--zoo", "mobilebert"], "name one model"),
    (["quantize", "--zoo", "mobilebert", "--model-arg", "n=1"], "go with a MODEL file"),
    (["quantize", "--zoo", "nosuch"], "no zoo model 'nosuch'; choose from"),
    (["bench", "gelux"], "error: no opsdk op named 'gelux'"),  # not the KeyError's quotes
    (["bench", "gelu", "--json", "r.out", "--plot", "./r.out"], "--json and --plot name the same"),
    (["drift", "m.py", "--max-rel", "nan"], "--max-rel: must be a finite number >= 0"),
    (["drift", "m.py", "--target", "armv9"], "unknown target 'armv9'"),
    (["drift", "/nonexistent/m.py"], "model file '/nonexistent/m.py' does not exist"),
    (["tune", __file__, "--target", "armv9"], "--target armv9: unknown target 'armv9'"),
    (["tune", __file__, "--target", "arm", "--tracker", "127.0.0.1:9190"],
     "--tracker needs --key"),
    (["tune", __file__, "--target", "arm", "--tracker", "127.0.0.1:9190", "--key", "k",
      "--rpc", "127.0.0.1:9090"], "--tracker and --rpc both name the device"),
    (["tune", __file__, "--rpc", "127.0.0.1:9090"], "--target x86 tunes on this machine"),
    (["tune", __file__, "--target", "arm", "--boards", "0"], "--boards: expected a number"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS,
                         ids=[" ".join(a)[:48] for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        rc = main(argv)
        raise SystemExit(rc)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"opsdk {argv[0]}: error:" in err and message in err, err


@pytest.mark.parametrize(("error", "rc", "said"), [
    (KeyboardInterrupt, 130, "interrupted"),  # Ctrl-C while TVM was being imported
    (BrokenPipeError, 141, ""),  # `opsdk verify | head`: the reader went away
])
def test_ctrl_c_during_start_up_is_a_word_not_a_traceback(monkeypatch, capsys, error, rc,
                                                          said):
    import opsdk.cli as cli

    def interrupted(command):
        raise error

    monkeypatch.setattr(cli, "_build_parser", interrupted)
    assert cli.main(["verify", "gelu"]) == rc
    assert capsys.readouterr().err.strip() == said


def _device_node(path) -> None:
    import os
    import stat

    try:  # a stand-in for /dev/null (char 1,3), which a test must never risk replacing
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")


# Where a report goes: each kind of path keeps what it is, and gets the whole text.
OUTPUT_TARGETS = ["new file", "existing file", "symlink", "device node", "full disk"]


@pytest.mark.parametrize("kind", OUTPUT_TARGETS)
def test_reports_are_written_whole_without_replacing_links_or_devices(tmp_path, kind,
                                                                      monkeypatch, capsys):
    import argparse
    import errno
    import stat

    import opsdk._files as files
    from opsdk._cliargs import output_path
    from opsdk._files import write_text_atomic

    path, real = tmp_path / "r.json", tmp_path / "real.json"
    if kind == "full disk":  # ENOSPC once the text is out: one line, the old file kept
        path.write_text("old")

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(files.os, "chmod", full)
        assert main(["explain", "gelu", "--no-asm", "--json", str(path)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"opsdk explain: error: cannot write {path}: No space left on device; "
                       "nothing was written to it"], err
        assert path.read_text() == "old" and not list(tmp_path.glob(".*.tmp"))
        return
    if kind == "existing file":
        path.write_text("old")
    elif kind == "symlink":  # the link stays; the file it points to is replaced
        real.write_text("old")
        path.symlink_to(real)
    elif kind == "device node":  # `--report /dev/null` renamed a regular file over it
        _device_node(path)
    assert output_path(str(path)) == str(path)
    write_text_atomic(path, '{"ok": true}')
    if kind == "device node":
        assert stat.S_ISCHR(path.lstat().st_mode)
    else:
        assert (real if kind == "symlink" else path).read_text() == '{"ok": true}'
        assert path.is_symlink() == (kind == "symlink")
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        output_path(str(tmp_path))


def test_a_json_switch_is_not_taken_for_an_output_path(capsys):
    # the same-file check looks at --json/--plot/--report/--junit: `list --json` is a switch
    import json

    assert main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("thread", ["none", "daemon", "worker"])
def test_the_console_exits_with_the_code_its_output_and_exit_handlers_whole(tmp_path, thread):
    # console() skips Python's teardown (a second after torch and TVM), not what a command
    # wrote, its exit handlers, or a thread it left running.
    done = tmp_path / "done.txt"
    r = _python(
        "import atexit, threading, time, opsdk.cli as cli\n"
        f"atexit.register(lambda: open({str(done)!r}, 'a').write('handler\\n'))\n"
        "def work():\n"
        f"    time.sleep({0.5 if thread == 'worker' else 60})\n"
        f"    open({str(done)!r}, 'a').write('thread\\n')\n"
        f"if {thread!r} != 'none':\n"
        f"    threading.Thread(target=work, daemon={thread!r} == 'daemon').start()\n"
        "def fake(argv=None):\n"
        "    for i in range(200000):\n"
        "        print(i)\n"
        "    return 3\n"
        "cli.main = fake\n"
        "cli.console()\n"
        "print('not reached')\n")
    assert r.returncode == 3, r.stderr
    lines = r.stdout.split()
    assert len(lines) == 200000 and lines[-1] == "199999"
    wrote = done.read_text().split()
    assert "handler" in wrote
    assert ("thread" in wrote) == (thread == "worker")  # a daemon thread is not waited for
