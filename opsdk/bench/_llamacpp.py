"""llama.cpp as a benchmark peer for GPT-2 decode (the ``llm`` extra).

A Hugging Face ``GPT2LMHeadModel`` (random weights: nothing is downloaded) is written as a
GGUF file that llama.cpp loads as architecture ``gpt2`` (:func:`write_gpt2_gguf`), quantized
by llama.cpp itself to ``q8_0`` / ``q4_0`` (:func:`quantize_gguf`, which reads back the
tensor types the file really holds), and timed through llama-cpp-python
(:func:`bench_llamacpp`: prefill of a prompt, then single-token decode steps, in a child
process so its peak RSS can be read). :func:`logits_llamacpp` gives the last position's
logits for a numerics check against torch.

llama-cpp-python builds llama.cpp from source:
``pip install 'opsdk[llm]' -c <(echo torch==2.13.0)``. Nothing here is imported by the rest
of opsdk unless asked for; :func:`available` says why it cannot run.

Notes on numerics: llama.cpp's CPU GELU goes through a float16 lookup table (its input and
output are rounded to float16, ``GGML_GELU_FP16``) even in an f32 model, and its KV cache is
float16 unless told otherwise; :func:`logits_llamacpp` uses an f32 KV cache,
:func:`bench_llamacpp` llama.cpp's default (``kv_type="f16"``) unless asked. An f32 file's
last-position logits are therefore ~2e-4 (2-layer GPT-2) to ~4.5e-4 (GPT-2-small, random
weights) from torch's in relative RMSE, where torch float32 is 7e-7 from float64: torch with
the same float16 GELU table comes to 1.4e-5 on the 2-layer model. For q8_0 / q4_0 files
llama.cpp also quantizes the activations to q8_0 blocks before each matrix product.

Timing on a shared host: ggml's worker threads spin at their barriers, so another process on
one of the cores can make a round 10x slower or worse; ``prefill_ms_all`` /
``decode_tok_s_all`` keep every round, and the best of many rounds is the figure to compare.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "INSTALL",
    "available",
    "bench_llamacpp",
    "gguf_tensor_types",
    "logits_llamacpp",
    "quantize_gguf",
    "write_gpt2_gguf",
    "write_llama_gguf",
]

INSTALL = "pip install 'opsdk[llm]' -c <(echo torch==2.13.0)"

# llama_ftype values (llama.h) and ggml_type values (ggml.h) of the types offered here
_FTYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}
_GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
# GELU forms llama.cpp's gpt2 graph computes (ggml_gelu: the tanh approximation)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def available() -> str | None:
    """Why the llama.cpp peer cannot run here, or None when it can.

    Returns
    -------
    str or None
        None when ``llama_cpp`` (llama-cpp-python) and ``gguf`` are importable, else a
        one-line reason naming the install command.
    """
    for mod, pkg in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
        if importlib.util.find_spec(mod) is None:
            return f"{pkg} not installed: {INSTALL}"
    try:
        import llama_cpp  # noqa: F401  # heavy: llama_cpp
    except (ImportError, OSError) as e:  # the shared library failed to load
        return f"llama-cpp-python does not import ({type(e).__name__}: {e}): {INSTALL}"
    return None


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each of 256 bytes
    (``bytes_to_unicode`` of GPT-2's encoder), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def synthetic_vocab(n: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of exactly ``n`` tokens that llama.cpp's ``gpt2``
    tokenizer loads: the 256 byte tokens, then multi-byte tokens in breadth-first order
    (every one the merge of a shorter token and one byte, listed in ``merges``), then
    ``<|endoftext|>`` as the last token (a control token, BOS and EOS), like GPT-2's.

    Parameters
    ----------
    n : int
        Vocabulary size (>= 2).

    Returns
    -------
    tokens, token_types, merges : list of str, list of int, list of str
        Token texts, their llama.cpp token types (1 normal, 3 control) and the BPE merges.
    """
    if n < 2:
        raise ValueError(f"vocab_size must be >= 2, got {n}")
    chars = _byte_chars()
    tokens = chars[: n - 1]
    merges: list[str] = []
    level = list(chars)
    while len(tokens) < n - 1:
        nxt = []
        for prefix in level:
            for c in chars:
                if len(tokens) == n - 1:
                    break
                tokens.append(prefix + c)
                merges.append(f"{prefix} {c}")
                nxt.append(prefix + c)
            if len(tokens) == n - 1:
                break
        level = nxt
    tokens.append("<|endoftext|>")
    types = [1] * (n - 1) + [3]
    return tokens, types, merges


