"""Declaring an op: the :func:`op` decorator, which reads the schema from the compute's Python
signature (the way ``torch.library.custom_op`` does), checks the declaration and traces the
compute once at definition time (:class:`~opsdk._opdef.OpDef` is what it returns).

A mistake in a declaration is an :class:`~opsdk._opdef.OpDefinitionError` naming the op, the
argument and the fix, raised where the op is defined, never later in a compile.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, Union

import numpy as np
from tvm import te, tirx

from ._domains import Bounded, LogUniform
from ._dtypes import FLOAT_DTYPES, np_dtype
from ._opdef import (
    _ATTR_TYPES,
    MAX_OP_NAME,
    OpDef,
    OpDefinitionError,
    Param,
    Tensor,
    _as_dim,
    _AxisMarker,
    _dims_equal,
    _fmt,
    _shape_tuple,
    as_outputs,
)

__all__ = ["OP_KINDS", "op"]


def _parse_param(opname: str, p: inspect.Parameter, hint: Any) -> Param:
    where = f"op {opname!r}: parameter {p.name!r}"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Tensor:
        if p.default is not inspect.Parameter.empty:
            raise OpDefinitionError(
                f"{where}: a Tensor input cannot have a default; use `Tensor | None = None`"
            )
        return Param(p.name, "tensor")
    if origin in (Union, types.UnionType) and set(args) == {Tensor, type(None)}:
        if p.default is not None:
            raise OpDefinitionError(f"{where}: an optional Tensor must default to None")
        return Param(p.name, "tensor", optional=True, default=None)
    if p.kind is not inspect.Parameter.KEYWORD_ONLY:
        raise OpDefinitionError(
            f"{where}: attributes must be keyword-only (put them after `*`) and tensors "
            f"annotated `Tensor` or `Tensor | None`; got annotation {hint!r}"
        )
    if origin is Annotated and args[0] is int and any(isinstance(a, _AxisMarker) for a in args[1:]):
        return Param(p.name, "attr", type=int, default=p.default, is_axis=True)
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _ATTR_TYPES:
            raise OpDefinitionError(
                f"{where}: Literal choices must share one of int/float/bool/str"
            )
        if p.default is not inspect.Parameter.empty and p.default not in args:
            raise OpDefinitionError(f"{where}: default {p.default!r} is not one of {args}")
        return Param(p.name, "attr", type=type(args[0]), default=p.default, choices=tuple(args))
    if hint in _ATTR_TYPES:
        return Param(p.name, "attr", type=hint, default=p.default)
    raise OpDefinitionError(
        f"{where}: unsupported annotation {hint!r}; use Tensor, Tensor | None, int, float, "
        "bool, str, Literal[...] or opsdk.Axis"
    )


def _check_dtype_rule(opname: str, rule: Any, attr_names: set[str]) -> None:
    if isinstance(rule, str):
        if rule not in attr_names:
            try:
                np_dtype(rule)
            except Exception:
                raise OpDefinitionError(
                    f"op {opname!r}: output_dtype={rule!r} is neither a dtype nor "
                    f"an attribute (attributes: {sorted(attr_names) or 'none'}); pass e.g. "
                    "'float32', an attribute name, or a function (dtypes, attrs) -> dtype"
                ) from None
    elif rule is not None and not callable(rule):
        raise OpDefinitionError(
            f"op {opname!r}: output_dtype must be a dtype, an attribute name or a "
            f"function (or a tuple of them, one per output), got {type(rule).__name__}"
        )


def _free_dims(opname: str, dims: Mapping[str, Any] | None) -> dict[str, tuple]:
    """``free_dims=``: name -> (lo, hi) or (lo, hi, default), default an int or a callable."""
    out = {}
    for name, v in (dims or {}).items():
        ok = isinstance(name, str) and isinstance(v, (tuple, list)) and len(v) in (2, 3)
        if ok and len(v) == 3:
            ok = callable(v[2]) or (isinstance(v[2], int) and not isinstance(v[2], bool))
        if not ok:
            raise OpDefinitionError(
                f"op {opname!r}: free_dims maps a dim name to (lo, hi) or (lo, hi, default), "
                f"the default an int or f(primary_shape, attrs) -> int; got {name!r}: {v!r}")
        out[name] = tuple(v)
    return out


def _dim_multiples(opname: str, dims: Mapping[int, Any] | None) -> dict[int, Any]:
    """``dim_multiples=``: axis (int) -> multiple (int >= 1, or ``f(attrs) -> int``)."""
    out = {}
    for axis, m in (dims or {}).items():
        if not (isinstance(axis, int) and (callable(m) or (isinstance(m, int) and m >= 1))):
            raise OpDefinitionError(f"op {opname!r}: dim_multiples maps an axis (int) to a "
                                    f"multiple (int >= 1); got {axis!r}: {m!r}")
        out[axis] = m
    return out


def _default_examples(ranks: tuple[int, int]) -> tuple[tuple[int, ...], ...]:
    base = (2, 3, 4, 5, 6, 7)
    return tuple(tuple(base[:r]) for r in sorted({ranks[0], min(ranks[1], ranks[0] + 1)}))


def op(
    *,
    reference: Callable[..., np.ndarray],
    dtypes: Sequence[str] | Mapping[str, Sequence[str]] = FLOAT_DTYPES,
    ranks: tuple[int, int] = (1, 6),
    free_dims: Mapping[str, tuple] | None = None,
    input_shapes: Callable[[tuple, dict], dict[str, tuple]] | None = None,
    check: Callable[[dict, dict, dict], None] | None = None,
    infer_type: Callable[[dict, dict, dict], tuple[tuple, str]] | None = None,
    layouts: Mapping[str, Mapping[str, Any]] | None = None,
    domain: Mapping[str, tuple[float, float] | LogUniform | Bounded] | None = None,
    attr_domain: Mapping[str, Any] | None = None,
    kind: str = "elementwise",
    examples: Sequence[tuple[int, ...]] | None = None,
    name: str | None = None,
    output_dtype: Any = None,
    special_values: bool = False,
    dim_multiples: Mapping[int, int] | None = None,
    weights: Sequence[str] = (),
) -> Callable[[Callable[..., te.Tensor]], OpDef]:
    """Declare an op from its TE compute.

    Parameters
    ----------
    reference
        float64 numpy implementation with the same signature as the compute.
    dtypes
        Dtypes the first tensor input may have; other tensor inputs must match it. A mapping
        ``{input: dtypes}`` gives inputs their own dtypes (e.g. float32 scales of an int8 op);
        inputs it leaves out must match the first input.
    ranks
        Inclusive (min, max) rank of the first tensor input.
    input_shapes
        ``f(primary_shape, attrs) -> {input: shape}`` giving the shape every other tensor
        input must have; used for type checking and for generating test inputs. A dim may be
        a name (``"N"``): a free size shared by the inputs that use it.
    free_dims
        Inclusive size range of each free named dim, for test generation: ``{"N": (1, 64)}``.
        A third element is the size the dim takes where none is chosen (examples, corner
        cases): an int, or ``f(primary_shape, attrs) -> size`` for a dim that must agree with
        the first input (``attention``'s key/value heads, which divide the query heads,
        default to the query heads); without it, 8 within the range.
    check
        Extra validation ``f(shapes, dtypes, attrs)`` raising ``ValueError``.
    infer_type
        Optional hand-written type relation ``f(shapes, dtypes, attrs) -> (shape, dtype)``;
        it is checked against the traced compute when the op is defined.
    layouts
        Named attribute settings forming the layout axis of the capability matrix,
        e.g. ``{"NCHW": {"layout": "NCHW"}, "NHWC": {"layout": "NHWC"}}``.
    domain
        Value range hints per tensor input for test generation, e.g. ``{"x": (-4, 4)}``
        (uniform; the ordinary data: the stress recipes ``tiny``, ``large``, ``offset`` and
        ``mixed`` go beyond it), ``{"scale": opsdk.log_uniform(1e-4, 1e2)}`` (spread evenly
        over the decades, positive), or ``{"cos": opsdk.bounded(-1, 1)}`` (a hard range
        that every recipe respects).
    attr_domain
        Values to draw attributes from, e.g. ``{"epsilon": [1e-5, 1e-3]}``, or a
        :func:`~opsdk.log_uniform` range for a ``float`` attribute.
    kind
        ``"elementwise"``, ``"reduction"`` or ``"norm"``: lets generic schedule rules apply.
    examples
        Primary-input shapes traced at definition time (defaults derived from ``ranks``).
    output_dtype
        The output dtype contract, which ``opsdk verify`` checks on every cell: None (the
        default) promises the first input's dtype (a float16 op returns float16, whatever
        it accumulates in); a dtype (``"float32"`` for a dequantize); the name of a ``str``
        attribute that selects it (``"out_dtype"``); or ``f(dtypes, attrs) -> dtype``. A
        multi-output op may give a tuple with one such rule per output.

    The compute returns one ``te.Tensor``, or a tuple of them for an op with several outputs
    (a fused residual add + LayerNorm returning the sum too); the reference then returns a
    tuple of arrays in the same order, ``infer_type`` one ``(shape, dtype)`` per output, and
    the Relax call's value is a tuple.
    special_values
        True when the reference follows the op's documented semantics for infinities, NaN
        and huge inputs (as the float built-ins do, docs/verification.md): verify then draws
        such inputs too (the ``special`` data recipe). Off by default, because a float64
        reference rarely overflows where a float32 kernel must.
    dim_multiples
        ``{axis: m}``: the first input's ``axis`` must have a length that is a multiple of
        ``m`` (``dense_q4``'s K, whole 32-weight blocks; ``check`` or ``input_shapes`` still
        refuses other lengths with the op's own message). Verify rounds the lengths it draws
        for that axis up to a multiple of ``m``, so its draws stay valid. ``m`` may be a
        function of the attributes, ``f(attrs) -> int`` (``dense_w8``: 32 with
        ``activations="q8_0"``, else 1).
    weights
        Names of the tensor inputs that are compile-time constants in a model (a dense
        layer's weight matrix, a conv's filter): the schedule rules may pack those at compile
        time (``layout_free_buffers``), and ``opsdk verify`` builds some cases with them
        bound as constants (packed cases) as well as at run time.

    Returns
    -------
    Callable
        A decorator turning the compute function into an :class:`OpDef`.

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import te
    >>> import opsdk
    >>> def _ref(x):
    ...     return x * (1.0 / (1.0 + np.exp(-x)))
    >>> @opsdk.op(reference=_ref)
    ... def demo_swish(x: opsdk.Tensor) -> te.Tensor:
    ...     return te.compute(x.shape, lambda *i: x(*i) * te.sigmoid(x(*i)), name="swish")
    >>> demo_swish.name, [p.name for p in demo_swish.params]
    ('demo_swish', ['x'])
    """

    def wrap(fn: Callable[..., te.Tensor]) -> OpDef:
        if not callable(fn) or not hasattr(fn, "__name__"):
            raise OpDefinitionError(f"@opsdk.op decorates a function; got "
                                    f"{type(fn).__name__} {fn!r:.40}")
        opname = name or fn.__name__
        # ASCII only: the name becomes C symbols, file names and TVM op names, which mangle
        # other letters (a non-ASCII name failed verify's lints, not at its definition).
        if not isinstance(opname, str) or not (opname.isascii() and opname.isidentifier()):
            raise OpDefinitionError(f"op name {opname!r} must be an identifier of ASCII "
                                    "letters, digits and _ (not starting with a digit)")
        if len(opname) > MAX_OP_NAME:  # it names files (new-op --from, tests) and symbols
            raise OpDefinitionError(f"op name {opname[:20]!r}... is {len(opname)} characters; "
                                    f"keep it to {MAX_OP_NAME} or fewer")
        sig = inspect.signature(fn)
        # Names the annotations use may be local to where the op is defined (an op made
        # inside a function, with ``from __future__ import annotations``): look there too.
        params = _read_params(opname, fn, sig, sys._getframe(1).f_locals)
        _check_declaration(opname, params, reference, dtypes, ranks, kind, domain, attr_domain)
        _check_optional_order(opname, params)
        ref_sig = inspect.signature(reference)
        if list(ref_sig.parameters) != list(sig.parameters):
            raise OpDefinitionError(
                f"op {opname!r}: reference parameters {list(ref_sig.parameters)} differ from the "
                f"compute's {list(sig.parameters)}"
            )
        per_input, primary_dtypes = _split_dtypes(opname, params, dtypes)
        free = _free_dims(opname, free_dims)
        _check_domains(opname, params, dict(domain or {}), dict(attr_domain or {}))
        _check_examples(opname, examples)
        _check_weights(opname, params, weights)
        attr_names = {p.name for p in params if p.kind == "attr"}
        rules = output_dtype if isinstance(output_dtype, (tuple, list)) else [output_dtype]
        for rule in rules:
            _check_dtype_rule(opname, rule, attr_names)
        d = OpDef(
            name=opname,
            compute=fn,
            reference=reference,
            params=tuple(params),
            dtypes=primary_dtypes,
            ranks=tuple(ranks),  # type: ignore[arg-type]
            input_dtypes=per_input,
            free_dims={k: (int(v[0]), int(v[1])) for k, v in free.items()},
            input_shapes=input_shapes,
            check=check,
            infer_type=infer_type,
            layouts={k: dict(v) for k, v in (layouts or {"default": {}}).items()},
            domain=dict(domain or {}),
            attr_domain=dict(attr_domain or {}),
            kind=kind,
            doc=inspect.getdoc(fn) or "",
            examples=tuple(examples or _default_examples(tuple(ranks))),
            module=fn.__module__,
            output_dtype=output_dtype,
            special_values=bool(special_values),
            dim_multiples=_dim_multiples(opname, dim_multiples),
            free_dim_defaults={k: v[2] for k, v in free.items() if len(v) == 3},
            weights=tuple(weights),
        )
        _self_check(d)
        return d

    return wrap


def _read_params(opname: str, fn: Callable, sig: inspect.Signature,
                 caller: Mapping[str, Any]) -> list[Param]:
    """The schema of the compute ``fn``: one :class:`Param` per parameter, from its
    annotation (resolved in the module of ``fn`` and in ``caller``'s locals)."""
    try:
        hints = typing.get_type_hints(fn, localns=dict(caller), include_extras=True)
    except Exception as e:  # unresolved forward references and the like
        raise OpDefinitionError(f"op {opname!r}: cannot resolve annotations: {e}") from e
    params = []
    for p in sig.parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise OpDefinitionError(
                f"op {opname!r}: *args/**kwargs are not allowed in a compute"
            )
        if p.name not in hints:
            raise OpDefinitionError(f"op {opname!r}: parameter {p.name!r} needs an annotation")
        params.append(_parse_param(opname, p, hints[p.name]))
    if not params or params[0].kind != "tensor" or params[0].optional:
        raise OpDefinitionError(f"op {opname!r}: the first parameter must be a required Tensor")
    return params


def _check_optional_order(opname: str, params: Sequence[Param]) -> None:
    """Optional tensor inputs come last (a call passes the required ones by position)."""
    seen_optional = False
    for p in params:
        if p.kind == "tensor":
            if seen_optional and not p.optional:
                raise OpDefinitionError(
                    f"op {opname!r}: required tensor {p.name!r} follows an optional one"
                )
            seen_optional |= p.optional


def _split_dtypes(opname: str, params: Sequence[Param], dtypes: Any
                  ) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """``dtypes=`` as (the other inputs' own dtypes, the first input's dtypes), each a dtype
    numpy knows."""
    if isinstance(dtypes, Mapping):
        per_input = {k: tuple(v) for k, v in dtypes.items()}
        first = next(p.name for p in params if p.kind == "tensor")
        if first not in per_input:
            raise OpDefinitionError(
                f"op {opname!r}: dtypes must name the first input {first!r}"
            )
        unknown = set(per_input) - {p.name for p in params if p.kind == "tensor"}
        if unknown:
            raise OpDefinitionError(
                f"op {opname!r}: dtypes names unknown inputs {sorted(unknown)}"
            )
        primary_dtypes = per_input.pop(first)
    else:
        per_input, primary_dtypes = {}, tuple(dtypes)
    for dt in (*primary_dtypes, *(d for v in per_input.values() for d in v)):
        try:
            np_dtype(dt)
        except ValueError as e:  # a typo: name the op and the argument
            raise OpDefinitionError(f"op {opname!r}: dtypes= {e}") from None
    return per_input, primary_dtypes


def _check_weights(opname: str, params: Sequence[Param], weights: Any) -> None:
    """``weights=``: names of tensor inputs (a string would be read letter by letter)."""
    tensors = [p.name for p in params if p.kind == "tensor"]
    if isinstance(weights, (str, bytes)) or any(w not in tensors for w in weights):
        raise OpDefinitionError(f"op {opname!r}: weights={weights!r} must name tensor inputs "
                                f"({', '.join(tensors)})")


def _check_examples(opname: str, examples: Any) -> None:
    """``examples=``: shapes of the first input, tuples of positive ints."""
    if examples is not None and (isinstance(examples, (str, bytes)) or not all(
            isinstance(e, (tuple, list)) and e and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
                for v in e)
            for e in examples)):  # else a TVM type error (a string) or empty tensors (0)
        raise OpDefinitionError(
            f"op {opname!r}: examples={examples!r} must be shapes of the first input, "
            "tuples of positive ints, e.g. [(2, 8), (2, 4, 8)]")


#: Op kinds the generic rules and error models know (see :func:`op`).
OP_KINDS = ("elementwise", "reduction", "norm", "dense", "matmul", "conv2d", "winograd", "pool")


def _check_declaration(opname: str, params: Sequence[Param], reference: Any, dtypes: Any,
                       ranks: Any, kind: Any, domain: Any, attr_domain: Any) -> None:
    """The decorator's arguments, before anything is traced: each mistake names the op, the
    argument and the fix (a typo would otherwise be ignored, or fail far away)."""
    where = f"op {opname!r}"
    if not callable(reference):
        raise OpDefinitionError(f"{where}: reference= must be a function (the float64 numpy "
                                f"reference), got {type(reference).__name__}")
    if isinstance(dtypes, Mapping):
        if not dtypes or any(not v for v in dtypes.values()):
            raise OpDefinitionError(f"{where}: dtypes= gives an input no dtype; list at least "
                                    "one per input, e.g. {'x': ('float32',)}")
    elif isinstance(dtypes, str) or not dtypes:
        raise OpDefinitionError(f"{where}: dtypes= must be a non-empty sequence of dtypes, "
                                f"e.g. ('float32', 'float16'), got {dtypes!r}")
    if (not isinstance(ranks, (tuple, list)) or len(ranks) != 2
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
            or not 1 <= ranks[0] <= ranks[1]):
        raise OpDefinitionError(
            f"{where}: ranks={ranks!r} must be (min, max) with 1 <= min <= max, the ranks the "
            "first input may have (a scalar is a shape-(1,) tensor)")
    if kind not in OP_KINDS:
        import difflib

        near = difflib.get_close_matches(str(kind), OP_KINDS, n=1)
        raise OpDefinitionError(f"{where}: kind={kind!r} is not one of {', '.join(OP_KINDS)}"
                                + (f" (did you mean {near[0]!r}?)" if near else ""))
    tensors = [p.name for p in params if p.kind == "tensor"]
    attrs = [p.name for p in params if p.kind == "attr"]
    for name, dom in dict(domain or {}).items():
        if name not in tensors:
            raise OpDefinitionError(
                f"{where}: domain= names {name!r}, but {name!r} is not a tensor input "
                f"(inputs: {', '.join(tensors)}); attribute values go in attr_domain=")
        if isinstance(dom, (tuple, list)):
            if len(dom) != 2 or not all(isinstance(v, (int, float)) for v in dom):
                raise OpDefinitionError(f"{where}: domain[{name!r}] = {dom!r}: give (lo, hi)")
            lo, hi = (float(v) for v in dom)
            if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
                raise OpDefinitionError(
                    f"{where}: domain[{name!r}] = {dom!r}: needs finite lo <= hi")
        elif not isinstance(dom, (LogUniform, Bounded)):  # else silently the default range
            raise OpDefinitionError(
                f"{where}: domain[{name!r}] = {dom!r}: give (lo, hi), opsdk.log_uniform(lo, "
                "hi) or opsdk.bounded(lo, hi)")
    for name in dict(attr_domain or {}):
        if name not in attrs:
            raise OpDefinitionError(
                f"{where}: attr_domain= names {name!r}, but {name!r} is not an attribute "
                f"(attributes: {', '.join(attrs) or 'none'}); tensor ranges go in domain=")


def _check_domains(opname: str, params: Sequence[Param], domain: Mapping[str, Any],
                   attr_domain: Mapping[str, Any]) -> None:
    """Log-uniform and bounded domains have usable bounds, and a log-uniform attribute range
    belongs to a float attribute (unknown names are refused by _check_declaration)."""
    attrs = {p.name: p for p in params if p.kind == "attr"}
    for name, dom in domain.items():
        if not isinstance(dom, (LogUniform, Bounded)):
            continue
        where = f"op {opname!r}: domain[{name!r}] = {dom!r}"
        problem = dom.problem()  # unknown names: _check_declaration
        if problem:
            raise OpDefinitionError(f"{where}: {problem}")
    for name, dom in attr_domain.items():
        where = f"op {opname!r}: attr_domain[{name!r}]"
        if isinstance(dom, (list, tuple)) and any(isinstance(v, LogUniform) for v in dom):
            raise OpDefinitionError(
                f"{where}: a log_uniform(...) range stands alone, not inside a list of values"
            )
        if not isinstance(dom, LogUniform):
            _check_attr_values(where, attrs[name], dom)
            continue
        where += f" = {dom!r}"
        p = attrs[name]  # unknown names: _check_declaration
        if p.type is not float or p.choices is not None:
            kind = f"Literal{list(p.choices)}" if p.choices is not None else p.type.__name__
            raise OpDefinitionError(
                f"{where}: a log-uniform range needs a float attribute; {name!r} is {kind}"
            )
        problem = dom.problem()
        if problem:
            raise OpDefinitionError(f"{where}: {problem}")


def _check_attr_values(where: str, p: Param, dom: Any) -> None:
    """Every value an ``attr_domain`` entry lists is one the attribute takes: a value outside
    a ``Literal``'s choices, or of another type, made every example that drew it fail (or,
    never drawn, hid the typo)."""
    values = list(dom) if isinstance(dom, (list, tuple)) else [dom]
    want = p.type
    for v in values:
        if isinstance(v, np.generic):
            v = v.item()
        ok = isinstance(v, want) and not (want is not bool and isinstance(v, bool))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            ok = True
        if not ok:
            raise OpDefinitionError(f"{where} lists {v!r} ({type(v).__name__}), but {p.name!r} "
                                    f"is {want.__name__}")
        if p.choices is not None and v not in p.choices:
            raise OpDefinitionError(f"{where} lists {v!r}, which is not one of the choices "
                                    f"of {p.name!r}: {list(p.choices)}")


def _self_check(d: OpDef) -> None:
    """Trace the compute for every dtype x layout on static and symbolic shapes.

    Checks that the compute builds, that a hand-written ``infer_type`` agrees with it, and
    that the reference returns the traced shape. Raises :class:`OpDefinitionError`.
    """
    first = True
    for layout, lattrs in d.layouts.items():
        attrs = {**d.default_attrs(), **lattrs}
        try:
            attrs_ok = d.bind_attrs(attrs)
        except ValueError as e:
            raise OpDefinitionError(f"op {d.name!r}: layout {layout!r}: {e}") from e
        # An axis attribute may not fit every example rank (begin_axis=-2 on a vector).
        fitting = []
        for shape in d.examples:
            try:
                d.normalize_attrs(attrs_ok, len(shape))
            except ValueError:
                continue
            fitting.append(shape)
        if not fitting:
            raise OpDefinitionError(
                f"op {d.name!r}: no example shape fits layout {layout!r} {lattrs}; "
                f"pass examples=[...] with a suitable rank"
            )
        for shape in fitting:
            for dt in d.dtypes:
                where = f"op {d.name!r} ({dt}, layout {layout!r}, {d.primary} shape {shape})"
                shapes = _user_call(where, "input_shapes", d.example_shapes, shape, attrs)
                dts = d.dtypes_for(dt, shapes)
                try:
                    out = d.trace(shapes, dts, attrs)
                except OpDefinitionError:
                    raise
                except Exception as e:
                    hint = ("" if d.examples != _default_examples(tuple(d.ranks)) else
                            "; the self-check traces default shapes: if the compute needs "
                            "particular extents (an even last axis, channels divisible by the "
                            "groups), pass examples=[(...), ...] to opsdk.op")
                    raise OpDefinitionError(f"{where}: compute failed: {e}{hint}") from e
                outs = as_outputs(out)
                if first:
                    d.n_outputs, first = len(outs), False
                    _check_output_rules(d)
                elif len(outs) != d.n_outputs:
                    raise OpDefinitionError(
                        f"{where}: compute returns {len(outs)} outputs here but {d.n_outputs} "
                        "elsewhere; an op has one output count for every dtype and layout"
                    )
                traced_all = [(_shape_tuple(t), str(t.dtype)) for t in outs]
                if d.infer_type is not None:
                    try:
                        declared_all = d.result_types(shapes, dts, attrs)
                    except Exception as e:
                        raise OpDefinitionError(
                            f"{where}: infer_type raised {type(e).__name__}: {e}; it takes "
                            "(shapes, dtypes, attrs) and returns (shape, dtype)"
                            + (f", one per output ({d.n_outputs})" if d.n_outputs > 1 else "")
                        ) from e
                    for k, (declared, traced) in enumerate(zip(declared_all, traced_all)):
                        declared = (tuple(int(s) for s in declared[0]), declared[1])
                        if declared != traced:
                            which = f" output {k}" if d.n_outputs > 1 else ""
                            raise OpDefinitionError(
                                f"{where}: declared type (infer_type){which} gives shape "
                                f"{declared[0]} dtype {declared[1]}, but the compute produces "
                                f"shape {traced[0]} dtype {traced[1]}"
                            )
                if dt == d.dtypes[0]:
                    rng = np.random.default_rng(0)
                    ins = {
                        k: (
                            rng.integers(-3, 4, v)
                            if np_dtype(dts[k]).kind in "iu"
                            else rng.uniform(-1, 1, v)
                        ).astype(np_dtype(dts[k]))
                        for k, v in shapes.items()
                    }
                    try:
                        refs = d.run_reference(ins, attrs)
                    except Exception as e:
                        if d.n_outputs > 1 and isinstance(e, TypeError):  # one array, not a tuple
                            raise OpDefinitionError(
                                f"{where}: the reference must return one array per output "
                                f"({d.n_outputs}): {e}") from e
                        raise OpDefinitionError(
                            f"{where}: the reference raised {type(e).__name__}: {e}; it is "
                            "called with float64 numpy arrays (None for absent optional "
                            "inputs) and the attributes as keywords") from e
                    refs = [refs] if d.n_outputs == 1 else list(refs)
                    if len(refs) != d.n_outputs:
                        raise OpDefinitionError(
                            f"{where}: the reference returns {len(refs)} arrays but the "
                            f"compute has {d.n_outputs} outputs"
                        )
                    for k, (ref, traced) in enumerate(zip(refs, traced_all)):
                        if tuple(ref.shape) != traced[0]:
                            which = f" (output {k})" if d.n_outputs > 1 else ""
                            raise OpDefinitionError(
                                f"{where}: reference returns shape {tuple(ref.shape)}{which} "
                                f"but the compute produces {traced[0]}"
                            )
            # A symbolic leading dim must survive tracing (Relax keeps it in the type).
            n = tirx.Var("n", "int64")
            shapes = d.example_shapes((n, *shape[1:]), attrs)
            dts = d.dtypes_for(d.dtypes[0], shapes)
            try:
                sym = as_outputs(d.trace(shapes, dts, attrs))
            except Exception as e:
                raise OpDefinitionError(
                    f"op {d.name!r} (layout {layout!r}): compute fails on a symbolic leading "
                    f"dimension: {e}"
                ) from e
            if d.infer_type is not None:  # (7, 4) for (n, 4) must not pass
                where = f"op {d.name!r} (layout {layout!r}, {d.primary} shape (n, ...))"
                declared_all = _user_call(where, "infer_type", d.result_types, shapes, dts,
                                          attrs)
                for k, ((dshape, _), t) in enumerate(zip(declared_all, sym)):
                    tshape = _shape_tuple(t)
                    if len(dshape) != len(tshape) or not all(
                            _dims_equal(_as_dim(a), _as_dim(b)) for a, b in zip(dshape, tshape)):
                        which = f" output {k}" if d.n_outputs > 1 else ""
                        raise OpDefinitionError(
                            f"{where}: declared type (infer_type){which} gives shape "
                            f"{_fmt(dshape)}, but the compute produces {_fmt(tshape)}; "
                            "infer_type must follow symbolic dims too")


def _user_call(where: str, what: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except OpDefinitionError:
        raise
    except Exception as e:  # the author's function: name it, not a traceback
        raise OpDefinitionError(f"{where}: {what} raised {type(e).__name__}: {e}") from e


def _check_output_rules(d: OpDef) -> None:
    rules = d.output_dtype
    if isinstance(rules, (tuple, list)) and len(rules) != d.n_outputs:
        raise OpDefinitionError(
            f"op {d.name!r}: output_dtype gives {len(rules)} rules but the compute has "
            f"{d.n_outputs} outputs; give one per output, or a single rule for all"
        )
