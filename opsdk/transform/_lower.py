"""Relax passes and pipelines that lower opsdk ops with the target's schedule rules."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.target import Target

from ..targets import target as _resolve

__all__ = ["LowerOps", "pipeline"]


def LowerOps(target: str | dict | Target) -> tvm.transform.Pass:
    """Legalize every ``opsdk.*`` call in a module with the rules chosen for ``target``.

    TVM's own ops are left for the regular pipeline. Lowering also happens automatically
    inside ``tvm.compile(mod, target=...)`` (FLegalize reads the target in scope); this pass
    makes it explicit and lets you inspect the module in between.

    Examples
    --------
    >>> import opsdk
    >>> p = opsdk.transform.LowerOps("x86")
    >>> p.info.name
    'opsdk.LowerOps'
    """
    tgt = _resolve(target)

    @tvm.transform.module_pass(opt_level=0, name="opsdk.LowerOps")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # Our FLegalize reads the target in scope; TVM's own ops are skipped here and left
        # to the regular pipeline.
        others = [n for n in tvm.ir.Op.list_op_names() if not n.startswith("opsdk.")]
        with tgt:
            return relax.transform.LegalizeOps(skip_ops=others)(mod)

    return _pass


def pipeline(target: str | dict | Target, base: str = "default") -> tvm.transform.Pass:
    """TVM's Relax pipeline with opsdk lowering for ``target`` in front.

    Examples
    --------
    >>> import opsdk, tvm
    >>> isinstance(opsdk.pipeline("x86"), tvm.transform.Pass)
    True
    """
    return tvm.transform.Sequential([LowerOps(target), relax.get_pipeline(base)], name="opsdk")
