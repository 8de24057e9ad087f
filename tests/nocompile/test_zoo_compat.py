"""torchvision beside a torch its C++ extension was not built for (the CUDA torchvision the
package index serves beside the pinned CPU torch): opsdk's import hook lets its Python half
import, and a torchvision that still fails is refused in one line naming the cause and the fix.

Fake torchvision packages stand in for the real one, so the first two run without it
installed; the third needs transformers (and torchvision's metadata, which it checks)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from opsdk._userfile import UserCodeError
from opsdk.model import load_model


def _fake_torchvision(root: pathlib.Path, init: str, has_ops: bool) -> None:
    pkg = root / "torchvision"
    pkg.mkdir()
    (pkg / "_C.so").write_bytes(b"not a shared object")
    (pkg / "extension.py").write_text(f"def _has_ops():\n    return {has_ops}\n")
    (pkg / "__init__.py").write_text(textwrap.dedent(init))


@pytest.fixture
def no_torchvision_modules(monkeypatch):
    """sys.modules without torchvision (restored after): the fake one is imported afresh."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "torchvision"}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    yield
    for k in [k for k in sys.modules if k.split(".")[0] == "torchvision"]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_a_torchvision_that_does_not_import_is_refused_in_one_line(tmp_path,
                                                                   no_torchvision_modules):
    _fake_torchvision(tmp_path, """\
        from . import extension
        raise RuntimeError("operator torchvision::roi_align does not exist")
        """, has_ops=True)
    model = tmp_path / "zoo_model.py"
    model.write_text("import torchvision.models\n\n\ndef build_model():\n    pass\n")
    with pytest.raises(UserCodeError) as e:
        load_model(str(model), baselines=False)
    # before: "zoo_model.py:1: RuntimeError: operator torchvision::roi_align does not exist"
    assert re.fullmatch(
        r"\S*zoo_model\.py:1: ZooImportError: torchvision \S+ beside torch \S+ does not "
        r"import: RuntimeError: operator torchvision::roi_align does not exist; fix: install "
        r"the torchvision built for this torch \(PyTorch's CPU wheel index\)", str(e.value))


def test_stand_ins_let_torchvision_import_and_its_cxx_ops_name_the_cause(tmp_path):
    # As torchvision 0.28's _meta_registrations: a fake kernel for torchvision::nms whether
    # or not its extension loaded. In a subprocess: the stand-in ops stay in torch.
    _fake_torchvision(tmp_path, """\
        import torch
        from . import extension

        @torch.library.register_fake("torchvision::nms")
        def _meta_nms(dets, scores, iou_threshold):
            return dets.new_empty(0, dtype=torch.long)

        MODELS = "imported"
        """, has_ops=False)
    script = textwrap.dedent("""\
        import sys, torch
        try:
            import torchvision
        except RuntimeError as e:
            print("without the hook:", e)
        for k in [k for k in sys.modules if k.split(".")[0] == "torchvision"]:
            del sys.modules[k]
        from opsdk._modelimports import TorchvisionOpUnavailable, prepare_model_imports
        prepare_model_imports()
        import torchvision
        print("with the hook:", torchvision.MODELS)
        try:
            torch.ops.torchvision.nms(torch.rand(3, 4), torch.rand(3), 0.5)
        except TorchvisionOpUnavailable as e:
            print("nms:", e)
        """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "without the hook: operator torchvision::nms does not exist"
    assert lines[1] == "with the hook: imported"
    assert lines[2].startswith("nms: torchvision::nms cannot run: torchvision ")
    assert "its C++ extension does not load (" in lines[2] and "_C.so: " in lines[2]
    assert lines[2].endswith("its models and transforms work without it; for its C++ ops, "
                             "install the torchvision built for this torch (PyTorch's CPU "
                             "wheel index)")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("torchvision") is None,
                    reason="transformers or torchvision not installed (pip install .[zoo])")
def test_transformers_does_not_hide_the_cause(tmp_path):
    # transformers re-raises a RuntimeError or ModuleNotFoundError from its model modules
    # as "Could not import module 'BertModel'"; the refusal (an ImportError) passes through.
    # In a subprocess: the failed import leaves transformers' lazy modules half imported.
    _fake_torchvision(tmp_path, """\
        from . import extension
        raise RuntimeError("operator torchvision::roi_align does not exist")
        """, has_ops=True)
    (tmp_path / "bert_model.py").write_text(
        "from transformers import BertModel\n\n\ndef build_model():\n    pass\n")
    script = textwrap.dedent("""\
        from opsdk._userfile import UserCodeError
        from opsdk.model import load_model
        try:
            load_model("bert_model.py", baselines=False)
        except UserCodeError as e:
            print(e)
        """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(
        r"bert_model\.py:1: ZooImportError: torchvision \S+ beside torch \S+ does not import: "
        r"RuntimeError: operator torchvision::roi_align does not exist; fix: install the "
        r"torchvision built for this torch \(PyTorch's CPU wheel index\)\n", out.stdout)


def test_the_bench_reads_a_transformers_output_as_its_first_tensor():
    # `bench --model` of a GPT-2 stopped at "CausalLMOutputWithCrossAttentions has no
    # attribute detach": transformers returns a ModelOutput, not a tensor.
    import torch

    from opsdk.bench._model import first_torch_output

    class Output(dict):  # the part of transformers' ModelOutput the bench relies on
        def to_tuple(self):
            return tuple(self.values())

    logits = torch.arange(6.0).reshape(2, 3)
    for out in (Output(logits=logits, past=None), {"logits": logits}, [(logits,)], logits):
        assert (first_torch_output(out) == logits.numpy()).all()
    with pytest.raises(TypeError, match="returned NoneType, not tensors"):
        first_torch_output(None)
