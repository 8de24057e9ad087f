"""The two gates a tuned record passes before it enters the database.

**Verify.** The record's trace, as stored (JSON), is replayed on the kernel's unscheduled
function and compiled with opsdk's TIR pipeline. On several random draws its outputs are
compared with a float64 reference (the same unscheduled function with every float32 in it
made float64, run on the same inputs) within the kernel's rounding bound
``gamma_(K+8) * |x|.|w| + 64 u |ref|`` (``K`` the reduction length, ``|x|.|w|`` the float64
kernel run on the inputs' absolute values with its clamps removed: the error model of a sum
of products, plus a few ulps for an epilogue). A clamp (ReLU6's ``min(v, 6)``) moves an
error by at most itself, so the bound is the unclamped sum's; clamping the magnitude run
too would bound the sum by 6 and miss its rounding. The unscheduled float32 kernel runs
beside it (schedule invariance: its error is reported next to the tuned one). A trace that
does not replay, does not build, or misses the bound on any element is rejected with a
reproducer.

**Speed.** The model is compiled twice, with the hand rules and with the records in place
(the same pipeline, packing folded as in use), and each tuned kernel is timed against its hand
rule on the arguments the model called it with, interleaved in alternating order; the ratio is
the median of the per-round ratios (one round's preemption moves one ratio, not the result).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._search import args_for, build_func

__all__ = ["GateResult", "float64_twin", "reduction_length", "speed_ratios", "verify_trace"]

U32 = 2.0 ** -24  # float32 unit roundoff


@dataclass
class GateResult:
    """The verify gate's verdict on one record."""

    ok: bool
    why: str = ""
    worst: float = 0.0  # the largest error / bound over every draw (> 1: failed)
    generic_worst: float = 0.0  # the unscheduled float32 kernel's, for comparison
    reference: str = "float64"  # or "unscheduled float32" when no float64 twin was made
    draws: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "why": self.why, "worst_error_over_bound": self.worst,
                "generic_error_over_bound": self.generic_worst, "reference": self.reference,
                "draws": self.draws, "notes": list(self.notes)}


def float64_twin(func: Any, *, clamps: bool = True, text: str | None = None) -> Any | None:
    """``func`` with float32 replaced by float64 throughout (buffers, constants, casts),
    through its TVMScript (0.27 has no TIR mutator in Python); None when the text does not
    parse back. ``clamps=False`` also drops every ``min`` / ``max`` with a constant (a
    ReLU6's or a hardswish's clamp): the magnitude run of the error bound. ``text``:
    ``func``'s TVMScript, when the caller printed it already.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.tune import float64_twin
    >>> a = te.placeholder((4,), name="a")
    >>> f = te.create_prim_func([a, te.compute((4,), lambda i: te.min(a[i], 6.0))])
    >>> "T.min" in float64_twin(f).script(), "T.min" in float64_twin(f, clamps=False).script()
    (True, False)
    """
    import tvm  # heavy: TVM

    text = func.script() if text is None else text
    if not clamps:
        text = _without_clamps(text)
    text = re.sub(r'"float32"', '"float64"', text)
    text = text.replace("T.float32(", "T.float64(").replace("T.float32", "T.float64")
    # An intermediate buffer printed without a dtype is float32 (TVMScript's default).
    text = re.sub(r"(T\.(?:sblock_)?alloc_buffer\(\((?:[^()]|\([^()]*\))*\))\)",
                  r'\1, "float64")', text)
    try:
        out = tvm.script.from_source(text)
    except Exception:
        return None
    if isinstance(out, tvm.IRModule):
        out = out["main"] if "main" in [g.name_hint for g in out.get_global_vars()] \
            else next(iter(out.functions.values()))
    return out


_CLAMP = re.compile(r"T\.(?:min|max)\(")
_LITERAL = re.compile(r"\s*T\.float(?:16|32|64)\(\s*[-+]?[\d.]+(?:e[-+]?\d+)?\s*\)\s*")


def _without_clamps(text: str) -> str:
    """TVMScript ``text`` with each ``T.min(v, c)`` / ``T.max(v, c)`` whose one operand is
    a float literal replaced by the other operand, parenthesized (innermost first, until
    none is left); a min or max of two values (a max-pool) and an index's integer clamp
    stay."""
    while True:
        for m in reversed(list(_CLAMP.finditer(text))):
            args, end = _call_args(text, m.end())
            if len(args) != 2:
                continue
            lit = [bool(_LITERAL.fullmatch(a)) for a in args]
            if lit[0] != lit[1]:
                keep = args[1] if lit[0] else args[0]
                text = text[:m.start()] + "(" + keep.strip() + ")" + text[end:]
                break
        else:
            return text


