"""``opsdk bench --decode MODEL``: LLM decode, opsdk against llama.cpp and torch, side by side.

Every runtime gets the same weights (opsdk.llm's random GPT-2 or Llama weights, written for
torch as a ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` and for llama.cpp as a GGUF file it
quantizes itself), the same prompt,
and the same fixed decode tokens (so each does the same work). Rounds are interleaved: each
round runs every runtime once (prefill, then the decode steps); a ratio is taken per round
and the median of the per-round ratios is reported, with the best round of each runtime.
Pairs: opsdk float32 / int8 / int4 against llama.cpp f32 / q8_0 / q4_0 (every matrix
q4_0, the LM head included, as opsdk quantizes it) and against torch float32 eager.

opsdk runs as it deploys: a decoder artifact built for this host (``opsdk build MODEL
--weights ...``), loaded with its weights mapped from the file; its peak memory is that of
a fresh process loading the artifact and running the same prompt and steps.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..deploy import build_decoder_artifact, load_decoder
from ..llm import DecoderWeights, default_activations, load_decoder_weights

__all__ = ["LLAMACPP_TYPES", "bench_decode", "gpt2_torch_model", "llama_torch_model",
           "print_decode_report", "torch_model"]

#: llama.cpp's file type for each opsdk weight mode.
LLAMACPP_TYPES = {"float32": "f32", "int8": "q8_0", "int4": "q4_0"}


def gpt2_torch_model(weights: DecoderWeights) -> Any:
    """A Hugging Face ``GPT2LMHeadModel`` holding ``weights`` (float32, eval mode)."""
    from ..frontend import prepare_model_imports

    prepare_model_imports()
    import torch  # heavy: torch
    import transformers  # heavy: transformers

    c = weights.config
    cfg = transformers.GPT2Config(vocab_size=c.vocab, n_embd=c.width, n_layer=c.layers,
                                  n_head=c.heads, n_positions=c.positions,
                                  layer_norm_epsilon=c.eps)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    sd = {}
    for name, a in weights.tensors.items():
        conv1d = name.endswith(".weight") and a.ndim == 2 and ("attn." in name or "mlp." in name)
        key = {"wte": "wte.weight", "wpe": "wpe.weight"}.get(name, name)
        sd["transformer." + key] = torch.from_numpy(np.ascontiguousarray(a.T if conv1d else a))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    left = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if left or unexpected:
        raise RuntimeError(f"GPT-2 weights do not map onto transformers' model: missing "
                           f"{left}, unexpected {unexpected}")
    model.tie_weights()
    return model


def llama_torch_model(weights: DecoderWeights) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` with ``qkv_bias``) holding
    llama-style ``weights`` (float32, eval mode); each array is read once."""
    from ..frontend import prepare_model_imports

    prepare_model_imports()
    import torch  # heavy: torch
    import transformers  # heavy: transformers

    c = weights.config
    conf, cls = (("Qwen2Config", "Qwen2ForCausalLM") if c.qkv_bias
                 else ("LlamaConfig", "LlamaForCausalLM"))
    cfg = getattr(transformers, conf)(
        vocab_size=c.vocab, hidden_size=c.width, intermediate_size=c.ffn,
        num_hidden_layers=c.layers, num_attention_heads=c.heads,
        num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.positions,
        rms_norm_eps=c.eps, rope_theta=c.rope_base, tie_word_embeddings=False)
    try:  # skip the random init of weights about to be replaced (1B: a minute on 2 cores)
        from transformers.modeling_utils import no_init_weights
    except ImportError:  # pragma: no cover - moved in another transformers
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = getattr(transformers, cls)(cfg).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in weights.tensors:
            key = name if name == "lm_head.weight" else "model." + name
            if key not in params:
                raise RuntimeError(f"llama weight {name} has no place in transformers' {cls}")
            params[key].copy_(torch.from_numpy(weights.tensors[name]))
    return model


def torch_model(weights: DecoderWeights) -> Any:
    """The transformers model of ``weights``' architecture (GPT-2 or Llama / Qwen2)."""
    return (llama_torch_model if weights.config.arch == "llama" else gpt2_torch_model)(weights)


