"""The verification engine: build once per signature, run every drawn example, check oracles.

For one op on one target, every cell of its capability matrix (dtype x layout) is a
hypothesis search over :class:`~opsdk.verify.Case`. Each example is checked against

(a) the float64 numpy reference on the same rounded inputs, within the error model's bound;
(b) the op's generic (unscheduled) lowering of the same compute: schedule invariance, within
    twice the bound (both kernels are held to the same model);
(c) the Relax type inferred for the call, against the real output's shape and dtype.

(d) Kernels are built with symbolic dims (static only where the op requires it, e.g. group
norm's channel count) and cached per (op, target, dtype, attributes, rank, inputs present):
one build runs every drawn shape, which is what keeps verification fast.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import Phase, example, given, settings
from hypothesis import seed as hyp_seed
from hypothesis.errors import Flaky
from tvm import relax, te

from .._dtypes import accum_dtype, is_float, np_dtype
from .._opdef import OpDef, as_outputs
from ..kernels import KERNEL_OPS
from ..registry import builder, get_op, is_registered, register, registered_ops, unregister
from ..runners import RunnerUnavailable, runner_for
from ..schedules import (
    GENERIC,
    choose,
    rule_failures,
    vector_lanes,
)
from ..targets import TARGETS, target_spec
from ..targets import target as resolve_target
from ._builds import _eval_shape, _get_build, _get_builds, _signature
from ._lints import lint_prim_func
from ._profiles import (
    _HYPOTHESIS_BASE,
    PROFILES,
    Profile,
    _database,
    _temporary_hypothesis_home,
    default_profile,
)
from ._report import (
    ROUNDING_ULPS,
    CaseResult,
    CellResult,
    LintResult,
    RefusalResult,
    VerifyReport,
    reproducer_command,
)
from ._strategies import (
    Case,
    _present_shapes,
    _repair,
    case_strategy,
    cell_dtypes,
    corner_cases,
    free_defaults,
    input_dtypes,
    layout_attrs,
    make_inputs,
)
from ._tolerance import ModelInput, output_bound, ulps, unit_roundoff

__all__ = [
    "capabilities",
    "check_refusals",
    "lint_cell",
    "run_case",
    "verify",
    "verify_op",
]

# ---------------------------------------------------------------------------------------------
# Targets and runners


def _target_name(target: str) -> str:
    return target_spec(target).name


def _runner_for(target_name: str, rpc: str | None = None, tracker: str | None = None,
                key: str | None = None) -> Any:
    runner = runner_for(target_name, rpc=rpc, tracker=tracker, key=key)
    if rpc or tracker:
        try:  # one bounded check up front, not a time-out per example
            runner.preflight()
        except RuntimeError as e:
            runner.close()
            raise ValueError(str(e)) from None
    return runner


# ---------------------------------------------------------------------------------------------
# One example


def _run(runner: Any, ex: Any, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    # An output element a kernel forgets to write shows whatever its memory held (garbage,
    # or zeros in fresh pages): never the right value, since nothing ever computed it.
    return [np.asarray(o) for o in runner.run(ex, list(args))]


def _errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        err = np.abs(got - ref)
        same = (np.isnan(got) & np.isnan(ref)) | (np.isinf(got) & (got == ref))
        err = np.where(same, 0.0, err)
        return np.where(np.isnan(err), np.inf, err)


def _module_of(d: OpDef) -> str | None:
    return None if d.module.startswith("opsdk.") else d.module


def _is_kernel_family(d: OpDef) -> bool:
    """One of :data:`opsdk.kernels.KERNEL_OPS` (``opsdk verify --kernels`` finds it)."""

    return any(d is k for k in KERNEL_OPS)


def run_case(case: Case, *, runner: Any = None, op: OpDef | None = None) -> CaseResult:
    """Build (or reuse) the kernels for ``case``, run them and check every oracle.

    Examples
    --------
    >>> from opsdk.verify import Case, run_case
    >>> c = Case("softmax", "x86", "float32", "last", (3, 17), {"axis": -1}, (), {}, 1)
    >>> run_case(c).status
    'pass'
    """
    d = op or get_op(case.op)
    tgt = resolve_target(case.target)
    own = runner is None
    runner = runner or _runner_for(case.target)
    try:
        return _check_case(d, case, tgt, runner)
    finally:
        if own and hasattr(runner, "close"):
            runner.close()


def _check_case(d: OpDef, case: Case, tgt: Any, runner: Any, *, generic: bool = True
                ) -> CaseResult:
    """All oracles for one example; the generic lowering runs when ``generic`` is set or
    when the scheduled kernel fails (to tell a schedule bug from a compute bug)."""
    res = CaseResult(case=case, status="pass", reproducer=reproducer_command(
        case, _module_of(d), kernels=_is_kernel_family(d)))
    try:
        inputs = make_inputs(d, case)
        b = _get_build(d, case, tgt, generic=generic)
        res.rule, res.tir = b.rule, b.prim.script()
        broken = rule_failures(b.prim)
        if broken:
            # The generic lowering (or a lower rule) ran in its place: passing it would
            # report the rule verified when it never ran. Built-in rules too: one that
            # raises leaves a model's kernel on a slower rule with only a warning.
            res.status = "error"
            res.message = (f"schedule rule {broken[0]} (on {d.name}, which it was chosen "
                           "for); fix the rule, or return None to decline the kernel")
            return res
        args = [inputs[n] for n in b.params]
        gots = _run(runner, b.ex, args)
    except Exception as e:  # a claimed cell must build and run
        res.status, res.message = "error", _plain_error(d, e)
        return res
    n_out = len(b.outs)
    if len(gots) != n_out:
        res.status = "type"
        res.message = f"the kernel returned {len(gots)} outputs, its type says {n_out}"
        return res
    free = {**free_defaults(d, case.shape, case.attrs), **case.free}
    nattrs = d.normalize_attrs(d.bind_attrs(case.attrs), len(case.shape))
    promised = d.declared_dtypes(d.dtypes_for(case.dtype), nattrs)
    for k, (got, (oshape, odtype)) in enumerate(zip(gots, b.outs)):
        which = f" output {k}" if n_out > 1 else ""
        want_shape = _eval_shape(b, case.shape, free, oshape)
        if tuple(got.shape) != want_shape or got.dtype != np_dtype(odtype):
            res.status = "type"
            res.message = (
                f"inferred type{which} R.Tensor({list(want_shape)}, {odtype}) but the kernel "
                f"returned shape {list(got.shape)} dtype {got.dtype}"
            )
            return res
        if odtype != promised[k]:
            # The contract, not the trace: a float16 op that computes and returns float32 has
            # a self-consistent type but breaks what its callers were promised.
            res.status = "type"
            res.message = (
                f"{d.op_name} ({case.dtype}, layout {case.layout!r}){which}: the output dtype "
                f"rule ({d.output_dtype_rule()}) promises {promised[k]}, but the compute "
                f"returns {odtype}; cast the result to {promised[k]} (e.g. .astype(x.dtype)) "
                "or declare output_dtype= in @opsdk.op"
            )
            return res
    full = {p.name: inputs.get(p.name) for p in d.tensor_params}
    x64 = {k: (None if v is None else v.astype(np.float64)) for k, v in full.items()}
    with np.errstate(all="ignore"):  # e.g. exp overflow in a reference on "large" data
        refs = d.run_reference(x64, case.attrs)
    refs = [refs] if n_out == 1 else list(refs)
    refs = [np.asarray(r, dtype=np.float64) for r in refs]
    for k, (ref, got) in enumerate(zip(refs, gots)):
        if ref.shape != got.shape:
            res.status = "type"
            res.message = (f"reference returns shape {list(ref.shape)}"
                           + (f" for output {k}" if n_out > 1 else "")
                           + f", kernel {list(got.shape)}")
            return res
    # Every output against its reference; the worst one (by its bound) is reported.
    checks = [_compare(d, x64, nattrs, case, k, ref, got, odtype)
              for k, (ref, got, (_, odtype)) in enumerate(zip(refs, gots, b.outs))]
    worst = max(range(n_out), key=lambda k: checks[k]["ratio_max"])
    c = checks[worst]
    y, ref, tol, err, ratio, rel, odtype = (c[n] for n in (
        "y", "ref", "tol", "err", "ratio", "rel", "dtype"))
    res.model = c["model"]
    which = f" (output {worst} of {n_out})" if n_out > 1 else ""
    got = gots[worst]
    if ref.size:
        idx = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        res.ratio = float(ratio[idx])
        res.max_abs = float(err.max())
        res.max_rel = float(rel.max())
        res.max_ulps = float(ulps(odtype, ref, err).max())
        res.index = tuple(int(i) for i in idx)
        res.got, res.expected, res.bound = float(y[idx]), float(ref[idx]), float(tol[idx])
        res.margin = margin_reason(res.expected, res.got,
                                   float(ulps(odtype, ref[idx], err[idx])))
    if res.ratio > 1.0:
        res.status = "mismatch"
        res.message = (
            f"kernel (rule {b.rule}){which} is {res.ratio:.3g}x outside the error bound of the "
            "float64 reference"
        )
    if generic or not res.ok:
        try:
            if b.ex_generic is None:
                b = _get_build(d, case, tgt, generic=True)
            ygs = ([c["y"] for c in checks] if b.ex_generic is b.ex else
                   [g.astype(np.float64) for g in _run(runner, b.ex_generic, args)])
        except Exception as e:
            res.message += f" (generic lowering failed: {type(e).__name__}: {e})".split("\n")[0]
            ygs = None
        if ygs is not None:
            res.generic_ok = True
            inv_worst = None
            for k, (cc, yg) in enumerate(zip(checks, ygs)):
                with np.errstate(all="ignore"):
                    err_g = _errors(yg, cc["ref"])
                    ok_g = np.where(err_g == 0, 0.0, err_g / cc["tol"]).max(initial=0) <= 1
                    res.generic_ok = bool(res.generic_ok and ok_g)
                    inv = _errors(cc["y"], yg)
                    ratio_inv = np.where(inv == 0, 0.0, inv / (2 * cc["tol"]))
                if ratio_inv.size and (inv_worst is None
                                       or float(ratio_inv.max()) > inv_worst[0]):
                    inv_worst = (float(ratio_inv.max()), k, ratio_inv, inv, yg)
            if res.ok and inv_worst is not None and inv_worst[0] > 1.0:
                _, k, ratio_inv, inv, yg = inv_worst
                cc = checks[k]
                wk = f" (output {k} of {n_out})" if n_out > 1 else ""
                res.status = "invariance"
                j = np.unravel_index(int(np.argmax(ratio_inv)), ratio_inv.shape)
                res.index = tuple(int(i) for i in j)
                res.got, res.expected = float(cc["y"][j]), float(yg[j])
                res.message = (
                    f"scheduled kernel (rule {b.rule}){wk} and generic lowering differ by "
                    f"{float(inv[j]):.3g} > 2x the bound {2 * float(cc['tol'][j]):.3g} at "
                    f"{res.index}"
                )
                got = gots[k]
    if res.status != "pass" and res.index is not None:
        res.worst_inputs = _inputs_at(inputs, res.index, got.shape)
    return res


#: TVM internal check messages (a substring) and what they mean for the op's compute.
_TVM_MESSAGES: tuple[tuple[str, str], ...] = (
    ("Divide by zero", "compute of {op} divides by zero (TVM folded the divisor to 0)"),
)


def _plain_error(d: OpDef, e: Exception) -> str:
    """One line for a build/run error; a known TVM internal check said in the op's terms."""
    text = str(e)
    for needle, plain in _TVM_MESSAGES:
        if needle in text:
            return plain.format(op=d.name)
    return f"{type(e).__name__}: {text}".split("\n")[0][:2000]


