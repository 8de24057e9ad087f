"""Every example in opsdk's docstrings runs and prints what it says: numpydoc examples are
documentation a user copies, so a stale one is a bug. They run in a process of their own
(some define or register ops, which the other tests must not see)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import opsdk

ROOT = Path(opsdk.__file__).resolve().parent


def test_docstring_examples_run(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--doctest-modules",
         str(ROOT), f"--ignore={ROOT / 'templates'}", f"--ignore={ROOT / '__main__.py'}",
         f"--ignore={ROOT / 'bench' / '__main__.py'}", "-o", "addopts=", "-W", "ignore"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-400:]
    assert r.returncode == 0, r.stdout[-3000:]
    # and it ran them: a hundred and more examples, none skipped unless marked so
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 100, summary
