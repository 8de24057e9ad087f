"""Target strategy: per-op schedule rules keyed by TVM target keys, chosen by one driver.

A rule is a small dlight-style function ``f(func, target) -> s_tir.Schedule | None``. Rules
never check the target themselves: the driver filters them by target key (``cpu``,
``arm_cpu``, ``cuda``, ...) and required features (``avx512f``, ``dotprod``, ``arch:x86_64``),
tries them by descending priority (like Relay's OpStrategy plevels) and records why each one
was taken or passed over. The unscheduled generic lowering is always the last resort.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx
from tvm.target import Target, codegen

from .._opdef import defined_op_names, install_handler
from .._vecmath import polynomial_math
from ..ops import BUILTIN_OPS
from ..targets import target_features
from ._core import bool_compares_as_int8, serial_asserts, vector_lanes, vectorize_loop
from ._kernels import KERNEL_KINDS, WINOGRAD_TAG, Kernel, classify, kernel_for
from ._memo import (
    memoized,
    nothing_decided,
    rebuild_memo,
    remember,
    reused_decisions,
    switched_on,
)
from ._tuned import (
    TUNED_PRIORITY,
    TunedRecord,
    apply_trace,
    tensor_intrinsics,
    tuned_rule_fn,
    workload_key,
)

__all__ = [
    "BUILTIN_RULE_MODULES",
    "KERNEL_KINDS",
    "RULE_FAILURES",
    "TUNED_PRIORITY",
    "WINOGRAD_TAG",
    "Choice",
    "Kernel",
    "Rule",
    "TunedRecord",
    "apply_schedule",
    "apply_trace",
    "choose",
    "classify",
    "deferred_scheduling",
    "generic_only",
    "kernel_for",
    "load_builtin_rules",
    "memoized",
    "nothing_decided",
    "rebuild_memo",
    "registered_rules",
    "remember",
    "reused_decisions",
    "rule",
    "rule_failures",
    "rules_for",
    "scheduling_deferred",
    "tensor_intrinsics",
    "tuned_rules",
    "vector_lanes",
    "vectorize_loop",
    "workload_key",
]

#: Modules holding the built-in rules, imported explicitly (no import-time discovery).
BUILTIN_RULE_MODULES: tuple[str, ...] = (
    "opsdk.schedules.cpu.x86",
    "opsdk.schedules.arm_cpu.neon",
    "opsdk.schedules.cpu.vnni",
    "opsdk.schedules.cpu.avx2",
    "opsdk.schedules.arm_cpu.dotprod",
)

GENERIC = "generic"
#: PrimFunc attribute listing the rules that raised on a kernel (see :func:`rule_failures`).
RULE_FAILURES = "opsdk.rule_failures"


@dataclass(frozen=True)
class Rule:
    """A schedule rule.

    ``ops`` names the ops it is for; ``kinds`` the op kinds (``elementwise``, ``norm``,
    ``reduction``) it applies to generically. ``claims`` lists structural facts verify lints
    check on its output (``"vectorize"``, ``"parallel"``).
    """

    name: str
    fn: Callable[[tirx.PrimFunc, Target], s_tir.Schedule | None]
    target_key: str
    ops: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    priority: int = 0
    claims: tuple[str, ...] = ()
    doc: str = ""

    def matches_op(self, op) -> bool:
        if "any" in self.kinds and isinstance(op, Kernel):  # fallbacks: model kernels only
            return True
        return op.name in self.ops or op.kind in self.kinds


@dataclass
class Choice:
    """The driver's decision for one op on one target, kept for ``opsdk explain``."""

    op: str
    target: str
    rule: str
    claims: tuple[str, ...]
    reasons: list[str] = field(default_factory=list)
    kind: str = ""  # the op's kind, or a model kernel's classified kind
    func: tirx.PrimFunc | None = None
    schedule: s_tir.Schedule | None = None  # the chosen rule's schedule (None: generic)
    #: ``"<rule>: <ErrorType>: <message>"`` for each rule that raised on this function (the
    #: next rule or the generic lowering took it); also the kernel's ``opsdk.rule_failures``.
    failures: list[str] = field(default_factory=list)