def _compare(d: OpDef, x64: Mapping[str, Any], nattrs: Mapping[str, Any], case: Case,
             k: int, ref: np.ndarray, got: np.ndarray, odtype: str) -> dict[str, Any]:
    """Output ``k`` against its float64 reference: its bound, errors and their ratios."""
    m = ModelInput(op=d, inputs=dict(x64), attrs=dict(nattrs), ref=ref,
                   u=_unit(accum_dtype(odtype)), dtype=case.dtype, output=k)
    tol, model = output_bound(d, m, odtype)
    y = got.astype(np.float64)
    err = _errors(y, ref)
    with np.errstate(all="ignore"):
        ratio = np.where(err == 0, 0.0, err / tol)
        # Relative error where it means something: not where the reference is zero or
        # below the output dtype's normal range (a correct kernel may flush it to zero).
        rel = np.where((err == 0) | (np.abs(ref) < _smallest_normal(odtype)), 0.0,
                       err / np.abs(ref))
    return {"y": y, "ref": ref, "tol": tol, "err": err, "ratio": ratio, "rel": rel,
            "dtype": odtype, "model": model, "ratio_max": float(ratio.max(initial=0.0))}


def margin_reason(expected: float, got: float, ulps_off: float) -> str:
    """Why a worst element near its bound is sound (see ``CaseResult.margin``): "underflow"
    when the reference is below float32's normal range and the kernel returned a value in
    ``[0, 2^-126]`` (any of them is within the models' underflow term), "rounding" when it
    is within ``ROUNDING_ULPS`` of the output dtype, else "".

    Examples
    --------
    >>> margin_reason(0.0, 1.1e-38, 8e6), margin_reason(1.0, 1.0005, 0.5), margin_reason(1, 2, 9)
    ('underflow', 'rounding', '')
    """
    tiny = _smallest_normal("float32")
    if abs(expected) < tiny and abs(got) <= tiny:
        return "underflow"
    return "rounding" if ulps_off <= ROUNDING_ULPS else ""


