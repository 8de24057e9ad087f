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
from .._walk import calls_of, relax_exprs

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
    for e in calls_of(func):
        name = str(e.op.name)
        counts[name] = counts.get(name, 0) + 1
    return counts


def _bindings(func: relax.Function) -> list[relax.Binding]:
    return [b for e in relax_exprs(func.body) if type(e) is relax.SeqExpr
            for block in e.blocks for b in block.bindings]


def _values(func: relax.Function) -> dict[Any, relax.Expr]:
    """Each bound variable's value, keyed by the variable's address (``same_as``)."""
    return {b.var.__chandle__(): b.value for b in _bindings(func)}


def _vars_by_value(func: relax.Function) -> dict[Any, relax.Var]:
    """The first variable bound to each value, keyed by the value's address."""
    out: dict[Any, relax.Var] = {}
    for b in _bindings(func):
        out.setdefault(b.value.__chandle__(), b.var)
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
            new = _rewrite(rule, callback, new, gv)
            if shared:
                new = _use_outputs(new, before, shared)
            if matched:
                present = set(_call_counts(new))
                var_of = _vars_by_value(before)
                values = _values(new)
                for orig in matched:
                    var = var_of.get(orig.__chandle__())
                    # The rewriter folds a trivial ``gv = var`` binding into the rewritten
                    # one; the site then lives on under the alias.
                    while var is not None and var.__chandle__() not in values:
                        var = var_of.get(var.__chandle__())
                    if var is not None:
                        sites.append(_site(gv.name_hint, var, rule.name, values))
        if not new.same_as(func):
            updates[gv] = new
    if not updates and len(sites) == len(rewrite_sites(mod)):
        return mod
    funcs = {gv: updates.get(gv, f) for gv, f in mod.functions_items()}
    out = tvm.IRModule(funcs, mod.attrs, mod.global_infos)
    return out.with_attr(SITES_ATTR, _dedupe(sites))


#: Rounds of :func:`_rewrite` before a rule that keeps matching its own output is refused.
_MAX_ROUNDS = 16  # the built-in rules settle in one or two


def _rewrite(rule: Rule, callback: Any, func: relax.Function, gv: tvm.ir.GlobalVar
             ) -> relax.Function:
    """``rewrite_call(rule.pattern, callback, func)``, the rewrites applied here.

    TVM's rewriter follows every round of rewrites with common-subexpression elimination
    and structural comparisons of the whole function, whose cost grows with the bytes of
    its constants: ResNet-50's 53 BatchNorm folds took 0.35 s there (1.8 s for 470 MB of
    weights), its matching alone 1 ms. So TVM only finds the matches here (a callback that
    rewrites nothing), and the rewrites are substituted into the bindings, then the bindings
    canonicalized and the unused ones removed, as TVM does; a match that looks into a
    binding rewritten in the same round waits for the next round (TVM does not look
    through a rewritten binding either), until a round rewrites nothing. A rule's result
    that recomputes a matched value reads its variable instead (what TVM's common
    subexpression elimination made of it).
    """
    for _ in range(_MAX_ROUNDS):
        found: list[tuple[relax.Expr, Any]] = []

        def collect(orig: relax.Expr, m: Any, found: list = found) -> relax.Expr:
            found.append((orig, m))
            return orig

        rewrite_call(rule.pattern, collect, func)
        values: dict[Any, relax.Expr] = {}
        for orig, m in found:
            # A part matched by its structure that this round rewrote: matched again on the
            # result (a wildcard's match is read through its variable, as TVM reads it).
            if any(e.__chandle__() in values for p, e in m.items()
                   if not isinstance(p, _dp.WildcardPattern)):
                continue
            out = callback(orig, m)
            if not out.same_as(orig):
                values[orig.__chandle__()] = out
        if not values:
            return func
        func = _substituted(func, values)
        func = relax.transform.CanonicalizeBindings()(tvm.IRModule({gv: func}))[gv]
        func = relax.analysis.remove_all_unused(func)
    raise ValueError(f"fusion rule {rule.name}: its pattern still matches what the rule built "
                     f"after {_MAX_ROUNDS} rounds of rewrites; make the rule's result something "
                     "its pattern does not match (or return None for it)")


def _substituted(func: relax.Function, values: dict[Any, relax.Expr]) -> relax.Function:
    """``func`` with each binding whose value is a key of ``values`` (by address) bound to
    the new value instead, the same variable kept (rewrite sites name it). A rule builds
    from what it matched, the bound values themselves (the matcher looks through the
    variables): each such value reads its variable again instead of being computed twice."""
    var_of = _vars_by_value(func)

    @relax.expr_functor.mutator
    class _Substitute(relax.PyExprMutator):
        def visit_var_binding_(self, binding: relax.VarBinding) -> None:
            new = values.get(binding.value.__chandle__())
            if new is None:
                super().visit_var_binding_(binding)
                return
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self._new(new)))

        def visit_match_cast_(self, binding: relax.MatchCast) -> None:
            new = values.get(binding.value.__chandle__())
            if new is None:
                super().visit_match_cast_(binding)
                return
            self.builder_.emit_normalized(relax.MatchCast(binding.var, self._new(new),
                                                          binding.ty))

        def _new(self, new: relax.Expr) -> relax.Expr:
            return self.builder_.normalize(self.visit_expr(_bound_read(new, var_of, True)))

    return _Substitute().visit_expr(func)


def _bound_read(e: relax.Expr, var_of: dict[Any, relax.Var], root: bool = False
                ) -> relax.Expr:
    """``e`` with every part that is some binding's value replaced by that binding's
    variable (``root``: ``e`` itself kept, it is the new value)."""
    if not root and (var := var_of.get(e.__chandle__())) is not None:
        return var
    if isinstance(e, relax.Call):
        args = [_bound_read(a, var_of) for a in e.args]
        if any(not a.same_as(b) for a, b in zip(args, e.args)):
            return relax.Call(e.op, args, e.attrs, list(e.ty_args))
    elif isinstance(e, relax.Tuple):
        fields = [_bound_read(f, var_of) for f in e.fields]
        if any(not a.same_as(b) for a, b in zip(fields, e.fields)):
            return relax.Tuple(fields)
    elif isinstance(e, relax.TupleGetItem):
        inner = _bound_read(e.tuple_value, var_of)
        if not inner.same_as(e.tuple_value):
            return relax.TupleGetItem(inner, e.index)
    return e


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
    by_value = _vars_by_value(before)

    def var_of(e: relax.Expr) -> relax.Var | None:
        return e if isinstance(e, relax.Var) else by_value.get(e.__chandle__())

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


def _site(func: str, var: relax.Var, rule: str, values: dict[Any, relax.Expr]
          ) -> dict[str, Any]:
    """The site of ``var``, bound in ``func``, whose bindings' ``values`` (:func:`_values`)
    give the op."""
    op = "?"
    v = values.get(var.__chandle__())
    if isinstance(v, relax.TupleGetItem):  # an output of a multi-output op
        v = values.get(v.tuple_value.__chandle__(), v)
    if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op):
        op = str(v.op.name)
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
