"""Fused-vs-unfused drift: how far each rewritten site's output moves from the subgraph it
replaced, on the same inputs.

For every site the rewrite passes recorded (:func:`opsdk.transform.rewrite_sites`), two
differences are measured:

- **local**: the rewritten computation (e.g. ``opsdk.layer_norm``) is run on exactly the
  values the unfused module feeds the original subgraph, and compared with the subgraph's
  output. This isolates the site: upstream sites do not contribute.
- **end to end** (``e2e``): the value of the same binding in the rewritten module, run as a
  whole, against the unfused module; this includes drift carried in from upstream sites.

Both modules are instrumented by exposing the site bindings (and the inputs of the rewritten
computations) as extra function outputs, then compiled with :func:`opsdk.compile`.

``max_rel`` is normwise: ``max|fused - unfused| / max|unfused|`` over the site's tensor, so
elements near zero do not dominate it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ._cliargs import model_file, named_shapes, nonneg_float, output_path
from ._files import write_text_atomic
from ._userfile import load_onnx_file
from .frontend import (
    call_entry,
    check_shape_names,
    example_args,
    export_user_model,
    from_onnx,
    from_torch,
    import_model_module,
    mapping_counts,
    onnx_mapping_counts,
    prepare_model_imports,
    random_inputs,
)
from .model import compile_model, vm_outputs
from .runners import check_inputs, runner_for
from .targets import target as resolve_target
from .targets import target_arch
from .transform import FuseIntoOps, ReplaceTVMOps, RewriteSite, op_counts, rewrite_sites

__all__ = ["DriftRow", "add_drift_arguments", "format", "report", "run_drift_command",
           "site_modules"]


@dataclass(frozen=True)
class DriftRow:
    """Drift at one rewritten site (or, with ``rule == "output"``, at a function output)."""

    site: str
    rule: str
    op: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    e2e_max_abs: float
    e2e_max_rel: float

    def as_dict(self) -> dict[str, Any]:
        """The row as a JSON-friendly dict."""
        return {
            "site": self.site,
            "rule": self.rule,
            "op": self.op,
            "shape": list(self.shape),
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "e2e_max_abs": self.e2e_max_abs,
            "e2e_max_rel": self.e2e_max_rel,
        }


def _diff(fused: np.ndarray, unfused: np.ndarray) -> tuple[float, float]:
    a = np.asarray(fused, dtype=np.float64)
    b = np.asarray(unfused, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: fused {a.shape} vs unfused {b.shape}")
    if a.size == 0:
        return 0.0, 0.0
    err = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b)))
    return err, (err / scale if scale > 0 else (0.0 if err == 0 else math.inf))


# ---------------------------------------------------------------------------------------------
# IR plumbing


def _bindings(func: relax.Function) -> list[relax.Binding]:
    if not isinstance(func.body, relax.SeqExpr):
        return []
    return [b for block in func.body.blocks for b in block.bindings]


def _resolve(func: relax.Function, site: RewriteSite) -> relax.Var | None:
    """The binding var of a recorded site: the recorded variable itself, else the one
    binding of that name (names can repeat, so an ambiguous name resolves to nothing)."""
    bound = [b.var for b in _bindings(func)]
    if site.binding is not None and site.binding in set(bound):
        return site.binding
    hits = [v for v in bound if str(v.name) == site.var]
    return hits[0] if len(hits) == 1 else None


def _expose(func: relax.Function, wanted: Sequence[relax.Var]) -> relax.Function:
    """``func`` returning ``(*wanted, original result)``; dataflow vars are bound to outputs
    at the end of their block so they may leave it."""
    want = set(wanted)
    exposed: dict[relax.Var, relax.Var] = {p: p for p in func.params if p in want}
    blocks = []
    for block in func.body.blocks:
        bindings = list(block.bindings)
        for b in block.bindings:
            if b.var not in want:
                continue
            if isinstance(block, relax.DataflowBlock):
                out = relax.Var(f"{b.var.name}_exposed", b.var.ty)
                bindings.append(relax.VarBinding(out, b.var))
                exposed[b.var] = out
            else:
                exposed[b.var] = b.var
        cls = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(cls(bindings))
    missing = [str(v.name) for v in wanted if v not in exposed]
    if missing:
        raise ValueError(f"cannot expose {missing}: not bound at the top level of the function")
    ret = relax.Tuple([*(exposed[v] for v in wanted), func.body.body])
    ret_ty = relax.TupleType([*(v.ty for v in wanted), func.body.body.ty])
    new = relax.Function(func.params, relax.SeqExpr(blocks, ret), ret_ty, func.is_pure, func.attrs)
    return relax.BlockBuilder().normalize(new)


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    def __init__(self, remap: dict[Any, relax.Expr]) -> None:
        super().__init__()
        self.remap = remap

    def visit_var_(self, op: relax.Var) -> relax.Expr:
        return self.remap.get(op, op)

    def visit_dataflow_var_(self, op: relax.DataflowVar) -> relax.Expr:
        return self.remap.get(op, op)


def _region(
    func: relax.Function,
    roots: Sequence[relax.Var],
    stop: Callable[[relax.Var], bool],
    frontier: list[relax.Var] | None = None,
) -> tuple[relax.Function, list[relax.Var]]:
    """A function computing ``roots`` from the bindings of ``func`` that lead to them, cut at
    the vars where ``stop`` holds (and at parameters): those become its parameters, in the
    order found, or in the order of ``frontier`` when given."""
    binds = _bindings(func)
    defs = {b.var: b for b in binds}
    order = {b.var: i for i, b in enumerate(binds)}
    region: dict[relax.Var, relax.Binding] = {}
    found: list[relax.Var] = []
    seen: set[relax.Var] = set()

    def walk(var: relax.Var, is_root: bool) -> None:
        if not is_root and (stop(var) or var not in defs):
            # An input of the region, even when it is another site's root.
            if var not in seen:
                seen.add(var)
                found.append(var)
            return
        if var in region:
            return
        region[var] = defs[var]
        for v in relax.analysis.free_vars(defs[var].value):
            walk(v, False)

    for r in roots:
        walk(r, True)
    inputs = found if frontier is None else list(frontier)
    tuples = [str(v.name) for v in inputs if not isinstance(v.ty, relax.TensorType)]
    if tuples:
        raise ValueError(f"a rewritten site reads non-tensor values {tuples}; cannot isolate it")
    extra = [v for v in found if v not in set(inputs)]
    if extra:
        raise ValueError(f"region reads {[str(v.name) for v in extra]} outside its frontier")
    bb = relax.BlockBuilder()
    params = [relax.Var(f"in{i}_{v.name}", v.ty) for i, v in enumerate(inputs)]
    remap: dict[Any, relax.Expr] = dict(zip(inputs, params))
    with bb.function("main", params):
        with bb.dataflow():
            for var in sorted(region, key=order.__getitem__):
                value = _Substitute(remap).visit_expr(region[var].value)
                remap[var] = bb.emit(value, name_hint=str(var.name))
            out = bb.emit_output(relax.Tuple([remap[r] for r in roots]))
        bb.emit_func_output(out)
    return bb.get()["main"], inputs


def _resolved_sites(
    before: tvm.IRModule, after: tvm.IRModule, func: str
) -> list[tuple[RewriteSite, relax.Var, relax.Var]]:
    """(site, var in after, var in before) for each recorded site, in binding order."""
    fb, fa = before[func], after[func]
    before_vars = {b.var for b in _bindings(fb)} | set(fb.params)
    resolved = []
    for s in rewrite_sites(after):
        if s.func != func:
            continue
        va = _resolve(fa, s)
        if va is None:
            continue
        # The rewriter keeps a rewritten binding's var; fall back to the name otherwise.
        vb = va if va in before_vars else _resolve(fb, s)
        if vb is not None:
            resolved.append((s, va, vb))
    order = {b.var: i for i, b in enumerate(_bindings(fa))}
    resolved.sort(key=lambda t: order[t[1]])
    return resolved


def site_modules(
    mod_before: tvm.IRModule, mod_after: tvm.IRModule, func: str = "main"
) -> tuple[tvm.IRModule, tvm.IRModule, list[RewriteSite]]:
    """The rewritten sites alone: ``(unfused, fused, sites)``, two modules whose ``main`` take
    the same inputs (the values the sites read) and return the sites' outputs as a tuple.

    Useful to time or inspect just what a rewrite changed.

    Examples
    --------
    >>> import opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    >>> b = relax.Var("b", relax.TensorType((16,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x, b]):
    ...     with bb.dataflow():
    ...         y = bb.emit(relax.op.nn.relu(x))
    ...         z = bb.emit_output(relax.op.nn.gelu(relax.op.add(y, b)))
    ...     _ = bb.emit_func_output(z)
    >>> mod = bb.get()
    >>> unfused, fused, sites = opsdk.drift.site_modules(mod, opsdk.transform.FuseIntoOps()(mod))
    >>> opsdk.transform.op_counts(unfused), opsdk.transform.op_counts(fused)
    ({'relax.add': 1, 'relax.nn.gelu': 1}, {'opsdk.bias_gelu': 1})
    >>> [p.ty.shape for p in fused["main"].params] == [p.ty.shape for p in unfused["main"].params]
    True
    """
    resolved = _resolved_sites(mod_before, mod_after, func)
    fb = mod_before[func]
    before_vars = {b.var for b in _bindings(fb)} | set(fb.params)
    fused, frontier = _region(
        mod_after[func], [va for _, va, _ in resolved], before_vars.__contains__
    )
    in_frontier = set(frontier)
    unfused, _ = _region(fb, [vb for *_, vb in resolved], in_frontier.__contains__, frontier)
    return (
        tvm.IRModule({"main": unfused}),
        tvm.IRModule({"main": fused}),
        [s for s, *_ in resolved],
    )


# ---------------------------------------------------------------------------------------------
# Running


def _run(mod: tvm.IRModule, func: str, inputs: Sequence[np.ndarray], target: Any) -> list[Any]:
    """Compile for ``target`` and run; the outputs flattened into a list of arrays."""

    tgt = resolve_target(target)
    ex = compile_model(mod, tgt).ex  # opsdk.compile's pipeline, through the compile cache
    machine = platform.machine().lower()
    if target_arch(tgt) == {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine):
        dev = tvm.cpu()
        vm = relax.VirtualMachine(ex, dev)
        out = vm[func](*[tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs])
        return vm_outputs(out)

    with runner_for(target if isinstance(target, str) else "arm") as r:
        return list(r.run(ex, list(inputs), entry=func))


def _inputs(func: relax.Function, inputs: Sequence[Any] | Mapping[str, Any]) -> list[np.ndarray]:
    names = [str(p.name) for p in func.params]
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        if missing:
            raise ValueError(f"inputs lack {missing}; the function takes {names}")
        return [np.asarray(inputs[n]) for n in names]
    if len(inputs) != len(names):
        raise ValueError(f"{len(inputs)} inputs given; the function takes {names}")
    return [np.asarray(a) for a in inputs]


def report(
    mod_before: tvm.IRModule,
    mod_after: tvm.IRModule | Callable[[tvm.IRModule], tvm.IRModule],
    inputs: Sequence[Any] | Mapping[str, Any],
    target: Any = "x86",
    *,
    func: str = "main",
    reference: tvm.IRModule | None = None,
) -> list[DriftRow]:
    """Per rewritten site, the max abs / rel difference between fused and unfused evaluation.

    Parameters
    ----------
    mod_before : tvm.IRModule
        The unfused module.
    mod_after : tvm.IRModule or callable
        The rewritten module, or a rewrite (e.g. ``opsdk.transform.FuseIntoOps()``, or a
        ``tvm.transform.Sequential`` of rewrites) to apply to ``mod_before``. Its sites come
        from :func:`opsdk.transform.rewrite_sites`, so it must have been made from
        ``mod_before`` by opsdk's rewrite passes.
    inputs : sequence or mapping of arrays
        Values for the parameters of ``func`` (positionally, or by parameter name).
    target : str or dict or tvm.target.Target
        Where to compile and run (``x86``; an aarch64 target runs through
        :func:`opsdk.runners.runner_for`).
    func : str
        The Relax function to compare.
    reference : tvm.IRModule, optional
        Compare the function outputs with this module's instead of ``mod_before``'s (same
        inputs): e.g. TVM's own import, when ``mod_before`` already holds ops that a torch
        mapping put in at import, so the output rows include their drift.

    Returns
    -------
    list of DriftRow
        One row per site in binding order (``max_abs``/``max_rel``: local, the site alone on
        the unfused module's values; ``e2e_*``: the rewritten module run as a whole), then one
        row per output leaf of ``func`` (``rule == "output"``, local columns = e2e columns).

    Examples
    --------
    >>> import numpy as np, opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    >>> b = relax.Var("b", relax.TensorType((16,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x, b]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.gelu(relax.op.add(x, b)))
    ...     _ = bb.emit_func_output(y)
    >>> rng = np.random.default_rng(0)
    >>> ins = [rng.normal(size=(4, 16)).astype("float32"), rng.normal(size=16).astype("float32")]
    >>> rows = opsdk.drift.report(bb.get(), opsdk.transform.FuseIntoOps(), ins)
    >>> [(r.rule, r.op) for r in rows]
    [('fuse.bias_gelu', 'opsdk.bias_gelu'), ('output', 'main')]
    >>> rows[0].max_abs < 1e-5
    True
    """
    after = mod_after if isinstance(mod_after, tvm.IRModule) else mod_after(mod_before)
    fb, fa = mod_before[func], after[func]
    ins = _inputs(fb, inputs)
    resolved = _resolved_sites(mod_before, after, func)
    before_vars = {b.var for b in _bindings(fb)} | set(fb.params)
    roots = [va for _, va, _ in resolved]
    local_fn, frontier = _region(fa, roots, before_vars.__contains__)
    before_mod = tvm.IRModule({func: _expose(fb, [vb for *_, vb in resolved] + frontier)})
    after_mod = tvm.IRModule({func: _expose(fa, roots)})
    n = len(resolved)
    nf = len(frontier)
    b_out = _run(before_mod, func, ins, target)
    a_out = _run(after_mod, func, ins, target)
    unfused_sites, frontier_vals = b_out[:n], b_out[n : n + nf]
    local = _run(tvm.IRModule({"main": local_fn}), "main", frontier_vals, target) if n else []

    rows = []
    for i, (s, *_) in enumerate(resolved):
        la, lr = _diff(local[i], unfused_sites[i])
        ea, er = _diff(a_out[i], unfused_sites[i])
        shape = tuple(np.shape(unfused_sites[i]))
        rows.append(DriftRow(s.var, s.rule, s.op, shape, la, lr, ea, er))
    final_b, final_a = b_out[n + nf :], a_out[n:]
    if reference is not None:
        final_b = _run(reference, func, ins, target)
    for i, (ob, oa) in enumerate(zip(final_b, final_a)):
        ea, er = _diff(oa, ob)
        name = func if len(final_b) == 1 else f"{func}[{i}]"
        rows.append(DriftRow(name, "output", func, tuple(ob.shape), ea, er, ea, er))
    return rows


def format(rows: Sequence[DriftRow]) -> str:
    """A plain-text table of drift rows.

    Examples
    --------
    >>> from opsdk.drift import DriftRow, format
    >>> print(format([DriftRow("lv3", "fuse.layer_norm", "opsdk.layer_norm", (2, 8),
    ...                        1e-7, 5e-8, 2e-7, 1e-7)]))  # doctest: +NORMALIZE_WHITESPACE
    site  rule             op                shape  max_abs  max_rel  e2e_max_abs  e2e_max_rel
    lv3   fuse.layer_norm  opsdk.layer_norm  2x8    1.0e-07  5.0e-08  2.0e-07      1.0e-07
    """
    head = ("site", "rule", "op", "shape", "max_abs", "max_rel", "e2e_max_abs", "e2e_max_rel")
    body = [
        (
            r.site,
            r.rule,
            r.op,
            "x".join(str(d) for d in r.shape) or "scalar",
            f"{r.max_abs:.1e}",
            f"{r.max_rel:.1e}",
            f"{r.e2e_max_abs:.1e}",
            f"{r.e2e_max_rel:.1e}",
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *body)
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------- opsdk drift
_REWRITES = ("replace", "fuse")


def add_drift_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``opsdk drift`` arguments to ``parser``.

    Examples
    --------
    >>> import argparse
    >>> from opsdk.drift import add_drift_arguments
    >>> args = add_drift_arguments(argparse.ArgumentParser()).parse_args(["model.onnx"])
    >>> args.target, args.rewrite
    ('x86', 'replace,fuse')
    """
    parser.add_argument(
        "model",
        help="an .onnx file, or a Python file / module whose ENTRY function returns "
        "(torch module, example args), a torch.export program, or (IRModule, inputs)",
    )
    parser.add_argument(
        "--entry", default="build_model", help="function to call in a Python model (build_model)"
    )
    parser.add_argument("--target", default="x86", help="where to compile and run (x86)")
    parser.add_argument(
        "--rewrite",
        default="replace,fuse",
        help="rewrites to measure, comma-separated: replace (ReplaceTVMOps), fuse (FuseIntoOps)",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="input shape for a symbolic ONNX / IRModule input (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument(
        "--max-rel",
        type=nonneg_float,
        default=None,
        help="exit 1 when a site's local max_rel exceeds this",
    )
    parser.add_argument("--json", default=None, metavar="PATH", type=output_path,
                        help="also write rows as JSON")
    return parser


def _load_model(
    spec: str,
    entry: str = "build_model",
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
) -> tuple[tvm.IRModule, list[np.ndarray], tvm.IRModule | None]:
    """The unfused Relax module of a model, inputs for it, and TVM's own import when the
    registered ops' torch / ONNX mappings changed the first.

    ``spec`` is an ``.onnx`` path (imported with TVM's plain ONNX frontend), or a Python file
    or module whose ``entry`` function returns one of: ``(torch.nn.Module, example_args)``,
    a ``torch.export.ExportedProgram`` (both imported with ``from_torch(..., ops=(),
    op_mappings=True)``: TVM's converters for the built-ins, which the rewrites then replace,
    and each op's own mapping, e.g. a user's op for hardswish), ``(tvm.IRModule, inputs)`` or a
    ``tvm.IRModule`` (random inputs).

    Returns
    -------
    (tvm.IRModule, list of numpy.ndarray, tvm.IRModule or None)
    """

    prepare_model_imports()  # timm / torchvision / transformers beside a CPU torch

    shapes = shapes or {}
    rng = np.random.default_rng(seed)
    if spec.endswith(".onnx"):
        proto = load_onnx_file(spec)
        check_shape_names(proto, shapes, spec)
        mod = from_onnx(proto, shape_dict=shapes or None, ops=())
        plain = (from_onnx(proto, shape_dict=shapes or None, ops=(), op_mappings=False)
                 if onnx_mapping_counts(mod) else None)
        return mod, random_inputs(mod["main"], shapes, rng), plain
    built = call_entry(import_model_module(spec), spec, entry)
    if isinstance(built, tvm.IRModule):
        return built, random_inputs(built["main"], shapes, rng), None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], tvm.IRModule):
        inputs = [np.asarray(a) for a in built[1]]
        check_inputs(built[0]["main"], inputs)  # InputMismatch (a ValueError): named, early
        return built[0], inputs, None
    import torch  # optional: only a torch model needs it

    if isinstance(built, torch.export.ExportedProgram):
        ep, args = built, built.example_inputs[0]
    elif isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module):
        model, args = built[0], example_args(built, spec, entry)
        ep = export_user_model(torch.export.export, model.eval(), args, spec)
    else:
        raise TypeError(
            f"{spec}:{entry}() returned {type(built).__name__}; expected (torch module, args), "
            "an ExportedProgram, an IRModule or (IRModule, inputs)"
        )
    inputs = [a.detach().cpu().numpy() for a in args if isinstance(a, torch.Tensor)]
    mod = from_torch(ep, ops=(), op_mappings=True)
    plain = from_torch(ep, ops=()) if any(mapping_counts(mod).values()) else None
    return mod, inputs, plain