def _add_synthetic_tokenizer(w: Any, vocab: int) -> None:
    """A byte-level GPT-2 tokenizer section of ``vocab`` tokens (:func:`synthetic_vocab`):
    what llama.cpp's loader needs; the benchmarks feed token ids, so its content is moot."""
    tokens, types, merges = synthetic_vocab(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)


def _check_config(cfg: Any) -> None:
    act = getattr(cfg, "activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise ValueError(f"llama.cpp's gpt2 graph computes tanh-GELU; this model uses {act!r}")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or \
            not getattr(cfg, "scale_attn_weights", True):
        raise ValueError("llama.cpp's gpt2 graph scales attention by 1/sqrt(head_dim) only")


def write_gpt2_gguf(model: Any, path: str | os.PathLike[str], *, ftype: str = "f32") -> Path:
    """Write a Hugging Face ``GPT2LMHeadModel`` as a GGUF file llama.cpp loads as ``gpt2``.

    The metadata follow llama.cpp's own converter (``convert_hf_to_gguf.py``, class
    ``GPT2Model``); the tokenizer section is :func:`synthetic_vocab` (the weights are random
    and token ids are fed directly, so it only has to load). HF's ``Conv1D`` weights are
    ``(in, out)`` and are transposed to llama.cpp's ``(out, in)`` rows. The output matrix is
    written only when it is not tied to the token embedding (llama.cpp then reuses
    ``token_embd``). The file is written beside ``path`` and renamed into place.

    Parameters
    ----------
    model : transformers.GPT2LMHeadModel
        The model (any configuration with tanh-GELU and standard attention scaling).
    path : str or PathLike
        Destination ``.gguf`` file.
    ftype : {"f32", "f16"}
        Type of the 2-D weights (norms and biases stay f32).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    import gguf  # heavy: gguf
    import torch  # heavy: torch

    if ftype not in ("f32", "f16"):
        raise ValueError(f"ftype must be 'f32' or 'f16' (then quantize_gguf), got {ftype!r}")
    cfg = model.config
    _check_config(cfg)
    n_embd, n_layer = cfg.n_embd, cfg.n_layer
    n_ff = cfg.n_inner or 4 * n_embd
    wdtype = np.float32 if ftype == "f32" else np.float16
    sd = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}
    pre = "transformer." if "transformer.wte.weight" in sd else ""

    def t(name: str, key: str, *, transpose: bool = False, weight: bool = False) -> None:
        a = sd[pre + key]
        if transpose:
            a = a.T
        a = np.ascontiguousarray(a, dtype=wdtype if weight else np.float32)
        w.add_tensor(name, a)

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "gpt2")
    try:
        w.add_name("gpt2-opsdk-random")
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_block_count(n_layer)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(float(cfg.layer_norm_epsilon))
        w.add_file_type(_FTYPE[ftype])
        _add_synthetic_tokenizer(w, cfg.vocab_size)

        t("token_embd.weight", "wte.weight", weight=True)
        t("position_embd.weight", "wpe.weight", weight=True)
        for i in range(n_layer):
            h, b = f"h.{i}.", f"blk.{i}."
            t(b + "attn_norm.weight", h + "ln_1.weight")
            t(b + "attn_norm.bias", h + "ln_1.bias")
            t(b + "attn_qkv.weight", h + "attn.c_attn.weight", transpose=True, weight=True)
            t(b + "attn_qkv.bias", h + "attn.c_attn.bias")
            t(b + "attn_output.weight", h + "attn.c_proj.weight", transpose=True, weight=True)
            t(b + "attn_output.bias", h + "attn.c_proj.bias")
            t(b + "ffn_norm.weight", h + "ln_2.weight")
            t(b + "ffn_norm.bias", h + "ln_2.bias")
            t(b + "ffn_up.weight", h + "mlp.c_fc.weight", transpose=True, weight=True)
            t(b + "ffn_up.bias", h + "mlp.c_fc.bias")
            t(b + "ffn_down.weight", h + "mlp.c_proj.weight", transpose=True, weight=True)
            t(b + "ffn_down.bias", h + "mlp.c_proj.bias")
        t("output_norm.weight", "ln_f.weight")
        t("output_norm.bias", "ln_f.bias")
        head = getattr(model, "lm_head", None)
        wte = model.get_input_embeddings().weight
        if head is not None and head.weight.data_ptr() != wte.data_ptr():
            w.add_tensor("output.weight", np.ascontiguousarray(
                head.weight.detach().to(torch.float32).cpu().numpy(), dtype=wdtype))

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path


def _permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q / k projection (or bias) from Hugging Face's rotate-half RoPE layout (each
    head's first half the real parts, second half the imaginary) to ggml's interleaved pairs
    (``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py``)."""
    return np.ascontiguousarray(w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
                                .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(weights: Any, path: str | os.PathLike[str], *,
                     ftype: str = "f32") -> Path:
    """Write opsdk.llm's llama weights (:class:`opsdk.llm.DecoderWeights` with
    ``arch="llama"``) as a GGUF file llama.cpp loads as ``llama``.

    Metadata and tensor names follow llama.cpp's converter (``convert_hf_to_gguf.py``, class
    ``LlamaModel``): the q / k projections' rows are permuted to ggml's RoPE layout
    (interleaved pairs, :func:`_permute_rope`; k by the kv heads), Qwen2's q / k / v biases
    likewise (llama.cpp's llama graph adds optional ``attn_q/k/v.bias``). The tokenizer is
    :func:`synthetic_vocab` as for GPT-2. Weights are read one at a time (lazy random weights
    are made once each), and the file is written beside ``path`` and renamed into place.

    Parameters
    ----------
    weights : opsdk.llm.DecoderWeights
        Llama-style weights (``config.arch == "llama"``).
    path : str or PathLike
        Destination ``.gguf`` file.
    ftype : {"f32", "f16"}
        Type of the 2-D weights (norms and biases stay f32).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    import gguf  # heavy: gguf

    cfg = weights.config
    if cfg.arch != "llama":
        raise ValueError(f"write_llama_gguf: a {cfg.arch!r} config; write GPT-2 with "
                         "write_gpt2_gguf")
    if ftype not in ("f32", "f16"):
        raise ValueError(f"ftype must be 'f32' or 'f16' (then quantize_gguf), got {ftype!r}")
    wdtype = np.float32 if ftype == "f32" else np.float16
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")

    def t(name: str, key: str, heads: int = 0) -> None:
        a = weights.tensors[key]
        if heads:
            a = _permute_rope(a, heads)
        w.add_tensor(name, np.ascontiguousarray(a, dtype=wdtype if a.ndim == 2 else np.float32))

    try:
        w.add_name("llama-opsdk-random")
        w.add_context_length(cfg.positions)
        w.add_embedding_length(cfg.width)
        w.add_feed_forward_length(cfg.ffn)
        w.add_block_count(cfg.layers)
        w.add_head_count(cfg.heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(float(cfg.rope_base))
        w.add_layer_norm_rms_eps(float(cfg.eps))
        w.add_vocab_size(cfg.vocab)
        w.add_file_type(_FTYPE[ftype])
        _add_synthetic_tokenizer(w, cfg.vocab)

        t("token_embd.weight", "embed_tokens.weight")
        for i in range(cfg.layers):
            h, b = f"layers.{i}.", f"blk.{i}."
            t(b + "attn_norm.weight", h + "input_layernorm.weight")
            for ours, theirs, heads in (("q", "attn_q", cfg.heads), ("k", "attn_k", cfg.n_kv_heads),
                                        ("v", "attn_v", 0)):
                t(f"{b}{theirs}.weight", f"{h}self_attn.{ours}_proj.weight", heads)
                if cfg.qkv_bias:
                    t(f"{b}{theirs}.bias", f"{h}self_attn.{ours}_proj.bias", heads)
            t(b + "attn_output.weight", h + "self_attn.o_proj.weight")
            t(b + "ffn_norm.weight", h + "post_attention_layernorm.weight")
            t(b + "ffn_gate.weight", h + "mlp.gate_proj.weight")
            t(b + "ffn_up.weight", h + "mlp.up_proj.weight")
            t(b + "ffn_down.weight", h + "mlp.down_proj.weight")
        t("output_norm.weight", "norm.weight")
        t("output.weight", "lm_head.weight")

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path


def gguf_tensor_types(path: str | os.PathLike[str]) -> dict[str, str]:
    """The type of every tensor a GGUF file holds, read back with ``gguf.GGUFReader``.

    Parameters
    ----------
    path : str or PathLike
        A GGUF file.

    Returns
    -------
    dict
        Tensor name -> type name in lower case (``"q4_0"``, ``"q8_0"``, ``"q6_k"``, ``"f32"``).
    """
    import gguf  # heavy: gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name.lower() for t in r.tensors}


def _summarize(types: dict[str, str]) -> dict[str, list[str]]:
    """Type -> the tensor names of that type, with ``blk.N.`` folded to ``blk.*.``."""
    out: dict[str, set[str]] = {}
    for name, ty in types.items():
        parts = name.split(".")
        if parts[0] == "blk":
            name = ".".join(["blk", "*", *parts[2:]])
        out.setdefault(ty, set()).add(name)
    return {ty: sorted(v) for ty, v in sorted(out.items())}


def quantize_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str, *,
                  same_output: bool = False, threads: int = 2,
                  verbose: bool = False) -> dict[str, Any]:
    """Quantize a GGUF file with llama.cpp's ``llama_model_quantize``.

    llama.cpp picks some tensors' types by its own rules (the output matrix, or a token
    embedding tied to it, becomes ``q6_K`` or ``q8_0``; 1-D tensors stay f32; the position
    embedding is not quantized); the types the file really holds are read back and returned.

    Parameters
    ----------
    src, dst : str or PathLike
        Source GGUF (f32 or f16) and destination; ``dst`` is written beside itself and renamed
        into place.
    qtype : {"q4_0", "q8_0", "f16"}
        The file type asked for.
    same_output : bool
        Force the output matrix and the token embedding to ``qtype`` too (the quantize
        parameters' ``output_tensor_type`` / ``token_embedding_type``), so every matrix of
        the model has the one type.
    threads : int
        Quantization threads.
    verbose : bool
        Let llama.cpp print its per-tensor log (it goes through llama-cpp-python's logger,
        held at ERROR meanwhile otherwise).

    Returns
    -------
    dict
        ``{"path", "qtype", "same_output", "types" (name -> type), "by_type" (type ->
        names, blocks folded), "bytes"}``.
    """
    import llama_cpp  # heavy: llama_cpp

    if qtype not in ("q4_0", "q8_0", "f16"):
        raise ValueError(f"qtype must be 'q4_0', 'q8_0' or 'f16', got {qtype!r}")
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    p = llama_cpp.llama_model_quantize_default_params()
    p.nthread = threads
    p.ftype = _FTYPE[qtype]
    if same_output:
        p.output_tensor_type = _GGML_TYPE[qtype]
        p.token_embedding_type = _GGML_TYPE[qtype]
    log = logging.getLogger("llama-cpp-python")  # llama.cpp's log callback reads its level
    level = log.level
    if not verbose:
        log.setLevel(logging.ERROR)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                            llama_cpp.byref(p))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) returned {rc}")
        os.replace(tmp, dst)
    finally:
        log.setLevel(level)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    types = gguf_tensor_types(dst)
    return {"path": str(dst), "qtype": qtype, "same_output": same_output, "types": types,
            "by_type": _summarize(types), "bytes": dst.stat().st_size}


def _vm_hwm_kib() -> int:
    """This process's peak resident set (VmHWM) in KiB, 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _open(gguf_path: str, n_ctx: int, n_batch: int, threads: int, kv_type: str,
          flash_attn: bool = False) -> Any:
    import llama_cpp  # heavy: llama_cpp

    kv = _GGML_TYPE[kv_type]
    return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_batch,
                           n_ubatch=n_batch, n_threads=threads, n_threads_batch=threads,
                           logits_all=False, verbose=False, type_k=kv, type_v=kv,
                           flash_attn=flash_attn)


