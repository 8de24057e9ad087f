"""Bad input from a user's own files and command-line text: one line naming the file, the
line and the error (exit 2), never a traceback through opsdk's frames or a silent success."""

from __future__ import annotations

import json
import sys

import pytest

from opsdk._userfile import UserCodeError, import_user_file
from opsdk.cli import main

_OP_MODULES = {
    "syntax": ("import opsdk\ndef f(:\n    pass\n", ":2: SyntaxError: invalid syntax"),
    "raises": ("import opsdk\nx = 1\nraise RuntimeError('boom at import')\n",
               ":3: RuntimeError: boom at import"),
    "missing": ("import opsdk\nimport no_such_helper_zz\n",
                ":2: ModuleNotFoundError: No module named 'no_such_helper_zz'"),
    "exits": ("import sys\nsys.exit(3)\n", ":2: SystemExit: 3"),
}


@pytest.mark.parametrize("command", [["list"], ["verify", "--quiet", "--no-db"],
                                     ["explain", "gelu", "--no-asm"], ["bench", "gelu"]])
@pytest.mark.parametrize("kind", sorted(_OP_MODULES))
def test_broken_op_module_is_one_line_naming_file_and_line(tmp_path, monkeypatch, capsys,
                                                           command, kind):
    src, needle = _OP_MODULES[kind]
    name = f"user_ops_{kind}_{command[0]}"
    (tmp_path / f"{name}.py").write_text(src)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main([*command, "--module", name]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{name}.py{needle}" in err
    assert "Traceback" not in err and "opsdk/" not in err  # no frame of opsdk's


def test_missing_op_module_is_still_no_module_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--module", "no_such_module_zz"]) == 2
    assert "No module named 'no_such_module_zz'" in capsys.readouterr().err


def _model(tmp_path, body: str, name: str = "model.py"):
    folder = tmp_path / "models"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(body)
    return folder / name


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("x = 1\n{}['nokey']\n", "model.py:2: KeyError: 'nokey'"),
        ("def build_model(:\n", "model.py:1: SyntaxError"),
        ("def helper():\n    raise ValueError('bad size')\n\n"
         "def build_model():\n    return helper()\n", "model.py:2: ValueError: bad size"),
        # the error is inside numpy: the line named is the user's call, not numpy's
        ("import numpy as np\n\ndef build_model():\n    return np.zeros((2, 3)).reshape(7)\n",
         "model.py:4: ValueError: cannot reshape"),
    ],
)
@pytest.mark.parametrize("command", [["drift"], ["explain", "--model"], ["bench", "--model"],
                                     ["quantize"]])
def test_model_file_that_raises_is_one_line_at_its_line(tmp_path, monkeypatch, capsys, body,
                                                        needle, command):
    path = _model(tmp_path, body)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main([*command, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["drift"], ["explain", "--model"], ["bench", "--model"],
                                     ["quantize"], ["build", "-o", "OUT", "--target", "x86"]])
def test_corrupt_onnx_is_one_line(tmp_path, capsys, command):
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"this is no protobuf \xff\xfe")
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    assert main([*argv, str(bad)] if command[0] != "build" else
                [argv[0], str(bad), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # build says "importing m.onnx" first
    assert last.startswith(f"opsdk {command[0]}: error: {bad}: not a valid ONNX model "
                           "(DecodeError"), err
    assert "Traceback" not in err


def test_model_file_imports_its_siblings_now_and_later(tmp_path, monkeypatch):
    from opsdk.frontend._cli import _call_entry, _import_python

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "sib_now_zz.py").write_text("SIZE = 4\n")
    (tmp_path / "models" / "sib_later_zz.py").write_text("def make(n):\n    return n * 2\n")
    path = _model(tmp_path, "import sib_now_zz\n\ndef build_model():\n"
                  "    import sib_later_zz\n    return sib_later_zz.make(sib_now_zz.SIZE)\n")
    monkeypatch.chdir(tmp_path)  # not the model's folder
    module = _import_python(str(path))
    assert _call_entry(module, str(path), "build_model") == 8


def test_failed_model_import_leaves_sys_path_and_modules_as_they_were(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = _model(tmp_path, "raise RuntimeError('no')\n", "broken_zz.py")
    before_path, before_mods = list(sys.path), set(sys.modules)
    with pytest.raises(UserCodeError, match=r"broken_zz.py:1: RuntimeError: no"):
        import_user_file(path)
    assert sys.path == before_path and set(sys.modules) == before_mods


def test_missing_entry_function_is_named(tmp_path, capsys):
    path = _model(tmp_path, "X = 1\n")
    assert main(["drift", str(path), "--entry", "make"]) == 2
    assert "has no function make() (pass --entry NAME)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ({"static": "no"}, "static 'no' is not true or false"),
        ({"op": "qdense", "dtype": "int8", "layout": "int8_per_channel", "free": {"ZZ": 4}},
         "free dim 'ZZ' is not one of the op's free dims (N)"),
        ({"op": "qdense", "dtype": "int8", "layout": "int8_per_channel", "free": {"N": 999}},
         "free dim 'N': 999 is outside its range (1, 64)"),
        ({"present": ["bias"]}, "present 'bias' is not an optional input"),
    ],
)
def test_verify_case_fields_that_would_have_passed_are_refused(capsys, case, needle):
    full = {"op": "gelu", "dtype": "float32", "layout": "erf", "shape": [3, 5], **case}
    assert main(["verify", "--target", "x86", "--case", json.dumps(full)]) == 2
    assert needle in capsys.readouterr().err


def test_verify_case_with_a_field_twice_is_refused(capsys):
    text = '{"op":"gelu","dtype":"float32","layout":"erf","shape":[3,5],"shape":[2,2]}'
    assert main(["verify", "--target", "x86", "--case", text]) == 2
    assert "field 'shape' is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["4096x", "0x3", "-4x3", "4x5abc", "4x\u00b2", "4x\u0663",
                                  "4,,5", "1_0x4", "+4x4"])
def test_shape_text_that_does_not_parse_is_refused(capsys, text):
    assert main(["explain", "gelu", "--no-asm", f"--shape={text}"]) == 2
    assert "write positive dims like 4096x768" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["drift", "M", "--shape", "x=2,3", "--shape", "x=4,5"], "'x' is given twice"),
        (["build", "M", "-o", "OUT", "--shape", "x=1_0x4"], "write positive dims"),
        (["build", "M", "-o", "OUT", "--shape", "x=2x3", "--shape", "x=4x5"],
         "'x' is given twice"),
        (["build", "M", "-o", "OUT", "--max-dim", "s1=\u00b2"], "--max-dim expects NAME=N"),
        (["build", "M", "-o", "OUT", "--max-dim", "s1=2", "--max-dim", "s1=4"],
         "'s1' is given twice"),
        (["explain", "--model", "M", "--model-arg", "n=1", "--model-arg", "n=2"],
         "'n' is given twice"),
        (["explain", "gelu", "--attr", "approximate=\"tanh\"", "--attr",
          "approximate=\"none\""], "'approximate' is given twice"),
    ],
)
def test_repeated_or_malformed_names_are_refused(tmp_path, capsys, argv, needle):
    model = _model(tmp_path, "def build_model():\n    raise AssertionError('not reached')\n")
    argv = [str(model) if a == "M" else str(tmp_path / "out") if a == "OUT" else a
            for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "not reached" not in err
