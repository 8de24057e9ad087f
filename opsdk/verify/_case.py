"""A verification example (:class:`Case`) and the validity of an op's example shapes: the
plain data every strategy (random draws, op corners, kernel corners) builds on."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .._opdef import OpDef

__all__ = ["Case", "cell_dtypes", "input_dtypes", "is_valid", "layout_attrs"]


@dataclass(frozen=True)
class Case:
    """One verification example: everything needed to rebuild the kernel and its inputs.

    Examples
    --------
    >>> from opsdk.verify import Case
    >>> c = Case("gelu", "x86", "float32", "erf", (3, 17), {"approximate": "none"}, (), {}, 7)
    >>> Case.from_json(c.to_json()) == c
    True
    """

    op: str
    target: str
    dtype: str
    layout: str
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    present: tuple[str, ...] = ()  # optional tensor inputs that are passed
    data: dict[str, str] = field(default_factory=dict)  # recipe per tensor input
    seed: int = 0
    static: bool = False  # compile with every dim static (else symbolic dims)
    free: dict[str, int] = field(default_factory=dict)  # sizes of free named dims ("N")
    # the op's weights (``OpDef.weights``) bound as constants, as in a model: the rules pack
    # them in a function of their own, which a model folds at compile time
    packed: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["present"] = list(self.present)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Case:
        known = {f for f in cls.__dataclass_fields__}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown case fields {sorted(extra)}; known: {sorted(known)}")
        kw = dict(d)

        def whole(field: str, v: Any) -> int:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                raise ValueError(f"case field {field!r}: {v!r} is not a whole number")
            return int(v)

        kw["shape"] = tuple(whole("shape", s) for s in kw.get("shape", ()))
        kw["present"] = tuple(kw.get("present", ()))
        kw["attrs"] = dict(kw.get("attrs", {}))
        kw["data"] = dict(kw.get("data", {}))
        kw["free"] = {k: whole(f"free.{k}", v) for k, v in kw.get("free", {}).items()}
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> Case:
        return cls.from_dict(json.loads(text))

    def __hash__(self) -> int:
        return hash(self.to_json())


def cell_dtypes(d: OpDef) -> tuple[str, ...]:
    """The dtype axis of the capability matrix: the dtypes the primary input may have."""
    return tuple(d.dtypes)


def input_dtypes(d: OpDef, dtype: str, names: Sequence[str]) -> dict[str, str]:
    """Dtype of each named input when the primary input has ``dtype``: the same, or the
    first dtype the op lists for that input (``input_dtypes``)."""
    return d.dtypes_for(dtype, names)


def layout_attrs(d: OpDef, layout: str) -> dict[str, Any]:
    """Default attributes with the layout's settings applied (required ones from attr_domain)."""
    return {**d.default_attrs(), **d.layouts[layout]}


def _present_shapes(d: OpDef, shape: Sequence[Any], attrs: Mapping[str, Any],
                    present: Sequence[str], free: Mapping[str, Any] | None = None
                    ) -> dict[str, tuple]:
    shapes = d.example_shapes(tuple(shape), attrs, free=dict(free or {}))
    keep = {p.name for p in d.tensor_params if not p.optional} | set(present)
    return {k: v for k, v in shapes.items() if k in keep}


def is_valid(d: OpDef, shape: Sequence[int], dtype: str, attrs: Mapping[str, Any],
             present: Sequence[str], free: Mapping[str, Any] | None = None) -> bool:
    """Whether the op accepts this combination (``d.validate`` does not raise); free named
    dims without a size in ``free`` take their defaults."""
    try:
        shapes = _present_shapes(d, shape, attrs, present, free)
        d.validate(shapes, input_dtypes(d, dtype, list(shapes)), attrs)
    except ValueError:
        return False
    return True
