"""opsdk.llm: the decoder with a KV cache against the float64 reference, in every weight mode,
through prefill, decode steps and cache growth; ``opsdk generate``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opsdk._errmodel import gamma
from opsdk.cli import main
from opsdk.llm import (
    Decoder,
    DecoderConfig,
    DecoderWeights,
    compile_decoder,
    dequantized_weights,
    random_weights,
    reference_logits,
)

CFG = DecoderConfig(vocab=96, width=64, layers=2, heads=2, positions=48)
U = 2.0**-24


def _bound(cfg: DecoderConfig) -> float:
    """Relative bound on float32 logits: every layer's dot products (length up to 4 x width)
    compound through the residual stream, the head's adds one more (first order)."""
    return gamma(4 * cfg.width * (2 * cfg.layers + 1), U)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)


@pytest.mark.parametrize("mode, activations", [
    ("float32", "float32"), ("int8", "float32"), ("int4", "float32"), ("int8", "q8_0"),
    ("int4", "q8_0")])
def test_prefill_then_decode_match_reference(weights, mode, activations):
    cm = compile_decoder(weights, weights_mode=mode, activations=activations, cache=False)
    dec = Decoder(cm, CFG, capacity=4)
    ids = np.random.default_rng(0).integers(0, CFG.vocab, 20).tolist()
    ref = reference_logits(dequantized_weights(weights, mode), ids, activations=activations)
    got = [dec.forward(ids[:9])]  # prefill past the cache's capacity of 4: it grows
    got += [dec.forward([t]) for t in ids[9:]]  # decode steps, one token each
    got = np.stack(got)
    assert dec.length == len(ids)
    assert _rel(got, ref[8:]) <= _bound(CFG)
    if mode != "float32":  # the quantization itself: visible, but small
        err = _rel(got, reference_logits(weights, ids)[8:])
        assert _bound(CFG) < err < (0.05 if mode == "int8" else 0.5)


def test_one_module_for_every_length(weights):
    """Prefill lengths 1..5 and decode steps use the same executable; a reset starts over."""
    cm = compile_decoder(weights, cache=False)
    dec = Decoder(cm, CFG)
    ids = [5, 17, 33, 2, 90]
    for n in range(1, 6):
        dec.reset()
        got = dec.forward(ids[:n])
        assert _rel(got, reference_logits(weights, ids[:n])[-1]) <= _bound(CFG)
    dec.reset()
    tokens, stats = dec.generate(ids, 6)
    assert len(tokens) == 6 and len(stats.step_ms) == 5 and stats.prefill_ms > 0
    seq = ids + tokens[:-1]
    assert tokens == [int(t) for t in np.argmax(reference_logits(weights, seq)[4:], -1)]


def test_errors_name_the_problem(weights):
    dec = Decoder(compile_decoder(weights, cache=False), CFG)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\)"):
        dec.forward([96])
    with pytest.raises(ValueError, match="no tokens"):
        dec.forward([])
    dec.forward(list(range(40)))
    with pytest.raises(ValueError, match="exceed the model's 48"):
        dec.forward(list(range(9)))
    with pytest.raises(ValueError, match="weights='int3'"):
        compile_decoder(weights, weights_mode="int3", cache=False)
    with pytest.raises(ValueError, match="q8_0 with int8 / int4 weights"):
        compile_decoder(weights, activations="q8_0", cache=False)


