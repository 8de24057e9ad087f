"""``opsdk explain``: which rule lowers an op on a target, why, and what it lowers to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from . import model as M
from ._asm import asm_of, asm_vector_stats
from ._tir import tir_pipeline
from ._userfile import one_line
from .registry import builder, get_op
from .runners.local import host_arch
from .schedules import Choice, Kernel, last_choices, load_builtin_rules, rules_for
from .targets import target as resolve_target
from .targets import target_arch
from .transform import LowerOps

__all__ = ["Explanation", "ZooCheck", "build_single_op",
           "catch_all_rules", "check_zoo_model", "explain", "format_zoo_check"]


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
    return builder(d)(**tensors, **attrs)


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
        ex = tvm.compile(lowered, target=tgt, tir_pipeline=tir_pipeline())
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


# ------------------------------------------------------------------------ explain --zoo
@dataclass
class ZooCheck:
    """The structure of one zoo model on a target (``opsdk explain --zoo``): whether it
    compiles, its kernels on a catch-all rule (``x86.fallback`` / ``neon.fallback``: no rule
    of their kind took them), its heavy kernels with no vector instructions in their
    assembly, every problem of its kernel report and, on the host, its agreement with torch.
    """

    model: str
    target: str
    compiled: bool = False
    error: str | None = None
    kernels: int = 0
    compile_s: float = 0.0
    #: ``"<kernel> (<kind>, <rule>)"`` for each kernel on a catch-all rule or unscheduled
    #: (rule ``generic``).
    fallback: list[str] = field(default_factory=list)
    #: ``"<kernel> (<kind>, <rule>)"`` for each heavy kernel without vector instructions.
    unvectorized: list[str] = field(default_factory=list)
    #: Every problem :func:`opsdk.model.report` states (``explain --model --strict``'s list).
    problems: list[str] = field(default_factory=list)
    #: Output agreement with torch (host targets; None when not run).
    torch: dict[str, Any] | None = None
    #: With ``verify_kernels``: ``{"linked", "no_family", "gaps", "cases", "failed"}``: the
    #: kernels linked to a verify cell, those of no family, ``"<kernel>: <gap>"`` for each
    #: class verify never draws, the distinct kernel cases run and ``"<kernel> <status>:
    #: <command>"`` for each that failed (None when not run).
    kernel_cases: dict[str, Any] | None = None

    def failed(self, strict: bool = False) -> bool:
        """Whether this model fails the check (``strict``: any report problem too)."""
        return (not self.compiled or bool(self.fallback or self.unvectorized)
                or (self.torch is not None and not self.torch["ok"])
                or (self.kernel_cases is not None and bool(self.kernel_cases["failed"]))
                or (strict and bool(self.problems)))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def catch_all_rules() -> set[str]:
    """Names of the rules that take any kernel no rule of its kind took (``kind:any``)."""

    load_builtin_rules()
    return {r.name for r in rules_for(Kernel("", "opaque")) if "any" in r.kinds}


def _heavy_unvectorized(k: Any, limit: int) -> bool:
    """A kernel writing more than ``limit`` elements (or a symbolic count) whose assembly has
    no vector instruction (an elementwise copy: no vector load or store either)."""
    big = k.out_elements is None or k.out_elements > limit
    vec = sum(k.vector_ops.values()) + (k.vector_moves if k.kind == "elementwise" else 0)
    return big and not vec and k.kind != "opaque"


def check_zoo_model(z: Any, target: Any = "host", *, asm: bool = True,
                    numerics: bool = True, cache: Any = None,
                    verify_kernels: bool = False) -> ZooCheck:
    """Compile a zoo entry (:class:`opsdk.bench._zoo.ZooModel`) for ``target`` and state
    its structure (:class:`ZooCheck`). Nothing runs for a target other than the host (an arm
    target is cross-compiled only); on the host, with ``numerics``, the model runs once and
    its first output is compared with torch's (:func:`opsdk.model.within_tolerance`).
    ``verify_kernels``: each distinct kernel's own case runs through ``opsdk verify`` (on
    an arm target under qemu; ``ZooCheck.kernel_cases``).

    Examples
    --------
    >>> from opsdk.bench._zoo import ZOO
    >>> c = check_zoo_model(ZOO["unet_tiny"], "x86")  # doctest: +SKIP
    >>> c.compiled, c.fallback, c.torch["ok"]  # doctest: +SKIP
    (True, [], True)
    """

    tgt = resolve_target(target)
    name = str(target) if isinstance(target, str) else str(tgt)
    out = ZooCheck(z.name, name)
    try:
        module, args = z.build()
        m = M.LoadedModel.from_torch(z.name, module, tuple(args), baselines=False)
        cm = M.compile_model(m.opsdk_mod, tgt, cache=cache)
        rep = M.report(cm, target, profile=False, asm=asm, name=z.name,
                       verify_kernels=verify_kernels, source=m.opsdk_mod)
    except Exception as e:  # the check goes on to the next model
        out.error = one_line(e)
        return out
    if verify_kernels:
        out.kernel_cases = _kernel_cases(rep)
    out.compiled, out.kernels, out.compile_s = True, len(rep.kernels), cm.seconds
    catch_all = catch_all_rules()
    for k in rep.kernels:
        tag = f"{k.name} ({k.kind}, {k.rule})"
        if k.rule in catch_all or not k.scheduled:  # no rule of its kind, or none at all
            out.fallback.append(tag)
        if asm and tgt.kind.name == "llvm" and _heavy_unvectorized(k, M.SERIAL_LIMIT):
            out.unvectorized.append(tag)
    out.problems = list(rep.problems)
    if numerics and tgt.kind.name == "llvm" and target_arch(tgt) == host_arch():
        import torch

        try:
            vm = relax.VirtualMachine(cm.ex, tvm.cpu())
            got = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in m.inputs])
            with torch.no_grad():
                ref = M.torch_outputs(module(*args))
            out.torch = M.within_tolerance_all(M.vm_outputs(got), ref)
        except Exception as e:
            out.torch = {"ok": False, "error": f"run: {one_line(e)}"}
    return out


def _kernel_cases(rep: Any) -> dict[str, Any]:
    """:attr:`ZooCheck.kernel_cases` of a report whose kernels' cases ran."""
    cells = [k.verify for k in rep.kernels if k.verify is not None]
    return {"linked": sum(1 for v in cells if v["family"]),
            "no_family": sum(1 for v in cells if not v["family"]),
            "gaps": [f"{v['kernel']}: {g}" for v in cells for g in v["gaps"]],
            "cases": (rep.verified or {}).get("cases", 0),
            "failed": [f"{v['kernel']} {v['status']}: {v['command']}" for v in cells
                       if v.get("status") not in (None, "pass")]}