def _smallest_normal(dtype: str) -> float:
    return float(ml_dtypes.finfo(np_dtype(dtype)).tiny) if is_float(dtype) else 1.0


def _unit(dtype: str) -> float:
    return unit_roundoff(dtype)


def _inputs_at(inputs: Mapping[str, np.ndarray], idx: tuple[int, ...],
               out_shape: tuple[int, ...]) -> dict[str, float]:
    out = {}
    for name, a in inputs.items():
        if a.shape == tuple(out_shape):
            out[name] = float(a[idx])
        elif a.ndim and a.ndim <= len(idx) and a.shape == tuple(out_shape[-a.ndim:]):
            out[name] = float(a[idx[-a.ndim:]])
    return out


# ---------------------------------------------------------------------------------------------
# Cells


class _CaseFailed(Exception):
    def __init__(self, result: CaseResult) -> None:
        super().__init__(result.status)
        self.result = result


def verify_cell(
    d: OpDef,
    target_name: str,
    dtype: str,
    layout: str,
    *,
    runner: Any,
    profile: Profile,
    seed: int | None = None,
    max_examples: int | None = None,
    database: Any = "default",
    on_example: Callable[[], None] | None = None,
) -> CellResult:
    """Run the hypothesis search of one cell; the failure (if any) is the shrunk example."""
    tgt = resolve_target(target_name)
    cell = CellResult(op=d.name, target=target_name, dtype=dtype, layout=layout)
    lanes = vector_lanes(tgt, np_dtype(dtype).itemsize * 8)
    strategy = case_strategy(d, target_name, dtype, layout, lanes, profile.knobs)
    last_fail: list[CaseResult] = []
    rules: set[str] = set()
    t0 = time.perf_counter()

    corners = corner_cases(d, target_name, dtype, layout, lanes) if profile.corners else []
    # "corners": the corner cases on the common signature (one generic build per cell).
    common = _signature(d, corners[0], tgt)[0] if corners else None
    inv_cases = [c for c in corners if _signature(d, c, tgt)[0] == common]

    def body(case: Case) -> None:
        generic = profile.invariance == "all" or case in inv_cases
        res = _check_case(d, case, tgt, runner, generic=generic)
        cell.examples += 1
        if res.rule:
            rules.add(res.rule)
        cell.model = cell.model or res.model
        if res.ok:
            cell.max_ulps = max(cell.max_ulps, res.max_ulps)
            cell.max_rel = max(cell.max_rel, res.max_rel)
            if res.ratio > cell.ratio:
                cell.ratio, cell.margin = res.ratio, res.margin
        if on_example:
            on_example()
        if not res.ok:
            last_fail[:] = [res]
            raise _CaseFailed(res)

    n = profile.max_examples if max_examples is None else max_examples
    # Without a database nothing is written to the working folder: hypothesis keeps other
    # files (its constants cache) under ./.hypothesis unless its home is elsewhere.
    home = (_temporary_hypothesis_home() if database is None
            else contextlib.nullcontext())

    def search(explicit: Sequence[Case], budget: int) -> None:
        test = given(case=strategy)(body)
        for c in reversed(explicit):
            test = example(case=c)(test)
        extra: dict[str, Any] = {} if budget else {"phases": (Phase.explicit,)}
        test = settings(**{**_HYPOTHESIS_BASE, **extra}, max_examples=max(budget, 1),
                        database=_database(database))(test)
        if seed is not None:
            test = hyp_seed(seed)(test)
        # One database entry per cell (the inner function's source is the same for all).
        test._hypothesis_internal_database_key = (  # type: ignore[attr-defined]
            f"opsdk.verify:{d.name}:{target_name}:{dtype}:{layout}".encode()
        )
        try:
            test()
        except _CaseFailed:
            pass
        except Flaky:
            if last_fail:
                last_fail[0].message += " (flaky: did not fail again on replay)"
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            if not last_fail:
                cell.error = f"{type(e).__name__}: {e}"

    if corners:
        with contextlib.suppress(Exception):  # a failing build is reported per example
            _get_builds(d, corners, tgt,  # side by side
                        generic=lambda c: profile.invariance == "all" or c in inv_cases)
    with home:
        search(corners, n)
        if last_fail and last_fail[0].case in corners:
            # Explicit examples are not shrunk: look for the bug with random examples, which
            # hypothesis shrinks, and report that one when found (else the corner case).
            corner = last_fail[0]
            last_fail.clear()
            search((), max(4 * n, 20))
            if not last_fail:
                last_fail.append(corner)

    cell.failure = last_fail[0] if last_fail else None
    if cell.failure is not None:
        cell.max_ulps = max(cell.max_ulps, cell.failure.max_ulps)
        cell.max_rel = max(cell.max_rel, cell.failure.max_rel)
        cell.ratio = max(cell.ratio, cell.failure.ratio)
    cell.rules = sorted(rules)
    cell.seconds = time.perf_counter() - t0
    return cell