_RULES: list[Rule] = []
_LOADED = False


def rule(
    op_or_kinds: object,
    target_key: str,
    *,
    name: str | None = None,
    requires: Sequence[str] = (),
    priority: int = 0,
    claims: Sequence[str] = (),
) -> Callable:
    """Decorator registering a schedule rule.

    Parameters
    ----------
    op_or_kinds
        An :class:`~opsdk.OpDef`, an op name, or ``kind:<kind>`` (e.g. ``"kind:norm"``) for a
        rule that applies to every op of that kind; a sequence of these is accepted.
    target_key
        TVM target key the rule is for (``"cpu"``, ``"arm_cpu"``, ``"cuda"``).
    requires
        Target features that must all be present (see :func:`opsdk.targets.target_features`).
    priority
        Higher runs first.
    claims
        Structural facts of the produced schedule, checked by ``opsdk verify``:
        ``"vectorize"``, ``"parallel"``, ``"insn:<mnemonic>"`` (that instruction in the
        kernel's assembly, e.g. ``"insn:vpdpbusd"``).

    Examples
    --------
    >>> from opsdk.schedules import rule
    >>> @rule("kind:elementwise", "cpu", name="demo.noop", priority=-100)
    ... def _noop(func, target):
    ...     return None
    """
    items = op_or_kinds if isinstance(op_or_kinds, (list, tuple)) else [op_or_kinds]
    ops, kinds = [], []
    for it in items:
        if isinstance(it, str) and it.startswith("kind:"):
            kinds.append(it[5:])
        else:
            ops.append(it if isinstance(it, str) else it.name)
    whom = ", ".join([*ops, *(f"kind:{k}" for k in kinds)]) or "no op"

    def deco(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"schedule rule {name or '(unnamed)'} for {whom}: @rule decorates "
                            "a function (func, target) -> Schedule | None, got "
                            f"{type(fn).__name__}")
        rname = name or f"{target_key}.{getattr(fn, '__name__', 'rule').lstrip('_')}"
        _check_rule_signature(fn, f"schedule rule {rname} for {whom}")
        _check_rule_ops(fn, f"schedule rule {rname}", ops)
        # Checked here, where the rule has its name: a typo names the rule, its ops and the
        # valid choices at definition, instead of a rule that silently never applies.
        _check_rule_args(f"schedule rule {rname} for {whom}", target_key, kinds, requires,
                         claims)
        if isinstance(priority, bool) or not isinstance(priority, (int, float)) \
                or priority != priority:  # else every choose() on the target raised TypeError
            raise ValueError(f"schedule rule {rname} for {whom}: priority={priority!r} must "
                             "be a number (higher runs first)")
        r = Rule(
            name=rname,
            fn=fn,
            target_key=target_key,
            ops=tuple(ops),
            kinds=tuple(kinds),
            requires=tuple(requires),
            priority=priority,
            claims=tuple(claims),
            doc=(fn.__doc__ or "").strip().split("\n")[0],
        )
        # Re-defining a rule of the same name (module reload) replaces it.
        _RULES[:] = [x for x in _RULES if x.name != r.name]
        _RULES.append(r)
        return fn

    return deco


def _check_rule_signature(fn: Callable, who: str) -> None:
    """Refuse a rule that cannot be called as ``fn(func, target)``: the driver's call raised
    on every kernel, a warning each time, and the generic lowering ran unverified."""

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    try:
        sig.bind(None, None)
    except TypeError:
        raise TypeError(f"{who}: {getattr(fn, '__name__', fn)!s}{sig} cannot be called as "
                        "(func, target); define it as def rule(func, target) -> "
                        "s_tir.Schedule | None") from None