def _call_args(text: str, start: int) -> tuple[list[str], int]:
    """The top-level comma-separated arguments of the call whose ``(`` ends just before
    ``start``, and the index after its ``)``."""
    depth, args, cur = 0, [], start
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                args.append(text[cur:i])
                return args, i + 1
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[cur:i])
            cur = i + 1
    return [], len(text)


def reduction_length(func: Any) -> int:
    """The rounding steps one output of ``func`` goes through at most: the sum over its
    blocks of each block's reduction extent (a chain of reductions, as Winograd's stages,
    adds up); 1 for a kernel without a reduction."""
    from tvm import s_tir, tirx  # heavy: TVM

    sch = s_tir.Schedule(func)
    total = 0
    for blk in sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []:
        n = 1
        for iv in sch.get(blk).iter_vars:
            if iv.iter_type == tirx.IterVar.CommReduce:
                n *= int(iv.dom.extent)
        if n > 1:
            total += n
    return max(total, 1)


def _has_root(sch: Any) -> bool:
    try:
        sch.get_sblock("root")
    except Exception:
        return False
    return True


def _outputs(args: list[Any]) -> list[np.ndarray]:
    return [a.numpy() for a in args]


def _here(fn: Any) -> Any:
    """A kernel built for this machine as :func:`verify_trace`'s ``device`` runs one."""
    import tvm  # heavy: TVM

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        args = [tvm.runtime.tensor(x, tvm.cpu()) for x in arrays]
        fn(*args)
        return _outputs(args)

    return run


def verify_trace(func: Any, trace: Any, target: Any, *, draws: int = 3,
                 seed: int = 0, device: Any = None) -> GateResult:
    """Replay ``trace`` on ``func`` and check it against the float64 reference and the
    unscheduled kernel on ``draws`` random inputs (see the module's note).

    ``device``: None runs both kernels here; else ``device(kernel, arrays)`` runs a
    ``target`` kernel on its device (a board, :mod:`opsdk.tune._remote`) on the arguments
    ``arrays`` (numpy, every parameter) and returns them after the call, raising
    ``ValueError`` when the kernel does not build. The float64 reference runs here.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import te
    >>> from opsdk.tune import verify_trace
    >>> a = te.placeholder((8, 8), name="a")
    >>> f = te.create_prim_func([a, te.compute((8, 8), lambda i, j: a[i, j] * 2)])
    >>> verify_trace(f, [[], []], opsdk.target("x86")).ok
    True
    """
    import tvm  # heavy: TVM

    from ..schedules import apply_trace
    from ..targets import target as resolve_target

    try:
        tuned_func = apply_trace(func, trace, target).mod["main"]
    except Exception as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return GateResult(False, f"the trace does not replay on the workload: {first}")
    if device is None:
        try:
            run_tuned = _here(build_func(tuned_func, target))
        except Exception as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            return GateResult(False, f"the scheduled kernel does not build: {first}")
        run_generic = _here(build_func(func, target))
        host = target
    else:
        def run_tuned(arrays: list[np.ndarray]) -> list[np.ndarray]:
            return list(device(tuned_func, arrays))

        def run_generic(arrays: list[np.ndarray]) -> list[np.ndarray]:
            return list(device(func, arrays))

        host = resolve_target("host")
    script = func.script()
    twin = float64_twin(func, text=script)
    ref64 = build_func(twin, host) if twin is not None else None
    mag64 = ref64
    unclamped = _without_clamps(script)
    if ref64 is not None and unclamped != script:
        loose = float64_twin(func, text=unclamped)
        mag64 = build_func(loose, host) if loose is not None else None
        if mag64 is None:
            ref64 = None  # no clamp-free magnitude run: judge against float32 instead
    k = reduction_length(func)
    gamma = (k + 8) * U32 / (1 - (k + 8) * U32)
    res = GateResult(True, reference="float64" if ref64 is not None
                     else "unscheduled float32", draws=draws)
    if ref64 is None:
        res.notes.append("no float64 twin (the TVMScript did not parse back as float64): "
                         "judged against the unscheduled float32 kernel")
    dev = tvm.cpu()
    for d in range(draws):
        a = args_for(func, seed + 101 * d, dev)
        if d == 1:  # a wider range: large magnitudes and cancellation
            a = [tvm.runtime.tensor((x.numpy() * 64).astype(x.dtype), dev)
                 if str(x.dtype).startswith("float") else x for x in a]
        base = [x.numpy() for x in a]
        try:
            out_t = run_tuned([x.copy() for x in base])
        except ValueError as e:  # a device's build
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            return GateResult(False, f"the scheduled kernel does not build: {first}")
        out_g = run_generic([x.copy() for x in base])
        if ref64 is not None:
            wide = [x.astype("float64") if x.dtype == np.float32 else x for x in base]
            r = [tvm.runtime.tensor(x.copy(), dev) for x in wide]
            m = [tvm.runtime.tensor(np.abs(x) if x.dtype.kind == "f" else x.copy(), dev)
                 for x in wide]
            ref64(*r)
            mag64(*m)
            refs, mags = _outputs(r), [np.abs(x) for x in _outputs(m)]
        else:
            refs = [x.astype("float64") for x in out_g]
            mags = [np.abs(x) for x in refs]
        for i, x in enumerate(base):
            if np.array_equal(out_t[i], x) and np.array_equal(out_g[i], x):
                continue  # an input (unchanged by either kernel)
            if out_t[i].dtype.kind != "f":
                if not np.array_equal(out_t[i], out_g[i]):
                    bad = int(np.argmax(out_t[i].ravel() != out_g[i].ravel()))
                    res.ok, res.why = False, (f"draw {d}: output {i} differs from the "
                                              f"unscheduled kernel at flat index {bad}")
                    return res
                continue
            ref = refs[i].astype("float64")
            slack = 2 if ref64 is None else 1  # against float32: both sides round
            bound = slack * (gamma * mags[i] + 64 * U32 * np.abs(ref)) + 1e-30
            for name, out in (("tuned", out_t[i]), ("generic", out_g[i])):
                err = np.abs(out.astype("float64") - ref)
                err = np.where(np.isnan(err), np.inf, err)
                ratio = err / bound
                worst = float(np.max(ratio)) if ratio.size else 0.0
                if name == "tuned":
                    res.worst = max(res.worst, worst)
                    if worst > 1.0:
                        bad = int(np.argmax(ratio))
                        idx = np.unravel_index(bad, ratio.shape)
                        res.ok = False
                        res.why = (f"draw {d}: output {i} at {tuple(int(v) for v in idx)} is "
                                   f"{out.ravel()[bad]!r}, the {res.reference} reference "
                                   f"{ref.ravel()[bad]!r} (error {err.ravel()[bad]:.3g} > bound "
                                   f"{bound.ravel()[bad]:.3g}; unscheduled float32: "
                                   f"{out_g[i].ravel()[bad]!r})")
                        return res
                else:
                    res.generic_worst = max(res.generic_worst, worst)
    return res