# ---------------------------------------------------------------------------------------------
# Capabilities, refusals and lints


def _example_shape(d: OpDef, attrs: Mapping[str, Any], dtype: str,
                   present: Sequence[str]) -> list[int] | None:
    return _repair(d, list(d.examples[0]), dtype, attrs, present)


def capabilities(d: OpDef, targets: Sequence[str] | None = None, *, rules: bool = True
                 ) -> list[dict[str, Any]]:
    """The op's claimed cells: target x dtype x layout, with the rule that lowers each.

    A cell is claimed when a schedule rule applies on that target, or when the target is a
    CPU one where the generic lowering runs as is (LLVM and C; GPUs need a rule). With
    ``rules=False`` the rule is only looked up where it decides the claim (not on CPUs).

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify import capabilities
    >>> cells = capabilities(opsdk.get_op("gelu"))
    >>> sorted({c["target"] for c in cells if c["claimed"]})[:2]
    ['arm', 'arm-dotprod']
    """

    out = []
    for tname in targets or TARGETS:
        try:
            tgt = resolve_target(tname)
        except Exception:  # a target this TVM cannot build
            continue
        for layout in d.layouts:
            attrs = layout_attrs(d, layout)
            for dtype in cell_dtypes(d):
                optional = [p.name for p in d.tensor_params if p.optional]
                shape = _example_shape(d, attrs, dtype, optional)
                rule: str | None = None  # not looked up
                cpu = tgt.kind.name in ("llvm", "c")
                if shape is not None and (rules or not cpu):
                    shapes = _present_shapes(d, shape, attrs, optional)
                    outs = as_outputs(d.trace(shapes, input_dtypes(d, dtype, list(shapes)),
                                              attrs))
                    ins = sorted({t.op.name: t for o in outs for t in _placeholders(o)}.values(),
                                 key=lambda p: p.op.name)
                    func = te.create_prim_func([*ins, *outs])
                    rule = choose(d, func, tgt).rule
                claimed = cpu or rule not in (None, GENERIC)
                out.append({"target": tname, "dtype": dtype, "layout": layout, "rule": rule,
                            "claimed": claimed})
    return out


