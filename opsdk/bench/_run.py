"""The benchmark runner: every candidate of a case measured side by side, interleaved."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import tvm
from tvm import relax, s_tir, te
from tvm.s_tir import dlight

from .._dtypes import np_dtype
from .._pipeline import fusion_passes
from .._tir import tir_pipeline as opsdk_tir
from ..registry import builder, get_op
from ..schedules import generic_only, last_choices, vector_lanes
from ..targets import target as resolve_target
from ..targets import target_arch
from ..transform import LowerOps as opsdk_lower
from ._cases import DEFAULT_CASES, SPECS, Case, onnx_model
from ._timing import Timer, ort_session, py_step, setup_threads, vm_step

__all__ = ["CANDIDATES", "expand_cases", "run_bench"]

#: Candidates in table order. ``copy_tvm``/``copy_numpy`` move the same bytes (the roofline);
#: ``hot`` is the opsdk kernel on a cache-resident slice of the rows, scaled to the full size:
#: its compute time without the memory traffic.
CANDIDATES = ("opsdk", "tvm", "dlight", "torch", "onnxruntime", "copy_tvm", "copy_numpy", "hot")
#: Working set (inputs + output) of the ``hot`` slice: within the two cores' L2 caches
#: (1 MiB each on Zen 4), large enough that a call lasts tens of microseconds.
_HOT_BYTES = 3 << 19
_SETTLE_S = 0.005
# torch's OpenMP workers spin for milliseconds after a parallel region (GOMP_SPINCOUNT, read
# when torch is imported, before the bench can set it); a short parallel TVM kernel timed in
# that window waits for a preempted worker on every call (measured: a 19 us kernel took
# 600 us right after torch). So torch is followed by a longer pause and by the one
# single-threaded candidate (numpy's copy), and the short TVM kernels run first.
_TORCH_SETTLE_S = 0.05
_RUN_ORDER = ("opsdk", "copy_tvm", "hot", "hot_one", "tvm", "dlight", "torch", "copy_numpy",
              "onnxruntime")
_PEERS = ("torch", "onnxruntime")  # their workers spin after a run: a longer pause follows


def expand_cases(
    ops: Sequence[str] | None = None,
    shapes: Sequence[tuple[int, ...]] | None = None,
    dtypes: Sequence[str] = ("float32", "float16"),
) -> list[Case]:
    """The cases to run: ``ops`` (``name`` or ``name:layout``) x shapes x dtypes.

    Without ``shapes`` each op uses the issue's benchmark shapes. A given shape is used for
    every op whose rank range admits it (group norm needs rank 4).

    Examples
    --------
    >>> from opsdk.bench import expand_cases
    >>> [c.label for c in expand_cases(["softmax"], [(64, 32)], ["float32"])]
    ['softmax 64x32 float32']
    """
    wanted: list[tuple[str, str]] = []
    for item in ops or sorted({c[0] for c in DEFAULT_CASES}, key=_default_order):
        name, _, layout = item.partition(":")
        d = get_op(name)  # KeyError for unknown ops
        if name not in SPECS and not shapes:
            raise ValueError(
                f"op {name!r} is not a built-in with a default benchmark shape; pass --shapes"
            )
        if layout and layout not in d.layouts:
            raise ValueError(f"op {name!r} has no layout {layout!r}; known: {list(d.layouts)}")
        wanted.append((name, layout))
    out: list[Case] = []
    for name, layout in wanted:
        d = get_op(name)
        if shapes:
            base = [(layout, tuple(s), {}) for s in shapes if d.ranks[0] <= len(s) <= d.ranks[1]]
            if name == "group_norm":
                base = [(lay or "NCHW", s, {"num_groups": _groups(s, lay)}) for lay, s, _ in base]
        else:
            base = [(lay, s, a) for (n, lay, s, a) in DEFAULT_CASES if n == name]
            if layout:
                base = [b for b in base if b[0] == layout] or [(layout, *base[0][1:])]
        for dt in dtypes:
            for lay, s, a in base:
                out.append(Case(name, tuple(s), dt, lay, dict(a)))
    return out


def _default_order(name: str) -> int:
    order = [c[0] for c in DEFAULT_CASES]
    return order.index(name)


def _groups(shape: tuple[int, ...], layout: str) -> int:
    c = shape[3] if layout == "NHWC" else shape[1]
    return math.gcd(c, 32)


# --------------------------------------------------------------------------------- builders
def _attrs(case: Case) -> dict[str, Any]:
    d = get_op(case.op)
    attrs = {**d.default_attrs(), **(d.layouts.get(case.layout, {}) if case.layout else {})}
    attrs.update(case.attrs)
    return d.normalize_attrs(d.bind_attrs(attrs), len(case.shape))


def _module(case: Case, body: Callable[[list], relax.Expr]) -> tvm.IRModule:
    d = get_op(case.op)
    shapes = d.example_shapes(case.shape, _attrs(case))
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(list(s), case.dtype)) for n, s in shapes.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(body(params)))
        bb.emit_func_output(out)
    return bb.get()


def _opsdk_module(case: Case) -> tvm.IRModule:
    d = get_op(case.op)
    names = list(d.example_shapes(case.shape, _attrs(case)))
    return _module(case, lambda v: builder(d)(**dict(zip(names, v)), **_attrs(case)))


def _tvm_module(case: Case) -> tvm.IRModule:
    return _module(case, lambda v: SPECS[case.op].relax_fn(v, _attrs(case)))


def _dlight(mod: tvm.IRModule, tgt) -> tuple[tvm.IRModule, bool]:
    """TVM's CPU dlight rules after default legalization; also says whether any applied."""

    with tgt:
        out = dlight.ApplyDefaultSchedule(dlight.cpu.Reduction(), dlight.cpu.GEMV())(
            _fuse(mod, tgt)
        )
    applied = any(
        isinstance(f, tvm.tirx.PrimFunc) and f.attrs and "tirx.is_scheduled" in f.attrs
        for f in out.functions.values()
    )
    return out, applied


