"""``ReplaceTVMOps``: swap TVM's own ops for opsdk ops.

The rules are the ops' own (``OpDef.replaces``, in the op files): each checks what its op can
express and leaves any other call alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tvm

from .. import ops as op_library  # the explicit op list, read when used
from .._patterns import Rule
from ..registry import registered_ops
from ._rewrite import apply_rules

__all__ = ["REPLACEABLE_OPS", "ReplaceTVMOps"]

#: TVM op names (without ``relax.nn.``) that :func:`ReplaceTVMOps` can replace: the built-in
#: ops' ``OpDef.replaces`` declarations, read when first asked for (module ``__getattr__``).
REPLACEABLE_OPS: tuple[str, ...]


def _short(tvm_op: str) -> str:
    return tvm_op.removeprefix("relax.nn.")


def _ops() -> list[Any]:
    """Ops that declare replacements: the built-ins in the op list's order, then the other
    registered ops by name."""

    builtin = list(op_library.BUILTIN_OPS)
    return [*builtin, *(d for d in registered_ops() if not any(d is b for b in builtin))]


def __getattr__(name: str) -> Any:
    if name == "REPLACEABLE_OPS":

        return tuple(_short(t) for d in op_library.BUILTIN_OPS for t, _, _ in d.replacements)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rules() -> dict[str, Rule]:
    """``replace.<tvm op>`` rules of the ops' ``OpDef.replaces``, by TVM op short name."""
    out: dict[str, Rule] = {}
    for d in _ops():
        for tvm_op, factory, _ in d.replacements:
            name = f"replace.{_short(tvm_op)}"
            try:
                pattern, build = factory()
            except Exception as e:  # the author's factory: name it, not a traceback
                raise ValueError(f"opsdk.{d.name}: replace rule {name!r} failed to build its "
                                 f"pattern: {type(e).__name__}: {e}") from e
            out[_short(tvm_op)] = Rule(name, pattern, build)
    return out


def ReplaceTVMOps(ops: Sequence[str] | None = None) -> tvm.transform.Pass:
    """Replace TVM's ``R.nn.layer_norm``, ``rms_norm``, ``group_norm``, ``gelu``,
    ``gelu_tanh`` and ``softmax`` with the opsdk ops: the built-in ops' rules, then those of
    the other registered ops (``OpDef.replaces``).

    A call is replaced only when the opsdk op computes the same thing: normalization over the
    trailing axes (layer/rms norm), a 4-D NCHW or NHWC input with a static channel count
    (group norm), and a float32/float16/bfloat16 input. ``center=False`` / ``scale=False``
    are honoured only where beta / gamma are zeros / ones (TVM's own lowering ignores the
    flags, so anything else would change the numbers). Other calls stay as they are. The
    rewritten bindings are recorded (:func:`opsdk.transform.rewrite_sites`).

    Parameters
    ----------
    ops : sequence of str, optional
        Which TVM ops to replace (names from :data:`REPLACEABLE_OPS`, e.g. ``"layer_norm"``);
        all by default.

    Returns
    -------
    tvm.transform.Pass

    Examples
    --------
    >>> import opsdk
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.nn.gelu_tanh(relax.op.nn.softmax(x)))
    ...     _ = bb.emit_func_output(y)
    >>> mod = opsdk.transform.ReplaceTVMOps()(bb.get())
    >>> opsdk.transform.op_counts(mod)
    {'opsdk.gelu': 1, 'opsdk.softmax': 1}
    """
    known = _rules()
    names = list(known) if ops is None else [o.removeprefix("relax.nn.") for o in ops]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"ReplaceTVMOps: unknown ops {unknown}; choose from {list(known)}")
    rules = [known[n] for n in names]

    @tvm.transform.module_pass(opt_level=0, name="opsdk.ReplaceTVMOps")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return apply_rules(mod, rules)

    return _pass