def _last_logits(llm: Any) -> np.ndarray:
    """A copy of the logits of the last evaluated position (``Llama.scores`` is filled only
    with ``logits_all=True``)."""
    import llama_cpp  # heavy: llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)


def _bench_in_process(gguf_path: str, prompt_ids: list[int], n_decode: int,
                      decode_ids: list[int] | None, threads: int, repeats: int,
                      kv_type: str, flash_attn: bool) -> dict[str, Any]:
    import llama_cpp  # noqa: F401  # heavy: llama_cpp (its code is not the model's memory)

    hwm0 = _vm_hwm_kib()
    t0 = time.perf_counter()
    llm = _open(gguf_path, len(prompt_ids) + n_decode + 8, max(len(prompt_ids), 1), threads,
                kv_type, flash_attn)
    load_s = time.perf_counter() - t0
    prefill, decode, first_logits, generated = [], [], None, []
    for r in range(repeats + 1):  # the first round warms up (pages, thread pool)
        llm.reset()  # n_tokens = 0: the next eval drops the KV cache from position 0
        a = time.perf_counter()
        llm.eval(prompt_ids)
        b = time.perf_counter()
        logits = _last_logits(llm)
        if first_logits is None:
            first_logits = logits
        toks = []
        c = time.perf_counter()
        for i in range(n_decode):
            tok = int(decode_ids[i]) if decode_ids is not None else int(np.argmax(logits))
            toks.append(tok)
            llm.eval([tok])
            logits = _last_logits(llm) if decode_ids is None else logits
        d = time.perf_counter()
        if r == 0:
            generated = toks
            continue
        prefill.append((b - a) * 1e3)
        decode.append(n_decode / (d - c) if n_decode else 0.0)
    hwm1 = _vm_hwm_kib()
    llm.close()
    return {
        "prefill_ms": float(np.median(prefill)),
        "decode_tok_s": float(np.median(decode)),
        "prefill_ms_all": prefill,
        "decode_tok_s_all": decode,
        "load_s": load_s,
        "peak_rss_growth_mib": (hwm1 - hwm0) / 1024 if hwm0 else None,
        "logits": first_logits,
        "generated": generated,
    }