def _check_rule_ops(fn: Callable, who: str, ops: Sequence[str]) -> None:
    """Refuse a rule for an op name no op has: a typo made a rule that never applied.

    Only a user's rule is checked (built-in rule modules may load before the built-in
    ops); its op must be defined first, as ``@myop.rule(...)`` makes sure."""
    if str(getattr(fn, "__module__", "")).startswith("opsdk."):
        return
    known = defined_op_names() | {d.name for d in BUILTIN_OPS}
    for o in ops:
        if o in known:
            continue

        m = difflib.get_close_matches(o, sorted(known), n=1)
        raise ValueError(f"{who}: no op named {o!r} is defined"
                         + (f" (did you mean {m[0]!r}?)" if m else "")
                         + "; define the op before its rules (or use @myop.rule(...)), "
                         "or key the rule by kind ('kind:elementwise')")


#: TVM target keys a rule may be keyed by (``Target(...).keys``).
TARGET_KEYS = ("cpu", "arm_cpu", "cuda", "gpu", "rocm", "opencl", "vulkan", "metal",
               "hexagon", "webgpu")
_RULE_KINDS = ("elementwise", "reduction", "norm", "dense", "any", "matmul", "conv2d", "winograd",
               "pool", "opaque")


def _known_features(target_key: str) -> frozenset[str] | None:
    """Every LLVM CPU feature some CPU of the key's architectures has (``cpu``: x86_64 and
    aarch64, whose targets carry it too; ``arm_cpu``: aarch64); None for other keys."""
    triples = {"cpu": ("x86_64-linux-gnu", "aarch64-linux-gnu"),
               "arm_cpu": ("aarch64-linux-gnu",)}.get(target_key)
    if triples is None:
        return None
    return _features_of(triples)


@functools.cache
def _features_of(triples: tuple[str, ...]) -> frozenset[str]:
    out: set[str] = set()
    for triple in triples:  # ~200 CPUs, 0.1 s once
        with contextlib.suppress(Exception):  # an LLVM without that backend
            for cpu in codegen.llvm_get_cpu_archlist(Target({"kind": "llvm", "mtriple": triple})):
                t = Target({"kind": "llvm", "mtriple": triple, "mcpu": str(cpu)})
                out |= {str(f) for f in codegen.llvm_get_cpu_features(t)}
    return frozenset(out)


#: Architectures ``requires=("arch:...",)`` may name (:func:`opsdk.targets.target_arch`).
_ARCHES = ("x86_64", "aarch64", "arm", "riscv64", "riscv32", "i386", "powerpc64le")


def _check_rule_args(who: str, target_key: str, kinds: Sequence[str],
                     requires: Sequence[str], claims: Sequence[str]) -> None:
    def near(x: str, pool: Sequence[str]) -> str:
        m = difflib.get_close_matches(x, pool, n=1)
        return f" (did you mean {m[0]!r}?)" if m else ""

    if target_key not in TARGET_KEYS:
        raise ValueError(f"{who}: target key {target_key!r} is not a TVM target key "
                         f"({', '.join(TARGET_KEYS)}){near(target_key, TARGET_KEYS)}")
    for k in kinds:
        if k not in _RULE_KINDS:
            raise ValueError(f"{who}: 'kind:{k}' names no op kind ({', '.join(_RULE_KINDS)})"
                             f"{near(k, _RULE_KINDS)}")
    for f in requires:
        ok = re.fullmatch(r"(kind:[a-z_]+|arch:[a-z0-9_]+|[a-z0-9_.\-]+)", str(f))
        if not ok:
            raise ValueError(f"{who}: requires={f!r} is not a feature name (e.g. 'avx512f', "
                             "'dotprod', 'arch:aarch64', 'kind:llvm')")
        f = str(f)
        if f.startswith("kind:"):
            kinds_ = [str(k) for k in Target.list_kinds()]
            if f[5:] not in kinds_:
                raise ValueError(f"{who}: requires={f!r}: {f[5:]!r} is not a TVM target kind "
                                 f"({', '.join(kinds_)}){near(f[5:], kinds_)}")
        elif f.startswith("arch:"):
            if f[5:] not in _ARCHES and target_key in ("cpu", "arm_cpu"):
                raise ValueError(f"{who}: requires={f!r}: {f[5:]!r} is not an architecture "
                                 f"({', '.join(_ARCHES)}){near(f[5:], _ARCHES)}")
        else:
            known = _known_features(target_key)
            if known and f not in known:  # a typo ('neonn') never matched: the rule was dead
                raise ValueError(
                    f"{who}: requires={f!r} is no LLVM feature of any {target_key!r} CPU"
                    f"{near(f, sorted(known))}; the features a target has: "
                    "opsdk.targets.target_features(opsdk.target('arm'))")
    for c in claims:
        if c not in ("vectorize", "parallel") and not re.fullmatch(r"insn:[a-z0-9_.]+", str(c)):
            raise ValueError(f"{who}: claim {c!r} is not one of 'vectorize', 'parallel', "
                             "'insn:<mnemonic>'" + near(str(c), ("vectorize", "parallel")))


