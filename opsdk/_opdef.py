"""Op definitions: one Python function is the schema, the TE compute and the entry point.

An op is declared once with :func:`opsdk.op` (:mod:`opsdk._declare`), which returns an
:class:`OpDef`. Its schema (tensor inputs, optional tensors, typed
attributes with defaults) is read from the compute's Python signature, the way
``torch.library.custom_op`` reads it. The result type is derived by tracing the compute on
(symbolic) TE placeholders; an author-written ``infer_type`` is checked against the trace when
the op is defined, so a definition that disagrees with itself never gets registered.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from tvm import te, tirx
from tvm.sym import Analyzer
from tvm.te import _ffi_api as te_api

from ._domains import Bounded, LogUniform
from ._dtypes import np_dtype
from ._vecmath import has_let
from .te_utils import narrow

_F32_MAX = float(np.finfo(np.float32).max)

__all__ = [
    "Axis",
    "OpDef",
    "OpDefinitionError",
    "Param",
    "Tensor",
]


class OpDefinitionError(TypeError):
    """An op definition is inconsistent (raised when the op is defined, not when used)."""


class Tensor:
    """Annotation marker for a tensor input of an op compute (a ``te.Tensor`` at trace time)."""


class _AxisMarker:
    def __repr__(self) -> str:
        return "Axis"


#: Annotation for an integer attribute that names an axis of the first tensor input.
#: Negative values count from the end; the compute and reference receive it normalized.
Axis = Annotated[int, _AxisMarker()]

_ATTR_TYPES = (int, float, bool, str)

#: The longest op name: ``test_NAME_schedules.py`` and the kernels' symbol names built from it
#: stay far below the 255-byte file-name limit (``opsdk new-op`` applies the same limit).
MAX_OP_NAME = 64


@dataclass(frozen=True)
class Param:
    """One parameter of an op schema.

    ``kind`` is ``"tensor"`` or ``"attr"``. Attributes carry their Python type, their
    allowed values (from ``Literal[...]``) and whether they name an axis.
    """

    name: str
    kind: str
    optional: bool = False
    type: type | None = None
    default: Any = inspect.Parameter.empty
    choices: tuple[Any, ...] | None = None
    is_axis: bool = False

    @property
    def required(self) -> bool:
        return self.kind == "attr" and self.default is inspect.Parameter.empty


def _shape_tuple(t: te.Tensor) -> tuple[Any, ...]:
    return tuple(int(s) if isinstance(s, tirx.IntImm) else s for s in t.shape)


#: Names of every op defined in this process, registered or not (see defined_op_names).
_DEFINED_NAMES: set[str] = set()


def defined_op_names() -> frozenset[str]:
    """Names of every :class:`OpDef` created in this process (registered or not)."""
    return frozenset(_DEFINED_NAMES)


@dataclass
class OpDef:
    """A declared op: schema, TE compute, float64 reference and capability matrix.

    Create one with the :func:`op` decorator rather than directly.
    """

    name: str
    compute: Callable[..., te.Tensor]
    reference: Callable[..., np.ndarray]
    params: tuple[Param, ...]
    dtypes: tuple[str, ...]
    ranks: tuple[int, int]
    input_dtypes: dict[str, tuple[str, ...]]
    free_dims: dict[str, tuple[int, int]]
    input_shapes: Callable[[tuple, dict], dict[str, tuple]] | None
    check: Callable[[dict, dict, dict], None] | None
    infer_type: Callable[[dict, dict, dict], tuple[tuple, str]] | None
    layouts: dict[str, dict[str, Any]]
    domain: dict[str, tuple[float, float] | LogUniform | Bounded]
    attr_domain: dict[str, Any]
    kind: str
    doc: str
    examples: tuple[tuple[int, ...], ...]
    module: str = ""
    source: str = "builtin"
    rules: list = field(default_factory=list)
    # the output dtype contract (see :func:`op`): None = the first input's dtype, a dtype, the
    # name of an attribute holding it, or ``f(dtypes, attrs) -> dtype``
    output_dtype: Any = None  # or a tuple of such rules, one per output
    # framework mappings and fusion rules that carry models to this op (see :meth:`torch`,
    # :meth:`fusion`): aten overload -> converter (None: the default one), and
    # (rule name, factory returning (pattern, build))
    # the reference follows the op's documented semantics for inf / NaN / huge inputs, so
    # verify draws them too (the ``special`` data recipe)
    special_values: bool = False
    # axis of the first input -> the multiple its length must be (a q4_0 K of whole 32-weight
    # blocks): verify rounds the lengths it draws up to it (see :func:`op`)
    dim_multiples: dict[int, int] = field(default_factory=dict)
    # outputs of the compute (a tuple of tensors when > 1), found by the definition-time trace
    n_outputs: int = 1
    # free named dim -> the size it takes where none is chosen: an int, or
    # ``f(primary_shape, attrs)`` (attention's key/value heads: the query heads); a dim not
    # here takes 8 within its range (see :meth:`free_defaults`)
    free_dim_defaults: dict[str, Any] = field(default_factory=dict)
    # tensor inputs that are compile-time constants in a model (see :func:`op`): verify's
    # packed cases bind them as constants, as a model's weights are
    weights: tuple[str, ...] = ()
    torch_maps: dict[str, Callable | None] = field(default_factory=dict)
    # ONNX op types -> converter (None: the default one), used by opsdk.frontend.from_onnx
    onnx_maps: dict[str, Callable | None] = field(default_factory=dict)
    fusions: list[tuple[str, Callable[[], tuple[Any, Callable]]]] = field(default_factory=list)
    # aten ops kept whole through torch's decomposition for the torch mappings, and the
    # converters of mapped overloads for when the mapping is not applied (see :meth:`torch`)
    torch_keep: list[str] = field(default_factory=list)
    torch_unmapped: dict[str, Callable] = field(default_factory=dict)
    # TVM ops this op replaces: (TVM op, factory returning (pattern, build), (ONNX operator,
    # first opset) or None), see :meth:`replaces`
    replacements: list[tuple[str, Callable[[], tuple[Any, Callable]], tuple[str, int] | None]] = \
        field(default_factory=list)

    def __post_init__(self) -> None:
        _DEFINED_NAMES.add(self.name)  # a rule for an op name no op has is a typo

    # ------------------------------------------------------------------ models
    def torch(self, *aten: str, convert: Callable | None = None,
              keep: Sequence[str] | None = None, unmapped: Callable | None = None) -> OpDef:
        """Map torch ATen overloads (``"hardswish.default"``, as ``node.target.__name__``
        names them) to this op in :func:`opsdk.frontend.from_torch`.

        The default converter passes the node's positional arguments as the op's tensor
        inputs, in order, and its keyword arguments named like the op's attributes as
        those; ``convert(node, importer) -> relax.Expr`` does anything else. The mapped ops
        are kept out of torch's decomposition, so they reach the converter whole; each
        import records how many nodes every mapping converted (:func:`opsdk.frontend.
        mapping_counts`). Returns the op, so it chains.

        ``keep`` names the aten ops kept out of the decomposition instead (``"layer_norm"``
        for both ``layer_norm.default`` and the ``native_layer_norm.default`` it becomes
        otherwise; ``()`` for none); ``unmapped(node, importer)`` converts the overloads when
        this mapping is not applied (``from_torch(ops=...)`` without the op), for an aten op
        TVM's importer has no converter of its own for.

        Examples
        --------
        >>> import opsdk
        >>> from tvm import te
        >>> @opsdk.op(reference=lambda x: x * 2)
        ... def twice(x: opsdk.Tensor) -> te.Tensor:
        ...     return te.compute(x.shape, lambda *i: x(*i) * 2, name="twice")
        >>> sorted(twice.torch("mul.Tensor").torch_maps)
        ['mul.Tensor']
        """
        for name in aten:
            if not isinstance(name, str) or not name or " " in name:
                raise OpDefinitionError(
                    f"op {self.name!r}: torch mapping {name!r} is not an aten overload name; "
                    "pass e.g. 'hardswish.default' (node.target.__name__ in an exported graph)")
            self.torch_maps[name] = convert
            if unmapped is not None:
                self.torch_unmapped[name] = unmapped
        for name in aten if keep is None else keep:
            if name not in self.torch_keep:
                self.torch_keep.append(name)
        return self

    def onnx(self, *op_types: str, convert: Callable | None = None) -> OpDef:
        """Map ONNX operator types (``"HardSwish"``) to this op in
        :func:`opsdk.frontend.from_onnx`: each such node is converted straight to the op,
        instead of TVM's own (often decomposed) import.

        The default converter passes the node's inputs as the op's tensor inputs, in order,
        and its attributes named like the op's attributes as those; ``convert(inputs,
        attrs) -> relax.Expr`` (the Relax inputs and the node's attributes) does anything
        else. Each import records how many nodes every mapping converted
        (:func:`opsdk.frontend.onnx_mapping_counts`). Returns the op, so it chains.

        Examples
        --------
        >>> import opsdk
        >>> from tvm import te
        >>> @opsdk.op(reference=lambda x: x * 2)
        ... def twice_onnx(x: opsdk.Tensor) -> te.Tensor:
        ...     return te.compute(x.shape, lambda *i: x(*i) * 2, name="twice")
        >>> sorted(twice_onnx.onnx("Double").onnx_maps)
        ['Double']
        """
        for name in op_types:
            if not isinstance(name, str) or not name.isidentifier():
                raise OpDefinitionError(
                    f"op {self.name!r}: ONNX mapping {name!r} is not an ONNX operator type; "
                    "pass e.g. 'HardSwish' (node.op_type in the model)")
            self.onnx_maps[name] = convert
        return self

    def fusion(self, name: str | None = None) -> Callable:
        """Decorator: a fusion rule that rewrites a Relax subgraph into this op, run by
        :func:`opsdk.transform.FuseIntoOps` (after common-subexpression elimination) with the
        built-in rules, and listed by ``opsdk list``.

        The decorated function takes no argument and returns ``(pattern, build)``: a
        ``tvm.relax.dpl`` pattern and ``build(matched_call, matchings) -> relax.Expr | None``
        (None leaves a near miss alone), or a list of such pairs tried in order (the
        spellings of one subgraph: with and without a bias, say). The rule is named
        ``fuse.<op>`` (or ``name``). For a multi-output op, ``build`` returns ``(call,
        {expr: output_index})`` naming the output that replaces the matched root and any other
        matched expression the op computes (docs/authoring.md, "Ops with several outputs").

        Examples
        --------
        >>> import opsdk
        >>> from tvm import te
        >>> from tvm.relax.dpl import is_op, wildcard
        >>> @opsdk.op(reference=lambda x, y: x + y)
        ... def add2(x: opsdk.Tensor, y: opsdk.Tensor) -> te.Tensor:
        ...     return te.compute(x.shape, lambda *i: x(*i) + y(*i), name="add2")
        >>> @add2.fusion()
        ... def _an_add():
        ...     x, y = wildcard(), wildcard()
        ...     return is_op("relax.add")(x, y), lambda call, m: opsdk.relax.add2(m[x], m[y])
        >>> [n for n, _ in add2.fusions]
        ['fuse.add2']
        """

        def deco(fn: Callable[[], tuple[Any, Callable]]) -> Callable:
            rule = name or f"fuse.{self.name}"
            self.fusions[:] = [(n, f) for n, f in self.fusions if n != rule] + [(rule, fn)]
            return fn

        return deco

    def replaces(self, tvm_op: str, *, onnx: str | None = None,
                 since: int | None = None) -> Callable:
        """Decorator: a rule that swaps TVM's own op ``tvm_op`` (``"relax.nn.softmax"``, as
        TVM's importers emit it) for this op where it computes the same thing, run by
        :func:`opsdk.transform.ReplaceTVMOps` (and so by :func:`opsdk.frontend.from_onnx`).

        The decorated function takes no argument and returns ``(pattern, build)`` as for
        :meth:`fusion`; ``build`` returns None for a call this op cannot express (it then
        stays TVM's). The rule is named ``replace.<tvm_op>`` without ``relax.nn.``. ``onnx``
        and ``since`` name the ONNX operator TVM's importer turns into ``tvm_op`` and the
        first opset it does so at (listed in :data:`opsdk.frontend.ONNX_OPS`).

        Examples
        --------
        >>> import opsdk
        >>> from tvm import te
        >>> from tvm.relax.dpl import is_op, wildcard
        >>> @opsdk.op(reference=lambda x: x * (x > 0))
        ... def my_relu(x: opsdk.Tensor) -> te.Tensor:
        ...     return te.compute(x.shape, lambda *i: te.max(x(*i), 0), name="my_relu")
        >>> @my_relu.replaces("relax.nn.relu", onnx="Relu", since=14)
        ... def _tvm_relu():
        ...     x = wildcard()
        ...     return is_op("relax.nn.relu")(x), lambda call, m: opsdk.relax.my_relu(m[x])
        >>> [t for t, _, _ in my_relu.replacements]
        ['relax.nn.relu']
        """
        if not isinstance(tvm_op, str) or not tvm_op.startswith("relax."):
            raise OpDefinitionError(
                f"op {self.name!r}: replaces({tvm_op!r}) takes a TVM Relax op name such as "
                "'relax.nn.softmax'")
        if (onnx is None) != (since is None):
            raise OpDefinitionError(
                f"op {self.name!r}: replaces({tvm_op!r}) takes onnx= and since= together")
        info = None if onnx is None else (onnx, int(since))

        def deco(fn: Callable[[], tuple[Any, Callable]]) -> Callable:
            self.replacements[:] = [r for r in self.replacements if r[0] != tvm_op]
            self.replacements.append((tvm_op, fn, info))
            return fn

        return deco

    # ------------------------------------------------------------------ schema
    @property
    def tensor_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.kind == "tensor")

    @property
    def attr_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.kind == "attr")

    @property
    def primary(self) -> str:
        """Name of the first tensor input, which fixes rank, axes and dtype."""
        return self.tensor_params[0].name

    @property
    def op_name(self) -> str:
        """The registered Relax op name, ``opsdk.<name>``."""
        return f"opsdk.{self.name}"

    def error(self, arg: str, problem: str, fix: str) -> ValueError:
        """A ``ValueError`` naming this op, the argument and the fix."""
        return ValueError(f"{self.op_name}: argument '{arg}' {problem}; {fix}")

    # ------------------------------------------------------------------ attributes
    def bind_attrs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """Check attribute names, types and choices; fill defaults (axes not yet normalized)."""
        known = {p.name: p for p in self.attr_params}
        for key in attrs:
            if key not in known:
                tensors = [p.name for p in self.tensor_params]
                if key in tensors:
                    raise self.error(
                        key, "is a tensor input, not an attribute", "pass it positionally"
                    )
                raise self.error(
                    key,
                    "is not an attribute of this op",
                    f"known attributes: {sorted(known) or 'none'}",
                )
        out: dict[str, Any] = {}
        for p in self.attr_params:
            if p.name in attrs:
                v = attrs[p.name]
            elif p.required:
                raise self.error(p.name, "is required", f"pass {p.name}=<{p.type.__name__}>")
            else:
                v = p.default
            out[p.name] = self._coerce(p, v)
        return out

    def _coerce(self, p: Param, v: Any) -> Any:
        if isinstance(v, np.generic):
            v = v.item()
        want = p.type
        ok = isinstance(v, want) and not (want is not bool and isinstance(v, bool))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v, ok = float(v), True
        if not ok:
            raise self.error(
                p.name,
                f"must be {want.__name__}, got {type(v).__name__} {v!r}",
                f"pass a {want.__name__}",
            )
        if p.choices is not None and v not in p.choices:
            raise self.error(
                p.name, f"is {v!r}", f"allowed values: {', '.join(map(repr, p.choices))}"
            )
        if want is float and not math.isfinite(v):
            raise self.error(p.name, f"is {v!r}", "pass a finite float")
        if want is float and abs(v) > _F32_MAX:
            # The compute embeds it as a float32 constant (TVM refuses the literal).
            raise self.error(p.name, f"is {v!r}, beyond float32's range (the kernel's "
                             "constants are float32)", f"pass a value within +-{_F32_MAX:.4g}")
        if want is float and v != 0 and np.float32(v) == 0:
            # silently 0 in the kernel: an epsilon of 1e-300 is no epsilon (NaN rows)
            raise self.error(p.name, f"is {v!r}, which is 0 in float32 (the kernel's constants "
                             "are float32)", "pass 0, or a magnitude of at least 1.4e-45")
        return v

    def normalize_attrs(self, attrs: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """Normalize axis attributes against the primary input's rank."""
        out = dict(attrs)
        for p in self.attr_params:
            if p.is_axis:
                a = out[p.name]
                if not -rank <= a < rank:
                    raise self.error(
                        p.name,
                        f"is {a}, out of range for a rank-{rank} input '{self.primary}'",
                        f"use an axis in [{-rank}, {rank - 1}]",
                    )
                out[p.name] = a % rank
        return out

    # ------------------------------------------------------------------ type checking
    def validate(
        self,
        shapes: Mapping[str, tuple | None],
        dtypes: Mapping[str, str],
        attrs: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Validate inputs against the schema; return normalized attributes.

        ``shapes`` maps each present tensor input to its shape (ints or symbolic PrimExprs).
        Raises ``ValueError`` naming the op, the argument and what is allowed.
        """
        for p in self.tensor_params:
            if p.name not in shapes and not p.optional:
                raise self.error(p.name, "is missing", "pass a tensor for it")
        prim = self.primary
        pshape = shapes[prim]
        if pshape is None:
            raise self.error(
                prim, "has unknown rank", "give the Relax var a TensorType with a shape"
            )
        rank = len(pshape)
        lo, hi = self.ranks
        if not lo <= rank <= hi:
            allowed = f"rank {lo}" if lo == hi else f"rank {lo}..{hi}"
            raise self.error(prim, f"has rank {rank}", f"this op takes {allowed}")
        pdt = dtypes[prim]
        if pdt not in self.dtypes:
            raise self.error(
                prim, f"has dtype {pdt}", f"supported dtypes: {', '.join(self.dtypes)}"
            )
        for name, dt in dtypes.items():
            if name == prim:
                continue
            allowed = self.input_dtypes.get(name)
            if allowed is not None and dt not in allowed:
                raise self.error(name, f"has dtype {dt}", f"supported dtypes: {', '.join(allowed)}")
            if allowed is None and dt != pdt:
                raise self.error(
                    name, f"has dtype {dt} but '{prim}' is {pdt}", f"cast '{name}' to {pdt}"
                )
        nattrs = self.normalize_attrs(self.bind_attrs(attrs), rank)
        if self.input_shapes is not None:
            expected = self.input_shapes(tuple(pshape), nattrs)
            bound: dict[str, Any] = {}  # free named dims ("N") take the first size seen
            for name, shp in shapes.items():
                if name == prim or name not in expected:
                    continue
                want = tuple(expected[name])
                if shp is not None and len(shp) == len(want):
                    for i, w in enumerate(want):
                        if isinstance(w, str):
                            bound.setdefault(w, shp[i])
                    want = tuple(bound[w] if isinstance(w, str) else w for w in want)
                if (
                    shp is None
                    or len(shp) != len(want)
                    or not all(_dims_may_equal(a, b) for a, b in zip(shp, want))
                ):
                    raise self.error(
                        name,
                        f"has shape {_fmt(shp)} but must have shape {_fmt(want)} for '{prim}' of "
                        f"shape {_fmt(pshape)} and attributes {_fmt_attrs(nattrs)}",
                        "reshape it or change the attributes",
                    )
                unproven = [(a, b) for a, b in zip(shp, want) if not _dims_equal(a, b)]
                if unproven:
                    # Equal only at run time, maybe: the kernel would index one input with
                    # the other's extent and read out of bounds when they differ.
                    a, b = unproven[0]
                    # Two tirx.Var("c") are two dims: "c and c are different" needs saying.
                    which = (f"its {a} and the {a} of '{prim}' are two different tirx.Var "
                             "objects with one name (create the Var once and use it in both "
                             "shapes)" if str(a) == str(b) else
                             f"{a} and {b} are different symbolic dims")
                    raise self.error(
                        name,
                        f"has shape {_fmt(shp)}, which must equal {_fmt(want)} for '{prim}' of "
                        f"shape {_fmt(pshape)}, but {which}, which cannot be proven equal",
                        f"give both the same dim (e.g. R.match_cast '{name}' to shape "
                        f"{_fmt(want)}), which TVM checks at run time",
                    )
        if self.check is not None:
            try:
                self.check(dict(shapes), dict(dtypes), nattrs)
            except ValueError as e:
                msg = str(e)
                if not msg.startswith(self.op_name):
                    msg = f"{self.op_name}: {msg}"
                raise ValueError(msg) from None
            except Exception as e:  # a bug in check= itself: blame it, not the compute
                raise OpDefinitionError(
                    f"op {self.name}: check= raised {type(e).__name__}: {e}; check(shapes, "
                    "dtypes, attrs) raises ValueError to refuse a call, else returns None"
                ) from e
        return nattrs

    def trace(
        self, shapes: Mapping[str, tuple], dtypes: Mapping[str, str], attrs: Mapping[str, Any]
    ) -> te.Tensor:
        """Run the TE compute on placeholders of the given (possibly symbolic) shapes."""
        nattrs = self.validate(shapes, dtypes, attrs)
        args = [
            te.placeholder(shapes[p.name], dtypes[p.name], name=p.name)
            if p.name in shapes
            else None
            for p in self.tensor_params
        ]
        return self.call_compute(args, nattrs)

    def call_compute(
        self, tensors: Sequence[te.Tensor | None], nattrs: Mapping[str, Any]
    ) -> te.Tensor | tuple[te.Tensor, ...]:
        """Call the compute with tensors (None for absent optionals) and normalized attributes.

        Returns its tensor, or its tuple of tensors for a multi-output op.
        """
        out = self.compute(*tensors, **nattrs)
        if isinstance(out, te.Tensor):
            return _narrow_bf16_store(out)
        if (isinstance(out, (tuple, list)) and len(out) >= 2
                and all(isinstance(t, te.Tensor) for t in out)):
            return tuple(_narrow_bf16_store(t) for t in out)
        got = (f"a {type(out).__name__} of {len(out)}: "
               f"{', '.join(type(t).__name__ for t in out)}"
               if isinstance(out, (tuple, list)) else type(out).__name__)
        raise OpDefinitionError(
            f"op {self.name!r}: compute must return a te.Tensor or a tuple of two or more "
            f"te.Tensor (one per output), got {got}"
        )

    def declared_dtype(self, dtypes: Mapping[str, str], nattrs: Mapping[str, Any]) -> str:
        """The output dtype the op promises for these input dtypes and (bound) attributes.

        Examples
        --------
        >>> import opsdk
        >>> opsdk.get_op("gelu").declared_dtype({"x": "float16"}, {"approximate": "none"})
        'float16'
        >>> opsdk.get_op("quantize").declared_dtype({"x": "float32"}, {"out_dtype": "uint8"})
        'uint8'
        """
        return self.declared_dtypes(dtypes, nattrs)[0]

    def declared_dtypes(self, dtypes: Mapping[str, str], nattrs: Mapping[str, Any]
                        ) -> list[str]:
        """The promised dtype of each output (``output_dtype`` may give one rule per output;
        a single rule applies to all of them).

        Examples
        --------
        >>> import opsdk
        >>> opsdk.get_op("gelu").declared_dtypes({"x": "bfloat16"}, {"approximate": "none"})
        ['bfloat16']
        """
        rules = self.output_dtype
        if not isinstance(rules, (tuple, list)):
            rules = [rules] * self.n_outputs
        out = []
        for rule in rules:
            if rule is None:
                out.append(str(dtypes[self.primary]))
            elif callable(rule):
                out.append(str(rule(dict(dtypes), dict(nattrs))))
            else:
                out.append(str(nattrs[rule]) if self._names_attr(rule) else rule)
        return out

    def output_dtype_rule(self) -> str:
        """The output dtype contract in words (for reports and error messages)."""
        rule = self.output_dtype
        if isinstance(rule, (tuple, list)):
            return "per output: " + ", ".join(
                _dtype_rule_words(self, r) for r in rule)
        return _dtype_rule_words(self, rule)

    def _names_attr(self, rule: str) -> bool:
        return any(p.name == rule for p in self.attr_params)

    def result_type(
        self, shapes: Mapping[str, tuple], dtypes: Mapping[str, str], attrs: Mapping[str, Any]
    ) -> tuple[tuple, str]:
        """Output (shape, dtype): the author's ``infer_type`` if given, else the traced compute.
        A multi-output op has one per output: :meth:`result_types`."""
        if self.n_outputs != 1:
            raise TypeError(f"{self.op_name} has {self.n_outputs} outputs: use result_types")
        return self.result_types(shapes, dtypes, attrs)[0]

    def result_types(
        self, shapes: Mapping[str, tuple], dtypes: Mapping[str, str], attrs: Mapping[str, Any]
    ) -> list[tuple[tuple, str]]:
        """(shape, dtype) of each output: the author's ``infer_type`` (one pair, or a list of
        pairs for a multi-output op) if given, else the traced compute."""
        if self.infer_type is not None:
            nattrs = self.validate(shapes, dtypes, attrs)
            got = self.infer_type(dict(shapes), dict(dtypes), nattrs)
            pairs = [got] if self.n_outputs == 1 else list(got)
            return [(tuple(shape), str(dtype)) for shape, dtype in pairs]
        return [(_shape_tuple(t), str(t.dtype))
                for t in as_outputs(self.trace(shapes, dtypes, attrs))]

    # ------------------------------------------------------------------ examples
    def example_shapes(
        self,
        primary_shape: tuple,
        attrs: Mapping[str, Any],
        free: Mapping[str, int] | None = None,
    ) -> dict[str, tuple]:
        """Shapes of every tensor input for a primary shape (optionals included).

        Free named dims of ``input_shapes`` (e.g. a dense layer's ``"N"``) take their value
        from ``free``, else their default (:meth:`free_defaults`).
        """
        nattrs = self.normalize_attrs(self.bind_attrs(attrs), len(primary_shape))
        out = {self.primary: tuple(primary_shape)}
        derived = self.input_shapes(tuple(primary_shape), nattrs) if self.input_shapes else {}
        unknown = [k for k in derived if k not in {p.name for p in self.tensor_params[1:]}]
        if unknown:
            raise OpDefinitionError(
                f"op {self.name!r}: input_shapes returned {unknown[0]!r}, which is not a tensor "
                f"input after the first (inputs: {', '.join(p.name for p in self.tensor_params)})")
        sizes = self.free_defaults(tuple(primary_shape), nattrs)
        sizes.update(free or {})
        for p in self.tensor_params[1:]:
            if p.name in derived:
                dims = []
                for dim in derived[p.name]:
                    if isinstance(dim, str):
                        if dim not in sizes:
                            raise OpDefinitionError(
                                f"op {self.name!r}: input_shapes uses the free dim {dim!r}; "
                                f"declare its range with free_dims={{{dim!r}: (lo, hi)}}"
                            )
                        dim = sizes[dim]
                    dims.append(_as_dim(dim))
                out[p.name] = tuple(dims)
            else:
                out[p.name] = tuple(primary_shape)
        return out

    def free_defaults(self, primary_shape: tuple, nattrs: Mapping[str, Any]) -> dict[str, Any]:
        """The size each free named dim takes where none is chosen, for a first input of
        ``primary_shape`` and normalized attributes ``nattrs``: its declared default (a
        function of both, or an int), else 8 within its range."""
        out: dict[str, Any] = {}
        for k, (lo, hi) in self.free_dims.items():
            dflt = self.free_dim_defaults.get(k)
            if dflt is None:
                out[k] = min(hi, max(lo, 8))
            else:
                out[k] = _as_dim(dflt(tuple(primary_shape), dict(nattrs)) if callable(dflt)
                                 else dflt)
        return out

    def dtypes_for(self, primary_dtype: str, names: Sequence[str] | None = None) -> dict[str, str]:
        """Dtype of each tensor input when the first input has ``primary_dtype``."""
        names = [p.name for p in self.tensor_params] if names is None else list(names)
        return {
            n: primary_dtype if n == self.primary else self.input_dtypes.get(n, (primary_dtype,))[0]
            for n in names
        }

    def default_attrs(self) -> dict[str, Any]:
        """Defaults, with required attributes taken from ``attr_domain`` examples."""
        out = {}
        for p in self.attr_params:
            if not p.required:
                out[p.name] = p.default
            elif p.name in self.attr_domain:
                dom = self.attr_domain[p.name]
                if isinstance(dom, LogUniform):
                    out[p.name] = dom.typical
                else:
                    out[p.name] = dom[0] if isinstance(dom, (list, tuple)) else dom
        return out

    def run_reference(
        self, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any]
    ) -> np.ndarray:
        """Float64 reference from the (already rounded) inputs; absent optionals are None."""
        pshape = inputs[self.primary].shape
        nattrs = self.normalize_attrs(self.bind_attrs(attrs), len(pshape))
        args: list[np.ndarray | None] = []
        for p in self.tensor_params:
            a = inputs.get(p.name)
            if a is not None:
                a = np.asarray(a)
                if a.dtype.kind == "f" or a.dtype == np_dtype("bfloat16"):
                    a = a.astype(np.float64)
            args.append(a)
        out = self.reference(*args, **nattrs)
        if self.n_outputs == 1:
            return np.asarray(out)
        if not isinstance(out, (tuple, list)):
            raise TypeError(f"{self.op_name}: the reference returned a {type(out).__name__}, "
                            f"not a tuple of {self.n_outputs} arrays (one per output)")
        return tuple(np.asarray(o) for o in out)

    def rule(self, target_key: str, **kwargs: Any) -> Callable:
        """Decorator: register a schedule rule for this op (see :func:`opsdk.schedules.rule`)."""
        return _handler(self, "rule", "a schedule rule")(self, target_key, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any):
        """Build a Relax call of this op (the op must be registered)."""
        return _handler(self, "builder", "a Relax call")(self)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<opsdk op {self.name} ({self.source})>"


#: What :meth:`OpDef.rule` and calling an op hand over to: the schedule-rule decorator and the
#: Relax builder. The layers that own them (``opsdk.schedules``, ``opsdk.registry``) sit
#: above this module and install them when they load; ``opsdk.op`` loads both first.
_HANDLERS: dict[str, Callable] = {}


def install_handler(name: str, fn: Callable) -> None:
    """Install ``fn`` as the ``"rule"`` (``f(op, target_key, **kw)``) or ``"builder"``
    (``f(op) -> relax builder``) an op hands over to (done by opsdk.schedules and
    opsdk.registry on import)."""
    _HANDLERS[name] = fn


def _handler(d: OpDef, name: str, what: str) -> Callable:
    fn = _HANDLERS.get(name)
    if fn is None:
        raise RuntimeError(
            f"{d.op_name}: {what} needs opsdk's {'registry' if name == 'builder' else 'rules'}"
            ", which are not loaded; define ops with opsdk.op (import opsdk), not "
            "opsdk._declare.op")
    return fn


def _dtype_rule_words(d: OpDef, rule: Any) -> str:
    if rule is None:
        return f"same as input '{d.primary}'"
    if callable(rule):
        return f"{getattr(rule, '__name__', 'a function')}(dtypes, attrs)"
    return f"given by attribute '{rule}'" if d._names_attr(rule) else f"always {rule}"


def as_outputs(out: te.Tensor | Sequence[te.Tensor]) -> tuple[te.Tensor, ...]:
    """A compute's result as a tuple of its outputs (one element for a single-output op)."""
    return (out,) if isinstance(out, te.Tensor) else tuple(out)


def _dims_equal(a: Any, b: Any) -> bool:
    """Whether two dims are provably equal (the same value, or a symbolic difference that
    folds to 0)."""
    ia = a.value if isinstance(a, tirx.IntImm) else a
    ib = b.value if isinstance(b, tirx.IntImm) else b
    if isinstance(ia, (int, np.integer)) and isinstance(ib, (int, np.integer)):
        return int(ia) == int(ib)

    diff = Analyzer().simplify(tirx.const(0, "int64") + ia - ib)
    return isinstance(diff, tirx.IntImm) and diff.value == 0


def _dims_may_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return int(a) == int(b)
    ia = a.value if isinstance(a, tirx.IntImm) else a
    ib = b.value if isinstance(b, tirx.IntImm) else b
    if isinstance(ia, int) and isinstance(ib, int):
        return ia == ib

    diff = Analyzer().simplify(tirx.const(0, "int64") + ia - ib)
    # A symbolic difference that does not fold to a constant may still be zero at run time.
    return not (isinstance(diff, tirx.IntImm) and diff.value != 0)


def _as_dim(d: Any) -> Any:
    if isinstance(d, (int, np.integer)):
        return int(d)
    if isinstance(d, tirx.IntImm):
        return int(d.value)
    return d


def _fmt(shape: Any) -> str:
    if shape is None:
        return "unknown"
    dims = [str(_as_dim(s)) for s in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _fmt_attrs(attrs: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in attrs.items()) + "}"


#: Op kinds the generic rules and error models know (see :func:`op`).
def _narrow_bf16_store(out: te.Tensor) -> te.Tensor:
    # A compute's last ``.astype("bfloat16")`` of a result built with Let bindings (exp_f32,
    # erf_f32, bind) is rewritten as te_utils.narrow: TVM's bfloat16 store rounding copies
    # its operand, Let bindings and all, and its vectorizer then refuses the twice-bound
    # variables (docs/authoring.md). Same rounding, so nothing else changes.

    op = out.op
    if str(out.dtype) != "bfloat16" or not isinstance(op, te.ComputeOp) or len(op.body) != 1:
        return out
    body = op.body[0]
    if not isinstance(body, tirx.Cast) or str(body.value.ty) != "float32" or not has_let(body):
        return out
    new = te_api.ComputeOp(op.name, op.tag, op.attrs, op.axis, [narrow(body.value, "bfloat16")])
    return new.output(0)