def _fuse(mod: tvm.IRModule, tgt) -> tvm.IRModule:
    """TVM's default legalization and fusion (what ``tvm.compile`` runs before codegen)."""

    seq = tvm.transform.Sequential(fusion_passes())
    with tgt:
        return seq(mod)


def _kernel_timer(
    lowered: tvm.IRModule, vm: relax.VirtualMachine, args: list, tgt, dev,
    tir_pipeline: str = "default",
) -> tuple[Timer, bool]:
    """Time the one kernel ``lowered`` holds on fixed buffers, like the copy roofline.

    Through the VM every call gets a fresh output and the previous result is still alive, so
    two output buffers alternate: at the L3-resident shape x + two outputs (38 MB) no longer
    fit the 32 MB L3 (measured: rms_norm 4096x768 0.37 ms through the VM, 0.21 ms on fixed
    buffers; no difference at the DRAM-sized shape). A model compiled by Relax also writes
    planned, reused buffers. Falls back to the VM when the module holds several kernels or
    the kernel's result differs from the VM's. Returns the timer and whether it is direct.
    """
    funcs = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    if len(funcs) == 1 and len(funcs[0].params) == len(args) + 1:
        f = funcs[0]
        shapes = [tuple(int(v) for v in p.ty.shape) for p in f.params]
        if shapes[:-1] == [tuple(a.shape) for a in args]:
            ex = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}),
                             target=tgt, tir_pipeline=tir_pipeline)
            out = tvm.runtime.empty(shapes[-1], str(f.params[-1].ty.dtype), dev)
            ex["main"](*args, out)
            want = vm["main"](*args).numpy()
            if want.shape == out.shape and np.array_equal(out.numpy(), want, equal_nan=True):
                return Timer(_mod_step(ex, [*args, out], dev)), True
    return Timer(vm_step(vm, args, dev)), False


