"""Bad input from a user's own files and command-line text: one line naming the file, the
line and the error (exit 2), never a traceback through opsdk's frames or a silent success."""

from __future__ import annotations

import json
import sys

import numpy as np
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
                                     ["quantize"], ["build"]])
def test_model_file_that_raises_is_one_line_at_its_line(tmp_path, monkeypatch, capsys, body,
                                                        needle, command):
    path = _model(tmp_path, body)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out"
    extra = ["-o", str(out), "--target", "x86"] if command == ["build"] else []
    assert main([*command, str(path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # build says "importing ..." first
    assert len(err.splitlines()) == 1 + bool(extra), err
    assert needle in last and "Traceback" not in err
    assert not out.exists()  # build left no folder behind


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
    from opsdk.frontend import call_entry, import_model_module

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "sib_now_zz.py").write_text("SIZE = 4\n")
    (tmp_path / "models" / "sib_later_zz.py").write_text("def make(n):\n    return n * 2\n")
    path = _model(tmp_path, "import sib_now_zz\n\ndef build_model():\n"
                  "    import sib_later_zz\n    return sib_later_zz.make(sib_now_zz.SIZE)\n")
    monkeypatch.chdir(tmp_path)  # not the model's folder
    module = import_model_module(str(path))
    assert call_entry(module, str(path), "build_model") == 8


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
        ({"packed": True}, "packed: the op declares no weights"),
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


def test_over_long_op_name_is_refused_at_definition():
    from tvm import te

    import opsdk
    from opsdk import OpDefinitionError

    def _ref(x):
        return x

    def compute(x: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i), name="y")

    with pytest.raises(OpDefinitionError, match=r"is 300 characters; keep it to 64 or fewer"):
        opsdk.op(reference=_ref, name="b" * 300)(compute)
    assert opsdk.op(reference=_ref, name="b" * 64)(compute).name == "b" * 64


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C"}])
def test_non_ascii_folder_prints_on_an_ascii_stdout(tmp_path, env):
    import os
    import subprocess

    folder = tmp_path / "\u00fcn\u00ef"
    folder.mkdir()
    r = subprocess.run([sys.executable, "-m", "opsdk", "new-op", "swishu", "--dir", str(folder),
                        "--targets", "x86"], capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONUTF8": "0", **env})
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-800:]
    assert b"wrote" in r.stdout and b"opsdk verify swishu --module swishu" in r.stdout
    assert sorted(p.name for p in folder.iterdir()) == [
        "swishu.py", "swishu_schedules.py", "test_swishu.py"]


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ([np.ones((8, 16), "float64")], "input 'x' (#0 of main): dtype float64, the model "
                                         "takes ['n', 16] (float32)"),
        ([np.ones((8, 16, 1), "float32")], "input 'x' (#0 of main): shape [8, 16, 1], the "
                                           "model takes ['n', 16] (float32)"),
        ([np.ones((8, 15), "float32")], "input 'x' (#0 of main): shape [8, 15], the model "
                                        "takes ['n', 16] (float32)"),
        ([np.ones((8, 16), "float32")] * 2, "2 inputs given, main takes 1"),
    ],
)
def test_build_with_inputs_the_model_refuses_names_the_input_before_compiling(
        tmp_path, monkeypatch, relu_mod, inputs, needle):
    import opsdk
    from opsdk.deploy import ArtifactError

    monkeypatch.setattr("opsdk.model.compile_model", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ArtifactError) as e:
        opsdk.deploy.build_artifact(relu_mod, tmp_path / "art", target="x86", inputs=inputs,
                                    log=None)
    assert str(e.value) == needle


def test_drift_model_returning_inputs_its_module_refuses_names_the_input(tmp_path, capsys):
    path = _model(tmp_path, "import numpy as np\nfrom tvm import relax\n\ndef build_model():\n"
                  "    x = relax.Var('x', relax.TensorType((2, 3), 'float32'))\n"
                  "    bb = relax.BlockBuilder()\n"
                  "    with bb.function('main', [x]):\n"
                  "        bb.emit_func_output(x)\n"
                  "    return bb.get(), [np.zeros((2, 4), 'float32')]\n")
    assert main(["drift", str(path)]) == 2
    assert ("input 'x' (#0 of main): shape [2, 4], the model takes [2, 3] (float32)"
            in capsys.readouterr().err)


