"""Results of a verify run: per case, per cell (op x dtype x layout), lints, refusals; JSON,
JUnit XML and the summary table."""

from __future__ import annotations

import contextlib
import json
import math
import shlex
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any
from xml.etree import ElementTree as ET

from ._strategies import Case

__all__ = ["CaseResult", "CellResult", "LintResult", "RefusalResult", "VerifyReport"]

_TIR_LINES = 60  # lines of TIR printed with a failure (all of it goes to the JSON report)


#: A passing cell whose worst error is above this fraction of its bound is listed in the
#: summary: the bound may be sound, or the kernel may be one unlucky input from failing.
NEAR_BOUND = 0.9
#: ... unless its worst element is within about half an ulp of the output dtype (the bound
#: is tight because the output's own rounding dominates it: the kernel is nearly correctly
#: rounded) or a result below float32's normal range returned in [0, 2^-126] (the bound's
#: underflow term is that size): such cells get a line of their own.
ROUNDING_ULPS = 0.55


@dataclass
class CaseResult:
    """The outcome of one example.

    ``status`` is ``"pass"`` or the first failed check: ``"mismatch"`` (scheduled kernel vs
    the float64 reference), ``"invariance"`` (scheduled vs generic lowering), ``"type"``
    (inferred Relax type vs the real output) or ``"error"`` (build or run raised).
    ``ratio`` is the worst error divided by its bound (a case passes while it is <= 1).
    """

    case: Case
    status: str
    message: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulps: float = 0.0
    ratio: float = 0.0
    #: Why the worst element sits where it does: "rounding" (within ROUNDING_ULPS of the
    #: output dtype), "underflow" (a result below float32's normal range returned as a
    #: value in [0, 2^-126], as the models allow), or "".
    margin: str = ""
    index: tuple[int, ...] | None = None
    got: float | None = None
    expected: float | None = None
    bound: float | None = None
    generic_ok: bool | None = None
    worst_inputs: dict[str, float] = field(default_factory=dict)
    rule: str = ""
    tir: str = ""
    reproducer: str = ""
    model: str = ""  # the error model that gave the bound (see opsdk.verify.model_for)

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = self.case.to_dict()
        d["index"] = list(self.index) if self.index is not None else None
        return _finite(d)

    def format(self, *, tir: bool = True) -> str:
        """Human-readable failure report: the shrunk example, errors, TIR and reproducer."""
        c = self.case
        lines = [
            f"FAILED opsdk.{c.op} [{c.dtype}, layout {c.layout}] on {c.target}: {self.status}",
            f"  {self.message}" if self.message else "",
            f"  shape {c.shape}  attrs {c.attrs}  inputs {list(c.present)}  "
            f"data {c.data}  seed {c.seed}  {'static' if c.static else 'symbolic'} build",
        ]
        if self.index is not None:
            lines.append(
                f"  worst at index {self.index}: got {self.got!r}, expected {self.expected!r} "
                f"(bound {self.bound:.3g}); |err| {self.max_abs:.3g}, rel {self.max_rel:.3g}, "
                f"{self.max_ulps:.3g} ulp, {self.ratio:.3g}x the bound"
            )
        if self.worst_inputs:
            vals = ", ".join(f"{k}={v!r}" for k, v in self.worst_inputs.items())
            lines.append(f"  inputs there: {vals}")
        if self.generic_ok is not None and self.status in ("mismatch", "invariance"):
            lines.append(
                "  the generic (unscheduled) lowering "
                + (
                    f"agrees with the reference: the schedule rule {self.rule!r} is at fault"
                    if self.generic_ok
                    else "fails too: the compute (or the reference/model) is at fault"
                )
            )
        if tir and self.tir:
            lines.append(f"  lowered TIR (rule {self.rule}):")
            tl = self.tir.splitlines()
            cut = [t if len(t) <= 400 else t[:400] + " ..." for t in tl[:_TIR_LINES]]
            lines += ["    " + t for t in cut]
            if len(tl) > _TIR_LINES or (len(cut) and any(len(t) > 400 for t in tl)):
                lines.append(f"    ... ({len(tl)} lines; the full TIR is in the --report JSON)")
        if self.reproducer:
            lines.append(f"  reproduce: {self.reproducer}")
        return "\n".join(x for x in lines if x)