def bench_llamacpp(gguf_path: str | os.PathLike[str], prompt_ids: Sequence[int],
                   n_decode: int, *, threads: int = 2, repeats: int = 3,
                   decode_ids: Sequence[int] | None = None, kv_type: str = "f16",
                   flash_attn: bool = False, isolate: bool = True) -> dict[str, Any]:
    """Time llama.cpp on one GGUF model: prefill of a prompt, then single-token decode.

    The model is loaded with ``n_ctx = len(prompt) + n_decode + 8``, ``n_batch`` the prompt's
    length (one eval for the prefill), ``threads`` for both single-token and batch evals.
    Each round resets the context, evaluates the prompt (prefill, timed), then ``n_decode``
    single-token evals (timed together), feeding ``decode_ids`` or, when None, the argmax of
    the previous logits (greedy). One warm-up round runs first and is not counted.

    Parameters
    ----------
    gguf_path : str or PathLike
        The model.
    prompt_ids : sequence of int
        The prompt's token ids.
    n_decode : int
        Decode steps per round.
    threads : int
        llama.cpp's threads (``n_threads`` and ``n_threads_batch``).
    repeats : int
        Timed rounds (medians are reported).
    decode_ids : sequence of int, optional
        Fixed tokens to feed in decode (so two runtimes do the same work); greedy if None.
    kv_type : {"f16", "f32"}
        KV cache type (llama.cpp's default is f16).
    flash_attn : bool
        llama.cpp's fused attention kernel (llama-cpp-python's default: off).
    isolate : bool
        Run in a child process (default), so the peak RSS growth is this model's alone.

    Returns
    -------
    dict
        ``prefill_ms`` (median), ``decode_tok_s`` (median), ``prefill_ms_all``,
        ``decode_tok_s_all``, ``load_s``, ``peak_rss_growth_mib`` (VmHWM after minus before
        loading, the mmapped weights included; None without /proc), ``logits`` (float32,
        the first prefill's last position), ``generated`` (the tokens fed in decode),
        ``threads``, ``kv_type``, ``flash_attn``, ``types`` (the file's tensor types, type ->
        names, blocks folded).
    """
    if decode_ids is not None and len(decode_ids) < n_decode:
        raise ValueError(f"decode_ids has {len(decode_ids)} tokens, n_decode is {n_decode}")
    if kv_type not in ("f16", "f32"):
        raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
    args = (str(gguf_path), [int(i) for i in prompt_ids], int(n_decode),
            None if decode_ids is None else [int(i) for i in decode_ids], threads, repeats,
            kv_type, flash_attn)
    res = _run_child(args) if isolate else _bench_in_process(*args)
    res.update(threads=threads, kv_type=kv_type, flash_attn=flash_attn,
               types=_summarize(gguf_tensor_types(gguf_path)))
    return res