@pytest.mark.parametrize(
    ("dom", "needle"),
    [
        ({"mode": ["a", "c"]}, "attr_domain['mode'] lists 'c', which is not one of the choices "
                               "of 'mode': ['a', 'b']"),
        ({"mode": "c"}, "lists 'c', which is not one of the choices"),
        ({"k": [1, "two"]}, "attr_domain['k'] lists 'two' (str), but 'k' is int"),
        ({"k": [0, 2.5]}, "attr_domain['k'] lists 2.5 (float), but 'k' is int"),
    ],
)
def test_attr_domain_outside_the_attributes_own_values_is_refused(dom, needle):
    from typing import Literal

    from tvm import te

    import opsdk
    from opsdk import OpDefinitionError

    def _ref(x, *, mode="a", k=1):
        return x

    def attrdom(x: opsdk.Tensor, *, mode: Literal["a", "b"] = "a", k: int = 1) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i), name="y")

    with pytest.raises(OpDefinitionError, match="op 'attrdom'") as e:
        opsdk.op(reference=_ref, attr_domain=dom)(attrdom)
    assert needle in str(e.value)
    assert opsdk.op(reference=_ref, attr_domain={"mode": ["b"], "k": (1, 5)})(attrdom)


def test_printing_a_module_with_opsdk_ops_and_constants_never_segfaults():
    # mod.script(show_meta=True) dies in TVM 0.27's JSON serializer on any node with a dtype
    # field: the constants' and the opsdk calls' types (printed as ret_ty=metadata[...]).
    # opsdk.transform.script prints the types inline and summarizes the constants.
    import subprocess

    code = (
        "import numpy as np, opsdk\nfrom tvm import relax, tirx\n"
        "n = tirx.Var('n', 'int64')\n"
        "x = relax.Var('x', relax.TensorType((n, 8), 'float32'))\n"
        "bb = relax.BlockBuilder()\n"
        "with bb.function('main', [x]):\n"
        "    with bb.dataflow():\n"
        "        y = bb.emit(opsdk.relax.layer_norm(x, relax.const(np.ones(8, 'float32')),\n"
        "                                           begin_axis=-1))\n"
        "        z = bb.emit_output(opsdk.relax.gelu(y))\n"
        "    bb.emit_func_output(z)\n"
        "print(opsdk.transform.script(bb.get()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-800:]
    out = r.stdout
    assert out.count('ret_ty=R.Tensor((n, 8), dtype="float32"))') == 2, out
    assert 'metadata["relax' not in out and "not shown" not in out
    assert "# [0] shape [8] float32: 1., 1., 1., 1., 1., 1., 1., 1." in out


def test_broken_entry_point_plugin_is_one_error_naming_it(monkeypatch):
    import functools
    import importlib

    import opsdk._plugins as plugins

    class _EP:  # an installed plugin whose module is gone: no frame of the user's to name
        name, value = "mine", "my_plugin_zz.ops:OPS"
        load = functools.partial(importlib.import_module, "my_plugin_zz")

    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: [_EP()])
    with pytest.raises(UserCodeError, match=r"^entry point mine = my_plugin_zz\.ops:OPS: "
                                            r"ModuleNotFoundError: No module named 'my_plugin_zz'"):
        plugins.load_plugins([])


def test_ctrl_c_while_a_model_file_loads_is_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = _model(tmp_path, "raise KeyboardInterrupt\n", "interrupted_zz.py")
    before_path, before_mods = list(sys.path), set(sys.modules)
    with pytest.raises(KeyboardInterrupt):
        import_user_file(path)
    assert sys.path == before_path and set(sys.modules) == before_mods
    assert main(["drift", str(path)]) == 130  # "interrupted", as Ctrl-C anywhere else


def test_two_model_files_each_get_their_own_sibling_helper(tmp_path, monkeypatch):
    from opsdk.frontend import call_entry, import_model_module

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    got = []
    for size in (3, 5):
        folder = tmp_path / f"m{size}"
        folder.mkdir()
        (folder / "helpers_twin_zz.py").write_text(f"SIZE = {size}\n")
        (folder / "model.py").write_text("import helpers_twin_zz\n\ndef build_model():\n"
                                         "    return helpers_twin_zz.SIZE\n")
        module = import_model_module(str(folder / "model.py"))
        got.append(call_entry(module, "model.py", "build_model"))
    assert got == [3, 5]


