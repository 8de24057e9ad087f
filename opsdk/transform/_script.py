"""A printer for modules with constants and opsdk ops: TVM 0.27's ``mod.script(show_meta=True)``
segfaults in tvm_ffi's JSON serializer (``ToJSONGraph``, also behind ``tvm.ir.save_json``),
which crashes on any node with a dtype field (``IntImm``, ``PrimType``, ``TensorType``). The
printer's metadata holds such nodes for every ``relax.Constant`` (e.g. every imported model)
and for every call of an op it prints generically, as ``T.Call(..., ret_ty=metadata[...])``:
opsdk's ops."""

from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax

from .._walk import relax_exprs

__all__ = ["script"]

_REF = re.compile(r'metadata\["(ir\.GenericConst|relax\.expr\.Constant)"\]\[(\d+)\]')
# `gv: R.Tensor((n, 8), dtype="float32") = T.Call("opsdk.gelu", ..., ret_ty=metadata[...])`:
# the call's type is the binding's annotation, printed inline instead.
_BOUND_CALL = re.compile(r'^(\s*[\w.]+: )(.+?)( = T\.Call\(.*, ret_ty=)metadata\["[\w.]+"\]'
                         r'\[\d+\](\).*)$', re.M)
_ANY_REF = re.compile(r'metadata\["([\w.]+)"\]\[\d+\]')


def _constants(mod: tvm.IRModule) -> list:
    """Distinct constants in the order the printer meets them (functions by name)."""
    seen: list[relax.Constant] = []

    def visit(e: object) -> None:
        if not isinstance(e, tvm.ir.expr.Constant):
            return
        if isinstance(getattr(e, "value", None), tvm.runtime.Tensor) and not any(
                e.same_as(c) for c in seen):  # tensor constants (the metadata), not scalars
            seen.append(e)

    for gv in sorted(mod.get_global_vars(), key=lambda g: g.name_hint):
        func = mod[gv]
        if isinstance(func, relax.Function):
            for e in relax_exprs(func):
                visit(e)
    return seen


def _summary(c: tvm.ir.expr.Constant, values: int) -> str:
    a = c.value.numpy()
    head = np.array2string(a.reshape(-1)[:values], precision=6, separator=", ",
                           threshold=values, max_line_width=1 << 16)
    more = " ..." if a.size > values else ""
    stats = (f"  min {a.min():.6g} max {a.max():.6g} mean {a.astype(np.float64).mean():.6g}"
             if a.size and np.issubdtype(a.dtype, np.number) else "")
    return f"shape {list(a.shape)} {a.dtype}: {head[1:-1]}{more}{stats}"


def script(mod: tvm.IRModule, *, show_meta: bool = True, values: int = 8) -> str:
    """TVMScript of ``mod`` with its constants summarized (never the segfaulting metadata
    dump): each ``metadata["ir.GenericConst"][i]`` the text refers to is listed after
    it with its shape, dtype, first ``values`` values and range.

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((2, 2), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     _ = bb.emit_func_output(bb.emit(relax.op.add(x, relax.const(np.ones((2, 2), "f4")))))
    >>> print(opsdk.transform.script(bb.get()).splitlines()[-1])
    # [0] shape [2, 2] float32: 1., 1., 1., 1.  min 1 max 1 mean 1
    """
    text = _BOUND_CALL.sub(lambda m: m.group(1) + m.group(2) + m.group(3) + m.group(2)
                           + m.group(4), mod.script(show_meta=False))
    if not show_meta:
        return text
    found = _REF.findall(text)
    key = found[0][0] if found else "ir.GenericConst"
    refs = sorted({int(i) for _, i in found})
    consts = _constants(mod)
    text = text.replace("# Metadata omitted. Use show_meta=True in script() method to show it.",
                        "")
    lines = [text.rstrip("\n"), "", f'# constants (metadata["{key}"][i]):']
    if len(refs) == len(consts) and refs == list(range(len(consts))):
        lines += [f"# [{i}] {_summary(c, values)}" for i, c in enumerate(consts)]
    else:  # the printer's numbering could not be matched: list them without indices
        lines += [f"# {_summary(c, values)}" for c in consts]
    other = sorted({k for k in _ANY_REF.findall(text)} - {"ir.GenericConst",
                                                           "relax.expr.Constant"})
    if other:  # never dumped: serializing them is what crashes
        lines.append(f"# not shown: metadata[{', '.join(map(repr, other))}] (TVM 0.27 cannot "
                     "serialize them)")
    return "\n".join(lines)