@dataclass
class CellResult:
    """One claimed cell of the capability matrix: (op, target, dtype, layout)."""

    op: str
    target: str
    dtype: str
    layout: str
    examples: int = 0
    max_ulps: float = 0.0
    max_rel: float = 0.0
    ratio: float = 0.0
    failure: CaseResult | None = None
    error: str = ""
    seconds: float = 0.0
    rules: list[str] = field(default_factory=list)
    model: str = ""  # the error model behind ``ratio``: the op's, its reference's, or a fallback
    margin: str = ""  # CaseResult.margin of the case with the largest ratio

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.error

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR"
        return "pass" if self.failure is None else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failure"] = self.failure.to_dict() if self.failure else None
        d["status"] = self.status
        return _finite(d)


@dataclass
class LintResult:
    """One structural check of a schedule's claim (``vectorize``/``parallel``) on one cell."""

    op: str
    target: str
    dtype: str
    layout: str
    rule: str
    check: str
    status: str  # pass | fail | warn | skip
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RefusalResult:
    """An unclaimed input (dtype, rank) must be refused with a ValueError naming op and argument."""

    op: str
    what: str
    status: str  # pass | fail
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VerifyReport:
    """Everything one ``verify`` run found."""

    target: str
    device: dict[str, Any] = field(default_factory=dict)
    profile: str = "dev"
    seed: int | None = None
    cells: list[CellResult] = field(default_factory=list)
    lints: list[LintResult] = field(default_factory=list)
    refusals: list[RefusalResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cells) and all(x.ok for x in self.lints + self.refusals)

    @property
    def failures(self) -> list[CaseResult]:
        return [c.failure for c in self.cells if c.failure is not None]

    def merge(self, other: VerifyReport) -> None:
        self.cells += other.cells
        self.lints += other.lints
        self.refusals += other.refusals
        self.device = self.device or other.device

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "target": self.target,
            "device": self.device,
            "profile": self.profile,
            "seed": self.seed,
            "seconds": round(self.seconds, 3),
            "examples": sum(c.examples for c in self.cells),
            "cells": [c.to_dict() for c in self.cells],
            "lints": [x.to_dict() for x in self.lints],
            "refusals": [x.to_dict() for x in self.refusals],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_junit(self) -> str:
        """JUnit XML: one test case per cell, lint and refusal check."""
        suite = ET.Element("testsuite", name=f"opsdk verify {self.target}")
        n = fails = 0
        for c in self.cells:
            tc = ET.SubElement(
                suite,
                "testcase",
                classname=f"opsdk.verify.{c.op}",
                name=f"{c.dtype}-{c.layout}",
                time=f"{c.seconds:.3f}",
            )
            n += 1
            if not c.ok:
                fails += 1
                message = c.failure.status if c.failure else "error"
                el = ET.SubElement(tc, "failure", message=message)
                el.text = c.failure.format() if c.failure else c.error
        for x in self.lints:
            tc = ET.SubElement(
                suite,
                "testcase",
                classname=f"opsdk.lint.{x.op}",
                name=f"{x.check}-{x.dtype}-{x.layout}",
            )
            n += 1
            if x.status == "fail":
                fails += 1
                ET.SubElement(tc, "failure", message=x.detail)
            elif x.status == "skip":
                ET.SubElement(tc, "skipped", message=x.detail)
        for x in self.refusals:
            tc = ET.SubElement(suite, "testcase", classname=f"opsdk.refuse.{x.op}", name=x.what)
            n += 1
            if not x.ok:
                fails += 1
                ET.SubElement(tc, "failure", message=x.detail)
        suite.set("tests", str(n))
        suite.set("failures", str(fails))
        suite.set("time", f"{self.seconds:.3f}")
        return ET.tostring(suite, encoding="unicode")

    def format_table(self) -> str:
        """The summary: op x dtype x layout with examples, worst ulps/rel error, status."""
        head = ("op", "dtype", "layout", "examples", "worst ulp", "worst rel", "of bound",
                "error model", "status")
        rows = [
            (
                c.op,
                c.dtype,
                c.layout,
                str(c.examples),
                _num(c.max_ulps),
                _num(c.max_rel),
                f"{c.ratio:.2f}",
                c.model or "-",
                c.status,
            )
            for c in self.cells
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        out.append("(pass = every element within its bound: 'of bound' is the worst fraction "
                   "used. 'worst ulp' and 'worst rel' are the largest over all elements, and are "
                   "large for a correct kernel where the output is near zero or subnormal, e.g. "
                   "gelu of large negative x.)")
        near = [c for c in self.cells if c.ok and c.ratio > NEAR_BOUND]
        thin = [c for c in near if not c.margin]

        def cells(cs: list[CellResult], why: bool = False) -> str:
            return ", ".join(f"{c.op} {c.dtype} {c.layout} {c.ratio:.3f}"
                             + (f" ({c.margin})" if why else "") for c in cs) or "none"

        out.append("")
        out.append(f"passed above {NEAR_BOUND} of their bound (a thin margin: check the error "
                   f"model): {cells(thin)}")
        if len(thin) < len(near):
            out.append(
                f"above {NEAR_BOUND} of the bound only by the output's own rounding (worst "
                f"element <= {ROUNDING_ULPS} ulp) or an underflowed result, sound "
                f"margins: {cells([c for c in near if c.margin], why=True)}")
        lint_lines = _lint_summary(self.lints)
        if lint_lines:
            out += ["", "lints (schedule claims):", *lint_lines]
        bad = [x for x in self.refusals if not x.ok]
        out.append("")
        out.append(
            f"refusals: {len(self.refusals) - len(bad)}/{len(self.refusals)} unclaimed inputs "
            "refused with a clear ValueError"
        )
        out += [f"  FAIL {x.op}: {x.what}: {x.detail}" for x in bad]
        return "\n".join(out)


def _lint_summary(lints: list[LintResult]) -> list[str]:
    cells: dict[tuple[str, str], set[tuple[str, str]]] = {}
    by: dict[tuple[str, str, str], list[LintResult]] = {}
    for x in lints:
        cells.setdefault((x.op, x.target), set()).add((x.dtype, x.layout))
        by.setdefault((x.op, x.target, x.check), []).append(x)
    lines = []
    for (op, target, check), xs in sorted(by.items()):
        total = len(cells[(op, target)])
        for status in ("fail", "warn", "pass", "skip"):
            hit = [x for x in xs if x.status == status]
            if not hit:
                continue
            rules = sorted({x.rule for x in hit})
            where = ("all cells" if len(hit) == total
                     else ", ".join(f"{x.dtype}/{x.layout}" for x in hit))
            detail = hit[0].detail if status in ("fail", "warn", "skip") else ""
            lines.append(f"  {status:<4} {op} {target} {check} [{', '.join(rules)}] {where}"
                         + (f": {detail}" if detail else ""))
    return lines


def _num(v: float) -> str:
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"


def _finite(obj: Any) -> Any:
    # JSON has no inf/nan: write them as strings.
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# The modules an ``opsdk verify --module M`` run loaded (plug-in ops or rules): a failure's
# reproducer must load them again. Per run, not per process: another run's modules (a test
# before) must not leak into this one's reproducers.
_RUN_MODULES: ContextVar[tuple[str, ...]] = ContextVar("opsdk_verify_modules", default=())


@contextlib.contextmanager
def run_modules(modules: Iterable[str] | None) -> Iterator[None]:
    """Within the block, reproducers also name ``modules`` (``--module``), the modules the
    run loaded.

    Examples
    --------
    >>> from opsdk.verify import Case
    >>> case = Case(op="gelu", dtype="float32", layout="default", shape=(3,), attrs={},
    ...             present=(), seed=0, target="x86")
    >>> with run_modules(["my_rules"]):
    ...     "--module my_rules" in reproducer_command(case)
    True
    >>> "--module" in reproducer_command(case)
    False
    """
    token = _RUN_MODULES.set(tuple(m for m in modules or () if not m.startswith("opsdk.")))
    try:
        yield
    finally:
        _RUN_MODULES.reset(token)


def reproducer_command(case: Case, module: str | None = None, *, kernels: bool = False) -> str:
    """The one-line command that re-runs ``case`` exactly (``kernels``: the op is a kernel
    family of :mod:`opsdk.kernels`, which ``opsdk verify`` finds with ``--kernels``): the
    op's own module and the modules the run loaded (:func:`run_modules`: plug-in rules a
    kernel family's case ran with) come along as ``--module``."""
    parts = ["opsdk", "verify", *(["--kernels"] if kernels else []), case.op, "--target",
             case.target]
    for name in dict.fromkeys([*([module] if module else []), *_RUN_MODULES.get()]):
        parts += ["--module", name]
    parts += ["--case", case.to_json()]
    return shlex.join(parts)