def test_generate_command(tmp_path, capsys):
    out = tmp_path / "gen.json"
    rc = main(["generate", "gpt2-tiny", "--tokens", "5", "--prompt-len", "7", "--check",
               "--weights", "int4", "--activations", "float32", "--no-cache", "--json",
               str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "kernels: logits vs the float64 reference" in text
    rep = json.loads(out.read_text())
    assert len(rep["generated"]) == 5 and rep["prompt_tokens"] == 7
    assert rep["kernel_rel_rmse"] < 1e-4 and rep["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["generate", "no-such-model"], "not a named model"),
    (["generate", "gpt2-tiny", "--prompt", "1,x"], "token ids separated by commas"),
    (["generate", "gpt2-tiny", "--prompt", "1,5000"], r"must lie in \[0, 1000\)"),
    (["generate", "gpt2-tiny", "--prompt-len", "250", "--tokens", "10"], "exceed the model's"),
    (["generate", "gpt2-tiny", "--activations", "q8_0"], "needs --weights int8 or int4"),
])
def test_generate_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "opsdk generate: error:" in err
    import re

    assert re.search(message, err), err


# ----------------------------------------------------------------------------- llama / qwen2
LCFG = DecoderConfig(vocab=96, width=128, layers=2, heads=4, positions=48, arch="llama",
                     kv_heads=2, intermediate=96)


@pytest.fixture(scope="module")
def llama():
    """Random llama weights with norm gains drawn in [0.5, 1.5], not 1: with gains of 1 an
    RMSNorm of a quantized embedding row keeps its exact integer ratios, and q8_0 then meets
    exact rounding ties (a nibble of 4 beside a block maximum of 8: 63.5) that float32 and
    float64 break apart (5e-3 on the logits from the first such token; no kernel error)."""
    w = random_weights(LCFG, seed=3)
    rng = np.random.default_rng(5)
    return DecoderWeights(LCFG, {k: v * rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
                                 if "norm" in k else v for k, v in w.tensors.items()})


@pytest.mark.parametrize("mode, activations", [
    ("float32", "float32"), ("int4", "float32"), ("int8", "q8_0"), ("int4", "q8_0")])
def test_llama_prefill_then_decode_match_reference(llama, mode, activations):
    cm = compile_decoder(llama, weights_mode=mode, activations=activations, cache=False)
    counts = cm.rule_counts()
    assert "generic" not in counts and not any(r.endswith(".fallback") for r in counts), counts
    dec = Decoder(cm, LCFG, capacity=4)
    ids = np.random.default_rng(0).integers(0, LCFG.vocab, 20).tolist()
    ref = reference_logits(dequantized_weights(llama, mode), ids, activations=activations)
    got = np.stack([dec.forward(ids[:9])] + [dec.forward([t]) for t in ids[9:]])
    assert _rel(got, ref[8:]) <= _bound(LCFG)
    if mode != "float32":
        err = _rel(got, reference_logits(llama, ids)[8:])
        assert _bound(LCFG) < err < (0.05 if mode == "int8" else 0.5)


def test_llama_unfused_attention_and_lazy_weights(llama):
    """The decomposed attention repeats the grouped kv heads; random llama weights are made
    when read, each from its name's seed (the same array every time)."""
    cm = compile_decoder(llama, fused_attention=False, cache=False)
    ids = [5, 17, 33, 2, 90, 41]
    got = Decoder(cm, LCFG).forward(ids)
    assert _rel(got, reference_logits(llama, ids)[-1]) <= _bound(LCFG)
    from opsdk.llm import LazyTensors

    w = random_weights(LCFG, seed=3)
    assert isinstance(w.tensors, LazyTensors)
    a = w.tensors["layers.1.mlp.up_proj.weight"]
    assert a.shape == (96, 128) and np.array_equal(a, w.tensors["layers.1.mlp.up_proj.weight"])
    assert abs(float(a.std()) - 0.02) < 2e-3
    assert LCFG.weight_count() == sum(v.size for v in w.tensors.values())
    assert isinstance(dequantized_weights(w, "int4").tensors, LazyTensors)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_weights_match_transformers(kind):
    from opsdk.frontend import prepare_model_imports

    prepare_model_imports()
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from opsdk.llm import llama_weights

    cls, conf = {"llama": ("LlamaForCausalLM", "LlamaConfig"),
                 "qwen2": ("Qwen2ForCausalLM", "Qwen2Config")}[kind]
    torch.manual_seed(0)
    cfg = getattr(transformers, conf)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=32,
        tie_word_embeddings=False)
    m = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    w = llama_weights(m)
    assert w.config.qkv_bias == (kind == "qwen2") and w.config.n_kv_heads == 2
    ids = list(range(3, 20))
    with torch.no_grad():
        want = m(torch.tensor([ids])).logits[0].double().numpy()
    assert _rel(reference_logits(w, ids), want) < 1e-5  # 2.2e-7 when written
    got = Decoder(compile_decoder(w, cache=False), w.config).forward(ids)
    assert _rel(got, want[-1]) < 1e-5
    cfg.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        llama_weights(m)


def test_generate_llama_tiny(tmp_path, capsys):
    out = tmp_path / "gen.json"
    rc = main(["generate", "llama-tiny", "--tokens", "4", "--prompt-len", "6", "--check",
               "--weights", "int4", "--activations", "float32", "--no-cache", "--json",
               str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rep = json.loads(out.read_text())
    assert rep["kernel_rel_rmse"] < 1e-4 and len(rep["generated"]) == 4


@pytest.mark.parametrize(("activations", "rc"), [("q8_0", 0), ("float32", 1)])
def test_generate_on_target_judges_the_reference_only_for_float_inputs(monkeypatch, capsys,
                                                                        activations, rc):
    # The device must match the host; the float64 reference is judged only where float32
    # rounding is all that separates them (q8_0 inputs round a few int8 values apart).
    import opsdk.llm._cli as gen

    monkeypatch.setattr(gen, "check_on_target", lambda *a, **k: {
        "target_vs_host": 0.0, "target_vs_reference": 6e-3, "steps": 3, "device": "board"})
    assert main(["generate", "gpt2-tiny", "--weights", "int4", "--activations", activations,
                 "--target", "arm-dotprod", "--tokens", "2", "--prompt-len", "4"]) == rc
    out = capsys.readouterr().out
    assert ("reported" in out) == (activations == "q8_0")
