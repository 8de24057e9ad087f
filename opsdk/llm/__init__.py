"""Language-model decoding: GPT-2- and Llama-style decoders with a KV cache in the Relax VM.

One compiled module serves the prompt and every decode step (symbolic sequence lengths);
linear layers are float32 or weight-only int8 / int4 (q4_0) built-ins. ``opsdk generate``
is the command.

Examples
--------
>>> from opsdk.llm import Decoder, DecoderConfig, compile_decoder, random_weights
>>> cfg = DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16)
>>> dec = Decoder(compile_decoder(random_weights(cfg), cache=False), cfg)
>>> dec.forward([1, 2, 3]).shape
(50,)
"""

from __future__ import annotations

from ._decoder import (
    ACTIVATION_MODES,
    ARCHITECTURES,
    WEIGHT_MODES,
    DecoderConfig,
    DecoderWeights,
    LazyTensors,
    add_check_entry,
    build_decoder,
    default_activations,
    dequantized_weights,
    gpt2_weights,
    llama_weights,
    random_weights,
    reference_logits,
)
from ._models import MODELS, load_decoder_weights
from ._runtime import Decoder, GenerateStats, check_on_target, compile_decoder

__all__ = [
    "ACTIVATION_MODES",
    "ARCHITECTURES",
    "MODELS",
    "WEIGHT_MODES",
    "Decoder",
    "DecoderConfig",
    "DecoderWeights",
    "GenerateStats",
    "LazyTensors",
    "add_check_entry",
    "build_decoder",
    "check_on_target",
    "compile_decoder",
    "default_activations",
    "dequantized_weights",
    "gpt2_weights",
    "llama_weights",
    "load_decoder_weights",
    "random_weights",
    "reference_logits",
]
