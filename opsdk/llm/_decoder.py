"""A GPT-2-style decoder as one Relax module: prefill and token-by-token decode through the
same function, with a KV cache of symbolic length.

The module has two functions:

- ``create_cache(capacity: R.Shape([c]))`` makes one cache per layer and per K / V
  (TVM's runtime ``AttentionKVCache``: rows appended in place, grown by doubling past
  ``capacity``);
- ``forward(tokens: (1, n) int32, total: R.Shape([m]), *caches)`` appends the ``n`` new
  tokens' keys and values, attends over all ``m`` cached positions (causal within the new
  tokens) and returns ``(logits of the last token (1, vocab), *caches)``. ``n`` and ``m`` are
  symbolic: one compiled module serves the prompt (``n`` = its length) and every decode step
  (``n`` = 1), at any length, without recompiling.

Linear layers are float32 matmuls, or weight-only quantized (:data:`WEIGHT_MODES`): int8 per
channel (``opsdk.dense_w8``) or int4 in ggml's q4_0 groups (``opsdk.dense_q4``), with the
token embedding stored once (the LM head reads the same matrix: GPT-2 ties them).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax import op as R

from .. import relax as opsdk_relax
from ..ops.dense_q4 import dense_q4, dequantize_q4_0, quantize_q4_0
from ..ops.dense_w8 import quantize_q8_0, quantize_w8
from ..registry import load_builtin_ops
from ..schedules import GENERIC, choose
from ..targets import target as resolve_target

__all__ = ["ACTIVATION_MODES", "ARCHITECTURES", "WEIGHT_MODES", "DecoderConfig",
           "DecoderWeights", "LazyTensors", "build_decoder", "default_activations",
           "dequantized_weights", "gpt2_weights", "llama_weights", "random_weights",
           "reference_logits"]

#: How linear layers hold their weights: float32, int8 per output channel (``dense_w8``), or
#: int4 in 32-weight groups with a float16 scale, ggml q4_0's layout (``dense_q4``).
WEIGHT_MODES = ("float32", "int8", "int4")
#: What a quantized linear layer multiplies: float32 inputs, or inputs quantized to ggml q8_0
#: blocks (int8 per 32 values with a float16 scale; integer dot products).
ACTIVATION_MODES = ("float32", "q8_0")

_CACHE_FUNCS = ("vm.builtin.attention_kv_cache_create", "vm.builtin.attention_kv_cache_append",
                "vm.builtin.attention_kv_cache_view")


#: The decoder architectures :func:`build_decoder` builds (:attr:`DecoderConfig.arch`).
ARCHITECTURES = ("gpt2", "llama")


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a decoder. ``arch="gpt2"`` (default): GPT-2 (pre-LayerNorm blocks,
    learned positions, GELU-tanh MLP of 4x width, biases, LM head tied to the token
    embedding). ``arch="llama"``: Llama / Qwen2 (pre-RMSNorm blocks without biases, rotary
    position embedding of base ``rope_base`` in Hugging Face's rotate-half convention,
    grouped-query attention with ``kv_heads`` key / value heads, SwiGLU MLP of width
    ``intermediate``, untied LM head; ``qkv_bias``: Qwen2's q / k / v biases).

    Examples
    --------
    >>> from opsdk.llm import DecoderConfig
    >>> DecoderConfig(vocab=1000, width=128, layers=2, heads=4, positions=64).head_dim
    32
    >>> c = DecoderConfig(vocab=1000, width=128, layers=2, heads=4, positions=64,
    ...                   arch="llama", kv_heads=2, intermediate=344)
    >>> c.kv_width, c.weight_count()
    (64, 619136)
    """

    vocab: int
    width: int
    layers: int
    heads: int
    positions: int
    eps: float = 1e-5
    arch: str = "gpt2"
    #: key / value heads (0: as many as ``heads``); llama only
    kv_heads: int = 0
    #: MLP width (0: 4 x ``width``)
    intermediate: int = 0
    rope_base: float = 10000.0
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"DecoderConfig: arch={self.arch!r}; choose one of "
                             f"{', '.join(ARCHITECTURES)}")
        if self.width % self.heads or self.heads % self.n_kv_heads:
            raise ValueError(f"DecoderConfig: width {self.width}, heads {self.heads}, "
                             f"kv_heads {self.n_kv_heads}: heads must divide width and "
                             "kv_heads divide heads")
        if self.arch == "gpt2" and (self.n_kv_heads != self.heads or self.qkv_bias
                                    or self.ffn != 4 * self.width):
            raise ValueError("DecoderConfig: GPT-2 has kv_heads = heads, a 4 x width MLP and "
                             "all biases; kv_heads / intermediate / qkv_bias are llama's")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"DecoderConfig: rotary embedding needs an even head_dim, got "
                             f"{self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def n_kv_heads(self) -> int:
        """Key / value heads: what the KV cache stores per position."""
        return self.kv_heads or self.heads

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        """The MLP's hidden width."""
        return self.intermediate or 4 * self.width

    def weight_count(self) -> int:
        """Parameters (GPT-2: the tied embedding counted once)."""
        e, f = self.width, self.ffn
        if self.arch == "llama":
            kv = self.kv_width
            per_layer = 2 * e + 2 * e * e + 2 * e * kv + 3 * e * f \
                + (e + 2 * kv if self.qkv_bias else 0)
            return 2 * self.vocab * e + self.layers * per_layer + e
        per_layer = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (4 * e * e + 4 * e) \
            + (4 * e * e + e)
        return self.vocab * e + self.positions * e + self.layers * per_layer + 2 * e