def _placeholders(t: Any) -> list[Any]:
    found: list[Any] = []
    stack = [t]
    seen: list[Any] = []
    while stack:
        x = stack.pop()
        if any(x.op.same_as(s) for s in seen):
            continue
        seen.append(x.op)
        if isinstance(x.op, te.PlaceholderOp):
            found.append(x)
        stack.extend(getattr(x.op, "input_tensors", []))
    return sorted(found, key=lambda p: p.op.name)


def _refused(d: OpDef, shapes: Mapping[str, tuple], dtypes: Mapping[str, str],
             attrs: Mapping[str, Any], arg: str, what: str) -> RefusalResult:
    params = {n: relax.Var(n, relax.TensorType(list(s), dtypes[n])) for n, s in shapes.items()}
    try:
        relax.BlockBuilder().normalize(builder(d)(**params, **attrs))  # runs FInferType
    except ValueError as e:
        msg = str(e).split("\n")[0]
        if d.op_name in msg and f"'{arg}'" in msg:
            return RefusalResult(d.name, what, "pass", msg)
        return RefusalResult(d.name, what, "fail", f"ValueError without op and argument: {msg}")
    except Exception as e:
        return RefusalResult(d.name, what, "fail",
                             f"raised {type(e).__name__} instead of ValueError: {e}"[:300])
    return RefusalResult(d.name, what, "fail", "accepted (no error): an unclaimed input")


