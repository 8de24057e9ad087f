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
