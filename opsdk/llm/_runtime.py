"""Compiling a decoder and running it: prefill, greedy decode, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .._pipeline import CompiledModel, compile_model
from ..runners import LocalRunner, runner_for
from ..targets import target as resolve_target
from ..targets import target_arch
from ..transform import FuseIntoOps, KernelFormWeights
from ._decoder import (
    DecoderConfig,
    DecoderWeights,
    add_check_entry,
    build_decoder,
    dequantized_weights,
    reference_logits,
)

__all__ = ["Decoder", "GenerateStats", "check_on_target", "compile_decoder"]


def compile_decoder(weights: DecoderWeights, *, weights_mode: str = "float32",
                    target: Any = "x86", cache: Any = None,
                    fused_attention: bool = True, activations: str = "float32",
                    weights_apart: bool = False) -> CompiledModel:
    """:func:`~opsdk.llm.build_decoder`, the fusion step, and :func:`opsdk.model.compile_model`
    (through its compile cache: ``cache`` as there). Arguments as for
    :func:`~opsdk.llm.build_decoder`; ``weights_apart`` as for ``compile_model``: the
    library holds no weights, ``cm.weights`` has them in the form the kernels read, each
    once, and :class:`Decoder` passes them to ``prefill`` and ``decode``.

    Examples
    --------
    >>> from opsdk.llm import DecoderConfig, compile_decoder, random_weights
    >>> w = random_weights(DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16))
    >>> cm = compile_decoder(w, cache=False)
    >>> sum(cm.rule_counts().values()) > 0
    True
    """
    mod = FuseIntoOps()(build_decoder(weights, weights_mode=weights_mode,
                                      fused_attention=fused_attention,
                                      activations=activations))
    return compile_model(mod, target, cache=cache, weights_apart=weights_apart)


@dataclass
class GenerateStats:
    """What one :meth:`Decoder.generate` took: ``prefill_ms`` for the prompt, then the
    milliseconds of each decode step."""

    prompt_tokens: int
    prefill_ms: float
    step_ms: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed from the median step (robust to a preempted step)."""
        return 1e3 / float(np.median(self.step_ms)) if self.step_ms else float("nan")


class Decoder:
    """A compiled decoder on a device: its KV caches, the position, and the steps.

    Parameters
    ----------
    executable
        What :func:`compile_decoder` built (a :class:`~opsdk.model.CompiledModel` or its
        ``ex``), for this machine's CPU.
    config
        The decoder's shape (for the vocabulary and the position limit).
    capacity
        Cache rows allocated up front (the caches grow past it by doubling).
    weights
        For a library compiled with its weights apart (``compile_decoder(...,
        weights_apart=True)``, a decoder artifact): the
        :class:`~opsdk.transform.KernelFormWeights` its functions take, on ``device``
        (default: the compiled model's own).

    Examples
    --------
    >>> from opsdk.llm import Decoder, DecoderConfig, compile_decoder, random_weights
    >>> cfg = DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16)
    >>> dec = Decoder(compile_decoder(random_weights(cfg), cache=False), cfg)
    >>> tokens, stats = dec.generate([1, 2, 3], 4)
    >>> len(tokens), stats.prompt_tokens
    (4, 3)
    """

    def __init__(self, executable: Any, config: DecoderConfig, *, capacity: int | None = None,
                 device: Any = None, weights: KernelFormWeights | None = None) -> None:
        ex = getattr(executable, "ex", executable)
        if weights is None:
            weights = getattr(executable, "weights", None)
        self.config = config
        self.device = device or tvm.cpu()
        self.vm = relax.VirtualMachine(ex, self.device)
        self._prefill, self._decode = self.vm["prefill"], self.vm["decode"]
        # The trailing parameters of each entry (none when the library holds the weights).
        self._weights = {f: [] if weights is None else
                         [weights.tensors[i] for i in weights.uses.get(f, [])]
                         for f in ("prefill", "decode")}
        self.capacity = capacity or min(config.positions, 256)
        self.reset()

    def reset(self) -> None:
        """Empty the caches: the next call is a new prompt."""
        self.caches = list(self.vm["create_cache"](tvm.runtime.ShapeTuple([self.capacity])))
        self.length = 0

    def forward(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Append ``tokens`` to the sequence; the logits after the last one, ``(vocab,)``."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("Decoder.forward: no tokens given")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise ValueError(f"Decoder.forward: token ids must lie in [0, {self.config.vocab})"
                             f"; got {int(ids.min())}..{int(ids.max())}")
        total = self.length + ids.size
        if total > self.config.positions:
            raise ValueError(f"Decoder.forward: {total} positions exceed the model's "
                             f"{self.config.positions}; reset() and start a shorter sequence")
        entry = "decode" if ids.size == 1 else "prefill"
        run = self._decode if ids.size == 1 else self._prefill
        out = run(tvm.runtime.tensor(ids.astype(np.int32)[None], self.device),
                  tvm.runtime.ShapeTuple([total]), *self.caches, *self._weights[entry])
        self.caches = [out[i] for i in range(1, len(out))]
        self.length = total
        return out[0].numpy()[0]

    def generate(self, prompt: list[int] | np.ndarray, tokens: int) -> tuple[list[int],
                                                                             GenerateStats]:
        """Greedy decoding: the prompt in one prefill, then ``tokens`` single steps, each
        feeding the previous argmax. Returns the generated ids and the timings."""
        self.reset()
        t0 = time.perf_counter()
        logits = self.forward(prompt)
        stats = GenerateStats(len(prompt), (time.perf_counter() - t0) * 1e3)
        out: list[int] = []
        for _ in range(tokens):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if len(out) == tokens:
                break
            t0 = time.perf_counter()
            logits = self.forward([nxt])
            stats.step_ms.append((time.perf_counter() - t0) * 1e3)
        return out, stats


