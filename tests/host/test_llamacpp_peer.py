"""llama.cpp as GPT-2 decode peer (opsdk/bench/_llamacpp.py): a random-weight GPT-2 written
as GGUF loads in llama.cpp and gives torch's logits; llama.cpp's q8_0 quantization gives q8_0
weight matrices. Skipped where llama-cpp-python or gguf is not installed (the ``llm`` extra,
not in CI).

llama.cpp's CPU GELU reads a float16 table (input and output rounded to float16) even in an
f32 model: against plain torch the tiny model's logits differ by 2.4e-4 relative RMSE, all of
it that table's (torch with the same table: 1.4e-5). The f32 check therefore compares with
torch running the table's GELU at < 1e-4, and with plain torch at < 1e-3.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from opsdk.bench import _llamacpp

_why = _llamacpp.available()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, f32 GGUF path, prompt ids, torch's last-position logits)."""
    from opsdk.frontend import prepare_model_imports

    prepare_model_imports()  # transformers beside a torchvision built for another torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=64, vocab_size=1000)
    m = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids[None]).logits[0, -1].double().numpy()
        acts = [blk.mlp.act for blk in m.transformer.h]
        for blk in m.transformer.h:
            blk.mlp.act = _GgmlGelu()
        ref_table = m(ids[None]).logits[0, -1].double().numpy()
        for blk, act in zip(m.transformer.h, acts):
            blk.mlp.act = act
    path = _llamacpp.write_gpt2_gguf(m, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, ids.tolist(), ref, ref_table


class _GgmlGelu(torch.nn.Module):
    """ggml's CPU GELU (GGML_GELU_FP16): tanh-GELU of the input rounded to float16, the
    result rounded to float16; 0 below -10, the identity above 10."""

    def forward(self, x):
        h = x.to(torch.float16).to(torch.float32)
        y = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        y = y.to(torch.float16).to(torch.float32)
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


def _rel_rmse(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def test_synthetic_vocab_is_exact_and_unique():
    tokens, types, merges = _llamacpp.synthetic_vocab(1000)
    assert len(tokens) == len(set(tokens)) == len(types) == 1000
    assert len(merges) == 1000 - 257 and types[-1] == 3 and tokens[-1] == "<|endoftext|>"


def test_f32_logits_match_torch(tiny):
    path, ids, ref, ref_table = tiny
    got = _llamacpp.logits_llamacpp(path, ids).astype(np.float64)
    assert got.shape == ref.shape
    assert _rel_rmse(got, ref_table) < 1e-4  # 1.4e-5 when written
    assert _rel_rmse(got, ref) < 1e-3  # 2.4e-4: ggml's float16 GELU table


def test_q8_0_quantizes_weight_matrices(tiny, tmp_path):
    path, ids, ref, _ = tiny
    q = _llamacpp.quantize_gguf(path, tmp_path / "q8.gguf", "q8_0", same_output=True)
    types = q["types"]
    for name, ty in types.items():
        if name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                          "ffn_down.weight")):
            assert ty == "q8_0", (name, ty)
        if name.endswith(".bias") or "norm" in name:
            assert ty == "f32", (name, ty)
    assert types["token_embd.weight"] == "q8_0"  # tied output forced with same_output
    got = _llamacpp.logits_llamacpp(q["path"], ids)
    assert _rel_rmse(got.astype(np.float64), ref) < 2e-2  # q8_0 weights and activations
