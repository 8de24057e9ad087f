"""IR and assembly lints: does the chosen schedule do what its rule claims?

A rule's ``claims`` (``"vectorize"``, ``"parallel"``, ``"insn:<mnemonic>"``) are checked on
structural facts, never on TIR text: the scheduled PrimFunc must hold a loop of that kind (or,
for ``vectorize``, ``Ramp`` vector expressions after TVM's lowering passes), and the kernel's
own functions in the generated assembly must hold packed vector arithmetic (``ymm``/``zmm``
or packed ``xmm`` on x86-64, ``v<n>.4s``-style NEON or ``z<n>.s`` SVE operands on aarch64),
the runtime's parallel launch, or the named instruction (``insn:vpdpbusd``, ``insn:sdot``).
The claims are checked on a static-shape build of the op's example; the symbolic-shape build
that verify runs is reported too (as ``warn``: TVM scalarizes a predicated vector loop whose
extent is symbolic, so dynamic dims may lose vector code).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tvm
from tvm import tirx
from tvm_ffi.structural import structural_walk

from .._asm import (
    asm_of,
    kernel_instruction_count,
    kernel_math_calls,
    kernel_vector_ops,
    loop_kinds,
    parallel_launch,
)
from .._opdef import OpDef
from ..schedules import GENERIC, rules_for
from ..targets import target_arch
from ._report import LintResult

__all__ = ["lint_prim_func"]


def _lower(func: tirx.PrimFunc, tgt: tvm.target.Target) -> tvm.IRModule:
    mod = tvm.IRModule.from_expr(func.with_attr("global_symbol", "main"))
    mod = tvm.tirx.transform.BindTarget(tgt.with_host(tgt))(mod)
    with tgt, tvm.transform.PassContext(opt_level=3):
        return tvm.tirx.get_tir_pipeline("default")[0](mod)


def _ramps(mod: Any) -> int:
    found: list[int] = []
    structural_walk(mod, [(tirx.Ramp, lambda n: found.append(1))])
    return len(found)


#: Scalar math-library functions: a vectorized loop that calls one runs it once per lane.
def lint_prim_func(
    d: OpDef,
    func: tirx.PrimFunc,
    ex: Any,
    tgt: tvm.target.Target,
    *,
    target_name: str,
    dtype: str,
    layout: str,
    symbolic: bool = False,
    prim_name: str = "",
) -> list[LintResult]:
    """Check the claims of the rule that scheduled ``func`` (compiled into ``ex``).

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify._engine import lint_cell
    >>> [x.status for x in lint_cell(opsdk.get_op("softmax"), "x86", "float32", "last")][:2]
    ['pass', 'pass']
    """
    rule = str((func.attrs or {}).get("opsdk.rule", GENERIC))
    claims: Sequence[str] = next((r.claims for r in rules_for(d) if r.name == rule), ())
    arch = target_arch(tgt)
    prim_name = prim_name or f"opsdk_{d.name}"
    where = dict(op=d.name, target=target_name, dtype=dtype, layout=layout, rule=rule)
    tag = " (symbolic dims)" if symbolic else ""
    out: list[LintResult] = []
    if not claims:
        out.append(LintResult(**where, check="claims" + tag, status="skip",
                              detail=f"rule {rule} claims nothing"))
        return out
    kinds = loop_kinds(func)
    asm = asm_of(ex) if tgt.kind.name == "llvm" else ""
    for claim in claims:
        if claim == "vectorize":
            vec_loops = kinds.get("VECTORIZED", 0)
            ramps = -1  # lowering TIR is slow: only when the loops alone do not settle it
            if not symbolic:
                if not vec_loops:
                    ramps = _ramps(_lower(func, tgt))
                ok = vec_loops > 0 or ramps > 0
                detail = f"{vec_loops} vectorized loops" + (
                    f", {ramps} Ramp nodes after lowering" if ramps >= 0 else "")
                out.append(LintResult(**where, check="vectorize:tir",
                                      status="pass" if ok else "fail", detail=detail))
            if asm:
                vec = kernel_vector_ops(asm, arch, prim_name)
                ok = sum(vec.values()) > 0
                detail = ", ".join(f"{k}={v}" for k, v in sorted(vec.items())) or "none"
                if not ok and vec_loops:
                    detail += "; the vectorized loop was scalarized"
                out.append(LintResult(
                    **where, check="vectorize:asm" + tag,
                    status="pass" if ok else ("warn" if symbolic else "fail"),
                    detail=f"vector arithmetic in the kernel: {detail}",
                ))
                calls = kernel_math_calls(asm, prim_name)
                out.append(LintResult(
                    **where, check="vectorize:math" + tag, status="fail" if calls else "pass",
                    detail=("scalar math calls per element: " + ", ".join(
                        f"{k} x{v}" for k, v in calls.items())) if calls
                    else "no scalar math-library calls"))
        elif claim == "parallel":
            if symbolic:
                continue
            n = kinds.get("PARALLEL", 0)
            out.append(LintResult(**where, check="parallel:tir", status="pass" if n else "fail",
                                  detail=f"{n} parallel loops"))
            if asm:
                ok = parallel_launch(asm, prim_name)
                out.append(LintResult(
                    **where, check="parallel:asm", status="pass" if ok else "fail",
                    detail="calls TVMBackendParallelLaunch" if ok else "no parallel launch",
                ))
        elif claim.startswith("insn:"):
            # A named instruction the rule is there for (vpdpbusd, sdot): counted in the
            # kernel's own assembly, so a rule that silently fell back to plain SIMD fails.
            if symbolic or not asm:
                continue
            mnem = claim[len("insn:"):]
            n = kernel_instruction_count(asm, mnem, prim_name)
            out.append(LintResult(**where, check=claim, status="pass" if n else "fail",
                                  detail=f"{n} {mnem} in the kernel"))
        else:
            out.append(LintResult(**where, check=claim, status="skip",
                                  detail=f"no lint for claim {claim!r}"))
    return out


