"""Quiet by default: known-harmless warnings and TVM log lines are hidden, anything else shows;
``-v`` / ``OPSDK_VERBOSE=1`` shows everything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A command body that emits, through Python and straight to fd 2 (as TVM's C++ LOG does),
# one known-harmless line of each kind and one real line of each kind.
_NOISY = r'''
import os, sys, warnings
from opsdk import cli

def fake(args):
    warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated, use ...",
                           FutureWarning, "copyreg.py", 105, module="copyreg")
    warnings.warn_explicit("a real deprecation", FutureWarning, "copyreg.py", 105,
                           module="copyreg")
    os.write(2, b"[10:13:26] /project/src/runtime/vm/executable.cc:276: Warning: "
                b"Scope Saving:global\n" * 3)
    os.write(2, b"[10:13:26] /project/src/runtime/vm/executable.cc:340: Warning: "
                b"Scope Loaded:global\n")
    os.write(2, b"[10:13:26] take.cc:1: Warning: Fast mode segfaults when there are "
                b"out-of-bounds indices. Make sure input indices are in bound\n")
    os.write(2, b"native: a line nobody vetted\n")
    print("progress line", file=sys.stderr)
    print("the result")
    return 0

cli._ARGS["list"] = lambda s: s.set_defaults(fn=fake)
sys.exit(cli.main(sys.argv[1:]))
'''


def _run(argv, verbose_env=False):
    env = {k: v for k, v in os.environ.items() if k != "OPSDK_VERBOSE"}
    if verbose_env:
        env["OPSDK_VERBOSE"] = "1"
    return subprocess.run([sys.executable, "-c", _NOISY, *argv], capture_output=True,
                          text=True, timeout=120, env=env)


def test_known_harmless_lines_are_hidden_and_the_rest_shows():
    r = _run(["list"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == "the result\n"
    assert "LeafSpec" not in r.stderr
    assert "Scope Saving" not in r.stderr and "Scope Loaded" not in r.stderr
    assert "Fast mode segfaults" not in r.stderr
    assert "a real deprecation" in r.stderr
    assert "native: a line nobody vetted" in r.stderr
    assert "progress line" in r.stderr


@pytest.mark.parametrize(("argv", "env"), [(["-v", "list"], False), (["list", "-v"], False),
                                           (["list"], True)])
def test_verbose_shows_everything(argv, env):
    r = _run(argv, verbose_env=env)
    assert r.returncode == 0, r.stderr
    assert "LeafSpec" in r.stderr
    assert r.stderr.count("Scope Saving") == 3
    assert "Fast mode segfaults" in r.stderr
    assert "native: a line nobody vetted" in r.stderr


def test_a_crash_under_the_filter_still_reaches_stderr():
    # fd 2 points at a file while a command runs: a segfault's report must not be lost there.
    code = _NOISY.replace('print("the result")',
                          'import ctypes; ctypes.string_at(0)')
    r = subprocess.run([sys.executable, "-c", code, "list"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "Segmentation fault" in r.stderr or "Fatal Python error" in r.stderr, r.stderr