def test_python_m_opsdk_bench_with_a_failing_model_is_one_line(tmp_path, capsys):
    from opsdk.bench.__main__ import main as bench_main

    path = _model(tmp_path, "def build_model():\n    raise ValueError('bad entry')\n")
    assert bench_main(["--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("model.py:2: ValueError: bad entry") and len(err.splitlines()) == 1


# ---------------------------------------------------------------- model files at load time
_FAILS_IN_EXPORT = ("import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
                    "        return x @ torch.ones(7, 7)\n\n"
                    "def build_model():\n    return M(), (torch.randn(2, 3),)\n")


@pytest.mark.parametrize("command", [["drift"], ["explain", "--model"], ["build"]])
def test_model_whose_forward_fails_in_export_is_one_line_at_its_line(tmp_path, monkeypatch,
                                                                     capfd, command):
    path = _model(tmp_path, _FAILS_IN_EXPORT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    extra = ["-o", str(tmp_path / "out"), "--target", "x86"] if command == ["build"] else []
    assert main([*command, str(path), *extra]) == 2
    err = capfd.readouterr().err.strip()
    assert "Traceback" not in err, err  # torch's logged traceback of the failing op too
    assert err.splitlines()[-1].endswith(
        "model.py:5: RuntimeError: a and b must have same reduction dim, but got [2, 3] X "
        "[7, 7].")


@pytest.mark.parametrize("command", [["drift"], ["explain", "--model"], ["bench", "--model"],
                                     ["quantize"], ["build"]])
def test_entry_returning_a_bare_tensor_as_args_is_named(tmp_path, monkeypatch, capsys,
                                                        command):
    path = _model(tmp_path, "import torch\n\ndef build_model():\n"
                  "    return torch.nn.Linear(3, 4), torch.randn(2, 3)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    extra = ["-o", str(tmp_path / "out"), "--target", "x86"] if command == ["build"] else []
    assert main([*command, str(path), *extra]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"{path}: build_model() must return (model, args) with args a tuple "
                         "of example inputs, e.g. (model, (x,)); got a Tensor"), last


@pytest.mark.parametrize("command", [["drift"], ["explain", "--model"], ["bench", "--model"],
                                     ["build", "-o", "OUT"]])
def test_empty_onnx_file_says_so(tmp_path, capsys, command):
    empty = tmp_path / "m.onnx"
    empty.write_bytes(b"")
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    assert main([argv[0], str(empty), *argv[1:]] if command[0] == "build" else
                [*argv, str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].endswith(f"{empty}: not an ONNX model (empty file)"), err
    assert "Traceback" not in err


def test_onnx_file_without_a_graph_is_not_read_as_onnx(tmp_path):
    from opsdk._userfile import load_onnx_file

    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"\x08\x00")  # decodes as a ModelProto with ir_version 0, no graph
    with pytest.raises(UserCodeError, match=r"m\.onnx: cannot be read as ONNX"):
        load_onnx_file(bad)


def _folder_and_txt(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "m.txt").write_text("def build_model():\n    pass\n")
    return tmp_path / "adir", tmp_path / "m.txt"


@pytest.mark.parametrize("command", [["drift"], ["explain", "--model"], ["bench", "--model"],
                                     ["quantize"], ["build", "-o", "OUT"]])
@pytest.mark.parametrize("which", [0, 1])
def test_folder_or_unknown_kind_of_file_as_model_is_named(tmp_path, monkeypatch, capsys,
                                                          command, which):
    path = _folder_and_txt(tmp_path)[which]
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    argv = ([argv[0], path.name, *argv[1:]] if command[0] == "build" else [*argv, path.name])
    try:
        rc = main(argv)
    except SystemExit as e:  # refused by the argument's type
        rc = e.code
    assert rc == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    want = "is a folder; " if which == 0 else "a .txt file is no model; "
    assert f"{path.name}: {want}pass a model file (.py with build_model(), .pt2 or .onnx)" in last


def test_model_loader_refuses_a_folder_whatever_calls_it(tmp_path):
    from opsdk.frontend import import_model_module

    folder, txt = _folder_and_txt(tmp_path)
    for p in (folder, txt):
        with pytest.raises(UserCodeError, match="pass a model file"):
            import_model_module(str(p))


def _onnx_model(path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("command", [["drift"], ["build", "-o", "OUT"]])
def test_shape_naming_no_input_of_the_onnx_model_is_refused(tmp_path, capsys, command):
    path = _onnx_model(tmp_path / "m.onnx")
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    assert main([argv[0], str(path), *argv[1:], "--shape", "zz=1x4"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"{path}: no input named 'zz' (--shape zz=...); its inputs: x"), last
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ command lines
def test_quantize_percentile_out_of_range_is_refused_before_calibrating(tmp_path, capsys):
    path = _model(tmp_path, "raise AssertionError('imported')\n")
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(path), "--method", "percentile", "--percentile", "200"])
    assert e.value.code == 2
    assert ("argument --percentile: must be a percentile in [0, 100], got '200'"
            in capsys.readouterr().err)


@pytest.mark.parametrize(("argv", "needle"), [
    (["explain", "layer_norm", "--no-asm", "--shape", "-4x768"],
     "--shape '-4x768': write positive dims like 4096x768"),
    (["bench", "gelu", "--shapes", "-64x64"],
     "argument --shapes: bad shape '-64x64': write positive dims like 4096x768"),
])
def test_shape_with_a_leading_minus_is_refused_by_the_shape_rule(capsys, argv, needle):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_module_given_as_a_py_path_is_imported_from_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    sub = tmp_path / "pkgdir"
    sub.mkdir()
    (sub / "helper_ops_zz.py").write_text("OPS = []\n")
    (sub / "user_ops_path_zz.py").write_text("import helper_ops_zz\nOPS = helper_ops_zz.OPS\n")
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--module", "./pkgdir/user_ops_path_zz.py"]) == 0
    assert sys.modules["user_ops_path_zz"].__file__ == str(sub / "user_ops_path_zz.py")
    assert main(["list", "--module", "./pkgdir/no_such_zz.py"]) == 2
    assert ("./pkgdir/no_such_zz.py: no such .py file; --module takes a module name (mod) or "
            "a .py file path" in capsys.readouterr().err)


def test_module_path_that_raises_names_its_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "user_ops_raise_zz.py").write_text("x = 1\nraise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--module", "./user_ops_raise_zz.py"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "user_ops_raise_zz.py:2: RuntimeError: boom")


# ------------------------------------------------------------------------------ artifacts
def test_run_of_a_file_says_it_is_no_artifact_folder(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x\n")
    assert main(["run", str(f)]) == 2
    assert (f"opsdk run: error: {f}: not an artifact folder (a file); opsdk build writes one"
            in capsys.readouterr().err)


def test_run_inputs_with_an_array_naming_no_input_are_refused():
    from opsdk.deploy import ArtifactError
    from opsdk.deploy._run import _given_inputs

    m = {"inputs": [{"name": "x", "dtype": "float32", "shape": [2, 3]}]}
    x = np.ones((2, 3), "float32")
    assert _given_inputs(m, {"x": x})[0].shape == (2, 3)
    with pytest.raises(ArtifactError, match=r"^inputs: 'y' name no input of the model; it "
                                            r"takes x$"):
        _given_inputs(m, {"x": x, "y": x})


# ------------------------------------------------------------------ the process's edges
_DEV_FULL = "/dev/full"


@pytest.mark.skipif(not __import__("os").path.exists(_DEV_FULL), reason="no /dev/full")
def test_output_to_a_full_disk_is_one_line():
    import subprocess

    with open(_DEV_FULL, "w") as full:
        r = subprocess.run([sys.executable, "-m", "opsdk", "list"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == ("opsdk: error: cannot write the output (No space left on "
                                "device); free some space or write elsewhere")


# Ctrl-C at the moment opsdk.cli imports its helpers (an import hook raises it there).
_INTERRUPT_AT_IMPORT = """
import builtins, sys
real = builtins.__import__
def imp(name, *a, **k):
    if name.endswith("_cliargs"):
        raise KeyboardInterrupt
    return real(name, *a, **k)
builtins.__import__ = imp
"""


@pytest.mark.parametrize("how", ["script", "python -m"])
def test_ctrl_c_while_the_command_imports_is_130_without_a_traceback(tmp_path, how):
    import subprocess

    if how == "script":  # as the console script `opsdk` does it
        script = tmp_path / "opsdk"
        script.write_text(_INTERRUPT_AT_IMPORT + "from opsdk.cli import main\n"
                          "sys.exit(main())\n")
        argv = [sys.executable, str(script), "list"]
    else:
        argv = [sys.executable, "-c", _INTERRUPT_AT_IMPORT + "import runpy\n"
                "sys.argv = ['opsdk', 'list']\n"
                "runpy.run_module('opsdk', run_name='__main__', alter_sys=True)\n"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted")


def test_a_package_folder_is_still_a_module_name():
    import opsdk
    from opsdk._cliargs import model_path_problem

    assert model_path_problem(str(__import__("pathlib").Path(opsdk.__file__).parent)) is None


def test_ctrl_c_inside_a_gc_callback_still_stops_the_command(monkeypatch, capsys):
    # hypothesis installs a gc callback; a Ctrl-C landing there was "ignored" by Python
    # (a traceback on stderr) and `opsdk verify` ran on to PASS, exit 0. Python hands such
    # an exception to sys.unraisablehook, which is what this calls.
    import time
    import types

    from opsdk import cli

    before = sys.unraisablehook

    def command(argv):
        sys.unraisablehook(types.SimpleNamespace(
            exc_type=KeyboardInterrupt, exc_value=KeyboardInterrupt(), exc_traceback=None,
            err_msg="Exception ignored in", object=None))
        for _ in range(500):
            time.sleep(0.01)
        return 0

    monkeypatch.setattr(cli, "_main", command)
    assert cli.main(["list"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert sys.unraisablehook is before  # restored for whoever called main()
