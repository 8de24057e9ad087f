"""The pytest plugin gives an op package the generic suite with one line of configuration."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_OPS = '''
import numpy as np
from tvm import te
import opsdk


def _swish(x):
    return x / (1.0 + np.exp(-x))


def _swish_te(x, k):
    def f(*i):
        v = x(*i).astype("float32")
        return (v * te.sigmoid(v) * k).astype(x.dtype)
    return te.compute(x.shape, f, name="swish")


@opsdk.op(reference=_swish, domain={"x": (-6.0, 6.0)}, ranks=(1, 3))
def plugin_swish(x: opsdk.Tensor) -> te.Tensor:
    return _swish_te(x, 1.0)


@opsdk.op(reference=_swish, domain={"x": (-6.0, 6.0)}, ranks=(1, 3), dtypes=("float32",))
def plugin_swish_off(x: opsdk.Tensor) -> te.Tensor:
    return _swish_te(x, 1.001)  # 0.1 % off: a bug the generic suite must catch


OPS = [plugin_swish, plugin_swish_off]
'''


def _pytest(folder, *args: str, env: dict | None = None) -> tuple[int, str]:
    # No PYTHONPATH: the plugin finds the op modules from the rootdir.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
           "HYPOTHESIS_PROFILE": "dev", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def _package(tmp_path):
    (tmp_path / "myops.py").write_text(textwrap.dedent(_OPS))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_other.py").write_text("def test_other():\n    pass\n")
    # The one line of configuration; the installed opsdk registers the plugin (pytest11).
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nopsdk_ops = myops\naddopts = -p no:cacheprovider\n"
    )
    return tmp_path


def test_plugin_runs_the_generic_suite_on_a_package(tmp_path) -> None:
    pkg = _package(tmp_path)
    rc, text = _pytest(pkg, "-q", "-rA", "--opsdk-seed", "0")
    assert rc == 1, text
    assert "INTERNALERROR" not in text
    for dtype in ("float32", "float16", "bfloat16"):
        assert f"PASSED myops.py::plugin_swish[{dtype}-default]" in text, text
    assert "PASSED myops.py::plugin_swish[refusals]" in text
    assert "PASSED tests/test_other.py::test_other" in text
    assert "FAILED myops.py::plugin_swish_off[float32-default]" in text
    assert "opsdk verify plugin_swish_off --target" in text and "--module myops" in text
    assert "1 failed" in text


def test_plugin_items_are_collected_like_tests_and_rerun_by_id(tmp_path) -> None:
    pkg = _package(tmp_path)
    rc, listed = _pytest(pkg, "--collect-only", "-q")
    assert rc == 0, listed
    ids = [ln for ln in listed.splitlines() if "::" in ln]
    assert "myops.py::plugin_swish[float32-default]" in ids
    assert "tests/test_other.py::test_other" in ids
    assert f"{len(ids)} tests collected" in listed, listed
    # another path: no suite items added behind the user's back
    rc, other = _pytest(pkg, "--collect-only", "-q", "tests")
    assert rc == 0 and "myops.py" not in other and "1 test collected" in other, other
    # a collected id re-runs exactly that check, and -v counts what it runs
    rc, one = _pytest(pkg, "-v", "myops.py::plugin_swish[float32-default]")
    assert rc == 0 and "collected 1 item" in one and "1 passed" in one, one


def test_plugin_usage_errors_are_clean(tmp_path) -> None:
    pkg = _package(tmp_path)
    rc, text = _pytest(pkg, "-q", "--opsdk-target", "risc-v")
    assert rc == 4 and "INTERNALERROR" not in text, text
    assert "--opsdk-target 'risc-v'" in text
    (pkg / "pytest.ini").write_text("[pytest]\nopsdk_ops = nosuchmod\n")
    rc, text = _pytest(pkg, "-q")
    assert rc == 4 and "INTERNALERROR" not in text, text
    assert "opsdk_ops: no module 'nosuchmod'" in text


def test_scaffolded_package_verifies_once(tmp_path) -> None:
    from opsdk._scaffold import new_op

    new_op("plug_gain", kind="elementwise", directory=tmp_path, targets=["x86"])
    rc, plain = _pytest(tmp_path, "-q", "-rA", "-p", "no:cacheprovider")
    assert rc == 0 and "PASSED test_plug_gain.py::test_plug_gain_verifies[x86]" in plain, plain
    (tmp_path / "pytest.ini").write_text("[pytest]\nopsdk_ops = plug_gain\n")
    rc, both = _pytest(tmp_path, "-q", "-rA", "-p", "no:cacheprovider")
    assert rc == 0, both
    assert "PASSED plug_gain.py::plug_gain[float32-default]" in both, both
    assert "SKIPPED" in both and "the opsdk pytest plugin verifies plug_gain" in both