class _Opsdk:
    """opsdk as deployed: a decoder artifact for this host (``folder``), loaded with its
    weights mapped from the file (:func:`opsdk.deploy.load_decoder`)."""

    def __init__(self, weights: DecoderWeights, mode: str, capacity: int,
                 activations: str | None, folder: Path) -> None:
        t0 = time.perf_counter()
        build_decoder_artifact(weights, folder, weights=mode, target="host",
                               activations=activations or default_activations(mode, "host"),
                               reference=False, log=None)
        self.compile_s = time.perf_counter() - t0
        self.folder = folder
        self.dec = load_decoder(folder, capacity=capacity)

    def round(self, prompt: list[int], steps: list[int]) -> tuple[float, float]:
        self.dec.reset()
        t0 = time.perf_counter()
        self.dec.forward(prompt)
        t1 = time.perf_counter()
        for t in steps:
            self.dec.forward([t])
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, len(steps) / (t2 - t1)


class _Torch:
    def __init__(self, weights: DecoderWeights, threads: int) -> None:
        import torch  # heavy: torch

        torch.set_num_threads(threads)
        self.torch, self.model = torch, torch_model(weights)
        # transformers 5 renamed the cache argument and output (the old names still work,
        # with a warning)
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def round(self, prompt: list[int], steps: list[int]) -> tuple[float, float]:
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(torch.tensor([prompt]), use_cache=True)
            t1 = time.perf_counter()
            past = getattr(out, self.cache_arg)
            for t in steps:
                past = getattr(self.model(torch.tensor([[t]]), use_cache=True,
                                          **{self.cache_arg: past}), self.cache_arg)
            t2 = time.perf_counter()
        return (t1 - t0) * 1e3, len(steps) / (t2 - t1)


def _peak_rss_child(folder: Path, prompt: list[int], steps: list[int]) -> float | None:
    """Peak resident memory growth (MiB) of loading the decoder artifact ``folder`` and
    running it, in a fresh process (the build's own memory and the import of opsdk's code
    excluded, as llama.cpp's import is for its figure)."""
    code = (
        "import json, sys\n"
        "from opsdk.deploy import load_decoder\n"
        "from opsdk.llm import Decoder\n"  # the runtime's code, imported before the baseline
        "from opsdk.bench._llamacpp import _vm_hwm_kib\n"
        "a = json.loads(sys.argv[1])\n"
        "h0 = _vm_hwm_kib()\n"
        "dec = load_decoder(a['dir'], capacity=len(a['p']) + len(a['s']))\n"
        "dec.forward(a['p'])\n"
        "[dec.forward([t]) for t in a['s']]\n"
        "print('HWM', (_vm_hwm_kib() - h0) / 1024)\n")
    arg = json.dumps({"dir": str(folder), "p": prompt, "s": steps})
    p = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True,
                       check=False)
    line = next((s for s in p.stdout.splitlines() if s.startswith("HWM ")), None)
    return float(line.split()[1]) if p.returncode == 0 and line else None