def check_refusals(d: OpDef) -> list[RefusalResult]:
    """Unclaimed inputs must be refused by a ``ValueError`` naming the op and the argument:
    dtypes outside ``d.dtypes`` (float64, int8, int32), ranks outside ``d.ranks`` and a
    secondary input whose dtype differs from the primary's.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.verify import check_refusals
    >>> all(r.ok for r in check_refusals(opsdk.get_op("layer_norm")))
    True
    """
    out = []
    layout = next(iter(d.layouts))
    attrs = layout_attrs(d, layout)
    ok_dtype = cell_dtypes(d)[0]
    shape = _example_shape(d, attrs, ok_dtype, ())
    if shape is None:
        return [RefusalResult(d.name, "example shape", "fail", "no valid example shape found")]
    shapes = _present_shapes(d, shape, attrs, ())
    for bad in ("float64", "int8", "int32"):
        if bad in cell_dtypes(d):
            continue
        dts = input_dtypes(d, ok_dtype, list(shapes))
        dts[d.primary] = bad
        out.append(_refused(d, shapes, dts, attrs, d.primary, f"dtype {bad}"))
    lo, hi = d.ranks
    required = [p.name for p in d.tensor_params[1:] if not p.optional]
    for rank in (lo - 1, hi + 1):
        if rank < 0:
            continue
        prim = (2,) * rank
        try:
            derived = d.input_shapes(prim, d.normalize_attrs(d.bind_attrs(attrs), max(rank, 1))
                                     ) if d.input_shapes else {}
        except Exception:  # the shape function cannot handle the wrong rank itself
            derived = {}
        sizes = free_defaults(d, prim, attrs)
        shp = {d.primary: prim, **{n: tuple(sizes.get(s, 2) if isinstance(s, str) else s
                                            for s in derived.get(n, (2,))) for n in required}}
        out.append(_refused(d, shp, input_dtypes(d, ok_dtype, list(shp)), attrs, d.primary,
                            f"rank {rank}"))
    others = [p.name for p in d.tensor_params[1:] if p.name not in d.input_dtypes]
    if others:  # inputs without dtypes of their own must share the primary's
        present = [p.name for p in d.tensor_params if p.optional]
        full = _present_shapes(d, shape, attrs, present)
        name = others[0]
        alt = next((t for t in ("float16", "float32", "float64") if t != ok_dtype), "float64")
        dts = input_dtypes(d, ok_dtype, list(full))
        dts[name] = alt
        out.append(_refused(d, full, dts, attrs, name,
                            f"'{name}' dtype {alt} with '{d.primary}' {ok_dtype}"))
    return out


