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

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import tvm
from tvm import tirx
from tvm_ffi.structural import structural_walk

from .._explain import asm_of
from .._opdef import OpDef
from ..schedules import GENERIC, rules_for
from ..targets import target_arch
from ._report import LintResult

__all__ = [
    "asm_functions",
    "kernel_math_calls",
    "kernel_vector_moves",
    "kernel_vector_ops",
    "lint_prim_func",
    "loop_kinds",
]

_X86_NONARITH = re.compile(
    r"^v(mov|broadcast|pbroadcast|perm|shuf|unpck|punpck|insert|extract|zeroupper|zeroall|"
    r"blend|pblend|gather|scatter|pinsr|pextr|maskmov|compress|expand|align|palignr|pshuf|"
    r"xorps|xorpd|pxor|kmov|ktest|kortest|lddqu|movdqa|movdqu)"
)
_X86_PACKED = re.compile(r"(ps|pd|ph|bf16|ps2\w+|pd2\w+)$")
_NEON_OPERAND = re.compile(r"\bv\d+\.(2d|4s|8h|2s|4h|16b|8b)\b")
_SVE_OPERAND = re.compile(r"\bz\d+\.[bhsd]\b")
_A64_NONARITH = re.compile(
    r"^(mov|dup|ld\d|st\d|ldr|str|ldp|stp|ins|zip\d|uzp\d|ext|trn\d|ld1r\w*)"
)


def loop_kinds(func: tirx.PrimFunc) -> Counter:
    """How many loops of each ``ForKind`` (by name: SERIAL, PARALLEL, VECTORIZED, ...)."""
    kinds: Counter = Counter()
    structural_walk(func, [(tirx.For, lambda n: kinds.update([tirx.ForKind(int(n.kind)).name]))])
    return kinds


def _lower(func: tirx.PrimFunc, tgt: tvm.target.Target) -> tvm.IRModule:
    mod = tvm.IRModule.from_expr(func.with_attr("global_symbol", "main"))
    mod = tvm.tirx.transform.BindTarget(tgt.with_host(tgt))(mod)
    with tgt, tvm.transform.PassContext(opt_level=3):
        return tvm.tirx.get_tir_pipeline("default")[0](mod)


def _ramps(mod: Any) -> int:
    found: list[int] = []
    structural_walk(mod, [(tirx.Ramp, lambda n: found.append(1))])
    return len(found)


def asm_functions(asm: str) -> dict[str, str]:
    """Split assembly text into ``{function name: its lines}``."""
    names = set(re.findall(r"\.type\s+([\w.$]+),\s*[@%]function", asm))
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in asm.splitlines():
        m = re.match(r"^([\w.$]+):", line)
        if m and m.group(1) in names:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is not None:
            if line.lstrip().startswith(".Lfunc_end"):
                cur = None
                continue
            cur.append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def _is_kernel(fn: str, prim_name: str) -> bool:
    return prim_name in fn or "parallel_lambda" in fn


_X86_VMOVE = re.compile(r"^vmov(u|a)p[sd]$|^vmovdq[au]\d*$")
_A64_VMOVE = re.compile(r"^(ld1|st1|ldr|str|ldp|stp)$")


def kernel_vector_moves(asm: str, arch: str, prim_name: str) -> int:
    """Packed vector loads and stores in the kernel's own functions (``[xyz]mm`` moves on
    x86, ``q``/``v`` register loads and stores on aarch64): what a vectorized copy or
    transpose, which does no arithmetic, is made of."""
    n = 0
    for name, body in asm_functions(asm).items():
        if not _is_kernel(name, prim_name):
            continue
        for line in body.splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) != 2:
                continue
            mnem, ops = parts
            x86 = arch == "x86_64" and _X86_VMOVE.match(mnem) and "mm" in ops
            a64 = arch == "aarch64" and _A64_VMOVE.match(mnem) and (
                re.search(r"\bq\d+\b", ops) or _NEON_OPERAND.search(ops))
            if x86 or a64:
                n += 1
    return n


def kernel_vector_ops(asm: str, arch: str, prim_name: str) -> dict[str, int]:
    """Count vector arithmetic instructions in the kernel's own functions, by register width.

    Moves, shuffles and zeroing idioms do not count (the calling-convention wrapper spills a
    ``ymm`` register in every module).
    """
    counts: Counter = Counter()
    for name, body in asm_functions(asm).items():
        if not _is_kernel(name, prim_name):
            continue
        for line in body.splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) != 2 or parts[0].startswith("."):
                continue
            mnem, ops = parts
            if arch == "x86_64":
                if not mnem.startswith("v") or _X86_NONARITH.match(mnem):
                    continue
                if "%zmm" in ops:
                    counts["zmm"] += 1
                elif "%ymm" in ops:
                    counts["ymm"] += 1
                elif "%xmm" in ops and _X86_PACKED.search(mnem):
                    counts["xmm"] += 1
            elif arch == "aarch64":
                if _A64_NONARITH.match(mnem):
                    continue
                if _SVE_OPERAND.search(ops):
                    counts["sve"] += 1
                elif _NEON_OPERAND.search(ops):
                    counts["neon"] += 1
    return dict(counts)


#: Scalar math-library functions: a vectorized loop that calls one runs it once per lane.
_LIBM = re.compile(r"^(exp|exp2|expm1|log|log2|log10|log1p|erf|erfc|tanh|sinh|cosh|sin|cos|"
                   r"tan|asin|acos|atan|atan2|pow|cbrt)f?$")
_CALLS = ("call", "callq", "jmp", "bl", "b")


def kernel_math_calls(asm: str, prim_name: str) -> dict[str, int]:
    """Calls to scalar math-library functions (``expf``, ``erff``, ...) in the kernel's own
    functions, by name: what TVM's lowering of ``exp`` / ``tanh`` / ``erf`` / ``log`` leaves
    in a loop, whatever it vectorized (:func:`opsdk._vecmath.polynomial_math` replaces exp,
    sigmoid, tanh and erf in scheduled kernels).

    Examples
    --------
    >>> kernel_math_calls("k_compute_:\n\tcallq\texpf@PLT\n\tbl\ttanhf\n", "k")
    {'expf': 1, 'tanhf': 1}
    """
    counts: Counter = Counter()
    for name, body in asm_functions(asm).items():
        if not _is_kernel(name, prim_name):
            continue
        for line in body.splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and parts[0] in _CALLS:
                callee = parts[1].strip().split("@")[0]
                if _LIBM.match(callee):
                    counts[callee] += 1
    return dict(sorted(counts.items()))


def _parallel_launch(asm: str, prim_name: str) -> bool:
    return any(
        "TVMBackendParallelLaunch" in body
        for name, body in asm_functions(asm).items()
        if _is_kernel(name, prim_name)
    )


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
                ok = _parallel_launch(asm, prim_name)
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


def kernel_instruction_count(asm: str, mnemonic: str, prim_name: str) -> int:
    """How many times ``mnemonic`` occurs as an instruction in the kernel's own functions."""
    n = 0
    for name, body in asm_functions(asm).items():
        if _is_kernel(name, prim_name):
            n += sum(1 for line in body.splitlines() if line.split(None, 1)[:1] == [mnemonic])
    return n