def run_drift_command(args: argparse.Namespace) -> int:
    """Run ``opsdk drift``: print the drift table; 0 on success, 1 when ``--max-rel`` is
    exceeded, 2 on a usage error.

    Examples
    --------
    >>> import argparse
    >>> from opsdk.drift import add_drift_arguments, run_drift_command
    >>> parser = add_drift_arguments(argparse.ArgumentParser(prog="opsdk drift"))
    >>> run_drift_command(parser.parse_args(["model.onnx", "--rewrite", "inline"]))
    2
    """

    try:
        names = [r.strip() for r in args.rewrite.split(",") if r.strip()]
        bad = [r for r in names if r not in _REWRITES]
        if bad or not names:
            raise ValueError(f"--rewrite {args.rewrite!r}: choose from {', '.join(_REWRITES)}")

        resolve_target(args.target)  # a typo was a traceback after the model loaded
        try:  # a missing file was "No module named '/path/m'"
            model_file(args.model)
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
        mod, inputs, plain = _load_model(args.model, args.entry, named_shapes(args.shape),
                                         args.seed)
    except (ValueError, TypeError, FileNotFoundError, ImportError, AttributeError) as e:
        print(f"opsdk drift: error: {e}", file=sys.stderr)
        return 2
    passes = {"replace": ReplaceTVMOps(), "fuse": FuseIntoOps()}
    rewrite = tvm.transform.Sequential([passes[n] for n in names], name="opsdk.drift")
    after = rewrite(mod)
    # The output rows compare with TVM's own import, so an op's own torch / ONNX mapping
    # (made at import, not a rewrite site) counts in the end-to-end drift too.
    rows = report(mod, after, inputs, target=args.target, reference=plain)
    counts = op_counts(after, "opsdk.")
    print(f"model: {args.model}   target: {args.target}   rewrites: {', '.join(names)}")
    print("opsdk ops: " + (", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"))
    mapped = {**mapping_counts(mod), **onnx_mapping_counts(mod)}
    if any(mapped.values()):
        print("mapped at import (drift in the output rows, against TVM's import): "
              + ", ".join(f"{k} x{v}" for k, v in mapped.items() if v))
    print(format(rows))
    if args.json:
        write_text_atomic(args.json, json.dumps([r.as_dict() for r in rows], indent=2))
    if args.max_rel is not None:
        worst = [r for r in rows if r.rule != "output" and r.max_rel > args.max_rel]
        if worst:
            print(f"{len(worst)} site(s) drift more than max_rel={args.max_rel}", file=sys.stderr)
            return 1
    return 0