def check_on_target(weights: DecoderWeights, target: str, prompt: list[int],
                    follow: list[int], *, weights_mode: str = "float32",
                    activations: str = "float32", cache: Any = None,
                    runner: Any = None) -> dict[str, Any]:
    """Run the decode loop (prefill of ``prompt``, one step per token of ``follow``) built for
    ``target`` on its runner (the emulator for ``arm`` on an x86 host, or ``runner``) and on
    the host, and compare every step's logits.

    Returns
    -------
    dict
        ``target_vs_host`` and ``target_vs_reference`` (relative RMSE against the float64
        reference of the weights the kernels use), ``steps``, ``device``.

    Examples
    --------
    >>> from opsdk.llm import DecoderConfig, check_on_target, random_weights
    >>> w = random_weights(DecoderConfig(vocab=50, width=32, layers=1, heads=2, positions=16))
    >>> r = check_on_target(w, "x86", [1, 2, 3], [4, 5], cache=False)
    >>> r["steps"], r["target_vs_host"] < 1e-6
    (3, True)
    """
    cfg = weights.config
    mod = add_check_entry(build_decoder(weights, weights_mode=weights_mode,
                                        activations=activations), cfg,
                          len(prompt), len(follow))
    mod = FuseIntoOps()(mod)
    inputs = [np.asarray([prompt], np.int32), np.asarray([follow], np.int32)]
    tgt, host = resolve_target(target), resolve_target("host")
    on_host = target_arch(tgt) == target_arch(host)
    host_cm = compile_model(mod, host, cache=cache)
    cm = host_cm if on_host and str(tgt) == str(host) else compile_model(mod, tgt, cache=cache)
    with LocalRunner() as local:
        want = local.run(host_cm.ex, inputs, entry="check")[0]
    own = runner is None
    run = runner if runner is not None else runner_for(target)
    try:
        got = run.run(cm.ex, inputs, entry="check")[0]
        device = run.device_info().get("device", str(run))
    finally:
        if own:
            run.close()
    ref = reference_logits(dequantized_weights(weights, weights_mode),
                           list(prompt) + list(follow),
                           activations=activations)[len(prompt) - 1:]

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))

    return {"target_vs_host": rel(got, want), "target_vs_reference": rel(got, ref),
            "steps": int(got.shape[0]), "device": device}
