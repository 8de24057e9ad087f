"""Kernel families: the kernels TVM's own ops lower to, as verifiable op definitions.

A model's matmuls, convolutions, pools and means are not opsdk ops; TVM legalizes them and
opsdk's rules for the kinds ``matmul``, ``conv2d``, ``pool`` and ``reduction`` schedule them.
To verify those rules like op rules, each family here is an op definition whose compute is
the TE that TVM's legalization emits (``topi.nn.conv``, ``topi.nn.pool2d``, relax's matmul
compute, ``topi.sum`` and a division for ``mean``, and the Winograd convolution the model
pipeline legalizes eligible convs to) followed by the epilogue FuseOps appends (bias,
residual add, ReLU / ReLU6 / SiLU / hardswish / sigmoid / tanh), with a float64 reference and
an error model. ``opsdk verify --kernels`` runs them through the same engine as the ops:
float64 reference, schedule invariance against the unscheduled kernel, hypothesis-drawn
shapes with tails, symbolic batch, x86 and emulated aarch64, vector / parallel lints.

They are not registered by ``import opsdk`` (they are not ops to put in a model);
:func:`opsdk.registry.register_kernels` does, and verify does it for the run.

Examples
--------
>>> from opsdk.kernels import KERNEL_OPS
>>> [d.name for d in KERNEL_OPS]
['tvm_matmul', 'tvm_conv2d', 'tvm_conv2d_winograd', 'tvm_pool2d', 'tvm_mean', 'tvm_reduce']
"""

from __future__ import annotations

from .conv2d import tvm_conv2d
from .matmul import tvm_matmul
from .pool2d import tvm_pool2d
from .reduce import tvm_mean, tvm_reduce
from .winograd import tvm_conv2d_winograd

__all__ = [
    "KERNEL_OPS",
    "tvm_conv2d",
    "tvm_conv2d_winograd",
    "tvm_matmul",
    "tvm_mean",
    "tvm_pool2d",
    "tvm_reduce",
]

#: The kernel families, in verification order. Adding one means adding it here.
KERNEL_OPS = (tvm_matmul, tvm_conv2d, tvm_conv2d_winograd, tvm_pool2d, tvm_mean,
              tvm_reduce)