def format_zoo_check(rows: list[ZooCheck], *, strict: bool = False) -> str:
    """The ``opsdk explain --zoo`` table: one line per model, then the kernels named.

    Examples
    --------
    >>> print(format_zoo_check([ZooCheck("m", "arm", True, kernels=3)]))
    model  target  compiles  kernels  fallback  unvectorized  problems  torch  compile s
    m      arm     yes             3         0             0         0  -            0.0
    zoo check: 1 model, all pass
    """
    w = max([5, *(len(r.model) for r in rows)])
    wt = max([6, *(len(r.target) for r in rows)])
    lines = [f"{'model':<{w}}  {'target':<{wt}}  compiles  kernels  fallback  unvectorized  "
             f"problems  torch  compile s"]
    for r in rows:
        torch_s = "-" if r.torch is None else ("ok" if r.torch["ok"] else "FAIL")
        if not r.compiled:
            lines.append(f"{r.model:<{w}}  {r.target:<{wt}}  NO        {r.error}")
            continue
        lines.append(f"{r.model:<{w}}  {r.target:<{wt}}  {'yes':<8}  {r.kernels:>7}  "
                     f"{len(r.fallback):>8}  {len(r.unvectorized):>12}  {len(r.problems):>8}  "
                     f"{torch_s:<5}  {r.compile_s:>9.1f}")
    for r in rows:
        named = ([f"fallback: {k}" for k in r.fallback]
                 + [f"no vector instructions: {k}" for k in r.unvectorized])
        if strict:
            named += [f"problem: {p}" for p in r.problems]
        if r.torch is not None and not r.torch["ok"]:
            named.append("torch: " + (r.torch.get("error") or
                                      f"max abs error {r.torch['max_abs']:.3g} "
                                      f"(relative {r.torch['max_rel']:.3g})"))
        kc = r.kernel_cases
        if kc is not None:
            named.append(f"kernel cases: {kc['linked']} kernels linked to a verify cell "
                         f"({len(kc['gaps'])} gaps), {kc['no_family']} of no family; "
                         f"{kc['cases']} distinct cases run, {len(kc['failed'])} failed")
            named += [f"outside what verify draws: {g}" for g in kc["gaps"]]
            named += [f"kernel case failed: {f}" for f in kc["failed"]]
        lines += [f"  {r.model}: {n}" for n in named]
    bad = [r.model for r in rows if r.failed(strict)]
    n = f"{len(rows)} model{'s' if len(rows) != 1 else ''}"
    lines.append(f"zoo check: {n}, " + (f"{len(bad)} failed ({', '.join(bad)})" if bad
                                         else "all pass"))
    return "\n".join(lines)
