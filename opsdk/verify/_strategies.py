"""Test cases derived from an op's definition: shapes, attributes, optional inputs, data recipes.

A :class:`Case` is plain data (JSON round-trips), and the input arrays are a pure function
of it (:func:`make_inputs`): the seed and the recipe names regenerate the data exactly, so a
one-line ``--case '<json>'`` re-runs a failure bit for bit.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import reject
from hypothesis import strategies as st
from tvm import tirx

from .._domains import Bounded, LogUniform
from .._dtypes import is_float, np_dtype
from .._opdef import OpDef, Param
from ._case import Case, _present_shapes, cell_dtypes, input_dtypes, is_valid, layout_attrs
from ._kcorners import kernel_corners

__all__ = [
    "AUX_RECIPES",
    "GRID_RECIPES",
    "INT_AUX_RECIPES",
    "RECIPES",
    "Case",
    "case_strategy",
    "cell_dtypes",
    "corner_cases",
    "input_dtypes",
    "make_inputs",
    "static_axes",
]

#: Data recipes for the primary input. ``domain`` (uniform over the op's domain hint) is the
#: ordinary case; the others are the inputs that break naive kernels.
RECIPES: tuple[str, ...] = (
    "domain",  # uniform over d.domain (ordinary data)
    "normal",  # bell-shaped over d.domain
    "tiny",  # |x| ~ 1e-3: variance far below epsilon, epsilon placement matters
    "large",  # |x| up to 1e3: exp overflows without max subtraction
    "offset",  # 1e3 + small spread: one-pass variance E[x^2]-E[x]^2 cancels
    "constant",  # every element equal: zero variance
    "rowconst",  # constant along the last axis (zero-variance rows)
    "mixed",  # mixed signs over five decades
)
#: Recipes for the other tensor inputs (gamma, beta, bias, ...).
AUX_RECIPES: tuple[str, ...] = ("domain", "ones", "mixed")
#: Recipes for the other integer inputs (zero points, shifts, weights): also ``edges``,
#: every element one of the domain's ends or an end of the int8 / uint8 range inside it.
INT_AUX_RECIPES: tuple[str, ...] = (*AUX_RECIPES, "edges")

#: Data for ops that declare their semantics outside ordinary data (``special_values=True``):
#: ``special``: the first row ordinary, then in turn rows with huge finite values (+-1e37:
#: their sum is finite, their squares overflow float32), one +-inf, one NaN, and a mix of
#: these, +-3e38 and -0.
SPECIAL_RECIPES: tuple[str, ...] = ("special",)
_SPECIALS = (np.inf, -np.inf, np.nan, 3e38, -3e38, 1e37, -1e37, -0.0)

#: Exact grid points, used together by a corner case of ops with a scale-like input (a
#: float input with a log-uniform domain, e.g. quantize's ``scale``): ``halfgrid`` puts the
#: primary input on odd multiples of 1/16 and ``pow2`` the scale at 1/8 (or the power of two
#: nearest it inside the domain), so ``x / scale`` lands exactly on ``k + 1/2``: a kernel
#: rounding ties another way than the reference (half away from zero, half up) fails.
#: ``midgrid`` does it for any scale: the scale inputs get one common value that is not a
#: power of two (``midscale``) and the primary input ``x = fl((k + 1/2) * s)``, so the
#: quotient ``x / s`` rounds to ``k + 1/2`` in float32 for most ``k`` while ``x * fl(1/s)``
#: often lands an ulp beside it: a kernel multiplying by a rounded reciprocal fails.
GRID_RECIPES: tuple[str, ...] = ("halfgrid", "pow2", "midgrid", "midscale")
#: The scale recipe that goes with each grid recipe of the primary input.
_GRID_SCALE = {"halfgrid": "pow2", "midgrid": "midscale"}

#: Integer values worth hitting exactly: the ends of the int8 and uint8 ranges.
_INT_EDGES = (-128, 0, 127, 255)
#: Recipes that draw from the domain: with a log-uniform domain they work in log space.
_DOMAIN_RECIPES = ("domain", "normal", "constant", "rowconst")

_DEFAULT_DOMAIN = (-2.0, 2.0)


# ---------------------------------------------------------------------------------------------
# Data


def free_defaults(d: OpDef, shape: Sequence[Any] | None = None,
                  attrs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Sizes the op's free named dims take when a case does not set them: their declared
    defaults for a first input of ``shape`` with ``attrs`` (attention's key/value heads: the
    query heads), else (no shape, or one the defaults do not fit) 8 within each range."""
    ranges = getattr(d, "free_dims", {})
    plain = {k: min(hi, max(lo, 8)) for k, (lo, hi) in ranges.items()}
    if shape is None or not getattr(d, "free_dim_defaults", None):
        return plain
    try:
        nattrs = d.normalize_attrs(d.bind_attrs(attrs or {}), len(shape))
        return d.free_defaults(tuple(shape), nattrs)
    except (ValueError, IndexError, TypeError):
        return plain


