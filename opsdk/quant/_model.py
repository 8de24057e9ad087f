"""Post-training quantization of a whole imported model (``quantize_model``).

The float model's dense layers with a constant weight (``matmul(x, W)``, optionally with its
bias ``+ b`` or an ``opsdk.bias_gelu(., b)`` after it) become ``quantize -> qdense`` with the
bias folded into the int32 accumulator and a float32 output (GELU stays float after it).
Its 2-D convolutions with a constant weight (``conv2d(x, W)``, groups 1 or depthwise,
symmetric padding, equal strides, no dilation; optionally ``+ b`` per channel, as left by
BatchNorm folding) become ``quantize -> qconv2d`` the same way. A layer that only feeds
another, directly or through ReLU / ReLU6 clamps, outputs int8 in that layer's input
parameters instead (``_chains``).
Activation ranges come from calibration inputs streamed through the float model once (each
layer's input is kept as exact min/max plus a bounded random sample for percentile / MSE);
weights are symmetric int8 per channel or per tensor. Layers that should stay float
(softmax, layer norms, matmuls of two activations such as attention's ``Q K^T``) are not
sites at all; ``keep_float`` keeps chosen sites float too (mixed precision).

:func:`sensitivity` reports each site's own output error (its quantized output on its float
inputs against the float64 layer), sorted worst first, which is what ``mixed_precision=``
uses to pick the layers to keep in float.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import tvm
from tvm import relax, tirx

from ..ops import QRANGE
from ._calibrate import QParams, calibrate, choose_qparams, quantize_conv2d, quantize_dense

__all__ = [
    "QuantConfig",
    "QuantSite",
    "QuantizedModel",
    "WeightOnlyQuant",
    "agreement",
    "find_sites",
    "quantize_model",
    "sensitivity",
]


@dataclass(frozen=True)
class QuantConfig:
    """How :func:`quantize_model` quantizes.

    Attributes
    ----------
    weights
        ``per_channel`` (one scale per output channel) or ``per_tensor``; symmetric int8.
    activations
        ``asymmetric`` (a zero point) or ``symmetric``; one scale per tensor.
    method
        Activation range from calibration: ``minmax``, ``percentile`` or ``mse``.
    percentile
        With ``method="percentile"``: the tails clipped (``99.99``: 0.01 % each side).
    keep_float
        Site names (:attr:`QuantSite.name`) left in float.
    samples_per_site
        Values kept per site for ``percentile`` / ``mse`` (min and max are exact).
    scheme
        ``int8``: activations and weights int8 (``quantize -> qdense`` / ``qconv2d``, as
        above). Weight-only, for memory-bound layers (an LLM's decode): ``w8`` int8 weights
        per output channel (``dense_w8``) or ``w4`` int4 in ggml q4_0 groups of 32
        (``dense_q4``; a layer whose K is not a multiple of 32 stays float). Weight-only
        schemes quantize dense layers only (convs stay float) and need no activation ranges.
    weight_only_activations
        With ``w8`` / ``w4``: ``float32`` (inputs stay float) or ``q8_0`` (inputs quantized
        per 32 values at run time, integer dot products: llama.cpp's numerics).
    """

    weights: Literal["per_channel", "per_tensor"] = "per_channel"
    activations: Literal["asymmetric", "symmetric"] = "asymmetric"
    method: Literal["minmax", "percentile", "mse"] = "minmax"
    percentile: float = 99.99
    keep_float: tuple[str, ...] = ()
    samples_per_site: int = 200_000
    scheme: Literal["int8", "w8", "w4"] = "int8"
    weight_only_activations: Literal["float32", "q8_0"] = "float32"

    @property
    def weight_only(self) -> bool:
        return self.scheme in ("w8", "w4")


@dataclass
class QuantSite:
    """One layer of the model that can become ``quantize -> qdense`` (or ``-> qconv2d``)."""

    name: str  # the layer in order of appearance: dense0, dense1, ... / conv0, conv1, ...
    root: Any  # the Relax var the quantized value replaces
    x: Any  # the Relax var of the layer's input
    w_kn: np.ndarray  # the float weight: as x @ w_kn (dense), OIHW (conv)
    bias: np.ndarray | None
    gelu: bool  # an opsdk.bias_gelu: GELU applied after the (biased) product
    act: QParams | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    conv: dict[str, Any] | None = None  # a conv's stride, padding, layout, depthwise

    @property
    def shape(self) -> tuple[int, ...]:
        """(K, N) of a dense layer: input, output features; a conv's weight shape OIHW."""
        return tuple(self.w_kn.shape)


def _const(e: Any) -> np.ndarray | None:
    if isinstance(e, tvm.ir.expr.GenericConst) and isinstance(e.value, tvm.runtime.Tensor):
        return e.value.numpy()
    return None


def _value(e: Any, bindings: dict[Any, Any]) -> np.ndarray | None:
    """A constant, or a transposed constant (a weight ConvertLayout or the importer
    transposed: ``permute_dims(const)``), as numpy; None for anything computed."""
    c = _const(e)
    if c is not None:
        return c
    v = bindings.get(e) if e is not None and hasattr(e, "ty") else None
    if v is not None and _op(v) == "relax.permute_dims":
        inner = _const(v.args[0])
        if inner is not None:
            axes = v.attrs.axes
            return np.transpose(inner, None if axes is None else [int(a) for a in axes])
    return None


def _op(e: Any) -> str | None:
    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
        return str(e.op.name)
    return None


def _graph(func: Any) -> tuple[dict[Any, Any], dict[Any, list[Any]], list[Any]]:
    """``func``'s bindings (var -> value), users (var -> vars whose value uses it; the output
    tuple counts as a user) and binding order."""

    bindings: dict[Any, Any] = {}
    users: dict[Any, list[Any]] = {}
    order = []
    for block in func.body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding):
                continue
            bindings[b.var] = b.value
            order.append(b.var)
            args = b.value.fields if isinstance(b.value, relax.Tuple) else getattr(
                b.value, "args", []) or []
            for arg in args:
                if isinstance(arg, relax.Var):
                    users.setdefault(arg, []).append(b.var)
    if isinstance(func.body.body, relax.Var):
        users.setdefault(func.body.body, []).append(None)
    return bindings, users, order


def _clamp_step(val: Any, bindings: dict[Any, Any]) -> tuple[Any, float, float] | None:
    """``(input var, lo, hi)`` of a ReLU or a ``maximum`` / ``minimum`` with a scalar constant
    (ReLU6 after ChannelsLast spells it so); None for anything else."""
    name = _op(val)
    if name == "relax.nn.relu":
        return val.args[0], 0.0, float("inf")
    if name not in ("relax.maximum", "relax.minimum"):
        return None
    values = [_value(e, bindings) for e in val.args]
    var = [e for e, v in zip(val.args, values) if v is None]
    const = [v for v in values if v is not None]
    if len(var) != 1 or len(const) != 1 or const[0].size != 1:
        return None
    bound = float(const[0].reshape(()))
    if name == "relax.maximum":
        return var[0], bound, float("inf")
    return var[0], -float("inf"), bound


def _chains(mod: Any, sites: Sequence[QuantSite], cfg: QuantConfig
            ) -> dict[str, tuple[QuantSite, list[Any]]]:
    """Consumer site name -> (producer site, the clamp vars between) for int8 chains of
    convs and dense layers: the producer's only use is the consumer's input, directly or
    through ReLU / ReLU6 clamps that nothing else reads. The producer then requantizes
    straight to the consumer's input parameters and the consumer's quantize disappears; the
    clamps fold into the saturation, which is exact when the int8 range lies inside the
    clamp's (a zero point of -128 for a ReLU; also ``127`` at or under 6 for a ReLU6).
    Otherwise no chain. A producer with a GELU after it (``bias_gelu``) has no chain: the
    GELU is not a saturation."""
    bindings, users, _ = _graph(mod["main"])
    quant = [s for s in sites if s.name not in cfg.keep_float]
    by_root = {s.root: s for s in quant if not s.gelu}
    out = {}
    for t in quant:
        if t.act is None or t.act.dtype != "int8":
            continue
        src, lo, hi, between = t.x, -float("inf"), float("inf"), []
        while (step := _clamp_step(bindings.get(src), bindings)) is not None:
            between.append(src)
            src, lo, hi = step[0], max(lo, step[1]), min(hi, step[2])
        s = by_root.get(src)
        if s is None or s is t:
            continue
        # Everything from the producer to the consumer has one user: nothing else needs the
        # float values.
        if any(len(users.get(v, [])) != 1 for v in (src, *between)):
            continue
        qmin, qmax = QRANGE["int8"]
        edges = t.act.quantize(np.array([lo if lo > -np.inf else 0.0,
                                         hi if hi < np.inf else 0.0], np.float32))
        if (lo > -np.inf and edges[0] > qmin) or (hi < np.inf and edges[1] < qmax):
            continue  # the clamp cuts inside the int8 range: saturation is not the clamp
        out[t.name] = (s, between)
    return out


def find_sites(mod: Any) -> list[QuantSite]:
    """The dense layers of ``mod["main"]`` with a constant float32 weight, in order.

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import relax
    >>> from opsdk.quant import find_sites
    >>> x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit(relax.op.matmul(x, relax.const(np.ones((8, 3), "float32"))))
    ...         y = bb.emit_output(relax.op.add(y, relax.const(np.ones(3, "float32"))))
    ...     _ = bb.emit_func_output(y)
    >>> [(s.name, s.shape, s.bias is not None) for s in find_sites(bb.get())]
    [('dense0', (8, 3), True)]
    """

    bindings, users, order = _graph(mod["main"])

    def bias_after(var: Any, n: int, shapes: tuple) -> tuple[Any, np.ndarray | None, str | None]:
        # The layer's only user adding a constant per-channel bias (or a bias_gelu).
        us = users.get(var, [])
        if len(us) != 1 or us[0] is None:  # (None: the function's result)
            return var, None, None
        u = bindings[us[0]]
        name = _op(u)
        other = None
        if name == "relax.add":
            other = u.args[1] if u.args[0].same_as(var) else u.args[0]
        elif name == "opsdk.bias_gelu" and u.args[0].same_as(var):
            other = u.args[1]
        b = _value(other, bindings) if other is not None else None
        if b is not None and b.shape in shapes and str(b.dtype) == "float32":
            return us[0], b.reshape(n), name
        return var, None, None

    sites = []
    convs = 0
    for var in order:
        val = bindings[var]
        if _op(val) == "relax.nn.conv2d":
            site = _conv_site(val, var, _value(val.args[1], bindings), bias_after,
                              f"conv{convs}")
            if site is not None:
                sites.append(site)
                convs += 1
            continue
        if _op(val) != "relax.matmul":
            continue
        x, w = val.args
        w_kn = _value(w, bindings)
        ty = x.ty
        if (w_kn is None or w_kn.ndim != 2 or str(w_kn.dtype) != "float32"
                or not isinstance(ty, relax.TensorType) or str(ty.dtype) != "float32"
                or ty.ndim < 2 or not isinstance(x, relax.Var)):
            continue  # (a vector times a matrix stays float: qdense takes rows)
        n = w_kn.shape[1]
        root, bias, how = bias_after(var, n, ((n,),))
        sites.append(QuantSite(f"dense{len(sites) - convs}", root, x, w_kn, bias,
                               how == "opsdk.bias_gelu"))
    return sites


def _conv_site(val: Any, var: Any, wc: np.ndarray | None, bias_after: Callable,
               name: str) -> QuantSite | None:
    """A conv2d binding qconv2d can compute (weight ``wc``), as a site; None for any other."""

    x = val.args[0]
    a = val.attrs
    layout = str(a.data_layout)
    ints = [[int(v) for v in vals] for vals in (a.strides, a.padding, a.dilation)]
    (sh, sw), pad, dil = ints
    ty = x.ty
    if (wc is None or wc.ndim != 4 or str(wc.dtype) != "float32" or not isinstance(x, relax.Var)
            or not isinstance(ty, relax.TensorType) or str(ty.dtype) != "float32"
            or (layout, str(a.kernel_layout)) not in (("NCHW", "OIHW"), ("NHWC", "HWIO"))
            or str(a.out_layout) != layout or sh != sw or len(set(pad)) != 1
            or dil != [1, 1]):
        return None
    if layout == "NHWC":  # ChannelsLast's HWIO: qconv2d takes OIHW in both layouts
        wc = np.ascontiguousarray(wc.transpose(3, 2, 0, 1))
    o, c_in = wc.shape[0], wc.shape[1] * int(a.groups)
    depthwise = int(a.groups) > 1
    if depthwise and not (int(a.groups) == c_in == o and wc.shape[1] == 1):
        return None  # grouped (neither dense nor depthwise): stays float
    shapes = ((1, o, 1, 1), (o, 1, 1)) if layout == "NCHW" else ((o,), (1, 1, 1, o))
    root, bias, _ = bias_after(var, o, shapes)
    return QuantSite(name, root, x, wc, bias, False,
                     conv={"stride": sh, "padding": pad[0], "layout": layout,
                           "depthwise": depthwise})


def _probe_module(mod: Any, sites: Sequence[QuantSite]) -> Any:
    """``mod`` whose ``main`` returns the inputs of every site (calibration)."""

    # ToNonDataflow keeps every block and binding in place (dataflow vars become plain
    # vars): find each site input at its position.
    where = {}
    for i, block in enumerate(mod["main"].body.blocks):
        for j, b in enumerate(block.bindings):
            where[b.var] = (i, j)
    plain = relax.transform.ToNonDataflow()(mod)
    func = plain["main"]
    outs = []
    for s in sites:
        if s.x in where:
            i, j = where[s.x]
            outs.append(func.body.blocks[i].bindings[j].var)
        else:
            pos = [k for k, p in enumerate(mod["main"].params) if p.same_as(s.x)]
            if not pos:
                raise ValueError(f"quantize_model: cannot find the input of {s.name}")
            outs.append(func.params[pos[0]])
    body = relax.SeqExpr(func.body.blocks, relax.Tuple(outs))
    ret = relax.TupleType([v.ty for v in outs])
    new = relax.Function(func.params, body, ret, func.is_pure, func.attrs)
    out = tvm.IRModule({"main": new})
    for gv, f in plain.functions_items():
        if gv.name_hint != "main":
            out[gv] = f
    return relax.transform.Normalize()(out)


def _collect(mod: Any, sites: Sequence[QuantSite], batches: Iterable[Sequence[np.ndarray]],
             cfg: QuantConfig, progress: Callable[[int], Any] | None) -> None:
    from ..model import compile_model  # heavy: TVM

    ex = compile_model(_probe_module(mod, sites), "host").ex  # through the compile cache
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    for s in sites:
        s.stats = {"lo": np.inf, "hi": -np.inf, "sample": [], "inputs": []}
    n = 0
    params = list(mod["main"].params)
    for batch in batches:
        arrays = [batch] if isinstance(batch, np.ndarray) else list(batch)
        _check_batch(arrays, params, n)
        outs = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays])
        for s, o in zip(sites, outs):
            a = o.numpy()
            if not np.isfinite(a).all():
                raise ValueError(
                    f"quantize_model: calibration batch {n}: the input of layer {s.name} has "
                    "NaN or infinite values (the float model computes them from this batch); "
                    "calibrate on finite data that the float model handles")
            st = s.stats
            st["lo"], st["hi"] = min(st["lo"], float(a.min())), max(st["hi"], float(a.max()))
            flat = a.ravel()
            # A bounded sample: up to 1/16 of the budget per batch, thinned uniformly when
            # it reaches twice the budget (later batches weigh a little more; min and max
            # stay exact).
            per_batch = max(1, cfg.samples_per_site // 16)
            take = flat if flat.size <= per_batch else rng.choice(flat, per_batch,
                                                                  replace=False)
            st["sample"].append(take.astype(np.float32))
            if sum(x.size for x in st["sample"]) > 2 * cfg.samples_per_site:
                st["sample"] = [rng.choice(np.concatenate(st["sample"]),
                                           cfg.samples_per_site, replace=False)]
            if len(st["inputs"]) < 4:  # a few whole inputs for the sensitivity report
                st["inputs"].append(a.copy() if s.conv else a.reshape(-1, a.shape[-1]).copy())
        n += 1
        if progress:
            progress(n)
    if n == 0:
        raise ValueError("quantize_model: the calibration data is empty")


def _check_batch(arrays: Sequence[Any], params: Sequence[Any], n: int) -> None:
    """One calibration batch against the model's inputs: count, dtype, static dims, finite."""
    where = f"quantize_model: calibration batch {n}"
    if len(arrays) != len(params):
        raise ValueError(f"{where} has {len(arrays)} array(s); the model takes "
                         f"{len(params)} input(s) ({', '.join(p.name for p in params)})")
    for a, p in zip(arrays, params):
        a = np.asarray(a)
        ty = p.ty
        want = [int(d) if hasattr(d, "value") else None for d in ty.shape.values]
        if str(a.dtype) != str(ty.dtype):
            raise ValueError(f"{where}, input {p.name!r}: dtype {a.dtype}; the model takes "
                             f"{ty.dtype}")
        if a.ndim != len(want) or any(w is not None and w != d for w, d in zip(want, a.shape)):
            shown = tuple("?" if w is None else w for w in want)
            raise ValueError(f"{where}, input {p.name!r}: shape {a.shape}; the model takes "
                             f"{shown} ('?' any size)")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ValueError(f"{where}, input {p.name!r} has NaN or infinite values; "
                             "calibrate on finite data")


def _act_params(s: QuantSite, cfg: QuantConfig) -> QParams:
    symmetric = cfg.activations == "symmetric"
    if cfg.method == "minmax":  # the exact extremes of every value seen
        return choose_qparams(s.stats["lo"], s.stats["hi"], symmetric=symmetric)
    return calibrate(s.stats["sample"], method=cfg.method, symmetric=symmetric,
                     percentile=cfg.percentile)


@dataclass
class QuantizedModel:
    """What :func:`quantize_model` returns: the rewritten module and what it decided."""

    mod: Any
    sites: list[QuantSite]
    config: QuantConfig

    @property
    def quantized(self) -> list[str]:
        """Names of the sites that became int8."""
        return [s.name for s in self.sites if s.name not in self.config.keep_float]

    def sensitivity(self) -> list[dict[str, Any]]:
        """:func:`sensitivity` of this model's sites."""
        return sensitivity(self.sites, self.config)


def agreement(got: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """Relative RMSE, cosine and max abs of ``got`` against ``ref`` (a float layer or model),
    and for a 2-d output (a classifier-like head) the share of rows with the same arg-max.

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk.quant import agreement
    >>> a = agreement(np.array([[1.0, 2.1]]), np.array([[1.0, 2.0]]))
    >>> round(a["max_abs"], 3), a["top1_agreement"]
    (0.1, 1.0)
    """
    g, r = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    e = g - r
    out = {"rel_rmse": float(np.sqrt(np.mean(e**2)) / (np.sqrt(np.mean(r**2)) or 1.0)),
           "cosine": float(g @ r / ((np.linalg.norm(g) * np.linalg.norm(r)) or 1.0)),
           "max_abs": float(np.abs(e).max(initial=0.0))}
    if ref.ndim == 2 and ref.shape[1] > 1:
        out["top1_agreement"] = float(np.mean(got.argmax(1) == ref.argmax(1)))
    return out


@dataclass
class WeightOnlyQuant:
    """One dense layer's weight-only quantization: the op (``dense_w8`` / ``dense_q4``), its
    constant inputs and attributes, and its float64 reference (bit-exact with the kernels up
    to the float32 sums)."""

    op: Any
    consts: tuple[np.ndarray, ...]
    bias: np.ndarray | None
    attrs: dict[str, Any]

    def run(self, x: np.ndarray, *, activation: bool = False) -> np.ndarray:
        """The layer on ``x`` (float64 reference of the op): ``x @ W + b``, and its GELU
        too with ``activation`` (the sensitivity report compares the product, as for int8)."""
        names = [p.name for p in self.op.tensor_params]
        ins = dict(zip(names, (x.reshape(-1, x.shape[-1]), *self.consts)))
        if self.bias is not None:
            ins["bias"] = self.bias.astype(np.float32)
        attrs = self.attrs if activation else {**self.attrs, "activation": "none"}
        return np.asarray(self.op.run_reference(ins, attrs))


def _weight_only(s: QuantSite, cfg: QuantConfig) -> WeightOnlyQuant:
    from ..ops.dense_q4 import dense_q4, quantize_q4_0  # heavy: TVM
    from ..ops.dense_w8 import dense_w8, quantize_w8  # heavy: TVM

    w = s.w_kn.T.astype(np.float32)  # (N, K)
    attrs = {"activation": "gelu" if s.gelu else "none",
             "activations": cfg.weight_only_activations}
    if cfg.scheme == "w8":
        return WeightOnlyQuant(dense_w8, quantize_w8(w), s.bias, attrs)
    return WeightOnlyQuant(dense_q4, quantize_q4_0(w), s.bias, attrs)


def _site_quant(s: QuantSite, cfg: QuantConfig) -> Any:
    if cfg.weight_only:
        return _weight_only(s, cfg)
    per_channel = cfg.weights == "per_channel"
    if s.conv:
        return quantize_conv2d(s.w_kn, s.bias, s.act, per_channel=per_channel, **s.conv)
    return quantize_dense(s.w_kn.T, s.bias, s.act, per_channel=per_channel)


def sensitivity(sites: Sequence[QuantSite], config: QuantConfig | None = None
                ) -> list[dict[str, Any]]:
    """Each calibrated site's own error: its int8 output (the ``qdense`` / ``qconv2d``
    reference, bit-exact with the kernels) on its float calibration inputs against the
    float64 layer (``x @ W + b``, ``conv(x, W) + b``), sorted worst first by relative RMSE.

    Returns rows ``{"site", "shape", "max_abs", "rel_rmse", "cosine", "x_range"}``.
    """
    cfg = config or QuantConfig()
    rows = []
    for s in sites:
        if s.act is None or not s.stats.get("inputs"):
            continue
        q = _site_quant(s, cfg)
        refs, gots = [], []
        for x in s.stats["inputs"]:
            if s.conv:
                ref = q.float_layer(x)
            else:
                ref = x.astype(np.float64) @ s.w_kn.astype(np.float64)
                if s.bias is not None:
                    ref = ref + s.bias
            gots.append(q.run(x.astype(np.float32)).ravel())
            refs.append(ref.ravel())
        a = agreement(np.concatenate(gots), np.concatenate(refs))
        rows.append({"site": s.name, "shape": list(s.shape), "max_abs": a["max_abs"],
                     "rel_rmse": a["rel_rmse"], "cosine": a["cosine"],
                     "x_range": [s.stats["lo"], s.stats["hi"]]})
    rows.sort(key=lambda r: -r["rel_rmse"])
    return rows


def _rewrite(mod: Any, sites: Sequence[QuantSite], cfg: QuantConfig) -> Any:
    from .. import relax as ops  # heavy: TVM

    todo = {s.root: s for s in sites if s.name not in cfg.keep_float}
    chains = {} if cfg.weight_only else _chains(mod, sites, cfg)
    # producer site name -> the consumer's input parameters it requantizes to
    by_name = {s.name: s for s in sites}
    to_int8 = {p.name: by_name[t].act for t, (p, _) in chains.items()}
    clamps = {v for _, between in chains.values() for v in between}
    bindings, _, _ = _graph(mod["main"])
    # A chained consumer's input is int8 now: the float ops between it and the consumer's
    # root (a matmul before its bias add) are dead, and must not be emitted on int8.
    dead = {by_name[t].x for t in chains}

    @relax.expr_functor.mutator
    class _Quantize(relax.PyExprMutator):
        def visit_var_binding_(self, binding: Any) -> None:
            if binding.var in clamps:  # folded into the producer's saturation
                step = _clamp_step(bindings[binding.var], bindings)
                self.set_var_remap(binding.var, self.visit_expr(step[0]))
                return
            if binding.var not in todo and any(
                    v in dead for v in relax.analysis.free_vars(binding.value)):
                dead.add(binding.var)
                return
            s = todo.get(binding.var)
            if s is None:
                super().visit_var_binding_(binding)
                return
            x = self.visit_expr(s.x)
            q = _site_quant(s, cfg)
            act = s.act
            if s.conv:
                xq = x if s.name in chains else self.builder_.emit(ops.quantize(
                    x, relax.const(np.array([act.scale], "float32")),
                    relax.const(np.array([act.zero_point], "int32")), out_dtype=act.dtype))
                out = to_int8.get(s.name)
                attrs = q.qconv2d_attrs("int8", out) if out is not None else q.qconv2d_attrs()
                new = self.builder_.emit(ops.qconv2d(
                    xq, relax.const(q.w_q), relax.const(q.w_scale), relax.const(q.bias_q),
                    **attrs))
                self.set_var_remap(binding.var, new)
                return
            shape = list(x.ty.shape.values)
            k, n = s.shape
            m = shape[0]
            for d in shape[1:-1]:
                m = m * d
            x2 = self.builder_.emit(relax.op.reshape(x, [m, tirx.IntImm("int64", k)]))
            if cfg.weight_only:  # one kernel: dequantize, multiply, bias, GELU
                bias = None if q.bias is None else relax.const(q.bias.astype(np.float32))
                y2 = self.builder_.emit(getattr(ops, q.op.name)(
                    x2, *(relax.const(c) for c in q.consts), bias, **q.attrs))
                new = self.builder_.emit(
                    relax.op.reshape(y2, [*shape[:-1], tirx.IntImm("int64", n)]))
                self.set_var_remap(binding.var, new)
                return
            xq = x2 if s.name in chains else self.builder_.emit(ops.quantize(
                x2, relax.const(np.array([act.scale], "float32")),
                relax.const(np.array([act.zero_point], "int32")), out_dtype=act.dtype))
            out = to_int8.get(s.name)
            attrs = q.qdense_attrs("int8", out) if out is not None else q.qdense_attrs()
            y2 = self.builder_.emit(ops.qdense(
                xq, relax.const(q.w_q), relax.const(q.w_scale), relax.const(q.bias_q),
                **attrs))
            y = relax.op.reshape(y2, [*shape[:-1], tirx.IntImm("int64", n)])
            if s.gelu:
                y = ops.gelu(self.builder_.emit(y))
            new = self.builder_.emit(y)
            self.set_var_remap(binding.var, new)

    func = _Quantize().visit_expr(mod["main"])
    out = mod.copy() if hasattr(mod, "copy") else tvm.IRModule(mod.functions)
    out["main"] = func
    return relax.transform.DeadCodeElimination()(out)


def quantize_model(
    mod: Any,
    calibration: Iterable[Any],
    config: QuantConfig | None = None,
    *,
    mixed_precision: int | float | None = None,
    progress: Callable[[int], Any] | None = None,
) -> QuantizedModel:
    """Quantize the dense and conv2d layers of an imported model to int8 after calibrating.

    Parameters
    ----------
    mod
        A Relax module from :mod:`opsdk.frontend` (after ``FuseIntoOps``).
    calibration
        An iterable of inputs for ``main`` (each an array, or a sequence of arrays for a
        model with several inputs), streamed through the float model once.
    config
        :class:`QuantConfig` (per-channel weights, asymmetric min/max activations by
        default).
    mixed_precision
        Keep the worst sites of the sensitivity report in float: an int keeps that many, a
        float keeps every site whose relative RMSE exceeds it.
    progress
        Called with the number of calibration batches done.

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import relax
    >>> from opsdk.quant import quantize_model
    >>> rng = np.random.default_rng(0)
    >>> x = relax.Var("x", relax.TensorType((16, 32), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         w = relax.const(rng.standard_normal((32, 24)).astype("float32"))
    ...         y = bb.emit_output(relax.op.matmul(x, w))
    ...     _ = bb.emit_func_output(y)
    >>> data = [rng.standard_normal((16, 32)).astype("float32") for _ in range(4)]
    >>> qm = quantize_model(bb.get(), data)
    >>> qm.quantized, qm.sensitivity()[0]["rel_rmse"] < 0.02
    (['dense0'], True)
    """
    from ..transform import ChannelsLast  # heavy: TVM

    cfg = config or QuantConfig()
    # Convs in NHWC inside, as opsdk.compile runs the float model (their int8 kernels and
    # what follows them read channels contiguously); a model without convs is unchanged.
    mod = ChannelsLast()(mod)
    sites = find_sites(mod)
    if cfg.weight_only:  # dense layers only; q4_0 needs whole 32-weight groups
        sites = [s for s in sites if not s.conv and (cfg.scheme == "w8" or s.shape[0] % 32 == 0)
                 and (cfg.weight_only_activations == "float32" or s.shape[0] % 32 == 0)]
    if not sites:
        what = ("dense (matmul) layer with a constant float32 weight" + (
            " and K a multiple of 32" if cfg.scheme == "w4"
            or cfg.weight_only_activations == "q8_0" else "")) if cfg.weight_only else \
            "dense (matmul) or conv2d layer with a constant float32 weight"
        raise ValueError(f"quantize_model: the model has no {what}: nothing to quantize")
    _collect(mod, sites, calibration, cfg, progress)
    for s in sites:
        s.act = _act_params(s, cfg)
    if mixed_precision is not None:
        rows = sensitivity(sites, cfg)
        if isinstance(mixed_precision, bool) or mixed_precision < 0:
            raise ValueError("mixed_precision: a count >= 0 or a relative-RMSE threshold")
        if isinstance(mixed_precision, int):
            keep = [r["site"] for r in rows[:mixed_precision]]
        else:
            keep = [r["site"] for r in rows if r["rel_rmse"] > mixed_precision]
        cfg = QuantConfig(**{**cfg.__dict__, "keep_float": tuple(cfg.keep_float) + tuple(keep)})
    unknown = set(cfg.keep_float) - {s.name for s in sites}
    if unknown:
        raise ValueError(f"keep_float names no site: {sorted(unknown)}; the sites are "
                         f"{', '.join(s.name for s in sites)}")
    return QuantizedModel(_rewrite(mod, sites, cfg), sites, cfg)