@dataclass
class DecoderWeights:
    """A decoder's weights as float32 numpy arrays; linear layers ``(out, in)`` like
    ``torch.nn.Linear``. GPT-2's names: ``wte``, ``wpe``, ``ln_f.{weight,bias}`` and per layer
    ``i`` ``h.{i}.{ln_1,ln_2}.{weight,bias}``, ``h.{i}.{attn.c_attn,attn.c_proj,mlp.c_fc,
    mlp.c_proj}.{weight,bias}``. Llama's: Hugging Face's without ``model.``:
    ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight`` and per layer
    ``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``,
    ``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (``q/k/v_proj.bias`` with ``qkv_bias``),
    ``layers.{i}.mlp.{gate,up,down}_proj.weight``.

    ``tensors`` may be any mapping: :func:`random_weights` of a llama config makes each
    array when it is read (:class:`LazyTensors`), so a 1B model is never held in float32."""

    config: DecoderConfig
    tensors: Mapping[str, np.ndarray]


class LazyTensors(Mapping):
    """A mapping whose arrays are made when read (``makers``: name -> function of no
    arguments), not kept: the reader holds one array at a time.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.llm import LazyTensors
    >>> t = LazyTensors({"a": lambda: np.zeros(3, np.float32)})
    >>> list(t), t["a"].shape
    (['a'], (3,))
    """

    def __init__(self, makers: dict[str, Any]) -> None:
        self.makers = makers

    def __getitem__(self, name: str) -> np.ndarray:
        return self.makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self.makers)

    def __len__(self) -> int:
        return len(self.makers)


def gpt2_weights(model: Any) -> DecoderWeights:
    """The weights of a Hugging Face ``GPT2LMHeadModel`` (any size) as
    :class:`DecoderWeights` (its Conv1D weights, stored ``(in, out)``, transposed).

    Examples
    --------
    >>> from opsdk.frontend import prepare_model_imports
    >>> prepare_model_imports()
    >>> import torch, transformers
    >>> _ = torch.manual_seed(0)
    >>> cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, n_positions=32,
    ...                               vocab_size=100)
    >>> w = gpt2_weights(transformers.GPT2LMHeadModel(cfg))
    >>> w.config.head_dim, w.tensors["h.0.attn.c_attn.weight"].shape
    (32, (192, 64))
    """
    c = model.config
    if getattr(c, "model_type", "gpt2") != "gpt2":
        raise ValueError(f"gpt2_weights: a {c.model_type!r} model is not GPT-2; opsdk.llm "
                         "reads GPT-2-style checkpoints (GPT2LMHeadModel)")
    if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"gpt2_weights: activation {c.activation_function!r} is not the "
                         "GELU-tanh that GPT-2 uses; only that one is built")
    inner = c.n_inner if getattr(c, "n_inner", None) else 4 * c.n_embd
    if inner != 4 * c.n_embd:
        raise ValueError(f"gpt2_weights: n_inner={inner} is not 4 x n_embd; not supported")
    cfg = DecoderConfig(vocab=c.vocab_size, width=c.n_embd, layers=c.n_layer, heads=c.n_head,
                        positions=c.n_positions, eps=float(c.layer_norm_epsilon))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        if not k.startswith("transformer."):
            continue  # lm_head.weight: tied to wte
        name = k.removeprefix("transformer.").replace("wte.weight", "wte") \
            .replace("wpe.weight", "wpe")
        conv1d = name.endswith(".weight") and v.ndim == 2 and ("attn." in name or "mlp." in name)
        out[name] = np.ascontiguousarray(v.T if conv1d else v, dtype=np.float32)
    return DecoderWeights(cfg, out)


def llama_weights(model: Any) -> DecoderWeights:
    """The weights of a Hugging Face ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` as
    :class:`DecoderWeights` (``arch="llama"``; Qwen2's q / k / v biases kept). Refuses what
    the built decoder does not compute: RoPE scaling, a head_dim other than width / heads,
    an o_proj or MLP bias, sliding-window attention, an activation other than SiLU.

    Examples
    --------
    >>> from opsdk.frontend import prepare_model_imports
    >>> prepare_model_imports()
    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    ...     vocab_size=100, max_position_embeddings=32)
    >>> w = llama_weights(transformers.LlamaForCausalLM(cfg))
    >>> w.config.kv_width, w.tensors["layers.0.self_attn.k_proj.weight"].shape
    (32, (32, 64))
    """
    c = model.config
    kind = getattr(c, "model_type", "")
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"llama_weights: a {kind!r} model is neither Llama nor Qwen2 "
                         "(LlamaForCausalLM, Qwen2ForCausalLM)")
    problems = []
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (SiLU is built)")
    scaling = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        problems.append(f"rope_scaling {scaling} (plain RoPE is built)")
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if hd * c.num_attention_heads != c.hidden_size:
        problems.append(f"head_dim {hd} x {c.num_attention_heads} heads != hidden_size")
    if getattr(c, "mlp_bias", False):
        problems.append("mlp_bias")
    if getattr(c, "use_sliding_window", False):
        problems.append("sliding-window attention")
    sd = {k.removeprefix("model."): v.detach().float().numpy()
          for k, v in model.state_dict().items()}
    if any(k.endswith("o_proj.bias") for k in sd):
        problems.append("an o_proj bias")
    if problems:
        raise ValueError(f"llama_weights: not supported: {'; '.join(problems)}")
    params = getattr(c, "rope_parameters", None) or {}
    base = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    cfg = DecoderConfig(vocab=c.vocab_size, width=c.hidden_size, layers=c.num_hidden_layers,
                        heads=c.num_attention_heads, positions=c.max_position_embeddings,
                        eps=float(c.rms_norm_eps), arch="llama",
                        kv_heads=c.num_key_value_heads, intermediate=c.intermediate_size,
                        rope_base=base, qkv_bias="layers.0.self_attn.q_proj.bias" in sd)
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()
           if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in out:  # tied (tie_word_embeddings)
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return DecoderWeights(cfg, out)


