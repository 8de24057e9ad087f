"""``opsdk explain``: which rule lowers an op on a target, why, and what it lowers to."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import tvm
from tvm import relax, tirx

from .registry import get_op
from .schedules import Choice, last_choices
from .targets import target as resolve_target
from .targets import target_arch

__all__ = ["Explanation", "asm_of", "asm_vector_stats", "build_single_op", "explain"]


@dataclass
class Explanation:
    """The outcome of :func:`explain`."""

    op: str
    target: str
    rule: str
    reasons: list[str]
    tir: str
    claims: tuple[str, ...] = ()
    asm_stats: dict[str, int] = field(default_factory=dict)

    def format(self) -> str:
        lines = [f"op      opsdk.{self.op}", f"target  {self.target}", f"rule    {self.rule}"]
        if self.claims:
            lines.append(f"claims  {', '.join(self.claims)}")
        lines.append("why:")
        lines += [f"  - {r}" for r in self.reasons]
        if self.asm_stats:
            stats = ", ".join(f"{k}={v}" for k, v in self.asm_stats.items())
            lines.append(f"asm     {stats}")
        lines += ["lowered TIR:", self.tir]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``opsdk explain OP --json PATH``)."""
        d = asdict(self)
        d["claims"] = list(self.claims)
        return d


def build_single_op(
    op_name: str,
    shapes: Mapping[str, tuple],
    dtype: str,
    attrs: Mapping[str, Any],
) -> tvm.IRModule:
    """A Relax module ``main(inputs...) -> opsdk.<op>(inputs...)``; dims may be symbolic."""
    d = get_op(op_name)
    dtypes = d.dtypes_for(dtype, shapes)  # e.g. qdense: int8 x, float32 scales, int32 bias
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(list(s), dtypes[n])) for n, s in shapes.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(_call(d, dict(zip(shapes, params)), attrs)))
        bb.emit_func_output(out)
    return bb.get()


def _call(d, tensors: Mapping[str, relax.Var], attrs: Mapping[str, Any]) -> relax.Call:
    from .registry import builder

    return builder(d)(**tensors, **attrs)


def asm_vector_stats(asm: str, arch: str) -> dict[str, int]:
    """Count vector instructions by register class in assembly text.

    x86: instructions touching ``zmm`` (AVX-512) / ``ymm`` (AVX2) / ``xmm`` registers;
    aarch64: NEON (``v<n>.4s``-style operands) and SVE (``z<n>.s``) instructions.
    """
    if arch == "x86_64":
        return {
            "zmm": len(re.findall(r"%zmm\d+", asm)),
            "ymm": len(re.findall(r"%ymm\d+", asm)),
        }
    if arch == "aarch64":
        return {
            "neon": len(re.findall(r"\bv\d+\.(?:2d|4s|8h|16b|2s|4h|8b)\b", asm)),
            "sve": len(re.findall(r"\bz\d+\.[bhsd]\b", asm)),
        }
    return {}


def explain(
    op_name: str,
    target: Any = "x86",
    *,
    shape: tuple[int, ...] | None = None,
    dtype: str | None = None,
    attrs: Mapping[str, Any] | None = None,
    asm: bool = True,
) -> Explanation:
    """Explain how ``op_name`` is lowered for ``target``.

    The op is built in a Relax function whose leading dim is symbolic (as in a model with a
    dynamic batch), legalized under the target, and the driver's decision is returned with
    the scheduled TIR. With ``asm=True`` the function is also compiled and its vector
    instructions counted.

    Examples
    --------
    >>> import opsdk
    >>> e = opsdk.explain("layer_norm", "arm", asm=False)
    >>> e.rule
    'neon.rows'
    """
    d = get_op(op_name)
    dtype = dtype or d.dtypes[0]
    tgt = resolve_target(target)
    attrs = {**d.default_attrs(), **(attrs or {})}
    base = tuple(shape or max(d.examples, key=len))
    n = tirx.Var("n", "int64")
    prim = (n, *base[1:]) if shape is None else base
    shapes = d.example_shapes(prim, attrs)
    mod = build_single_op(d.name, shapes, dtype, attrs)
    before = len(last_choices())
    from .transform import LowerOps

    lowered = LowerOps(tgt)(mod)
    new = [c for c in last_choices()[before:] if c.op == d.name]
    choice: Choice | None = new[-1] if new else None
    funcs = [
        f
        for f in lowered.functions.values()
        if isinstance(f, tirx.PrimFunc) and f.attrs and f.attrs.get("opsdk.op") == d.name
    ]
    tir = funcs[0].script() if funcs else "<no PrimFunc>"
    stats: dict[str, int] = {}
    if asm and tgt.kind.name == "llvm":
        ex = tvm.compile(lowered, target=tgt)
        stats = asm_vector_stats(asm_of(ex), target_arch(tgt))
    return Explanation(
        op=d.name,
        target=str(target) if isinstance(target, str) else str(tgt),
        rule=choice.rule if choice else "generic",
        reasons=list(choice.reasons) if choice else ["no decision recorded"],
        tir=tir,
        claims=tuple(choice.claims) if choice else (),
        asm_stats=stats,
    )


def asm_of(ex: Any) -> str:
    """The assembly of a compiled executable's LLVM module ('' for other backends)."""
    for m in [ex.mod, *getattr(ex.mod, "imports", [])]:
        try:
            src = m.inspect_source("asm")
        except Exception:  # modules without an LLVM backend (the VM bytecode module)
            continue
        if src:
            return src
    return ""
