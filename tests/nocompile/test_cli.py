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


def test_any_module_can_be_imported_first():
    # `import opsdk` is lazy, so a user module's first opsdk import decides the import order;
    # each must work on its own and leave the built-in ops registered on first lookup.
    import concurrent.futures

    def run(stmt: str) -> tuple[str, subprocess.CompletedProcess]:
        return stmt, _python(f"{stmt}\nimport opsdk\nassert opsdk.get_op('softmax')\n")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = [(s, r.stderr[-600:]) for s, r in pool.map(run, _FIRST_IMPORTS) if r.returncode]
    assert not bad, bad


def test_rpc_preflight_fails_fast_and_clearly():
    # A port that accepts and never answers, and one that refuses: both a clear error in a
    # bounded time, not a 120 s wait per example (or forever, for a tracker).
    import socket
    import threading
    import time

    from opsdk.runners.rpc import RPCRunner

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    held = []
    threading.Thread(target=lambda: held.extend(srv.accept() for _ in range(2)),
                     daemon=True).start()
    port = srv.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer the TVM RPC handshake within 1 s"):
        RPCRunner("127.0.0.1", port, arch="x86_64").preflight(timeout=1.0)
    assert time.monotonic() - t0 < 10
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed = free.getsockname()[1]
    free.close()
    with pytest.raises(RuntimeError, match="cannot connect"):
        RPCRunner.from_tracker("127.0.0.1", closed, "k", arch="x86_64").preflight(timeout=1.0)
    srv.close()


# One table per boundary: each bad argument is a usage error (exit 2) that names the flag and
# says what was wrong, before any work (none of these loads TVM's kernels or runs anything).
BAD_ARGUMENTS = [
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
    (["drift", "m.py", "--json", "/nonexistent/d.json"], "its directory does not exist"),
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


def test_ctrl_c_during_start_up_is_a_word_not_a_traceback(monkeypatch, capsys):
    import opsdk.cli as cli

    def interrupted(command):
        raise KeyboardInterrupt  # as if Ctrl-C landed while TVM was being imported

    monkeypatch.setattr(cli, "_build_parser", interrupted)
    assert cli.main(["verify", "gelu"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