def _copy_kernel(n: int, dtype: str, tgt) -> tvm.runtime.Module:
    """A parallel, vectorized ``y = x`` over ``n`` elements (the bandwidth roofline)."""
    x = te.placeholder((n,), dtype, name="x")
    y = te.compute((n,), lambda i: x[i], name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    (i,) = sch.get_loops(sch.get_sblock("y"))
    lanes = vector_lanes(tgt, np.dtype(np_dtype(dtype)).itemsize * 8)
    outer, inner = sch.split(i, [None, lanes * 64])  # n is a multiple (see _copy_elems)
    sch.parallel(outer)
    _, vec = sch.split(inner, [None, lanes])
    sch.vectorize(vec)
    return tvm.compile(sch.mod, target=tgt)


def _copy_elems(nbytes: int, itemsize: int) -> int:
    """Elements each side of the copy (half the bytes read, half written), rounded up to a
    whole number of 64-vector chunks so the copy kernel needs no tail."""
    n = max(nbytes // 2 // itemsize, 1)
    chunk = 4096
    return -(-n // chunk) * chunk


def _mod_step(ex, args: list, dev) -> Callable[[int], float]:
    cache: dict[int, Any] = {}

    def step(k: int) -> float:
        if k not in cache:
            cache[k] = ex.mod.time_evaluator("main", dev, number=k, repeat=1)
        return float(cache[k](*args).mean)

    return step


def _inputs(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d = get_op(case.op)
    out = {}
    for name, shp in d.example_shapes(case.shape, _attrs(case)).items():
        lo, hi = d.domain.get(name, (-2.0, 2.0))
        out[name] = rng.uniform(lo, hi, size=shp).astype(np_dtype(case.dtype))
    return out


def _torch_callable(case: Case, ins: dict[str, np.ndarray]) -> Callable[[], Any] | None:
    try:
        import torch
    except ImportError:
        return None
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    ts = [torch.from_numpy(a.astype(np.float32)).to(tdt[case.dtype]) for a in ins.values()]
    if case.op not in SPECS:
        return _mapped_torch_callable(case, ins, ts)
    fn = SPECS[case.op].torch_fn(ts, _attrs(case))
    try:
        fn()
    except (RuntimeError, NotImplementedError):  # e.g. a dtype torch has no CPU kernel for
        return None
    return fn


def _mapped_torch_callable(case: Case, ins: dict[str, np.ndarray],
                           ts: list) -> Callable[[], Any] | None:
    """torch eager for an op without a bench spec: the aten op its ``OpDef.torch`` mapping
    names, called with the inputs (and the attributes, if it takes them), used only when it
    computes the op (close to the float64 reference), so a mapping that ignores an
    attribute is not timed as if it were the op."""
    import torch  # heavy: torch

    d = get_op(case.op)
    attrs = _attrs(case)
    ref = np.asarray(d.run_reference({k: v.astype(np.float64) for k, v in ins.items()}, attrs))
    scale = float(np.max(np.abs(ref), initial=0.0)) or 1.0
    for aten in d.torch_maps:
        base, _, overload = aten.partition(".")
        fn_ = getattr(getattr(torch.ops.aten, base, None), overload or "default", None)
        if fn_ is None:
            continue
        for kw in (attrs, {}):
            def call(fn_=fn_, kw=kw):  # bound per candidate
                return fn_(*ts, **kw)
            try:
                out = call().float().numpy().astype(np.float64)
            except (RuntimeError, TypeError, NotImplementedError, AttributeError):
                continue
            if out.shape == ref.shape and np.allclose(out, ref, rtol=2e-2, atol=1e-3 * scale):
                return call
    return None


def _ort_callable(case: Case, ins: dict[str, np.ndarray], row: dict,
                  threads: int) -> Callable[[], Any] | None:
    """onnxruntime's CPU kernel of the op on the same inputs, through an IO binding (inputs
    and output bound once, like the TVM kernels' fixed buffers); None where it has none."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return None
    arrays = list(ins.values())
    model = onnx_model(case.op, arrays, _attrs(case))
    if model is None:
        return None

    try:
        sess = ort_session(model, threads)
    except Exception as e:  # an op or dtype this onnxruntime has no kernel for
        row["onnxruntime_error"] = f"{type(e).__name__}: {e}".split("\n")[0][:200]
        return None
    binding = sess.io_binding()
    for name, a in zip((i.name for i in sess.get_inputs()), arrays):
        binding.bind_cpu_input(name, a)
    binding.bind_output("y")
    sess.run_with_iobinding(binding)
    out = binding.copy_outputs_to_cpu()[0].astype(np.float64)
    row["onnxruntime_max_err"] = float(np.max(np.abs(
        out - get_op(case.op).run_reference(ins, _attrs(case)))))
    return lambda: sess.run_with_iobinding(binding)


def run_bench(
    ops: Sequence[str] | None = None,
    *,
    target: str = "x86",
    shapes: Sequence[tuple[int, ...]] | None = None,
    dtypes: Sequence[str] = ("float32", "float16"),
    repeats: int = 15,
    threads: int | None = None,
    budget_ms: float = 20.0,
    check: bool = True,
    candidates: Iterable[str] = CANDIDATES,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark opsdk kernels against TVM's own lowering, dlight, torch and a copy roofline.

    For each case every candidate is compiled and warmed up, then the candidates are timed
    round-robin (interleaved) ``repeats`` times, each sample a batch of calls lasting about
    ``budget_ms``; the figures are medians over the samples. TVM candidates run through
    ``time_evaluator`` (C++ timer loop); torch and numpy through a ``perf_counter`` loop.
    torch and TVM run with ``threads`` threads (default: all cores; TVM's pool only follows
    when it has not started yet in this process, else set ``TVM_NUM_THREADS`` beforehand),
    and TVM's idle workers spin only briefly (``TVM_THREAD_POOL_SPIN_COUNT``, same caveat) so
    they do not steal the cores from the next candidate.

    Returns one dict per case: ``op``, ``layout``, ``shape``, ``dtype``, ``bytes`` moved,
    ``rule`` (the opsdk schedule rule), per candidate ``<c>_ms`` / ``<c>_min_ms`` /
    ``<c>_gbps`` (None when not applicable), ``copy_gbps`` (the faster copy), ``pct_copy``
    (opsdk bandwidth / copy bandwidth), ``speedup_tvm`` / ``speedup_dlight`` /
    ``speedup_torch``, ``dlight_applied`` and ``max_err`` (opsdk vs the float64 reference).

    Examples
    --------
    >>> from opsdk.bench import run_bench
    >>> rows = run_bench(["gelu"], shapes=[(64, 32)], dtypes=["float32"], repeats=1,
    ...                  candidates=["opsdk", "copy_numpy"], budget_ms=1)
    >>> rows[0]["op"], rows[0]["opsdk_ms"] > 0
    ('gelu', True)
    """
    tgt = resolve_target(target)
    if tgt.kind.name != "llvm" or target_arch(tgt) != target_arch(resolve_target("x86")):
        raise ValueError(f"target {target!r} does not run on this host; use x86 (the host CPU)")
    cands = [c for c in CANDIDATES if c in set(candidates)]

    # The same threads for TVM, torch and onnxruntime; TVM keeps its default worker spin and
    # each timed batch follows an untimed warm-up batch (see setup_threads and the rounds).
    ncores = setup_threads(threads)
    try:
        import torch  # noqa: F401
    except ImportError:
        cands = [c for c in cands if c != "torch"]
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    rows = []
    for case in expand_cases(ops, shapes, dtypes):
        if progress:
            progress(case.label)
        rows.append(_run_case(case, tgt, dev, cands, rng, repeats, budget_ms / 1e3, check,
                              ncores))
        rows[-1]["threads"] = ncores
    return rows


def _run_case(
    case: Case, tgt, dev, cands: list[str], rng, repeats: int, budget_s: float, check: bool,
    threads: int,
) -> dict[str, Any]:
    ins = _inputs(case, rng)
    d = get_op(case.op)
    out_shape = d.result_type(
        {k: v.shape for k, v in ins.items()}, {k: case.dtype for k in ins}, _attrs(case)
    )[0]
    itemsize = np.dtype(np_dtype(case.dtype)).itemsize
    nbytes = sum(a.nbytes for a in ins.values()) + int(np.prod(out_shape)) * itemsize
    targs = [tvm.runtime.tensor(a, dev) for a in ins.values()]
    timers: dict[str, Timer] = {}
    row: dict[str, Any] = {
        "op": case.op,
        "layout": case.layout,
        "shape": list(case.shape),
        "dtype": case.dtype,
        "attrs": {k: v for k, v in _attrs(case).items()},
        "bytes": int(nbytes),
    }
    direct: dict[str, bool] = {}
    if "opsdk" in cands:
        before = len(last_choices())
        mod = _opsdk_module(case)
        ex = tvm.compile(mod, target=tgt, tir_pipeline=opsdk_tir())
        chosen = [c.rule for c in last_choices()[before:] if c.op == case.op]
        row["rule"] = chosen[-1] if chosen else "generic"
        vm = relax.VirtualMachine(ex, dev)
        if check:
            got = vm["main"](*targs).numpy().astype(np.float64)
            row["max_err"] = float(np.max(np.abs(got - d.run_reference(ins, _attrs(case)))))
        with tgt:
            lowered = opsdk_lower(tgt)(mod)
        timers["opsdk"], direct["opsdk"] = _kernel_timer(lowered, vm, targs, tgt, dev,
                                                         opsdk_tir())
    if "tvm" in cands:
        if case.op in SPECS:
            mod = _tvm_module(case)
            vm = relax.VirtualMachine(tvm.compile(mod, target=tgt), dev)
            lowered = _fuse(mod, tgt)
        else:  # a custom op: TVM's default lowering of its own compute (no schedule rule)

            with generic_only():
                mod = _opsdk_module(case)
                vm = relax.VirtualMachine(tvm.compile(mod, target=tgt), dev)
                with tgt:
                    lowered = opsdk_lower(tgt)(mod)
        timers["tvm"], direct["tvm"] = _kernel_timer(lowered, vm, targs, tgt, dev)
    if "dlight" in cands and case.op in SPECS:
        mod, applied = _dlight(_tvm_module(case), tgt)
        row["dlight_applied"] = applied
        vm = relax.VirtualMachine(tvm.compile(mod, target=tgt), dev)
        timers["dlight"], direct["dlight"] = _kernel_timer(mod, vm, targs, tgt, dev)
    if "torch" in cands and (case.op in SPECS or get_op(case.op).torch_maps):
        fn = _torch_callable(case, ins)
        if fn is not None:
            timers["torch"] = Timer(py_step(fn))
    if "onnxruntime" in cands and case.op in SPECS:
        made = _ort_callable(case, ins, row, threads)
        if made is not None:
            timers["onnxruntime"] = Timer(py_step(made))
    hot = _hot_case(case, nbytes) if "hot" in cands and "opsdk" in cands else None
    if hot is not None:
        # The slice and a single row: their difference removes the fixed cost of a call
        # (VM dispatch, output allocation, waking the pool; ~4 us here).
        axis = _slice_axis(case)
        for key, c in (("hot", hot), ("hot_one", _rows_of(hot, 1, axis))):
            hot_ins = [tvm.runtime.tensor(a, dev) for a in _inputs(c, rng).values()]
            mod = _opsdk_module(c)
            vm = relax.VirtualMachine(tvm.compile(mod, target=tgt, tir_pipeline=opsdk_tir()),
                                      dev)
            with tgt:
                lowered = opsdk_lower(tgt)(mod)
            timers[key], _ = _kernel_timer(lowered, vm, hot_ins, tgt, dev, opsdk_tir())
        row["hot_rows"] = hot.shape[axis]
        row["hot_axis"] = axis
    half = _copy_elems(nbytes, itemsize)
    if "copy_tvm" in cands:
        ex = _copy_kernel(half, case.dtype, tgt)
        src = tvm.runtime.tensor(np.zeros(half, np_dtype(case.dtype)), dev)
        dst = tvm.runtime.tensor(np.zeros(half, np_dtype(case.dtype)), dev)
        timers["copy_tvm"] = Timer(_mod_step(ex, [src, dst], dev))
    if "copy_numpy" in cands:
        a = np.ones(half, np_dtype(case.dtype))
        b = np.empty_like(a)
        timers["copy_numpy"] = Timer(py_step(lambda: np.copyto(b, a)))
    for t in timers.values():
        t.calibrate(budget_s)
    order = [c for c in _RUN_ORDER if c in timers]
    for _ in range(max(1, repeats)):  # round-robin: drift and noise hit every candidate alike
        for c in order:
            # TVM's and torch's (OpenMP) thread pools spin for a while after a parallel call;
            # a pause lets the previous candidate's workers go idle before timing.
            time.sleep(_SETTLE_S)
            timers[c].step(max(1, timers[c].number // 4))  # wake workers and vCPUs, untimed
            timers[c].samples.append(timers[c].step(timers[c].number))
            if c in _PEERS:
                time.sleep(_TORCH_SETTLE_S)
    row["direct"] = direct  # candidates timed as one kernel on fixed buffers (else the VM)
    if "hot" in timers:  # per-row cost (slice minus one row) times the full row count
        one = timers.pop("hot_one").samples
        scale = case.shape[row["hot_axis"]] / (row["hot_rows"] - 1)
        timers["hot"].samples = [max(h - float(np.median(one)), 0.0) * scale
                                 for h in timers["hot"].samples]
    for c in CANDIDATES:
        t = timers.get(c)
        ms = float(np.median(t.samples)) * 1e3 if t else None
        row[f"{c}_ms"] = ms
        row[f"{c}_min_ms"] = float(min(t.samples)) * 1e3 if t else None
        row[f"{c}_gbps"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
    copies = [c for c in ("copy_tvm", "copy_numpy") if row.get(f"{c}_gbps")]
    best_copy = max(copies, key=lambda c: row[f"{c}_gbps"]) if copies else None
    row["copy_gbps"] = row[f"{best_copy}_gbps"] if best_copy else None
    # Ratios are medians of per-round ratios: the candidates of one round run within a few
    # hundred ms of each other, so a machine that slows down for a while (other tenants of
    # the host) changes both sides of a ratio alike.

    def ratio(c: str | None, base: str = "opsdk") -> float | None:
        t = timers.get(c) if c else None
        b = timers.get(base)
        if t is None or b is None:
            return None
        return float(np.median([x / y for x, y in zip(t.samples, b.samples) if y > 0]))

    pct = ratio(best_copy)
    row["pct_copy"] = 100.0 * pct if pct else None
    for c in ("tvm", "dlight", "torch", "onnxruntime"):
        row[f"speedup_{c}"] = ratio(c)
    # The speedup over TVM of a kernel that ran at the copy's speed: the most a memory-bound
    # op can reach without moving fewer bytes than the copy does.
    row["tvm_ceiling"] = ratio("tvm", best_copy) if best_copy else None
    # Share of the kernel's time that remains with every byte in cache: near 100 % the op is
    # compute-bound at this size, and the copy's bandwidth is out of its reach.
    hot = ratio("hot")
    row["pct_hot"] = 100.0 * hot if hot else None
    return row


def _slice_axis(case: Case) -> int:
    spec = SPECS.get(case.op)
    if spec is None or spec.slice_axis is None:
        return 0
    return spec.slice_axis(_attrs(case))


def _hot_case(case: Case, nbytes: int) -> Case | None:
    """The case cut down along its slice axis (the rows; see ``OpSpec.slice_axis``) to a
    cache-resident working set (a power of two of rows), or None when even two rows are too
    large or the case is small already."""
    axis = _slice_axis(case)
    rows = case.shape[axis]
    per_row = nbytes / rows
    fit = int(_HOT_BYTES // per_row)
    if fit < 2 or fit >= rows:
        return None
    return _rows_of(case, 1 << (fit.bit_length() - 1), axis)


def _rows_of(case: Case, k: int, axis: int = 0) -> Case:
    shape = (*case.shape[:axis], k, *case.shape[axis + 1 :])
    return Case(case.op, shape, case.dtype, case.layout, dict(case.attrs))
