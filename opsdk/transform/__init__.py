"""Relax passes for models that use opsdk ops.

- :func:`pipeline`: the whole model compile (legalize, fold constants, fuse, schedule every
  kernel with :func:`ScheduleKernels`, pack weights at compile time);
- :func:`LowerOps`: legalize only the opsdk ops with the target's schedule rules;
- :func:`ReplaceTVMOps`: TVM's ``R.nn.layer_norm``, ``rms_norm``, ``group_norm``, ``gelu``,
  ``gelu_tanh``, ``softmax``  ->  opsdk ops;
- :func:`FuseIntoOps`: decomposed LayerNorm / RMSNorm chains, bias + GELU and
  conv2d + batch_norm  ->  fused ops;
- :func:`tir_pipeline`: the TIR pipeline opsdk's kernels compile with (register tiles kept
  on the stack, not in a per-tile workspace);
- :func:`op_counts` and :func:`rewrite_sites` to inspect the result, :func:`script` to print
  it with its constants (TVM 0.27's ``mod.script(show_meta=True)`` segfaults on them).

Examples
--------
>>> import opsdk
>>> from tvm import relax
>>> x = relax.Var("x", relax.TensorType((2, 8), "float32"))
>>> g = relax.Var("g", relax.TensorType((8,), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x, g]):
...     with bb.dataflow():
...         y = bb.emit_output(relax.op.nn.layer_norm(x, g, g, axes=[-1]))
...     _ = bb.emit_func_output(y)
>>> mod = opsdk.transform.ReplaceTVMOps()(bb.get())
>>> opsdk.transform.op_counts(mod, "opsdk.")
{'opsdk.layer_norm': 1}
>>> [s.rule for s in opsdk.transform.rewrite_sites(mod)]
['replace.layer_norm']
"""

from __future__ import annotations

from ._fuse import FUSION_RULES, FuseIntoOps
from ._layout import ChannelsLast
from ._lower import LowerOps, ScheduleKernels, pipeline, schedule_passes
from ._replace import REPLACEABLE_OPS, ReplaceTVMOps
from ._rewrite import RewriteSite, op_counts, rewrite_sites
from ._script import script
from ._tir import tir_pipeline

__all__ = [
    "FUSION_RULES",
    "REPLACEABLE_OPS",
    "ChannelsLast",
    "FuseIntoOps",
    "LowerOps",
    "ReplaceTVMOps",
    "RewriteSite",
    "ScheduleKernels",
    "op_counts",
    "pipeline",
    "rewrite_sites",
    "schedule_passes",
    "script",
    "tir_pipeline",
]
