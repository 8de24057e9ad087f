"""Models from timm, torchvision and transformers through a model file, beside the pinned CPU
torch (whose torchvision from the package index is a CUDA build: opsdk's import hook lets its
Python half import, :mod:`opsdk._modelimports`): loaded with ``load_model``, compiled with
``compile_model``, and compared with torch within ``within_tolerance``."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import tvm
from tvm import relax

from opsdk.model import compile_model, load_model, within_tolerance

_MISSING = [m for m in ("timm", "transformers") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed "
                                                       "(pip install .[zoo])")

TIMM = """\
import timm
import torch
import torchvision.models  # noqa: F401  (torchvision's models import too)


def build_model():
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_100", pretrained=False).eval()
    return model, (torch.randn(1, 3, 96, 96),)
"""

BERT = """\
import torch
from transformers import BertConfig, BertModel


def build_model():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=32)
    return BertModel(cfg).eval(), (torch.randint(0, 256, (1, 16)),)
"""


GPT2 = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                     use_cache=False)
    return GPT2LMHeadModel(cfg).eval(), (torch.randint(0, 256, (1, 16)),)
"""

# MobileBERT's structure (the zoo's `mobilebert` is its default config): NoNorm, 128-wide
# bottlenecks, stacked ReLU feed-forward networks, trigram embeddings; tiny here.
MOBILEBERT = """\
import torch
from transformers import MobileBertConfig, MobileBertModel


def build_model():
    torch.manual_seed(0)
    cfg = MobileBertConfig(vocab_size=256, hidden_size=64, embedding_size=32,
                           intra_bottleneck_size=32, true_hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=64,
                           num_feedforward_networks=2, max_position_embeddings=32)
    return MobileBertModel(cfg).eval(), (torch.randint(0, 256, (1, 16)),)
"""


def _outputs(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value.numpy()]
    if hasattr(value, "to_tuple"):  # transformers' ModelOutput
        value = value.to_tuple()
    if isinstance(value, (tuple, list, tvm.ir.Array)):
        return [v for item in value for v in _outputs(item)]
    return [value.numpy()]


@pytest.mark.parametrize(("name", "source", "n_out"), [("timm_mnv3", TIMM, 1),
                                                       ("bert_tiny", BERT, 2),
                                                       # cumsum of its mask: was unlowered
                                                       ("gpt2_tiny", GPT2, 1)])
def test_zoo_model_compiles_and_matches_torch(tmp_path, name, source, n_out):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    m = load_model(str(path), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    assert "generic" not in cm.rule_counts(), cm.rule_counts()
    vm = relax.VirtualMachine(cm.ex, tvm.cpu())
    got = _outputs(vm["main"](*[tvm.runtime.tensor(a) for a in m.inputs]))
    with torch.no_grad():
        ref = _outputs(m.torch_module(*m.torch_args))
    assert len(got) == len(ref) == n_out
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        check = within_tolerance(g, r)
        assert check["ok"], check



def test_mobilebert_shaped_encoder_quantizes(tmp_path):
    # Token ids calibrate on draws from the example's (a rounded normal would index the
    # embeddings at -1); every dense layer becomes int8, each ReLU FFN one int8 chain.
    from opsdk.quant import agreement, quantize_model
    from opsdk.quant._cli import _random_batches
    from opsdk.transform import op_counts

    path = tmp_path / "mobilebert_tiny.py"
    path.write_text(MOBILEBERT)
    m = load_model(str(path), baselines=False)
    qm = quantize_model(m.opsdk_mod, _random_batches(m.inputs, 4))
    counts = op_counts(qm.mod, "opsdk.")
    assert counts["opsdk.qdense"] == len(qm.sites)
    assert counts["opsdk.quantize"] == len(qm.sites) - 2  # the layer's 2 FFNs chain
    vm = relax.VirtualMachine(compile_model(qm.mod, "x86", cache=False).ex, tvm.cpu())
    got = _outputs(vm["main"](*[tvm.runtime.tensor(a) for a in m.inputs]))[0]
    with torch.no_grad():
        ref = _outputs(m.torch_module(*m.torch_args))[0]
    assert agreement(got, ref)["rel_rmse"] < 0.05
