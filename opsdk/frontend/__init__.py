"""Import models into Relax with opsdk ops.

- :func:`from_torch`: ``torch.export`` programs through TVM's ``from_exported_program`` with
  converters (:func:`torch_convert_map`) for LayerNorm, RMSNorm, GELU, softmax, GroupNorm;
- :func:`from_onnx`: TVM's ONNX frontend, then :func:`opsdk.transform.ReplaceTVMOps`;
- :func:`bind_params`: turn parameters kept as inputs into constants.

torch and onnx are imported only when a function needs them.

Examples
--------
>>> import opsdk
>>> sorted(opsdk.frontend.TORCH_OPS)
['attention', 'gelu', 'group_norm', 'layer_norm', 'rms_norm', 'softmax']
"""

from __future__ import annotations

from .._modelimports import prepare_model_imports
from ._modelfile import (
                         call_entry,
                         check_shape_names,
                         example_args,
                         export_user_model,
                         import_model_module,
                         random_inputs,
)
from ._onnx import ONNX_OPS, from_onnx, onnx_mapping_counts
from ._params import bind_params
from ._torch import (
                         TORCH_OPS,
                         decomposition_table,
                         from_torch,
                         mapping_counts,
                         torch_convert_map,
)

__all__ = [
                         "ONNX_OPS",
                         "TORCH_OPS",
                         "bind_params",
                         "call_entry",
                         "check_shape_names",
                         "decomposition_table",
                         "example_args",
                         "export_user_model",
                         "from_onnx",
                         "from_torch",
                         "import_model_module",
                         "mapping_counts",
                         "onnx_mapping_counts",
                         "prepare_model_imports",
                         "random_inputs",
                         "torch_convert_map",
]
