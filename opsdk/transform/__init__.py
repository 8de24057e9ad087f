"""Relax passes for models that use opsdk ops.

- :func:`ScheduleKernels`: every kernel of a module scheduled by the one driver (the model
  pipeline, :func:`opsdk.pipeline`, runs it after fusion);
- :func:`LowerOps`: legalize only the opsdk ops with the target's schedule rules;
- :func:`ReplaceTVMOps`: TVM's ``R.nn.layer_norm``, ``rms_norm``, ``group_norm``, ``gelu``,
  ``gelu_tanh``, ``softmax``  ->  opsdk ops;
- :func:`FoldViewsIntoOps`: reshape / transpose / slice copies read through inside the opsdk
  op kernels they feed;
- :func:`ConvLiveTaps`: a conv that reads mostly its zero padding (an atrous conv on a
  small map) -> one conv per region of the output, with only the taps that read the image;
- :func:`FuseIntoOps`: decomposed LayerNorm / RMSNorm chains, bias + GELU and
  conv2d + batch_norm  ->  fused ops; summed conv branches of one input (RepVGG, MobileOne)
  ->  one conv (:func:`MergeConvBranches`);
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

from .._tir import tir_pipeline
from ._branches import MergeConvBranches
from ._fold import FoldConstantsAtOnce, fold_cache
from ._fuse import FUSION_RULES, FuseIntoOps
from ._layout import ChannelsLast
from ._lift import (
    KernelFormWeights,
    constants_as_params,
    lift_passes,
    lifts_weights,
    weights_as_params,
)
from ._lower import (
    MISSING_LEGALIZATIONS,
    LegalizeOpsDeferred,
    LegalizeOpsOnce,
    LowerOps,
    ScheduleKernels,
)
from ._oppattern import InjectiveWhenShapesChange
from ._replace import REPLACEABLE_OPS, ReplaceTVMOps
from ._rewrite import RewriteSite, op_counts, rewrite_sites
from ._script import script
from ._taps import ConvLiveTaps
from ._views import FoldViewsIntoOps

__all__ = [
    "FUSION_RULES",
    "MISSING_LEGALIZATIONS",
    "REPLACEABLE_OPS",
    "ChannelsLast",
    "ConvLiveTaps",
    "FoldConstantsAtOnce",
    "FoldViewsIntoOps",
    "FuseIntoOps",
    "InjectiveWhenShapesChange",
    "KernelFormWeights",
    "LegalizeOpsDeferred",
    "LegalizeOpsOnce",
    "LowerOps",
    "MergeConvBranches",
    "ReplaceTVMOps",
    "RewriteSite",
    "ScheduleKernels",
    "constants_as_params",
    "fold_cache",
    "lift_passes",
    "lifts_weights",
    "op_counts",
    "rewrite_sites",
    "script",
    "tir_pipeline",
    "weights_as_params",
]
