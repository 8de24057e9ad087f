"""Shared machinery of the rewrite passes: apply dataflow-pattern rules to every Relax function
and record which bindings were rewritten (the *sites*), so drift reports can find them.

The sites travel with the module as the IRModule attribute ``opsdk.rewrite_sites`` (a list of
``{func, var, rule, op, binding}`` maps, ``binding`` being the bound Relax variable). The pattern
rewriter keeps the bound variable of a rewritten binding (its type does not change), so a
site's variable is the same object in the module before and after the rewrite.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import relax
from tvm.relax.dpl import pattern as _dp
from tvm.relax.dpl import rewrite_call

from .._patterns import Rule

__all__ = ["RewriteSite", "op_counts", "rewrite_sites"]

SITES_ATTR = "opsdk.rewrite_sites"


@dataclass(frozen=True)
class RewriteSite:
    """One rewritten binding: ``var`` in Relax function ``func`` now holds the result of
    ``op``, produced by rewrite rule ``rule``. ``binding`` is the bound variable itself
    (names need not be unique: a rewrite may add a second ``lv2``)."""

    func: str
    var: str
    rule: str
    op: str
    binding: relax.Var | None = field(default=None, compare=False, repr=False)


def rewrite_sites(mod: tvm.IRModule) -> list[RewriteSite]:
    """The sites recorded by opsdk's rewrite passes on ``mod``, oldest first.

    Examples
    --------
    >>> import tvm, opsdk
    >>> opsdk.transform.rewrite_sites(tvm.IRModule())
    []
    """
    attrs = mod.attrs
    if attrs is None or SITES_ATTR not in attrs:
        return []
    return [
        RewriteSite(str(s["func"]), str(s["var"]), str(s["rule"]), str(s["op"]), s.get("binding"))
        for s in attrs[SITES_ATTR]
    ]


def op_counts(mod: tvm.IRModule, prefix: str = "") -> dict[str, int]:
    """How many calls of each op the module's Relax functions hold, for op names starting with
    ``prefix`` (``"opsdk."`` counts opsdk ops only).

    Examples
    --------
    >>> import opsdk, tvm
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((2, 8), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(opsdk.relax.gelu(relax.op.nn.relu(x)))
    ...     _ = bb.emit_func_output(y)
    >>> opsdk.transform.op_counts(bb.get())
    {'opsdk.gelu': 1, 'relax.nn.relu': 1}
    """
    counts: dict[str, int] = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for name, n in _call_counts(func).items():
                if name.startswith(prefix):
                    counts[name] = counts.get(name, 0) + n
    return dict(sorted(counts.items()))


def _call_counts(func: relax.Function) -> dict[str, int]:
    """How many calls of each op ``func`` holds."""
    counts: dict[str, int] = {}

    def visit(e: Any) -> None:
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            name = str(e.op.name)
            counts[name] = counts.get(name, 0) + 1

    relax.analysis.post_order_visit(func, visit)
    return counts


def _bindings(func: relax.Function) -> list[relax.Binding]:
    out: list[relax.Binding] = []

    def visit(e: Any) -> None:
        if isinstance(e, relax.SeqExpr):
            for block in e.blocks:
                out.extend(block.bindings)

    relax.analysis.post_order_visit(func.body, visit)
    return out


def _rewritable(func: Any) -> bool:
    if not isinstance(func, relax.Function):
        return False
    attrs = func.attrs or {}
    # Functions already split off for fusion or external codegen are not rewritten.
    return "Primitive" not in attrs and "Codegen" not in attrs


def apply_rules(mod: tvm.IRModule, rules: Sequence[Rule]) -> tvm.IRModule:
    """Apply ``rules`` in order to every Relax function; record the sites in the module."""
    sites = [_as_dict(s) for s in rewrite_sites(mod)]
    updates: dict[tvm.ir.GlobalVar, relax.Function] = {}
    for gv, func in mod.functions_items():
        if not _rewritable(func):
            continue
        new = func
        present = set(_call_counts(new))
        for rule in rules:
            if not _required_ops(rule.pattern) <= present:
                continue  # a whole-function match that cannot match (11 ms each on ResNet-50)
            matched: list[relax.Expr] = []
            shared: list[tuple[relax.Expr, list[tuple[relax.Expr, int]]]] = []

            def callback(orig, matchings, rule=rule, matched=matched, shared=shared):
                if isinstance(orig, relax.Var):
                    # An alias binding (``gv = lv``) matched through the var: rewrite the
                    # binding that computes the value instead, once.
                    return orig
                out = rule.build(orig, matchings)
                if out is None:
                    return orig
                if isinstance(out, tuple):
                    out = _multi_output(rule, orig, out, shared)
                matched.append(orig)
                return out

            before = new
            new = rewrite_call(rule.pattern, callback, new)
            if shared:
                new = _use_outputs(new, before, shared)
            if matched:
                present = set(_call_counts(new))
                by_value = [(b.var, b.value) for b in _bindings(before)]
                kept = {b.var for b in _bindings(new)}
                for orig in matched:
                    var = next((v for v, val in by_value if val.same_as(orig)), None)
                    # The rewriter folds a trivial ``gv = var`` binding into the rewritten
                    # one; the site then lives on under the alias.
                    while var is not None and var not in kept:
                        var = next((v for v, val in by_value if val.same_as(var)), None)
                    if var is not None:
                        sites.append(_site(gv.name_hint, var, rule.name, new))
        if not new.same_as(func):
            updates[gv] = new
    if not updates and len(sites) == len(rewrite_sites(mod)):
        return mod
    funcs = {gv: updates.get(gv, f) for gv, f in mod.functions_items()}
    out = tvm.IRModule(funcs, mod.attrs, mod.global_infos)
    return out.with_attr(SITES_ATTR, _dedupe(sites))


def _required_ops(p: Any) -> frozenset[str]:
    """The ops every match of pattern ``p`` calls (of an alternative, those both sides
    call); a part it does not know adds none, so the set never claims too much."""
    if isinstance(p, _dp.CallPattern):
        out = {str(p.op.expr.name)} if isinstance(p.op, _dp.ExprPattern) and \
            isinstance(p.op.expr, tvm.ir.Op) else set()
        for a in p.args or ():
            out |= _required_ops(a)
        return frozenset(out)
    if isinstance(p, _dp.OrPattern):
        return _required_ops(p.left) & _required_ops(p.right)
    if isinstance(p, _dp.AndPattern):
        return _required_ops(p.left) | _required_ops(p.right)
    if isinstance(p, _dp.TupleGetItemPattern):
        return _required_ops(p.tuple)
    if isinstance(p, _dp.TuplePattern):
        return frozenset().union(*(_required_ops(f) for f in p.fields))
    if isinstance(p, (_dp.AttrPattern, _dp.TypePattern, _dp.DataTypePattern,
                      _dp.ShapePattern)):
        return _required_ops(p.pattern)
    return frozenset()


def _multi_output(rule: Rule, orig: relax.Expr, out: tuple,
                  shared: list[tuple[relax.Expr, list[tuple[relax.Expr, int]]]]) -> relax.Expr:
    call, outputs = out
    root = [k for e, k in outputs.items() if e.same_as(orig)]
    if not isinstance(call, relax.Call) or len(root) != 1:
        raise ValueError(f"fusion rule {rule.name}: a multi-output build returns (call, "
                         "{expr: output_index}) with the matched root among the keys")
    shared.append((call, [(e, k) for e, k in outputs.items() if not e.same_as(orig)]))
    return relax.TupleGetItem(call, root[0])


def _use_outputs(func: relax.Function, before: relax.Function,
                 shared: list[tuple[relax.Expr, list[tuple[relax.Expr, int]]]]
                 ) -> relax.Function:
    """After each multi-output call, later uses of the other expressions it computes read
    its outputs; bindings left unused (the add the op now does) are removed."""
    by_value = [(b.var, b.value) for b in _bindings(before)]

    def var_of(e: relax.Expr) -> relax.Var | None:
        if isinstance(e, relax.Var):
            return e
        return next((v for v, val in by_value if val.same_as(e)), None)

    plan = [(call, [(v, k) for v, k in ((var_of(e), k) for e, k in extra) if v is not None])
            for call, extra in shared]

    @relax.expr_functor.mutator
    class _Outputs(relax.PyExprMutator):
        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            # The same bound variable (rewrite sites and drift identify bindings by it).
            value = self.visit_expr(binding.value)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            for call, extra in plan:
                if _same_call(binding.value, call):
                    t = binding.var
                    for v, k in extra:
                        self.set_var_remap(v, self.builder_.emit(relax.TupleGetItem(t, k)))

    out = _Outputs().visit_expr(func)
    return relax.analysis.remove_all_unused(out)


def _same_call(a: relax.Expr, b: relax.Call) -> bool:
    # The normalizer may rebuild the call it binds; same op, same argument objects.
    if a.same_as(b):
        return True
    return (isinstance(a, relax.Call) and a.op.same_as(b.op) and len(a.args) == len(b.args)
            and all(x.same_as(y) for x, y in zip(a.args, b.args)))


def _as_dict(s: RewriteSite) -> dict[str, Any]:
    d: dict[str, Any] = {"func": s.func, "var": s.var, "rule": s.rule, "op": s.op}
    if s.binding is not None:
        d["binding"] = s.binding
    return d


def _site(func: str, var: relax.Var, rule: str, new_func: relax.Function) -> dict[str, Any]:
    op = "?"
    for b in _bindings(new_func):
        if b.var.same_as(var):
            v = b.value
            if isinstance(v, relax.TupleGetItem):  # an output of a multi-output op
                v = next((c.value for c in _bindings(new_func)
                          if c.var.same_as(v.tuple_value)), v)
            op = (
                str(v.op.name) if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) else "?"
            )
            break
    # The Var itself rides along (printed as a metadata reference): it identifies the binding
    # in the module before and after the rewrite.
    return {"func": func, "var": str(var.name), "rule": rule, "op": op, "binding": var}


def _dedupe(sites: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    # A later rule rewriting the same binding again (gelu -> opsdk.gelu -> opsdk.bias_gelu)
    # replaces the earlier record.
    last: dict[tuple[str, Any], dict[str, Any]] = {}
    for s in sites:
        key = (s["func"], s.get("binding", s["var"]))
        last.pop(key, None)
        last[key] = s
    return list(last.values())