def _ulp(dtype: str, value: float) -> float:
    if not is_float(dtype):
        return 1.0
    info = ml_dtypes.finfo(np_dtype(dtype))
    e = np.floor(np.log2(max(abs(value), float(info.tiny))))
    return float(2.0**e * float(info.eps))


def _raw(recipe: str, shape: tuple[int, ...], lo: float, hi: float, dtype: str,
         rng: np.random.Generator, log: bool = False) -> np.ndarray:
    if log and recipe in _DOMAIN_RECIPES:
        # The same recipe over [log lo, log hi]: evenly spread over the decades, positive.
        a = _raw(recipe, shape, math.log(lo), math.log(hi), dtype, rng)
        return np.clip(np.exp(a), lo, hi)
    if recipe == "domain":
        return rng.uniform(lo, hi, shape)
    if recipe == "normal":
        return np.clip(rng.normal((lo + hi) / 2, (hi - lo) / 6, shape), lo, hi)
    if recipe == "tiny":
        return rng.uniform(-1e-3, 1e-3, shape)
    if recipe == "large":
        return rng.uniform(-1e3, 1e3, shape)
    if recipe == "offset":
        # Small spread, but at least 16 ulps of the dtype at 1e3 so it survives rounding.
        spread = max(0.1, 16 * _ulp(dtype, 1e3))
        return 1e3 + rng.uniform(-spread, spread, shape)
    if recipe == "constant":
        return np.full(shape, rng.uniform(lo, hi))
    if recipe == "rowconst":
        if not shape:
            return np.full(shape, rng.uniform(lo, hi))
        return np.broadcast_to(rng.uniform(lo, hi, (*shape[:-1], 1)), shape).copy()
    if recipe == "mixed":
        sign = rng.choice([-1.0, 1.0], shape)
        return sign * 10.0 ** rng.uniform(-3, 2, shape)
    if recipe == "ones":
        return np.ones(shape)
    if recipe == "zeros":
        return np.zeros(shape)
    if recipe == "halfgrid":
        k = np.arange(math.ceil((16 * lo - 1) / 2), math.floor((16 * hi - 1) / 2) + 1)
        if not k.size:
            return rng.uniform(lo, hi, shape)
        return (2 * rng.choice(k, shape) + 1) / 16.0
    if recipe == "pow2":
        v = 2.0 ** round(math.log2(min(max(0.125, lo), hi))) if hi > 0 else 0.125
        v = v * 2 if v < lo else v
        return np.full(shape, v / 2 if v > hi else v)
    if recipe == "special":
        a = rng.uniform(lo, hi, shape)
        if a.ndim:
            flat = a.reshape(-1, shape[-1]) if a.ndim > 1 else a.reshape(1, -1)
            for i, row in enumerate(flat):
                # row 0 ordinary; then rows of huge finite values only (their squares
                # overflow float32), one +-inf, one NaN, and a mix of everything
                kind = 3 if flat.shape[0] == 1 else (i - 1) % 4 if i else -1
                if kind == 0:  # +-1e37: their sum stays finite, their squares overflow
                    hit = rng.random(row.shape) < 0.25
                    hit[rng.integers(row.size)] = True
                    row[hit] = rng.choice(np.asarray(_SPECIALS[5:7]), int(hit.sum()))
                elif kind in (1, 2):
                    row[rng.integers(row.size)] = (rng.choice([np.inf, -np.inf]) if kind == 1
                                                   else np.nan)
                elif kind == 3:
                    hit = rng.random(row.shape) < 0.25
                    row[hit] = rng.choice(np.asarray(_SPECIALS), int(hit.sum()))
            a = flat.reshape(shape)
        return a
    if recipe in ("midgrid", "midscale"):  # set jointly by make_inputs (_on_midpoints)
        return np.zeros(shape)
    if recipe == "edges":
        ends = sorted({lo, hi, *(v for v in _INT_EDGES if lo <= v <= hi)})
        return rng.choice(np.asarray(ends, dtype=np.float64), shape)
    known = RECIPES + INT_AUX_RECIPES + GRID_RECIPES + SPECIAL_RECIPES
    raise ValueError(f"unknown data recipe {recipe!r}; known: {known}")


def _input_range(d: OpDef, name: str, dtype: str) -> tuple[float, float, bool]:
    """(lo, hi, log) of the data drawn for input ``name``: its domain hint (log-uniform or
    not), for an integer input cut to the range of its dtype (a domain (-128, 255) means the
    whole 8-bit range for both int8 and uint8)."""
    dom = d.domain.get(name, _DEFAULT_DOMAIN)
    lo, hi = (float(v) for v in dom)
    if not is_float(dtype):
        info = np.iinfo(np_dtype(dtype))
        clo, chi = max(lo, float(info.min)), min(hi, float(info.max))
        if clo <= chi:
            lo, hi = clo, chi
    return lo, hi, isinstance(dom, LogUniform)