# ------------------------------------------------------------------------ building the module
def _const(a: np.ndarray) -> relax.Constant:
    return relax.const(np.ascontiguousarray(a))


class _Builder:
    """Emits the decoder's layers into a BlockBuilder, weights as constants."""

    def __init__(self, weights: DecoderWeights, mode: str, fused_attention: bool,
                 activations: str = "float32") -> None:
        if mode not in WEIGHT_MODES:
            raise ValueError(f"build_decoder: weights={mode!r}; choose one of "
                             f"{', '.join(WEIGHT_MODES)}")
        self.weights = weights
        self._consts: dict[str, relax.Constant] = {}
        self.w, self.cfg, self.mode = weights.tensors, weights.config, mode
        self.bb = relax.BlockBuilder()
        load_builtin_ops()
        self.ops = opsdk_relax  # the builders of the registered ops
        self.fused_attention = fused_attention
        if activations not in ACTIVATION_MODES or (activations != "float32"
                                                   and mode == "float32"):
            raise ValueError(f"build_decoder: activations={activations!r}; choose "
                             f"{', '.join(ACTIVATION_MODES)} (q8_0 with int8 / int4 weights)")
        self.activations = activations

    def const(self, key: str, make: Any) -> relax.Constant:
        """The constant ``key`` (``make()`` the first time): both entry points share it, so
        the module holds each weight once."""
        if key not in self._consts:
            self._consts[key] = _const(make())
        return self._consts[key]

    def emit(self, e: relax.Expr) -> relax.Var:
        return self.bb.emit(e)

    def layer_norm(self, x: relax.Expr, name: str) -> relax.Var:
        g = self.const(name + ".weight", lambda: self.w[name + ".weight"])
        b = self.const(name + ".bias", lambda: self.w[name + ".bias"])
        return self.emit(R.nn.layer_norm(x, g, b, [-1], self.cfg.eps))

    def rms_norm(self, x: relax.Expr, name: str) -> relax.Var:
        g = self.const(name + ".weight", lambda: self.w[name + ".weight"])
        return self.emit(self.ops.rms_norm(x, g, begin_axis=-1, epsilon=self.cfg.eps))

    def rope(self, x: relax.Expr, cos: relax.Expr, sin: relax.Expr) -> relax.Var:
        """Rotary embedding of ``x (n, heads, D)`` with the rows ``(n, D)`` of its positions."""
        return self.bb.emit_te(_rope, x, cos, sin)

    def linear(self, x: relax.Expr, name: str, activation: str = "none") -> relax.Var:
        """``act(x @ W.T + b)`` with W held as the weight mode says."""
        return self.dense(x, name + ".weight", name + ".bias", activation)

    def dense(self, x: relax.Expr, w_name: str, b_name: str | None,
              activation: str = "none") -> relax.Var:
        bias = None if b_name is None else self.const(b_name, lambda: (
            np.zeros(self.cfg.width, np.float32) if b_name == "zero_bias" else self.w[b_name]))
        if self.mode == "float32":  # bias and GELU join the matmul's kernel (fusion step)
            y = R.matmul(x, self.const(w_name + ".T",
                                       lambda: np.ascontiguousarray(self.w[w_name].T)))
            y = y if bias is None else R.add(y, bias)
            act = {"gelu_tanh": R.nn.gelu_tanh, "silu": R.nn.silu}.get(activation)
            return self.emit(act(y) if act else y)
        # the weight-only ops compute bias and activation in their own write-back
        if self.mode == "int8":
            q, s = self._quantized(w_name, quantize_w8)
            return self.emit(self.ops.dense_w8(x, q, s, bias, activation=activation,
                                               activations=self.activations))
        qs, d = self._quantized(w_name, quantize_q4_0)
        return self.emit(self.ops.dense_q4(x, qs, d, bias, activation=activation,
                                           activations=self.activations))

    def _quantized(self, w_name: str, quantize: Any) -> tuple[relax.Constant, ...]:
        key = f"{w_name}.{self.mode}"
        if key not in self._consts:
            for i, a in enumerate(quantize(self.w[w_name])):
                self._consts[f"{key}.{i}"] = _const(a)
            self._consts[key] = self._consts[f"{key}.0"]
        return self._consts[f"{key}.0"], self._consts[f"{key}.1"]

    def embed(self, tokens: relax.Expr, name: str = "wte") -> relax.Var:
        """Token embedding rows of matrix ``name``. Quantized modes hold it quantized and
        dequantize the rows gathered (GPT-2: the LM head's matrix, tied; llama: its own,
        quantized like llama.cpp's ``token_embd``), so the float matrix is not kept. int4
        gathers with ``opsdk.take_q4`` and int8 with ``opsdk.take_w8``, told the head's
        activations: their rules gather from the packing the head's kernel reads (one copy
        of a tied table; an untied table is packed alone, at the same size)."""
        if self.mode == "float32":
            return self.emit(R.take(self.const(name, lambda: self.w[name]), tokens, axis=0))
        if self.mode == "int8":
            q, s = self._quantized(name, quantize_w8)
            return self.emit(self.ops.take_w8(q, s, tokens, activations=self.activations))
        qs, d = self._quantized(name, quantize_q4_0)
        return self.emit(self.ops.take_q4(qs, d, tokens, activations=self.activations))

    def attention(self, q: relax.Expr, k: relax.Expr, v: relax.Expr) -> relax.Var:
        """Causal attention of ``n`` new queries ``(n, H, D)`` over ``m`` cached keys and
        values ``(m, H, D)`` (query ``i`` at position ``m - n + i``): ``opsdk.attention``, one
        kernel reading the cache rows where they are."""
        if not self.fused_attention:
            return self._attention_unfused(q, k, v)
        group = self.cfg.heads // self.cfg.n_kv_heads
        if group > 1 and not _attention_takes_grouped_heads():
            # The op's kernel reads grouped heads (query head h: kv head h // group), but its
            # Relax shape check (opsdk/ops/attention.py ``_input_shapes``) asks k / v for q's
            # head count: repeated here (the cache itself holds the kv heads only).
            k, v = (self.emit(R.repeat(t, group, axis=1)) for t in (k, v))
        one = [self.emit(R.reshape(t, [1, *t.ty.shape])) for t in (q, k, v)]
        o = self.emit(self.ops.attention(*one, causal=True, layout="BSHD"))
        return self.emit(R.reshape(o, list(q.ty.shape)))

    def _attention_unfused(self, q: relax.Expr, k: relax.Expr, v: relax.Expr) -> relax.Var:
        d, group = self.cfg.head_dim, self.cfg.heads // self.cfg.n_kv_heads
        if group > 1:  # grouped heads: each key / value head serves ``group`` query heads
            k, v = (self.emit(R.repeat(t, group, axis=1)) for t in (k, v))
        s = self.emit(R.matmul(R.permute_dims(q, [1, 0, 2]), R.permute_dims(k, [1, 2, 0])))
        s = self.bb.emit_te(_causal_scale, s, 1.0 / float(np.sqrt(d)))
        p = self.emit(R.nn.softmax(s, axis=-1))
        o = self.emit(R.matmul(p, R.permute_dims(v, [1, 0, 2])))  # (H, n, D)
        return self.emit(R.permute_dims(o, [1, 0, 2]))


