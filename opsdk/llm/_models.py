"""The decoders ``opsdk generate`` and ``opsdk bench --decode`` name, and reading weights for
one: a named shape with random weights, or a local Hugging Face checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path

from ._decoder import DecoderConfig, DecoderWeights, random_weights

__all__ = ["MODELS", "load_decoder_weights"]

#: Named decoders with random weights (normal, std 0.02; nothing is downloaded). ``llama-1b``
#: has TinyLlama-1.1B's shape.
MODELS: dict[str, DecoderConfig] = {
    "gpt2": DecoderConfig(vocab=50257, width=768, layers=12, heads=12, positions=1024),
    "gpt2-medium": DecoderConfig(vocab=50257, width=1024, layers=24, heads=16, positions=1024),
    "gpt2-tiny": DecoderConfig(vocab=1000, width=128, layers=2, heads=4, positions=256),
    "llama-tiny": DecoderConfig(vocab=1000, width=128, layers=2, heads=4, positions=256,
                                arch="llama", kv_heads=2, intermediate=352),
    "llama-1b": DecoderConfig(vocab=32000, width=2048, layers=22, heads=32, positions=2048,
                              arch="llama", kv_heads=4, intermediate=5632),
}


def load_decoder_weights(model: str, seed: int = 0) -> DecoderWeights:
    """A named decoder's random weights, or a GPT-2 / Llama / Qwen2 checkpoint folder's.

    Raises
    ------
    ValueError
        Neither a name nor a checkpoint folder, transformers missing, or a checkpoint this
        reader refuses; the message names the model and the fix.
    """
    if model in MODELS:
        return random_weights(MODELS[model], seed)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model}: not a named model ({', '.join(MODELS)}) nor a folder "
                         "with a Hugging Face checkpoint (config.json)")
    from ..frontend import prepare_model_imports

    prepare_model_imports()
    try:
        import transformers  # heavy: transformers
    except ImportError:
        raise ValueError(f"{model}: reading a checkpoint needs transformers: pip install "
                         "'opsdk[zoo]'") from None
    from ._decoder import gpt2_weights, llama_weights

    kind = json.loads((path / "config.json").read_text()).get("model_type", "gpt2")
    cls, read = {"llama": ("LlamaForCausalLM", llama_weights),
                 "qwen2": ("Qwen2ForCausalLM", llama_weights)}.get(
                     kind, ("GPT2LMHeadModel", gpt2_weights))
    try:
        hf = getattr(transformers, cls).from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model}: cannot load it as a {cls} checkpoint ({e})") from None
    return read(hf)