def make_inputs(d: OpDef, case: Case) -> dict[str, np.ndarray]:
    """The input arrays of ``case`` (present inputs only), rounded to the case's dtype.

    Each input gets its own generator seeded with ``(case.seed, position)``, so the data of
    one input does not depend on the recipes of the others. Values respect the sign of the
    op's domain hint (a domain in ``[0, inf)`` gets non-negative data from every recipe); a
    :func:`~opsdk.log_uniform` domain draws the domain-based recipes in log space. Integer
    inputs stay inside their domain cut to their dtype's range, and are rounded.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify import Case
    >>> from opsdk.verify._strategies import make_inputs
    >>> c = Case("gelu", "x86", "float16", "erf", (2, 5), {"approximate": "none"}, (),
    ...          {"x": "offset"}, 3)
    >>> x = make_inputs(opsdk.get_op("gelu"), c)["x"]
    >>> x.dtype, x.shape, bool((abs(x - 1000) < 20).all())
    (dtype('float16'), (2, 5), True)
    """
    shapes = d.example_shapes(case.shape, case.attrs, free=case.free)
    dtypes = input_dtypes(d, case.dtype, [p.name for p in d.tensor_params])
    out: dict[str, np.ndarray] = {}
    for i, p in enumerate(d.tensor_params):
        if p.optional and p.name not in case.present:
            continue
        rng = np.random.default_rng([case.seed, i])
        shape = tuple(int(s) for s in shapes[p.name])
        dt = dtypes[p.name]
        lo, hi, log = _input_range(d, p.name, dt)
        a = _raw(case.data.get(p.name, "domain"), shape, lo, hi, dt, rng, log)
        if lo >= 0:
            a = np.abs(a)
        elif hi <= 0:
            a = -np.abs(a)
        if isinstance(d.domain.get(p.name), Bounded):
            a = np.clip(a, lo, hi)  # the author's hard range: no recipe leaves it
        if not is_float(dt):
            # Integer inputs (zero points, shifts, accumulators) have meaning only inside
            # their domain: every recipe is kept within it, then rounded.
            info = np.iinfo(np_dtype(dt))
            a = np.clip(np.rint(np.clip(a, lo, hi)), info.min, info.max)
        with np.errstate(over="ignore"):  # huge (special) values become +-inf in float16, as meant
            out[p.name] = np.ascontiguousarray(a.astype(np_dtype(dt)))
    if case.data.get(d.primary) == "midgrid":
        _on_midpoints(d, case, out, dtypes)
    return out


def _scale_inputs(d: OpDef, dtype: str, names: Sequence[str]) -> set[str]:
    """The scale-like inputs: float, with a log-uniform domain (e.g. quantize's ``scale``)."""
    return {n for n, dt in input_dtypes(d, dtype, list(names)).items()
            if is_float(dt) and isinstance(d.domain.get(n), LogUniform)}


def _on_midpoints(d: OpDef, case: Case, out: dict[str, np.ndarray],
                  dtypes: Mapping[str, str]) -> None:
    """The ``midgrid`` recipe: one non-power-of-two scale ``s`` for every scale input and
    ``x = fl((k + 1/2) s)`` with ``x`` inside its domain and ``|k|`` over the int8 range."""
    rng = np.random.default_rng([case.seed, 1 << 16])
    x = d.primary
    lo, hi, _ = _input_range(d, x, dtypes[x])
    reach = max(abs(lo), abs(hi))
    scales = sorted(n for n in _scale_inputs(d, case.dtype, list(out)) if n != x)
    if not scales:
        return
    slo, shi, _ = _input_range(d, scales[0], dtypes[scales[0]])
    top = max(slo, min(shi, reach / 64))  # at least ~64 grid points inside x's domain
    s = float(np.float32(10 ** rng.uniform(math.log10(slo), math.log10(top))))
    if math.log2(s).is_integer():
        s = float(np.float32(s * 1.375))
    for n in scales:
        out[n] = np.full(out[n].shape, s, dtype=out[n].dtype)
    kmin = max(math.ceil(lo / s - 0.5), -200)
    kmax = min(math.floor(hi / s - 0.5), 200)
    if kmin > kmax:
        return
    k = rng.integers(kmin, kmax + 1, out[x].shape)
    out[x] = np.ascontiguousarray(((k + 0.5) * s).astype(out[x].dtype))


# ---------------------------------------------------------------------------------------------
# Shapes and attributes


