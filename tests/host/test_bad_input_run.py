"""A compiled model called with inputs it refuses, or on a CPU it was not built for: the
runner says which input, what the model takes and what it got (not TVM's internal check)."""

from __future__ import annotations

import numpy as np
import pytest

import opsdk
from opsdk.runners import InputMismatch, LocalRunner

_ANN = '(R.Tensor((n, 16), dtype="float32"))'


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([np.ones((8, 16), "float64")],
         f"input 'x' (#0 of main): dtype float64, the model takes dtype float32 {_ANN}"),
        ([np.ones((8, 16, 1), "float32")],
         f"input 'x' (#0 of main): shape [8, 16, 1] (3 dims), the model takes 2 dims {_ANN}"),
        ([np.ones((8, 15), "float32")],
         f"input 'x' (#0 of main): shape [8, 15] (dim 1 is 15), the model takes 16 there "
         f"{_ANN}"),
        ([np.ones((8, 16), "float32")] * 2, "2 inputs given, main takes 1"),
        ([], "0 inputs given, main takes 1"),
    ],
)
def test_wrong_inputs_name_the_input_and_what_the_model_takes(relu_mod, inputs, message):
    ex = opsdk.compile(relu_mod, "x86")
    with LocalRunner() as r:
        with pytest.raises(InputMismatch) as e:
            r.run(ex, inputs)
        assert str(e.value) == message
        with pytest.raises(InputMismatch):
            r.run_timed(ex, inputs, repeats=1)
        assert r.run(ex, [np.ones((3, 16), "float32")])[0].shape == (3, 16)  # still usable


def test_an_arm_build_run_on_the_host_says_so(relu_mod):
    ex = opsdk.compile(relu_mod, "arm")
    with LocalRunner() as r, pytest.raises(InputMismatch,
                                           match="compiled for another CPU architecture"):
        r.run(ex, [np.ones((8, 16), "float32")])


def test_run_with_an_npz_array_naming_no_input_is_refused(relu_mod, tmp_path, capsys):
    from opsdk.cli import main
    from opsdk.deploy import build_artifact

    art = tmp_path / "art"
    x = np.ones((2, 16), "float32")
    build_artifact(relu_mod, art, target="x86", inputs=[x], log=None)
    npz = tmp_path / "in.npz"
    np.savez(npz, x=x, y=x)  # `y` was ignored: PASS, exit 0
    assert main(["run", str(art), "--inputs", str(npz), "--repeats", "1"]) == 2
    assert ("opsdk run: error: inputs: 'y' name no input of the model; it takes x"
            in capsys.readouterr().err)