_CHILD = """
import json, sys
import numpy as np
from opsdk.bench._llamacpp import _bench_in_process
args = json.loads(sys.argv[1])
res = _bench_in_process(*args)
np.save(sys.argv[2], res.pop("logits"))
print("RESULT " + json.dumps(res))
"""


def _run_child(args: tuple) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="opsdk-llamacpp-") as d:
        npy = os.path.join(d, "logits.npy")
        env = dict(os.environ, OMP_NUM_THREADS=str(args[4]))
        p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args), npy],
                           capture_output=True, text=True, env=env, check=False)
        line = next((s for s in p.stdout.splitlines() if s.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"llama.cpp bench child failed (rc {p.returncode}):\n"
                               f"{p.stderr[-3000:]}")
        res = json.loads(line[len("RESULT "):])
        res["logits"] = np.load(npy)
    return res


def logits_llamacpp(gguf_path: str | os.PathLike[str], ids: Sequence[int], *,
                    kv_type: str = "f32", threads: int = 2) -> np.ndarray:
    """llama.cpp's logits at the last position of ``ids`` (one eval, in this process).

    Parameters
    ----------
    gguf_path : str or PathLike
        The model.
    ids : sequence of int
        Token ids.
    kv_type : {"f32", "f16"}
        KV cache type; f32 (default) keeps the check to the weights' and GELU's rounding.
    threads : int
        llama.cpp's threads.

    Returns
    -------
    numpy.ndarray
        float32, shape ``(vocab_size,)``.
    """
    ids = [int(i) for i in ids]
    llm = _open(str(gguf_path), len(ids) + 8, max(len(ids), 1), threads, kv_type)
    try:
        llm.eval(ids)
        return _last_logits(llm)
    finally:
        llm.close()