def round_dims(d: OpDef, shape: Sequence[int],
               attrs: Mapping[str, Any] | None = None) -> list[int]:
    """``shape`` with each axis the op declares ``dim_multiples`` for rounded up to its
    multiple (a drawn K of 17 is 32 for ``dense_q4``); a multiple that is a function of the
    attributes is applied only where ``attrs`` are given."""
    out = list(shape)
    for axis, m in getattr(d, "dim_multiples", {}).items():
        if callable(m):
            if attrs is None:
                continue
            m = int(m(attrs))
        if -len(out) <= axis < len(out):
            out[axis] = max(m, -(-int(out[axis]) // m) * m)
    return out


def _freeze(attrs: Mapping[str, Any]) -> tuple:
    return tuple(sorted(attrs.items()))


_STATIC_CACHE: dict[tuple, tuple[int, ...]] = {}


def _static_axes_cached(d: OpDef, rank: int, dtype: str, fattrs: tuple, present: tuple,
                        probe: tuple) -> tuple[int, ...]:
    key = (d.name, id(d), rank, dtype, fattrs, present)
    if key not in _STATIC_CACHE:
        _STATIC_CACHE[key] = _find_static_axes(d, rank, dtype, dict(fattrs), present, probe)
    return _STATIC_CACHE[key]


def _find_static_axes(d: OpDef, rank: int, dtype: str, attrs: dict, present: tuple,
                      probe: tuple) -> tuple[int, ...]:
    sym = [tirx.Var(f"d{i}", "int64") for i in range(rank)]

    def ok(static: Sequence[int]) -> bool:
        shape = [probe[i] if i in static else sym[i] for i in range(rank)]
        try:
            shapes = _present_shapes(d, shape, attrs, present)
            d.validate(shapes, input_dtypes(d, dtype, list(shapes)), attrs)
        except ValueError:
            return False
        return True

    if ok(()):
        return ()
    for i in range(rank):
        if ok((i,)):
            return (i,)
    for i in range(rank):
        for j in range(i + 1, rank):
            if ok((i, j)):
                return (i, j)
    return tuple(range(rank))


def static_axes(d: OpDef, shape: Sequence[int], dtype: str, attrs: Mapping[str, Any],
                present: Sequence[str]) -> tuple[int, ...]:
    """Axes of the primary input that must stay static in the symbolic build.

    Found by asking ``d.validate`` which dims it refuses to see symbolic (e.g. group_norm's
    channel count); every other dim becomes a ``tirx.Var``.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify._strategies import static_axes
    >>> gn = opsdk.get_op("group_norm")
    >>> static_axes(gn, (2, 3, 5, 8), "float32", {"num_groups": 2, "layout": "NHWC"}, ())
    (3,)
    """
    return _static_axes_cached(d, len(shape), dtype, _freeze(attrs), tuple(present),
                               tuple(int(s) for s in shape))


def weight_axes(d: OpDef, shape: Sequence[Any], attrs: Mapping[str, Any],
                present: Sequence[str]) -> tuple[int, ...]:
    """Axes of the primary input that the shapes of the op's weights (``d.weights``) use:
    static in a packed build, as a model's weights are (a matmul's K, a batched weight's
    batch dims, the rows of a ``take_q4`` table)."""
    free = free_defaults(d, shape, attrs)
    out = []
    for i in range(len(shape)):  # one axis symbolic at a time: an op may refuse several
        v = tirx.Var(f"d{i}", "int64")
        try:
            shapes = _present_shapes(d, [*shape[:i], v, *shape[i + 1:]], attrs, present, free)
        except ValueError:
            continue  # it must be static anyway (static_axes)
        if any(v.same_as(u) for w in d.weights if w in shapes for e in shapes[w]
               if not isinstance(e, int)
               for u in tirx.analysis.undefined_vars(tirx.const(0, "int64") + e)):
            out.append(i)
    return tuple(out)


@dataclass(frozen=True)
class LogAttr:
    """A float attribute drawn log-uniformly from ``dom``; ``first`` is its common value
    (the default when inside the range, else ``dom.typical``) and the shrink target."""

    dom: LogUniform
    first: float

    def strategy(self) -> st.SearchStrategy[float]:
        """Log-uniform over ``[lo, hi]``: hypothesis draws an offset ``t`` from ``first`` in
        units of the whole log range, so ``t = 0`` (where it shrinks to) gives ``first``
        exactly, the ends of ``t``'s range give ``lo`` and ``hi`` exactly, and a uniform ``t``
        is a log-uniform value."""
        lo, hi = math.log(self.dom.lo), math.log(self.dom.hi)
        a = min(max((math.log(self.first) - lo) / (hi - lo), 0.0), 1.0)

        def value(t: float) -> float:
            if t == 0:
                return self.first
            if t <= -a:
                return float(self.dom.lo)
            if t >= 1.0 - a:
                return float(self.dom.hi)
            return self.dom.at(a + t)

        return st.floats(-a, 1.0 - a).map(value)


def _attr_choices(d: OpDef, layout: str, rank: int) -> dict[str, list[Any] | LogAttr]:
    """Values each free attribute is drawn from, the common one first (a list), or a
    :class:`LogAttr` for a log-uniform float attribute."""
    fixed = d.layouts[layout]
    out: dict[str, list[Any] | LogAttr] = {}
    for p in d.attr_params:
        if p.name in fixed:
            continue
        dom = d.attr_domain.get(p.name)
        if isinstance(dom, LogUniform):
            out[p.name] = LogAttr(dom, _log_first(p, dom))
            continue
        if isinstance(dom, (list, tuple)) and dom:
            vals = list(dom)
        elif dom is not None:
            vals = [dom]
        elif p.choices is not None:
            vals = list(p.choices)
        elif p.is_axis:
            vals = list(range(-1, -rank - 1, -1))
        else:
            continue  # keep the default
        # The default first: hypothesis shrinks towards it.
        if not p.required and p.default in vals:
            vals.remove(p.default)
            vals.insert(0, p.default)
        out[p.name] = vals
    return out


def _log_first(p: Param, dom: LogUniform) -> float:
    if not p.required and p.default in dom:
        return float(p.default)
    return dom.typical


def _first(vals: list[Any] | LogAttr) -> Any:
    return vals.first if isinstance(vals, LogAttr) else vals[0]


def _attr_strategy(vals: list[Any] | LogAttr) -> st.SearchStrategy[Any]:
    return vals.strategy() if isinstance(vals, LogAttr) else st.sampled_from(vals)


def _largest_first(vals: list[Any] | LogAttr) -> list[Any] | None:
    """Numeric values, largest first (None when the values are not numbers)."""
    if isinstance(vals, LogAttr):
        return [float(vals.dom.hi)]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return sorted(vals, reverse=True)
    return None


def _lengths(lanes: int) -> list[int]:
    """Axis lengths, simplest first: size-1, small, around the vector width (tails!), multiples."""
    vals = [1, 2, 3, 5, lanes + 1, lanes - 1, 2 * lanes + 3, 7, lanes, 2 * lanes, 4, 3 * lanes - 5]
    seen: list[int] = []
    for v in vals:
        if v >= 1 and v not in seen:
            seen.append(v)
    return seen


#: Lengths for axes that must stay static (each value is a separate compile).
_STATIC_POOL = (8, 4, 16, 12, 6, 2, 32, 24, 3)
_BUDGET = 6144  # elements of an ordinary example
_LONG = (1000, 5000)  # length of the occasional long reduction axis


def _fit_budget(shape: list[int], keep: set[int], budget: int) -> list[int]:
    # Deterministic shrink of the largest free dims until the example is small.
    while int(np.prod(shape)) > budget:
        free = [i for i in range(len(shape)) if i not in keep and shape[i] > 2]
        if not free:
            break
        i = max(free, key=lambda k: shape[k])
        shape[i] = max(2, shape[i] // 2)
    return shape


@dataclass(frozen=True)
class StrategyKnobs:
    """How the strategy spends examples (set per profile)."""

    p_common: int = 70  # percent of examples with the common signature (see case_strategy)
    p_long: int = 12  # percent of examples with one long axis
    p_static: int = 5  # percent compiled with static dims (exercises the vector code path)
    p_packed: int = 15  # percent of an op with weights built with them constant (packed)
    max_extra_rank: int = 3  # ranks drawn from [lo, lo + max_extra_rank]


def case_strategy(
    d: OpDef,
    target: str,
    dtype: str,
    layout: str,
    lanes: int,
    knobs: StrategyKnobs = StrategyKnobs(),
) -> st.SearchStrategy[Case]:
    """Hypothesis strategy of :class:`Case` for one cell (op, target, dtype, layout).

    Each rank, attribute value and set of optional inputs is a separate compile, so most
    examples (``knobs.p_common`` percent) keep the common signature: rank 2 (or the nearest
    allowed), the first value of each attribute domain, every optional input present.
    Shapes: rank within ``d.ranks``; axis lengths around the vector width ``lanes`` (tails),
    size-1 dims, occasionally one long axis (1000-5000, usually the last). Attributes from
    ``attr_domain`` (or ``Literal`` choices); optional inputs present or absent; data recipes
    from :data:`RECIPES`. Invalid combinations (``d.validate`` raises) are redrawn.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify._strategies import case_strategy
    >>> from hypothesis import HealthCheck, given, settings
    >>> s = case_strategy(opsdk.get_op("softmax"), "x86", "float32", "last", 16)
    >>> @settings(max_examples=10, deadline=None,  # a loaded machine draws slowly
    ...           suppress_health_check=[HealthCheck.too_slow])
    ... @given(s)
    ... def shapes_are_small(case):
    ...     assert case.op == "softmax" and len(case.shape) >= 1
    >>> shapes_are_small()
    """
    lo, hi = d.ranks
    # Each rank, attribute value and set of optional inputs is a separate compile: the
    # common signature (rank 2, default attributes, every input present) is drawn most.
    pref = min(max(2, lo), hi)
    ranks = list(range(max(lo, 0), min(hi, lo + knobs.max_extra_rank) + 1))
    optional = [p.name for p in d.tensor_params if p.optional]
    aux = [p.name for p in d.tensor_params[1:]]
    aux_dtypes = input_dtypes(d, dtype, aux)
    aux_recipes = {n: AUX_RECIPES if is_float(aux_dtypes[n]) else INT_AUX_RECIPES for n in aux}
    scales = _scale_inputs(d, dtype, aux) if is_float(dtype) else set()
    primary_recipes = (*_PRIMARY_ORDER, *_GRID_SCALE) if scales else _PRIMARY_ORDER
    if d.special_values and is_float(dtype):
        primary_recipes = (*primary_recipes, *SPECIAL_RECIPES)
    lengths = _lengths(lanes)

    @st.composite
    def draw_case(draw: Any) -> Case:
        # Most examples share the common signature (one compile for all their shapes).
        common = draw(st.integers(0, 99)) < knobs.p_common
        rank = pref if common else draw(st.sampled_from(ranks))
        attrs = dict(layout_attrs(d, layout))
        for name, vals in _attr_choices(d, layout, rank).items():
            attrs[name] = _first(vals) if common else draw(_attr_strategy(vals))
        if common:
            present = tuple(optional)
        else:
            present = tuple(n for n in optional if not draw(st.booleans()))
        probe = next(
            (round_dims(d, (p,) * rank, attrs) for p in _STATIC_POOL
             if is_valid(d, round_dims(d, (p,) * rank, attrs), dtype, attrs, present)), None
        )
        if probe is None:
            reject()
        fixed = static_axes(d, probe, dtype, attrs, present)
        # Drawn only for ops with weights, so other ops' draws stay as they were. A packed
        # build has static weights: the dims they use are drawn like static ones (a few
        # values, each a compile), not like the symbolic dims every shape may vary.
        packed = bool(d.weights) and draw(st.integers(0, 99)) >= 100 - knobs.p_packed
        if packed:
            fixed = tuple(sorted({*fixed, *weight_axes(d, probe, attrs, present)}))
        shape: list[int] = []
        for _ in range(4):  # redraw shapes the op refuses (e.g. groups must divide channels)
            long_draw = draw(st.integers(0, 99)) >= 100 - knobs.p_long
            shape = [
                (_STATIC_POOL[0] if common else draw(st.sampled_from(_STATIC_POOL)))
                if i in fixed else draw(st.sampled_from(lengths))
                for i in range(rank)
            ]
            keep = set(fixed)
            if long_draw and rank > 0:
                k = draw(st.integers(0, 2 * rank - 1))  # shrinks towards the last axis
                axis = rank - 1 if k < rank else k - rank
                if axis not in fixed:
                    shape[axis] = draw(st.integers(*_LONG))
                    keep.add(axis)
                    for i in range(rank):
                        if i not in keep:
                            shape[i] = min(shape[i], 3)
                shape = _fit_budget(shape, keep, 4 * _LONG[1])
            else:
                shape = _fit_budget(shape, keep, _BUDGET)
            shape = round_dims(d, shape, attrs)
            if is_valid(d, shape, dtype, attrs, present):
                break
        else:
            reject()
        data = {d.primary: draw(st.sampled_from(primary_recipes))}
        for name in aux:
            if name in present or name not in optional:
                data[name] = (_GRID_SCALE[data[d.primary]]
                              if name in scales and data[d.primary] in _GRID_SCALE
                              else draw(st.sampled_from(aux_recipes[name])))
        free: dict[str, int] = {}
        for k, (lo_, hi_) in sorted(getattr(d, "free_dims", {}).items()):
            sizes = [n for n in lengths if lo_ <= n <= hi_] or [lo_]
            # A free dim the op ties to the shape (attention's key/value heads divide the
            # query heads) is drawn among the sizes it accepts.
            ok = [n for n in sizes if is_valid(d, shape, dtype, attrs, present, {**free, k: n})]
            # static in a packed build: two sizes (each a compile) rather than every one
            free[k] = draw(st.sampled_from((ok or sizes)[:2] if packed else ok or sizes))
        seed = draw(st.integers(0, 2**31 - 1))
        static = draw(st.integers(0, 99)) >= 100 - knobs.p_static
        return Case(d.name, target, dtype, layout, tuple(shape), attrs, present, data, seed, static,
                    free, packed)

    return draw_case()


# "domain" weighted up: most examples are ordinary data, the rest one of the hard recipes.
_PRIMARY_ORDER = ("domain", "domain", "normal", "domain", *RECIPES[2:])


def corner_cases(d: OpDef, target: str, dtype: str, layout: str, lanes: int) -> list[Case]:
    """Deterministic examples every run starts with (hypothesis's explicit phase).

    One of each hard input class on a small shape with a vector tail (last axis ``lanes + 1``),
    plus one long reduction (last axis 1531) with ordinary and with large-offset data, every
    optional input present and absent, all-ones shapes and the largest attribute values (the
    largest the op accepts together), integer inputs at their ``edges`` twice; last a larger
    case compiled with static dims (the lints inspect that build; free named dims at an odd
    length around the vector width). They use three signatures (compiles). These catch the
    classic kernel bugs whatever the seed; random examples explore the rest.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify._strategies import corner_cases
    >>> cs = corner_cases(opsdk.get_op("layer_norm"), "x86", "float32", "last", 16)
    >>> cs[0].shape, cs[0].present
    ((3, 17), ('gamma', 'beta'))
    """
    lo, hi = d.ranks
    rank = min(max(2, lo), hi)
    # An axis-taking op gets rank 3 in the largest-attributes signature: at rank 2 "axis 1"
    # and "the last axis" coincide, and an op that ignores its axis would pass. (Only there:
    # every corner at rank 3 cost the norms and softmax 2-3 s more compiling.)
    has_axis = any(p.is_axis for p in d.attr_params)
    rank3 = min(max(3, lo), hi) if has_axis else rank
    base_attrs = layout_attrs(d, layout)
    optional = tuple(p.name for p in d.tensor_params if p.optional)
    aux = [p.name for p in d.tensor_params[1:]]
    choices = _attr_choices(d, layout, rank3)

    def shape_of(last: int, other: int, r: int = rank) -> list[int]:
        s = [other] * r
        if r:
            s[-1] = last
        return s

    # The largest value of each numeric attribute that the op accepts with the others (a
    # zero point of 255 is the top of uint8 but out of range for int8: 127 there).
    # Axes and other categorical attributes take their least default value there (the first
    # axis, a non-default out_dtype), so every attribute leaves its default at least once.
    params = {p.name: p for p in d.attr_params}
    big_attrs = dict(base_attrs)
    for name, vals in choices.items():
        if params[name].is_axis:
            order = list(reversed(vals))
        else:
            order = _largest_first(vals)
            if order is None and isinstance(vals, list):
                order = [*vals[1:], *vals[:1]]
        for v in order or ():
            trial = {**big_attrs, name: v}
            if _repair(d, shape_of(lanes - 1, 2, rank3), dtype, trial, ()) is not None:
                big_attrs = trial
                break

    specs = [
        # (shape, recipe, present, attrs)
        (shape_of(lanes + 1, 3), "domain", optional, base_attrs),
        (shape_of(1531, 2), "normal", optional, base_attrs),
        (shape_of(1531, 2), "offset", optional, base_attrs),
        (shape_of(lanes + 1, 3), "tiny", optional, base_attrs),
        (shape_of(lanes + 1, 3), "large", optional, base_attrs),
        (shape_of(lanes + 1, 3), "rowconst", optional, base_attrs),
        (shape_of(1, 1), "domain", optional, base_attrs),
        # One more signature: optional inputs absent, largest attribute values.
        (shape_of(lanes - 1, 2, rank3), "tiny", (), big_attrs),
        (shape_of(lanes - 1, 2, rank3), "offset", (), big_attrs),
    ]
    # Integer inputs (zero points, weights, shifts) at the ends of their ranges, once per
    # signature: with large data, and with the largest attributes.
    edges = {n for n, dt in input_dtypes(d, dtype, aux).items() if not is_float(dt)}
    # Rounding ties: x / scale exactly k + 1/2 (see GRID_RECIPES).
    scales = _scale_inputs(d, dtype, aux)
    if d.special_values and is_float(dtype):  # inf, NaN, huge values (docs: semantics)
        specs.append((shape_of(lanes + 1, 5), "special", optional, base_attrs))
    if scales and is_float(dtype):
        specs.append((shape_of(lanes + 1, 3), "halfgrid", optional, base_attrs))
        specs.append((shape_of(lanes + 3, 5), "midgrid", optional, base_attrs))
    out: list[Case] = []
    for k, (shape, recipe, present, attrs) in enumerate(specs):
        shape = _repair(d, shape, dtype, attrs, present)
        if shape is None:
            continue
        passed = [n for n in aux if n in present or n not in optional]
        data = {d.primary: recipe,
                **{n: "edges" if n in edges and k in (4, 8) else "domain" for n in passed}}
        if recipe in _GRID_SCALE:
            data.update({n: _GRID_SCALE[recipe] for n in passed if n in scales})
        c = Case(d.name, target, dtype, layout, tuple(shape), dict(attrs), tuple(present), data, k)
        if c not in out:
            out.append(c)
    # An op with weights: them constant, as in a model, so every cell builds the rules'
    # compile-time packing at least once (one more compile). The largest attributes (a
    # matmul's 80 output features: several packed tiles, where 16 packs to a mere reshape)
    # with every optional input present (a bias is a weight too).
    packed = _repair(d, shape_of(lanes + 1, 3), dtype, big_attrs, optional)
    if d.weights and packed is not None:
        data = {d.primary: "domain", **{n: "domain" for n in aux}}
        out.append(Case(d.name, target, dtype, layout, tuple(packed), dict(big_attrs),
                        optional, data, len(specs) + 2, packed=True))
    # Static dims, as in a model with fixed shapes, and big enough (32 rows, 4 vectors) that a
    # schedule applies everything it claims: also the build the lints inspect. The
    # remainders left by the vector width and the rules' row tiles differ from cell to cell
    # (_static_tail): a rule wrong only for some residue of a static extent, or only on round
    # extents, is built on several across an op's cells, at no extra compile.
    tail, extra_rows = _static_tail(d, dtype, layout)
    rows = 32 + extra_rows
    big = [max(3, -(-rows // 3 ** max(rank - 2, 0))) if i == 0 else 3 for i in range(rank)]
    if rank:
        big[-1] = 4 * lanes + min(tail, lanes - 1)
    shape = _repair(d, big, dtype, base_attrs, optional)
    cell = _cell_index(d, dtype, layout)
    if shape is not None:
        free = _static_free(d, shape, dtype, base_attrs, optional, lanes, cell)
        data = {d.primary: "domain", **{n: "domain" for n in aux}}
        out.append(Case(d.name, target, dtype, layout, tuple(shape), dict(base_attrs),
                        tuple(optional), data, len(specs), static=True, free=free))
    # A dense layer also runs as a GEMV (one row, an LLM's decode step) with a long K, which
    # rules schedule apart from the many-row kernel above: one static build of that shape too.
    dec = _repair(d, [1, _DECODE_K], dtype, base_attrs, optional) \
        if d.kind == "dense" and rank == 2 else None
    if dec is not None and dec[0] == 1:
        free = _static_free(d, shape or dec, dtype, base_attrs, optional, lanes, cell)
        data = {d.primary: "domain", **{n: "domain" for n in aux}}
        out.append(Case(d.name, target, dtype, layout, tuple(dec), dict(base_attrs),
                        tuple(optional), data, len(specs) + 1, static=True, free=free))
    # A kernel family's attribute combinations and tile edges, on purpose (_kcorners).
    out += [c for c in kernel_corners(d, target, dtype, layout, lanes) if c not in out]
    return out


#: K of the static decode corner of dense ops (GPT-2's MLP down-projection).
_DECODE_K = 3072


#: (last-axis remainder past 4 vectors, rows past 32) of the static corner, one per cell.
_STATIC_TAILS = ((1, 0), (3, 1), (7, 3), (15, 7), (2, 5), (5, 2))


def _cell_index(d: OpDef, dtype: str, layout: str) -> int:
    """The cell's place in the op's capability matrix (1 for a cell outside it)."""
    cells = [(dt, ly) for dt in d.dtypes for ly in d.layouts]
    return cells.index((dtype, layout)) if (dtype, layout) in cells else 1


def _static_free(d: OpDef, shape: Sequence[int], dtype: str, attrs: Mapping[str, Any],
                 present: Sequence[str], lanes: int, cell: int) -> dict[str, int]:
    """The static corner's free named dims (a dense layer's N): the largest odd length
    around the vector width in their range, so a blocked kernel sees whole blocks and a tail.
    A dim the op refuses that length for (attention's key/value heads must divide the query
    heads) takes the odd lengths it accepts, smallest first, cell by cell: grouped heads in
    some cells, as many as the queries in others."""
    lengths = _lengths(lanes)
    free: dict[str, int] = {}
    for k, (lo_, hi_) in sorted(d.free_dims.items()):
        odd = sorted(n for n in lengths if lo_ <= n <= hi_ and n % 2)
        pick = odd[-1] if odd else min(hi_, max(lo_, 8))
        if not is_valid(d, shape, dtype, attrs, present, {**free, k: pick}):
            ok = [n for n in odd if is_valid(d, shape, dtype, attrs, present, {**free, k: n})]
            if not ok:
                continue  # the default
            pick = ok[cell % len(ok)]
        free[k] = pick
    return free


def _static_tail(d: OpDef, dtype: str, layout: str) -> tuple[int, int]:
    """The static corner's (last-axis remainder, extra rows) for a cell. An op's first cell
    gets round extents (no remainder: the shapes of most models, and the only ones on which
    some rules take their fast path, e.g. softmax's merged exp-and-sum loop); its other cells
    step through ``_STATIC_TAILS`` from a stable per-op offset, so up to six cells see six
    different remainders."""
    k = _cell_index(d, dtype, layout)
    if k == 0:
        return 0, 0
    return _STATIC_TAILS[(zlib.crc32(d.name.encode()) + k - 1) % len(_STATIC_TAILS)]


def _repair(d: OpDef, shape: list[int], dtype: str, attrs: Mapping[str, Any],
            present: Sequence[str]) -> list[int] | None:
    """Make ``shape`` valid by replacing single dims with friendlier lengths, if needed."""
    shape = round_dims(d, shape, attrs)
    if is_valid(d, shape, dtype, attrs, present):
        return shape
    for fill in (8, 16, 4, 2, 1):
        for i in range(len(shape)):
            s = list(shape)
            s[i] = fill
            s = round_dims(d, s, attrs)
            if is_valid(d, s, dtype, attrs, present):
                return s
    for fill in (8, 16, 4, 2, 1):
        if is_valid(d, round_dims(d, [fill] * len(shape), attrs), dtype, attrs, present):
            return round_dims(d, [fill] * len(shape), attrs)
    return None