def load_builtin_rules() -> None:
    """Import the built-in rule modules once."""
    global _LOADED
    if not _LOADED:
        for m in BUILTIN_RULE_MODULES:
            importlib.import_module(m)
        _LOADED = True


def registered_rules() -> list[Rule]:
    """Every registered rule (built-in and user-defined), in registration order; a copy.

    Examples
    --------
    >>> from opsdk.schedules import load_builtin_rules, registered_rules
    >>> load_builtin_rules()
    >>> "x86.matmul" in {r.name for r in registered_rules()}
    True
    """
    return list(_RULES)


def rules_for(op) -> list[Rule]:
    """Rules that apply to ``op`` on some target, highest priority first."""
    return sorted((r for r in _RULES if r.matches_op(op)), key=lambda r: -r.priority)


def choose(op, func: tirx.PrimFunc, target: Target | None) -> Choice:
    """Pick and apply the highest-priority rule that fits ``target`` and accepts ``func``
    (an earlier decision inside :func:`reused_decisions`)."""
    tname = "none" if target is None else str(target.kind.name) + str(list(target.keys))
    if target is None:
        ch = Choice(op=op.name, target=tname, rule=GENERIC, claims=(), func=func, kind=op.kind)
        ch.reasons.append("no target in scope: generic lowering")
        return ch
    rules = rules_for(op)
    # The symbol is the kernel's name in its module (numbered by position), not its code;
    # apply_schedule puts the caller's back.
    key = (str(target), op.name, op.kind,
           tuple((r.name, r.fn, r.priority, r.target_key, r.requires) for r in rules))
    rule_name, claims, out, sch, reasons, failures = memoized(
        "choose", func, key, lambda: _frozen(_choose(op, func, target, tname, rules)))
    return Choice(op=op.name, target=tname, rule=rule_name, claims=claims, func=out,
                  kind=op.kind, schedule=sch, reasons=list(reasons), failures=list(failures))


def _frozen(ch: Choice) -> tuple:
    """What a decision keeps for another build: its fields that depend on the function."""
    return ch.rule, ch.claims, ch.func, ch.schedule, tuple(ch.reasons), tuple(ch.failures)