def lint_cell(d: OpDef, target: str, dtype: str, layout: str,
              cases: Sequence[Case] | None = None) -> list[LintResult]:
    """Check the schedule's claims on the static-shape corner case's build, and report the
    symbolic build of the first corner case (both are builds verify itself runs)."""
    tname = _target_name(target)
    tgt = resolve_target(tname)
    if cases is None:
        lanes = vector_lanes(tgt, np_dtype(dtype).itemsize * 8)
        cases = corner_cases(d, tname, dtype, layout, lanes)
    if not cases:
        return [LintResult(d.name, tname, dtype, layout, "?", "claims", "skip",
                           "no valid example shape")]
    static = next((c for c in cases if c.static), replace(cases[0], static=True))
    out: list[LintResult] = []
    for c, symbolic in ((static, False), (replace(cases[0], static=False), True)):
        try:
            b = _get_build(d, c, tgt, generic=False)
        except Exception as e:
            out.append(LintResult(d.name, tname, dtype, layout, "?", "build", "fail",
                                  _plain_error(d, e)[:300]))
            continue
        out += lint_prim_func(d, b.prim, b.ex, tgt, target_name=tname, dtype=dtype,
                              layout=layout, symbolic=symbolic, prim_name=b.prim_name)
    return out


# ---------------------------------------------------------------------------------------------
# Public entry points


def _resolve_profile(profile: str | Profile | None) -> Profile:
    if isinstance(profile, Profile):
        return profile
    name = profile or default_profile()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; use one of {', '.join(PROFILES)}") from None


def verify_op(
    op: str | OpDef,
    target: str = "host",
    *,
    dtypes: Sequence[str] | None = None,
    layouts: Sequence[str] | None = None,
    profile: str | Profile | None = None,
    seed: int | None = None,
    max_examples: int | None = None,
    runner: Any = None,
    database: Any = "default",
    lints: bool = True,
    refusals: bool = True,
    progress: Callable[[str, int], None] | None = None,
    fail_fast: bool = False,
) -> VerifyReport:
    """Verify one op on one target: every claimed dtype x layout cell, its lints and refusals.

    Parameters
    ----------
    op
        A registered op name or :class:`~opsdk.OpDef` (registered for the run if needed).
    target
        Friendly target name (``host``, ``x86``, ``arm``, ...).
    dtypes, layouts
        Restrict the cells (default: all claimed ones).
    profile
        ``dev`` (default), ``ci`` or ``thorough``: random examples per cell after the
        deterministic corner cases.
    seed
        Hypothesis seed, for reproducible runs.
    max_examples
        Override the profile's random examples per cell (0: corner cases only).
    runner
        A runner from :mod:`opsdk.runners` (default: the one for ``target``).
    database
        ``"default"`` (``$OPSDK_CACHE/hypothesis``), a path, a hypothesis database or None.

    Returns
    -------
    VerifyReport

    Examples
    --------
    >>> from opsdk.verify import verify_op
    >>> r = verify_op("gelu", "x86", dtypes=["float32"], layouts=["erf"], max_examples=2,
    ...               database=None, lints=False, refusals=False)
    >>> r.ok, r.cells[0].examples > 2
    (True, True)
    """
    return verify([op], target, dtypes=dtypes, layouts=layouts, profile=profile, seed=seed,
                  max_examples=max_examples, runner=runner, database=database, lints=lints,
                  refusals=refusals, progress=progress, fail_fast=fail_fast)


