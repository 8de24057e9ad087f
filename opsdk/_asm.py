"""Structural facts of generated code, read by the verify lints, the model report and
``opsdk explain``: the kinds of a PrimFunc's loops, and from a kernel's assembly its vector
moves and arithmetic, its calls into libm and its instruction counts, and the work of one
call (operations and bytes).

Examples
--------
>>> from opsdk._asm import asm_vector_stats
>>> asm_vector_stats("vaddps %zmm1, %zmm2, %zmm3", "x86_64")
{'zmm': 3, 'ymm': 0}
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import tvm
from tvm import tirx
from tvm.s_tir.analysis import estimate_tir_flops
from tvm_ffi.structural import structural_mutate, structural_walk

__all__ = ["asm_functions", "asm_of", "asm_vector_stats", "kernel_instruction_count",
           "kernel_math_calls", "kernel_vector_moves", "kernel_vector_ops", "kernel_work",
           "loop_kinds",
           "parallel_launch"]


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


def _instructions(asm: str, prim_name: str) -> Iterator[tuple[str, str]]:
    """(mnemonic, operands) of every instruction with operands in the kernel's own functions
    (its parallel bodies included; directives skipped)."""
    for name, body in asm_functions(asm).items():
        if not _is_kernel(name, prim_name):
            continue
        for line in body.splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and not parts[0].startswith("."):
                yield parts[0], parts[1]


_X86_VMOVE = re.compile(r"^vmov(u|a)p[sd]$|^vmovdq[au]\d*$")
_A64_VMOVE = re.compile(r"^(ld1|st1|ldr|str|ldp|stp)$")


def kernel_vector_moves(asm: str, arch: str, prim_name: str) -> int:
    """Packed vector loads and stores in the kernel's own functions (``[xyz]mm`` moves on
    x86, ``q``/``v`` register loads and stores on aarch64): what a vectorized copy or
    transpose, which does no arithmetic, is made of."""
    n = 0
    for mnem, ops in _instructions(asm, prim_name):
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
    for mnem, ops in _instructions(asm, prim_name):
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


_LIBM = re.compile(r"^(exp|exp2|expm1|log|log2|log10|log1p|erf|erfc|tanh|sinh|cosh|sin|cos|"
                   r"tan|asin|acos|atan|atan2|pow|cbrt)f?$")
_CALLS = ("call", "callq", "jmp", "bl", "b")


def kernel_math_calls(asm: str, prim_name: str) -> dict[str, int]:
    r"""Calls to scalar math-library functions (``expf``, ``erff``, ...) in the kernel's own
    functions, by name: what TVM's lowering of ``exp`` / ``tanh`` / ``erf`` / ``log`` leaves
    in a loop, whatever it vectorized (:func:`opsdk._vecmath.polynomial_math` replaces exp,
    sigmoid, tanh and erf in scheduled kernels).

    Examples
    --------
    >>> asm = ".type k_compute_,@function\nk_compute_:\n\tcallq\texpf@PLT\n\tbl\ttanhf\n"
    >>> kernel_math_calls(asm, "k")
    {'expf': 1, 'tanhf': 1}
    """
    counts: Counter = Counter()
    for mnem, ops in _instructions(asm, prim_name):
        if mnem in _CALLS:
            callee = ops.strip().split("@")[0]
            if _LIBM.match(callee):
                counts[callee] += 1
    return dict(sorted(counts.items()))


def parallel_launch(asm: str, prim_name: str) -> bool:
    return any(
        "TVMBackendParallelLaunch" in body
        for name, body in asm_functions(asm).items()
        if _is_kernel(name, prim_name)
    )


def kernel_instruction_count(asm: str, mnemonic: str, prim_name: str) -> int:
    """How many times ``mnemonic`` occurs as an instruction in the kernel's own functions."""
    n = 0
    for name, body in asm_functions(asm).items():
        if _is_kernel(name, prim_name):
            n += sum(1 for line in body.splitlines() if line.split(None, 1)[:1] == [mnemonic])
    return n


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


def kernel_work(func: Any) -> tuple[float | None, int | None]:
    """(flops, bytes) of a scheduled kernel: TVM's operation count (None when the function
    has symbolic extents) and its parameters' bytes (None when a shape is symbolic)."""
    nbytes = 0
    for p in func.params:
        shape = getattr(p, "shape", None)
        if shape is None:
            return None, None
        n = 1
        for d in shape:
            if not isinstance(d, tirx.IntImm):
                return None, None
            n *= int(d.value)
        nbytes += n * max(1, p.dtype.bits * p.dtype.lanes // 8)
    try:
        flops = float(estimate_tir_flops(tvm.IRModule({"main": _without_lets(func)})))
    except Exception:  # TVM's estimate refuses some loops (symbolic, opaque): no count
        flops = None
    return flops, nbytes


def _without_lets(func: Any) -> Any:
    """``func`` with every ``Let`` expression (opsdk's polynomial math binds its
    intermediates with them; TVM's estimate refuses ``Let``) replaced by its value and body
    added together (the bound variable left free in the body): the same operations, plus
    one add per ``Let``. Only for counting."""
    def flat(node: Any, mut: Any) -> Any:
        node = mut.default_mutate(node)
        body, value = node.body, node.value
        if str(value.ty) != str(body.ty):
            value = tirx.Cast(str(body.ty), value)
        return tirx.Add(value, body)

    body = structural_mutate(func.body, [(tirx.Let, flat)])
    return func if body.same_as(func.body) else func.with_body(body)