def _choose(op, func: tirx.PrimFunc, target: Target, tname: str,
            rules: Sequence[Rule]) -> Choice:
    ch = Choice(op=op.name, target=tname, rule=GENERIC, claims=(), func=func, kind=op.kind)
    keys = set(target.keys)
    feats = target_features(target)
    for r in rules:
        if r.target_key not in keys:
            ch.reasons.append(
                f"{r.name}: skipped, target keys {sorted(keys)} lack {r.target_key!r}"
            )
            continue
        missing = [f for f in r.requires if f not in feats]
        if missing:
            ch.reasons.append(f"{r.name}: skipped, target lacks {', '.join(missing)}")
            continue
        try:
            sch = r.fn(func, target)
        except Exception as e:  # a broken rule must not break compilation
            brief = _brief_error(e)
            warnings.warn(f"opsdk: schedule rule {r.name} failed on {op.name}: {brief} "
                          "(generic lowering or the next rule used)", stacklevel=2)
            ch.reasons.append(f"{r.name}: raised {type(e).__name__}: {brief}")
            ch.failures.append(f"{r.name}: {type(e).__name__}: {brief}")
            continue
        if sch is None:
            ch.reasons.append(f"{r.name}: declined (returned None)")
            continue
        if not isinstance(sch, s_tir.Schedule):
            warnings.warn(f"opsdk: schedule rule {r.name} returned a {type(sch).__name__} on "
                          f"{op.name}; a rule returns an s_tir.Schedule or None", stacklevel=2)
            ch.reasons.append(f"{r.name}: returned {type(sch).__name__}, not a Schedule")
            # A failure like a raise: verify refuses the kernel instead of passing the
            # generic lowering in the rule's place.
            ch.failures.append(f"{r.name}: TypeError: returned {type(sch).__name__} "
                               f"{_short_repr(sch)}, not an s_tir.Schedule or None")
            continue
        ch.rule, ch.claims, ch.func, ch.schedule = r.name, r.claims, sch.mod["main"], sch
        ch.reasons.append(
            f"{r.name}: chosen (priority {r.priority}, key {r.target_key!r}"
            + (f", requires {', '.join(r.requires)}" if r.requires else "")
            + ")"
        )
        return ch
    ch.reasons.append("no rule applied: generic lowering")
    return ch


