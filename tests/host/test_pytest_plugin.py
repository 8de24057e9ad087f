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


def test_plugin_runs_the_generic_suite_on_a_package(tmp_path) -> None:
    (tmp_path / "myops.py").write_text(textwrap.dedent(_OPS))
    # The one line of configuration; the installed opsdk registers the plugin (pytest11).
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nopsdk_ops = myops\naddopts = -p no:cacheprovider\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HYPOTHESIS_PROFILE": "dev"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "--opsdk-seed", "0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    for dtype in ("float32", "float16", "bfloat16"):
        assert f"PASSED ::opsdk::plugin_swish[{dtype}-default]" in text, text
    assert "PASSED ::opsdk::plugin_swish[refusals]" in text
    assert "FAILED ::opsdk::plugin_swish_off[float32-default]" in text
    assert "opsdk verify plugin_swish_off --target" in text and "--module myops" in text
    assert "1 failed" in text