def verify(
    ops: Sequence[str | OpDef] | None = None,
    target: str = "host",
    *,
    dtypes: Sequence[str] | None = None,
    layouts: Sequence[str] | None = None,
    profile: str | Profile | None = None,
    seed: int | None = None,
    max_examples: int | None = None,
    runner: Any = None,
    database: Any = "default",
    lints: bool = True,
    refusals: bool = True,
    progress: Callable[[str, int], None] | None = None,
    rpc: str | None = None,
    tracker: str | None = None,
    key: str | None = None,
    fail_fast: bool = False,
) -> VerifyReport:
    """Verify several ops (default: every registered op) on one target; see :func:`verify_op`.

    ``progress(label, examples_done)`` is called after each example. ``fail_fast`` stops
    at the first failing cell. ``rpc``/``tracker``/``key`` pick a remote runner (one board;
    ``opsdk.verify._shard.verify_sharded`` spreads the cells over every free board of a
    tracker's key).

    Examples
    --------
    >>> from opsdk.verify import verify
    >>> r = verify(["softmax"], "x86", dtypes=["float16"], max_examples=0, database=None)
    >>> r.ok
    True
    """

    prof = _resolve_profile(profile)
    tname = _target_name(target)
    temporary: list[OpDef] = []  # ops registered for this run only
    # By default every registered op, not the kernel families (``--kernels`` names them).
    defs = ([_as_def(o, temporary) for o in ops] if ops else
            [d for d in registered_ops() if not d.module.startswith("opsdk.kernels")])
    report = VerifyReport(target=tname, profile=prof.name, seed=seed)
    t0 = time.perf_counter()
    own = runner is None
    runner = runner or _runner_for(tname, rpc, tracker, key)
    done = [0]
    try:
        try:
            if own and hasattr(runner, "__enter__"):
                runner.__enter__()
            report.device = dict(runner.device_info())
        except (RuntimeError, OSError) as e:
            raise RunnerUnavailable(f"cannot start the {tname} runner: {e}") from e
        for d in defs:
            for dtype, layout in _cells_of(d, tname, dtypes, layouts):
                if fail_fast and not report.ok:
                    break
                label = f"{d.name} {dtype} {layout}"

                def tick(label: str = label) -> None:
                    done[0] += 1
                    if progress:
                        progress(label, done[0])

                cell = verify_cell(d, tname, dtype, layout, runner=runner, profile=prof,
                                   seed=seed, max_examples=max_examples, database=database,
                                   on_example=tick)
                report.cells.append(cell)
                if fail_fast and not cell.ok:
                    break
                if lints:
                    report.lints += lint_cell(d, tname, dtype, layout)
            if refusals:
                report.refusals += check_refusals(d)
    finally:
        if own and hasattr(runner, "__exit__"):
            runner.__exit__(None, None, None)
        for d in temporary:
            unregister(d)
    report.seconds = time.perf_counter() - t0
    return report


def _cells_of(d: OpDef, tname: str, dtypes: Sequence[str] | None,
              layouts: Sequence[str] | None) -> list[tuple[str, str]]:
    """The op's cells a run verifies, in its order: claimed dtype x layout, filtered."""
    claimed = {(c["dtype"], c["layout"])
               for c in capabilities(d, [tname], rules=False) if c["claimed"]}
    return [(dtype, layout) for dtype in cell_dtypes(d) if not dtypes or dtype in dtypes
            for layout in d.layouts
            if (not layouts or layout in layouts) and (dtype, layout) in claimed]


def _claimed_cells(defs: Sequence[OpDef], tname: str, dtypes: Sequence[str] | None,
                   layouts: Sequence[str] | None) -> Iterator[tuple[OpDef, str, str]]:
    """Every cell of a run over ``defs``, in the order :func:`verify` runs them."""
    for d in defs:
        for dtype, layout in _cells_of(d, tname, dtypes, layouts):
            yield d, dtype, layout


def _as_def(op: str | OpDef, temporary: list[OpDef]) -> OpDef:
    if isinstance(op, OpDef):
        if not is_registered(op.name):
            register(op)
            temporary.append(op)
        return op
    return get_op(op)