def _short_repr(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _brief_error(e: Exception) -> str:
    # A ScheduleError carries the whole IR; its first line and its "Error message" say it.
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    msg = next((ln for ln in lines if ln.startswith("Error message:")), "")
    return lines[0] + (f" ({msg})" if msg and msg != lines[0] else "")


_LOG: list[Choice] = []


_BYPASS = threading.local()
_DEFER = threading.local()


@contextlib.contextmanager
def deferred_scheduling() -> Iterator[None]:
    """Within this block, opsdk ops legalize to their unscheduled compute, tagged ``opsdk.op``.

    The model pipeline schedules them after fusion (:func:`opsdk.transform.ScheduleKernels`);
    ops other than elementwise ones are marked opaque to fusion, so they stay whole.
    """
    with switched_on(_DEFER):
        yield


def scheduling_deferred() -> bool:
    """Whether :func:`deferred_scheduling` is in effect on this thread."""
    return getattr(_DEFER, "on", False)


@contextlib.contextmanager
def generic_only() -> Iterator[None]:
    """Within this block, lowering skips every rule and keeps the generic function.

    ``opsdk verify`` compiles each op twice, with and without its schedule, and compares the
    two (schedule invariance).

    Examples
    --------
    >>> from opsdk.schedules import generic_only
    >>> with generic_only():
    ...     pass
    """
    with switched_on(_BYPASS):
        yield


def apply_schedule(op, func: tirx.PrimFunc, target: Target | None) -> tirx.PrimFunc:
    """Schedule ``func`` for ``target`` and tag it with the chosen rule (``opsdk.rule``)."""
    load_builtin_rules()
    if getattr(_BYPASS, "on", False):
        ch = Choice(op=op.name, target=str(target), rule=GENERIC, claims=(), func=func,
                    kind=op.kind)
        ch.reasons.append("generic_only() in effect: rules bypassed")
    else:
        ch = choose(op, func, target)
    _LOG.append(ch)
    # Keep every decision (callers slice by length: `last_choices()[before:]`) but let old
    # ones drop their functions and schedules, which hold the memory.
    if len(_LOG) > 256:
        old = _LOG[-257]
        old.func = old.schedule = None
    out = ch.func
    # A rule may return a freshly built function (e.g. TVMScript with tensor intrinsics);
    # keep the original's symbol attrs so it slots back into the module unchanged.
    orig = dict(func.attrs or {})
    for key in ("global_symbol",):
        if key in (out.attrs or {}) and key not in orig:
            out = out.without_attr(key)
        elif key in orig:
            out = out.with_attr(key, orig[key])
    out = out.with_attr("opsdk.rule", ch.rule)
    if ch.failures:
        # On the kernel itself, so a model report (read from the scheduled module or the
        # compile cache) names it as a problem, not only a warning at compile time.
        out = out.with_attr(RULE_FAILURES, list(ch.failures))
    if ch.rule != GENERIC:
        out = out.with_attr("tir.is_scheduled", True)
        # exp / sigmoid / tanh / erf as vectorizable polynomials: TVM's lowering calls libm
        # once per vector lane, whatever the rule vectorized (an epilogue, a softmax).
        out = serial_asserts(bool_compares_as_int8(polynomial_math(out)))
        # A body with Let bindings (exp_f32, erf_f32, bind) that a rule inlined into two
        # blocks, or split into a main loop and a tail, binds one variable twice: renamed
        # here, so the function stays well-formed TIR (a new Schedule of it would refuse it).
        out = tirx.transform.ConvertSSA()(tvm.IRModule({"main": out}))["main"]
    return out


def rule_failures(func: tirx.PrimFunc) -> list[str]:
    """The schedule rules that raised on ``func`` before another rule (or the generic
    lowering) took it: ``"<rule>: <ErrorType>: <message>"`` each; empty when none did.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.schedules import rule_failures
    >>> x = te.placeholder((4,), "float32", name="x")
    >>> rule_failures(te.create_prim_func([x, te.compute((4,), lambda i: x[i] + 1)]))
    []
    """
    return [str(s) for s in (func.attrs or {}).get(RULE_FAILURES, [])]


def last_choices() -> list[Choice]:
    """Decisions made by lowerings in this process, oldest first; its length only grows, so
    ``last_choices()[n:]`` are the decisions made since the length was ``n`` (entries older
    than the last 256 keep their reasons but drop their functions)."""
    return list(_LOG)


@contextlib.contextmanager
def tuned_rules(records: Sequence[TunedRecord], target_key: str = "cpu") -> Iterator[list[str]]:
    """Within this block, each verified tuning record is a rule of the registry (named
    ``tuned:<hash8>``, priority :data:`TUNED_PRIORITY`, for model kernels) that schedules
    its own workload only (:func:`workload_key`) by replaying its trace; yields the rule
    names. A rule of the same name registered before is put back on exit.

    Examples
    --------
    >>> from opsdk.schedules import TunedRecord, registered_rules, tuned_rules
    >>> with tuned_rules([TunedRecord("0123456789abcdef", [[], []])]) as names:
    ...     names, "tuned:01234567" in {r.name for r in registered_rules()}
    (['tuned:01234567'], True)
    >>> "tuned:01234567" in {r.name for r in registered_rules()}
    False
    """
    load_builtin_rules()
    names: list[str] = []
    saved: list[Rule] = []
    try:
        for rec in records:
            saved += [r for r in _RULES if r.name == rec.rule_name]
            fn = tuned_rule_fn(rec)
            fn.__module__ = __name__  # a built-in kind of rule: no user-op name check
            rule("kind:any", target_key, name=rec.rule_name, priority=TUNED_PRIORITY)(fn)
            names.append(rec.rule_name)
        yield names
    finally:
        _RULES[:] = [r for r in _RULES if r.name not in names] + saved


install_handler("rule", rule)  # OpDef.rule (opsdk._opdef cannot import this package)