def speed_ratios(hand: Any, tuned: Any, inputs: list[np.ndarray], names: list[str], *,
                 rounds: int = 7, budget_s: float = 0.01) -> dict[str, dict[str, float]]:
    """Per kernel of ``names`` (fused names: ``_prepacked`` dropped): the hand-rule and
    tuned times (medians, ms) and the median of the per-round ratios hand / tuned, each
    kernel timed on the arguments one run of each compiled model passed it, the two timed
    in alternating order round by round.

    ``hand`` and ``tuned`` are VM executables of the same model."""
    import tvm  # heavy: TVM
    from tvm import relax  # heavy: TVM

    dev = tvm.cpu()

    def calls(ex: Any) -> dict[str, tuple[Any, list[Any]]]:
        vm = relax.VirtualMachine(ex, dev)
        found: dict[str, tuple[Any, list[Any]]] = {}

        def instrument(func: Any, sym: Any, before: bool, ret: Any, *a: Any) -> int:
            name = str(sym).removesuffix("_prepacked")
            if before and not str(sym).startswith("vm.") and name not in found:
                found[name] = (func, list(a))
            return 0

        vm.set_instrument(instrument)
        vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(x), dev) for x in inputs])
        return found

    ch, ct = calls(hand), calls(tuned)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        if name not in ch or name not in ct:
            continue
        (fh, ah), (ft, at) = ch[name], ct[name]
        for f, a in ((fh, ah), (ft, at)):
            f(*a)
        per = []
        for f, a in ((fh, ah), (ft, at)):
            t0 = time.perf_counter()
            f(*a)
            per.append(max(time.perf_counter() - t0, 1e-7))
        n = max(1, min(2000, int(budget_s / max(per))))
        th, tt, ratios = [], [], []
        for r in range(rounds):
            pair = []
            order = ((fh, ah), (ft, at)) if r % 2 == 0 else ((ft, at), (fh, ah))
            for f, a in order:
                t0 = time.perf_counter()
                for _ in range(n):
                    f(*a)
                pair.append((time.perf_counter() - t0) / n)
            h, t = (pair[0], pair[1]) if r % 2 == 0 else (pair[1], pair[0])
            th.append(h)
            tt.append(t)
            ratios.append(h / t)
        out[name] = {"hand_ms": float(np.median(th)) * 1e3,
                     "tuned_ms": float(np.median(tt)) * 1e3,
                     "ratio": float(np.median(ratios))}
    return out
