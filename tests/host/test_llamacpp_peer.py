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


# ------------------------------------------------------------------------------------ llama
@pytest.fixture(scope="module", params=[False, True], ids=["llama", "qwen2-biases"])
def tiny_llama(request, tmp_path_factory):
    """(weights, f32 GGUF path, ids): a random 2-layer Llama with grouped kv heads, norm gains
    and (Qwen2) q / k / v biases drawn so that no permutation mistake can hide."""
    from opsdk.llm import DecoderConfig, DecoderWeights, random_weights

    cfg = DecoderConfig(vocab=1000, width=128, layers=2, heads=4, positions=64, arch="llama",
                        kv_heads=2, intermediate=352, qkv_bias=request.param)
    rng = np.random.default_rng(5)
    w = DecoderWeights(cfg, {
        k: v * rng.uniform(0.5, 1.5, v.shape).astype(np.float32) if "norm" in k else
        (rng.standard_normal(v.shape).astype(np.float32) * 0.1 if k.endswith("bias") else v)
        for k, v in random_weights(cfg, seed=1).tensors.items()})
    path = _llamacpp.write_llama_gguf(w, tmp_path_factory.mktemp("gguf") / "llama.gguf")
    ids = np.random.default_rng(1).integers(0, 1000, 16).tolist()
    return w, path, ids


def test_llama_f32_logits_match_reference(tiny_llama):
    """q / k rows permuted to ggml's RoPE layout: llama.cpp's f32 logits are opsdk's float64
    reference's to float32 rounding (its SiLU is float32; 2e-7 when written)."""
    from opsdk.llm import reference_logits

    w, path, ids = tiny_llama
    got = _llamacpp.logits_llamacpp(path, ids).astype(np.float64)
    assert _rel_rmse(got, reference_logits(w, ids)[-1]) < 1e-5


def test_llama_q4_0_quantizes_every_matrix(tiny_llama, tmp_path):
    from opsdk.llm import reference_logits

    w, path, ids = tiny_llama
    q = _llamacpp.quantize_gguf(path, tmp_path / "q4.gguf", "q4_0", same_output=True)
    for name, ty in q["types"].items():
        assert ty == ("f32" if name.endswith((".bias", "norm.weight")) else "q4_0"), (name, ty)
    got = _llamacpp.logits_llamacpp(q["path"], ids).astype(np.float64)
    assert _rel_rmse(got, reference_logits(w, ids)[-1]) < 0.5  # q4_0 weights and q8_0 inputs


def test_bench_decode_llama_tiny():
    from opsdk.bench._decode import bench_decode

    rep = bench_decode("llama-tiny", weights_modes=("int4",), prompt_len=8, tokens=4,
                       rounds=1, log=lambda s: None)
    assert {"opsdk int4", "llama.cpp q4_0", "torch float32"} <= set(rep["runtimes"])
    assert rep["ratios"]["opsdk int4 / llama.cpp q4_0"]["decode"] > 0
    # opsdk runs as deployed (a decoder artifact, weights mapped): its peak memory is known
    assert rep["runtimes"]["opsdk int4"]["peak_rss_mib"] > 0