def bench_decode(model: str = "gpt2", *, weights_modes: Sequence[str] = ("int4", "int8"),
                 peers: Sequence[str] = ("llamacpp", "torch"), prompt_len: int = 64,
                 tokens: int = 64, rounds: int = 5, threads: int = 2, seed: int = 0,
                 activations: str | None = None, weights: DecoderWeights | None = None,
                 log: Any = print) -> dict[str, Any]:
    """Interleaved decode benchmark (module docstring); returns the report as a dict.
    ``weights``: ``model``'s, read already (default: :func:`opsdk.llm.load_decoder_weights`).

    Peers that cannot run (not installed) are skipped with one line through ``log``.
    ``activations``: what opsdk's quantized layers multiply (``q8_0``, llama.cpp's numerics,
    or ``float32``; None: :func:`opsdk.llm.default_activations` for the host).
    """
    from ._llamacpp import (
        available,
        bench_llamacpp,
        quantize_gguf,
        write_gpt2_gguf,
        write_llama_gguf,
    )

    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    if weights is None:
        weights = load_decoder_weights(model, seed)
    cfg = weights.config
    rng = np.random.default_rng(seed + 1)
    prompt = rng.integers(0, cfg.vocab, prompt_len).tolist()
    steps = rng.integers(0, cfg.vocab, tokens).tolist()
    runners: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    tmp = tempfile.TemporaryDirectory(prefix="opsdk-decode-")
    peak: dict[str, float | None] = {}
    folders: dict[str, Path] = {}
    try:
        for mode in weights_modes:
            folders[mode] = Path(tmp.name) / f"opsdk-{mode}"
            r = _Opsdk(weights, mode, prompt_len + tokens + 1, activations, folders[mode])
            runners[f"opsdk {mode}"] = r.round
            meta[f"opsdk {mode}"] = {"compile_s": round(r.compile_s, 1)}
        if "torch" in peers:
            try:
                runners["torch float32"] = _Torch(weights, threads).round
            except ImportError as e:
                log(f"peer torch skipped: {e}")
        if "llamacpp" in peers:
            why = available()
            if why:
                log(f"peer llama.cpp skipped: {why}")
            else:
                f32 = Path(tmp.name) / "f32.gguf"
                if cfg.arch == "llama":
                    write_llama_gguf(weights, f32)
                else:
                    write_gpt2_gguf(gpt2_torch_model(weights), f32)
                for mode in weights_modes:
                    qt = LLAMACPP_TYPES[mode]
                    path = f32
                    if qt != "f32":
                        path = Path(tmp.name) / f"{qt}.gguf"
                        info = quantize_gguf(f32, path, qt, same_output=True, threads=threads)
                        meta[f"llama.cpp {qt}"] = {"types": info["by_type"]}

                    def run(p: list[int], s: list[int], path: Path = path) -> tuple[float,
                                                                                      float]:
                        res = bench_llamacpp(path, p, len(s), threads=threads, repeats=1,
                                             decode_ids=s)
                        peak[path.name] = res.get("peak_rss_growth_mib")
                        return res["prefill_ms"], res["decode_tok_s"]

                    runners[f"llama.cpp {qt}"] = run
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
        for _ in range(rounds):
            for name, run in runners.items():
                times[name].append(run(prompt, steps))
        for mode in weights_modes:
            peak[f"opsdk {mode}"] = _peak_rss_child(folders[mode], prompt, steps)
    finally:
        tmp.cleanup()
    report: dict[str, Any] = {
        "model": model, "params": cfg.weight_count(), "prompt_tokens": prompt_len,
        "decode_tokens": tokens, "rounds": rounds, "threads": threads,
        "activations": activations or {m: default_activations(m, "host") for m in weights_modes},
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "runtimes": {}, "ratios": {}}
    for name, t in times.items():
        pre = [a for a, _ in t]
        dec = [b for _, b in t]
        report["runtimes"][name] = {
            "prefill_ms": float(np.median(pre)), "prefill_ms_best": float(min(pre)),
            "decode_tok_s": float(np.median(dec)), "decode_tok_s_best": float(max(dec)),
            **meta.get(name, {})}
    for mode in weights_modes:
        name = f"llama.cpp {LLAMACPP_TYPES[mode]}"
        if name in report["runtimes"]:
            report["runtimes"][name]["peak_rss_mib"] = peak.get(f"{LLAMACPP_TYPES[mode]}.gguf")
        mine = times[f"opsdk {mode}"]
        report["runtimes"][f"opsdk {mode}"]["peak_rss_mib"] = peak.get(f"opsdk {mode}")
        for peer in (f"llama.cpp {LLAMACPP_TYPES[mode]}", "torch float32"):
            if peer not in times:
                continue
            theirs = times[peer]
            report["ratios"][f"opsdk {mode} / {peer}"] = {
                "decode": float(np.median([a[1] / b[1] for a, b in zip(mine, theirs)])),
                "prefill": float(np.median([b[0] / a[0] for a, b in zip(mine, theirs)]))}
    return report


def print_decode_report(rep: dict[str, Any]) -> None:
    """The report as two tables (runtimes; per-round ratios, > 1 means opsdk is faster)."""
    print(f"{rep['model']} ({rep['params'] / 1e6:.0f}M parameters): prefill "
          f"{rep['prompt_tokens']} tokens, decode {rep['decode_tokens']}, {rep['rounds']} "
          f"interleaved rounds, {rep['threads']} threads, load {rep['load']:.2f}")
    print(f"{'runtime':<18} {'prefill ms':>10} {'(best)':>8} {'decode tok/s':>13} "
          f"{'(best)':>8} {'peak MiB':>9}")
    for name, r in rep["runtimes"].items():
        peak = r.get("peak_rss_mib")
        print(f"{name:<18} {r['prefill_ms']:>10.1f} {r['prefill_ms_best']:>8.1f} "
              f"{r['decode_tok_s']:>13.1f} {r['decode_tok_s_best']:>8.1f} "
              f"{'' if peak is None else f'{peak:.0f}':>9}")
    if rep["ratios"]:
        print(f"\n{'ratio (median of rounds)':<40} {'decode':>7} {'prefill':>8}")
        for name, r in rep["ratios"].items():
            print(f"{name:<40} {r['decode']:>6.2f}x {r['prefill']:>7.2f}x")