def _attention_takes_grouped_heads() -> bool:
    """Whether ``opsdk.attention``'s declared input shapes let k / v have fewer heads than q
    (its kernel computes grouped-query attention either way)."""
    from ..registry import get_op

    shapes = get_op("attention").input_shapes
    return shapes is not None and shapes((1, 5, 4, 8), {"layout": "BSHD"})["k"][2] != 4


def _rope(x: te.Tensor, cos: te.Tensor, sin: te.Tensor) -> te.Tensor:
    """Hugging Face's rotary embedding: ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = (-x[D/2:], x[:D/2])``; ``cos`` / ``sin`` ``(n, D)`` are the rows of the
    positions (each half the same frequencies)."""
    half = x.shape[2] // 2

    def f(i, h, d):
        other = tirx.Select(d < half, -x[i, h, tirx.min(d + half, 2 * half - 1)],
                            x[i, h, tirx.max(d - half, 0)])
        return x[i, h, d] * cos[i, d] + other * sin[i, d]

    return te.compute(x.shape, f, name="rope")


def _rope_tables(cfg: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``(positions, head_dim)`` in float64 (rotate-half layout)."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(cfg.positions, dtype=np.float64)[:, None] * inv[None]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang), np.sin(ang)


def _causal_scale(s: te.Tensor, scale: float) -> te.Tensor:
    """Scores ``(H, n, m)`` scaled, with key ``j`` hidden from query ``i`` past its position
    ``m - n + i`` (the lowest float32, so softmax gives it exactly 0)."""
    n, m = s.shape[1], s.shape[2]
    return te.compute(
        s.shape,
        lambda h, i, j: tirx.Select(j <= m - n + i, s[h, i, j] * tirx.const(scale, "float32"),
                                    tirx.min_value("float32")),
        name="causal_scale")


def _emit_forward(b: _Builder, name: str, n: tirx.PrimExpr) -> None:
    """One forward function: ``n`` new tokens (symbolic, or 1) over ``m`` cached positions."""
    cfg, bb = b.cfg, b.bb
    hkv, d_ = cfg.n_kv_heads, cfg.head_dim
    m = tirx.Var("m", "int64")
    tokens = relax.Var("tokens", relax.TensorType((1, n), "int32"))
    total = relax.Var("total", relax.ShapeType([m]))
    caches = [relax.Var(f"{kv}_cache{i}", relax.ObjectType())
              for i in range(cfg.layers) for kv in ("k", "v")]
    kv_type = relax.TensorType([m, hkv, d_], "float32")
    llama = cfg.arch == "llama"
    with bb.function(name, [tokens, total, *caches]):
        # One dataflow block: kernel fusion and view-only reshapes work inside one; the
        # cache calls are ordered by their data (a view reads the appended cache).
        with bb.dataflow():
            ids = R.reshape(tokens, [n])
            pos = b.emit(R.arange(relax.prim_value(m - n), relax.prim_value(m), dtype="int64"))
            if llama:
                x = b.embed(ids, "embed_tokens.weight")
                cos, sin = (b.emit(R.take(b.const(f"rope.{j}", lambda j=j: _rope_tables(cfg)[j]
                                                  .astype(np.float32)), pos, axis=0))
                            for j in range(2))
            else:
                x = b.embed(ids)
                wpe = b.const("wpe", lambda: b.w["wpe"])
                x = b.emit(R.add(x, R.take(wpe, pos, axis=0)))
            new_caches = []

            def attend(i: int, q: relax.Expr, k: relax.Expr, v: relax.Expr) -> relax.Var:
                views = []
                for cache, new in ((caches[2 * i], k), (caches[2 * i + 1], v)):
                    c = b.emit(R.call_pure_packed(_CACHE_FUNCS[1], cache, new,
                                                  ty_args=relax.ObjectType()))
                    new_caches.append(c)
                    views.append(b.emit(R.call_pure_packed(
                        _CACHE_FUNCS[2], c, relax.ShapeExpr([m, hkv, d_]), ty_args=kv_type)))
                o = b.attention(q, *views)
                return b.emit(R.reshape(o, [n, cfg.width]))

            for i in range(cfg.layers):
                if llama:
                    x = _llama_layer(b, i, x, n, cos, sin, attend)
                else:
                    x = _gpt2_layer(b, i, x, n, attend)
            # the last token's row, (1, width) with a static 1 (not n - (n - 1))
            last = b.emit(R.reshape(R.strided_slice(x, [0], [n - 1], [n]), [1, cfg.width]))
            if llama:
                logits = b.dense(b.rms_norm(last, "norm"), "lm_head.weight", None)
            else:
                logits = b.dense(b.layer_norm(last, "ln_f"), "wte", None)  # tied LM head
            out = bb.emit_output(relax.Tuple([logits, *new_caches]))
        bb.emit_func_output(out)


def _gpt2_layer(b: _Builder, i: int, x: relax.Expr, n: tirx.PrimExpr, attend: Any
                ) -> relax.Var:
    cfg = b.cfg
    p = f"h.{i}."
    h = b.layer_norm(x, p + "ln_1")
    qkv = b.linear(h, p + "attn.c_attn")
    q, k, v = (b.emit(R.reshape(R.strided_slice(qkv, [1], [j * cfg.width],
                                                [(j + 1) * cfg.width]),
                                [n, cfg.heads, cfg.head_dim]))
               for j in range(3))
    o = b.linear(attend(i, q, k, v), p + "attn.c_proj")
    x = b.emit(R.add(x, o))
    h = b.layer_norm(x, p + "ln_2")
    f = b.linear(h, p + "mlp.c_fc", "gelu_tanh")
    return b.emit(R.add(x, b.linear(f, p + "mlp.c_proj")))


def _llama_layer(b: _Builder, i: int, x: relax.Expr, n: tirx.PrimExpr, cos: relax.Expr,
                 sin: relax.Expr, attend: Any) -> relax.Var:
    cfg = b.cfg
    p = f"layers.{i}."
    h = b.rms_norm(x, p + "input_layernorm")

    def proj(name: str, heads: int) -> relax.Var:
        w = p + f"self_attn.{name}_proj"
        y = b.dense(h, w + ".weight", w + ".bias" if cfg.qkv_bias else None)
        return b.emit(R.reshape(y, [n, heads, cfg.head_dim]))

    q = b.rope(proj("q", cfg.heads), cos, sin)
    k = b.rope(proj("k", cfg.n_kv_heads), cos, sin)
    v = proj("v", cfg.n_kv_heads)
    # Quantized modes give o_proj and down_proj a zero bias: without one, dense_w8 / dense_q4's
    # epilogue rule takes the decode step's residual add (1, width) for a bias and fails
    # (opsdk/ops/dense_w8.py ``build`` reads the type of a reshape it has not normalized).
    zero = None if b.mode == "float32" else "zero_bias"
    o = b.dense(attend(i, q, k, v), p + "self_attn.o_proj.weight", zero)
    x = b.emit(R.add(x, o))
    h = b.rms_norm(x, p + "post_attention_layernorm")
    g = b.dense(h, p + "mlp.gate_proj.weight", None, "silu")
    u = b.dense(h, p + "mlp.up_proj.weight", None)
    return b.emit(R.add(x, b.dense(b.emit(R.multiply(g, u)), p + "mlp.down_proj.weight", zero)))


def default_activations(weights_mode: str, target: Any = "x86") -> str:
    """What a quantized decoder's linear layers multiply on ``target`` by default: ``q8_0``
    where the schedule driver has an integer rule for it (the op's q8_0 numerics on VNNI,
    dotprod, ...), else ``float32`` (weights dequantized in registers, a rule on every CPU):
    q8_0 without a rule would run the unscheduled generic lowering.

    Examples
    --------
    >>> from opsdk.llm import default_activations
    >>> default_activations("int4", "arm"), default_activations("int4", "arm-dotprod")
    ('float32', 'q8_0')
    """
    if weights_mode == "float32":
        return "float32"
    load_builtin_ops()
    tgt = resolve_target(target)
    x = te.placeholder((1, 64), "float32", name="x")
    qs = te.placeholder((32, 32), "uint8", name="qs")
    d = te.placeholder((32, 2), "float16", name="d")
    out = dense_q4.call_compute([x, qs, d, None], {"activation": "none",
                                                   "activations": "q8_0"})
    func = te.create_prim_func([x, qs, d, out])
    with tgt:
        rule = choose(dense_q4, func, tgt).rule
    return "float32" if rule == GENERIC else "q8_0"


def build_decoder(weights: DecoderWeights, *, weights_mode: str = "float32",
                  fused_attention: bool = True, activations: str = "float32"
                  ) -> tvm.IRModule:
    """The decoder as a Relax module with ``create_cache`` and ``forward`` (module doc).

    Parameters
    ----------
    weights
        Float32 weights (:func:`gpt2_weights`).
    weights_mode
        One of :data:`WEIGHT_MODES`: how every linear layer and the LM head hold weights.
    fused_attention
        Attention as one ``opsdk.attention`` kernel (default), or decomposed into batched
        matmuls, a mask and a softmax (the baseline it is measured against).
    activations
        With int8 / int4 weights: ``"q8_0"`` quantizes each linear layer's input to int8 in
        32-blocks and multiplies in integers (llama.cpp's numerics, VNNI / sdot kernels);
        ``"float32"`` keeps it float (weights dequantized in registers).

    Returns
    -------
    tvm.IRModule
        To compile with :func:`opsdk.model.compile_model` after
        :class:`opsdk.transform.FuseIntoOps` (:func:`opsdk.llm.compile_decoder` does both).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.llm import DecoderConfig, DecoderWeights, build_decoder, random_weights
    >>> w = random_weights(DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16))
    >>> mod = build_decoder(w)
    >>> sorted(gv.name_hint for gv in mod.functions if gv.name_hint != "causal_scale")
    ['create_cache', 'decode', 'prefill']
    """
    b = _Builder(weights, weights_mode, fused_attention, activations)
    cfg, bb = b.cfg, b.bb
    # Two entry points over the same weights: ``prefill`` for any number of new tokens and
    # ``decode`` for exactly one, so the decode step's kernels are scheduled for one row (a
    # matrix-vector product) and the prompt's for many (register-tiled GEMMs).
    _emit_forward(b, "prefill", tirx.Var("n", "int64"))
    _emit_forward(b, "decode", tirx.IntImm("int64", 1))
    h_, d_ = cfg.n_kv_heads, cfg.head_dim
    cap = tirx.Var("c", "int64")
    capacity = relax.Var("capacity", relax.ShapeType([cap]))
    # Impure: the caches are distinct objects (a pure call with equal arguments may be merged).
    with bb.function("create_cache", [capacity], pure=False):
        shape = relax.ShapeExpr([cap, h_, d_])
        made = [bb.emit(relax.Call(relax.ExternFunc(_CACHE_FUNCS[0]),
                                   [R.zeros(shape, "float32"), shape, relax.prim_value(0)],
                                   ty_args=[relax.ObjectType()]))
                for _ in range(2 * cfg.layers)]
        bb.emit_func_output(relax.Tuple(made))
    return bb.get()


def random_weights(config: DecoderConfig, seed: int = 0) -> DecoderWeights:
    """Random GPT-2 weights in numpy, for tests and benchmarks that need no torch: every
    matrix and bias normal with std 0.02, LayerNorm weights 1 and biases 0.

    Not GPT-2's training initialization (zero biases, residual projections scaled by
    ``1 / sqrt(2 * layers)``): with that, a small test config (width 64, 2 layers) predicts
    the token it has just read at every position, so greedy decoding only repeats its
    input; with these weights it does at about half the positions, and GPT-2-small at none.

    Examples
    --------
    >>> from opsdk.llm import DecoderConfig, random_weights
    >>> w = random_weights(DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16))
    >>> w.tensors["h.0.mlp.c_fc.weight"].shape
    (128, 32)
    """
    if config.arch == "llama":
        return _random_llama(config, seed)
    rng = np.random.default_rng(seed)
    e = config.width

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    t = {"wte": normal(config.vocab, e), "wpe": normal(config.positions, e),
         "ln_f.weight": np.ones(e, np.float32), "ln_f.bias": np.zeros(e, np.float32)}
    for i in range(config.layers):
        p = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            t[p + ln + ".weight"] = np.ones(e, np.float32)
            t[p + ln + ".bias"] = np.zeros(e, np.float32)
        for name, (o, i_) in {"attn.c_attn": (3 * e, e), "attn.c_proj": (e, e),
                              "mlp.c_fc": (4 * e, e), "mlp.c_proj": (e, 4 * e)}.items():
            t[p + name + ".weight"] = normal(o, i_)
            t[p + name + ".bias"] = normal(o)
    return DecoderWeights(config, t)


def _llama_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    e, kv, f = cfg.width, cfg.kv_width, cfg.ffn
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab, e)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (e,)
        for name, o in (("q", e), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (o, e)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (o,)
        shapes[p + "self_attn.o_proj.weight"] = (e, e)
        shapes[p + "post_attention_layernorm.weight"] = (e,)
        shapes[p + "mlp.gate_proj.weight"] = (f, e)
        shapes[p + "mlp.up_proj.weight"] = (f, e)
        shapes[p + "mlp.down_proj.weight"] = (e, f)
    shapes["norm.weight"] = (e,)
    shapes["lm_head.weight"] = (cfg.vocab, e)
    return shapes


def _random_llama(cfg: DecoderConfig, seed: int) -> DecoderWeights:
    """Llama's initialization (normal, std 0.02; norm weights 1, biases 0), each array made
    when read from its own seed (``seed`` and the name), so a 1B model's float32 weights
    (4.4 GB) are never all held."""

    def make(name: str, shape: tuple[int, ...]) -> Any:
        if len(shape) == 1:
            fill = 1.0 if name.endswith("norm.weight") else 0.0
            return lambda: np.full(shape, fill, np.float32)

        def normal() -> np.ndarray:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            a = rng.standard_normal(shape, dtype=np.float32)
            a *= np.float32(0.02)
            return a
        return normal

    return DecoderWeights(cfg, LazyTensors({k: make(k, s)
                                            for k, s in _llama_shapes(cfg).items()}))


def _act_in(x: np.ndarray, activations: str) -> np.ndarray:
    """What a linear layer reads of its input: as is, or quantized to q8_0 blocks (bit-exactly
    as the kernels do)."""
    if activations == "float32":
        return x
    xq, dx = quantize_q8_0(x.astype(np.float32))
    return (xq.reshape(len(x), -1, 32) * dx[:, :, None].astype(np.float64)).reshape(x.shape)


def _softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention of ``(H, n, D)`` queries over ``(H, n, D)`` keys / values."""
    n = q.shape[1]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[2]) + np.triu(np.full((n, n), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def _llama_reference(weights: DecoderWeights, ids: np.ndarray, activations: str) -> np.ndarray:
    cfg = weights.config
    n, hd, group = ids.size, cfg.head_dim, cfg.heads // cfg.n_kv_heads

    def t(name: str) -> np.ndarray:  # one array at a time (lazy weights stay lazy)
        return np.asarray(weights.tensors[name], dtype=np.float64)

    def rms(x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * t(name + ".weight")

    def lin(x: np.ndarray, name: str, bias: bool = False) -> np.ndarray:
        y = _act_in(x, activations) @ t(name + ".weight").T
        return y + t(name + ".bias") if bias else y

    cos, sin = (a[:n, None, :] for a in _rope_tables(cfg))
    half = hd // 2

    def rope(a: np.ndarray) -> np.ndarray:
        return a * cos + np.concatenate([-a[..., half:], a[..., :half]], -1) * sin

    x = t("embed_tokens.weight")[ids]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        h = rms(x, p + "input_layernorm")
        q, k, v = (lin(h, p + f"self_attn.{j}_proj", cfg.qkv_bias).reshape(n, -1, hd)
                   for j in "qkv")
        q, k = rope(q), rope(k)
        k, v = (np.repeat(a, group, axis=1) for a in (k, v))  # query head h: kv h // group
        o = _softmax_attention(*(a.transpose(1, 0, 2) for a in (q, k, v)))
        x = x + lin(o.transpose(1, 0, 2).reshape(n, cfg.width), p + "self_attn.o_proj")
        h = rms(x, p + "post_attention_layernorm")
        g = lin(h, p + "mlp.gate_proj")
        g = g / (1 + np.exp(-g)) * lin(h, p + "mlp.up_proj")
        x = x + lin(g, p + "mlp.down_proj")
    return lin(rms(x, "norm"), "lm_head")


def reference_logits(weights: DecoderWeights, tokens: list[int] | np.ndarray, *,
                     activations: str = "float32") -> np.ndarray:
    """The float64 logits ``(len(tokens), vocab)`` of the whole sequence, from the float32
    weights: what the decoder's numerics are judged against. ``activations="q8_0"``: every
    linear layer's input quantized to q8_0 blocks first (bit-exactly as the kernels do), so
    only float rounding separates a quantized decoder from this reference.

    Examples
    --------
    >>> from opsdk.llm import DecoderConfig, random_weights, reference_logits
    >>> w = random_weights(DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16))
    >>> reference_logits(w, [1, 2, 3]).shape
    (3, 50)
    """
    ids = np.asarray(tokens, dtype=np.int64)
    if weights.config.arch == "llama":
        return _llama_reference(weights, ids, activations)
    t = {k: v.astype(np.float64) for k, v in weights.tensors.items()}
    cfg = weights.config
    n, hd = ids.size, cfg.head_dim

    def ln(x: np.ndarray, name: str) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.eps) * t[name + ".weight"] + t[name + ".bias"]

    def act_in(x: np.ndarray) -> np.ndarray:  # what the matmul reads of its input
        if activations == "float32":
            return x
        xq, dx = quantize_q8_0(x.astype(np.float32))  # bit-exact, as the kernels quantize
        return (xq.reshape(len(x), -1, 32) * dx[:, :, None].astype(np.float64)).reshape(x.shape)

    def lin(x: np.ndarray, name: str) -> np.ndarray:
        return act_in(x) @ t[name + ".weight"].T + t[name + ".bias"]

    x = t["wte"][ids] + t["wpe"][np.arange(n)]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(cfg.layers):
        p = f"h.{i}."
        q, k, v = np.split(lin(ln(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(n, cfg.heads, hd).transpose(1, 0, 2) for a in (q, k, v))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + lin(o.transpose(1, 0, 2).reshape(n, cfg.width), p + "attn.c_proj")
        f = lin(ln(x, p + "ln_2"), p + "mlp.c_fc")
        f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f ** 3)))
        x = x + lin(f, p + "mlp.c_proj")
    return act_in(ln(x, "ln_f")) @ t["wte"].T


def dequantized_weights(weights: DecoderWeights, weights_mode: str) -> DecoderWeights:
    """The float32 weights a weight mode actually computes with: every linear layer's and the
    LM head's matrix quantized and dequantized (exactly, in float32). Their
    :func:`reference_logits` is what the quantized decoder must match to float32 accuracy;
    the float weights' logits measure the quantization itself.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.llm import DecoderConfig, dequantized_weights, random_weights
    >>> w = random_weights(DecoderConfig(vocab=64, width=32, layers=1, heads=2, positions=16))
    >>> q = dequantized_weights(w, "int4")
    >>> bool(np.array_equal(q.tensors["wpe"], w.tensors["wpe"]))  # not a linear layer
    True
    >>> bool(0 < np.abs(q.tensors["wte"] - w.tensors["wte"]).max() < 0.01)
    True
    """
    if weights_mode == "float32":
        return weights
    src = weights.tensors

    def dequantized(name: str) -> np.ndarray:
        w = src[name]
        if weights_mode == "int8":
            q, s = quantize_w8(w)
            return (q.astype(np.float32) * s[:, None]).astype(np.float32)
        return dequantize_q4_0(*quantize_q4_0(w))

    linear = set(_linear_weights(weights.config))
    if isinstance(src, LazyTensors):  # stays lazy: one array at a time
        return DecoderWeights(weights.config, LazyTensors({
            k: (lambda k=k: dequantized(k)) if k in linear else src.makers[k] for k in src}))
    out = dict(src)
    for name in linear:
        out[name] = dequantized(name)
    return DecoderWeights(weights.config, out)


def _linear_weights(cfg: DecoderConfig) -> list[str]:
    if cfg.arch == "llama":  # the embedding is held quantized too (llama.cpp's token_embd)
        return [k for k, s in _llama_shapes(cfg).items() if len(s) == 2]
    names = ["wte"]  # the tied LM head; the embedding reads the same matrix
    for i in range(cfg.layers):
        names += [f"h.{i}.{n}.weight" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                "mlp.c_proj")]
    return names


def add_check_entry(mod: tvm.IRModule, config: DecoderConfig, prompt_len: int,
                    steps: int) -> tvm.IRModule:
    """``mod`` (from :func:`build_decoder`) with one more function, ``check(prompt (1, P)
    int32, follow (1, S) int32) -> logits (1 + S, vocab)``: fresh caches, the prompt's
    prefill, then ``S`` decode steps feeding ``follow``, every step's logits. A stateless
    call of the whole decode loop, so any runner (the emulator, a board over RPC) can run it
    and compare with the host.

    Examples
    --------
    >>> from opsdk.llm import DecoderConfig, build_decoder, random_weights
    >>> from opsdk.llm._decoder import add_check_entry
    >>> cfg = DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16)
    >>> mod = add_check_entry(build_decoder(random_weights(cfg)), cfg, 4, 2)
    >>> mod["check"].ret_ty.shape
    R.shape([3, 50])
    """
    bb = relax.BlockBuilder(mod)
    prompt = relax.Var("prompt", relax.TensorType((1, prompt_len), "int32"))
    follow = relax.Var("follow", relax.TensorType((1, steps), "int32"))
    n_caches = 2 * config.layers
    with bb.function("check", [prompt, follow], pure=False):
        made = bb.emit(relax.Call(mod.get_global_var("create_cache"),
                                  [relax.ShapeExpr([prompt_len + steps])]))
        caches = [bb.emit(relax.TupleGetItem(made, i)) for i in range(n_caches)]
        out = bb.emit(relax.Call(mod.get_global_var("prefill"),
                                 [prompt, relax.ShapeExpr([prompt_len]), *caches]))
        logits = [bb.emit(relax.TupleGetItem(out, 0))]
        for s in range(steps):
            caches = [bb.emit(relax.TupleGetItem(out, 1 + i)) for i in range(n_caches)]
            tok = bb.emit(R.strided_slice(follow, [1], [s], [s + 1]))
            out = bb.emit(relax.Call(mod.get_global_var("decode"),
                                     [tok, relax.ShapeExpr([prompt_len + s + 1]), *caches]))
            logits.append(bb.emit(relax.TupleGetItem(out, 0)))
        bb.emit_func_output(bb.emit(R.concat(logits, axis=0)))
    return bb.get()
