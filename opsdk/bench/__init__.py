"""``opsdk bench``: opsdk kernels against TVM's own lowering, TVM dlight, torch eager and a
copy kernel moving the same bytes (the bandwidth roofline), measured side by side; whole
models (``--model``, ``--examples``) against TVM's default pipeline, torch eager and
onnxruntime; fp32 GEMM (``--gemm``) against torch.matmul.

Examples
--------
>>> from opsdk.bench import expand_cases
>>> len(expand_cases(["layer_norm"], dtypes=["float32"]))
2
"""

from __future__ import annotations

from ._cases import DEFAULT_CASES, SPECS, Case, OpSpec
from ._model import (
    MODEL_CANDIDATES,
    format_gemm_table,
    format_model_table,
    run_gemm_bench,
    run_model_bench,
)
from ._report import add_bench_arguments, format_table, plot, run_bench_command, summary
from ._run import CANDIDATES, expand_cases, run_bench

__all__ = [
    "CANDIDATES",
    "DEFAULT_CASES",
    "MODEL_CANDIDATES",
    "SPECS",
    "Case",
    "OpSpec",
    "add_bench_arguments",
    "expand_cases",
    "format_gemm_table",
    "format_model_table",
    "format_table",
    "plot",
    "run_bench",
    "run_bench_command",
    "run_gemm_bench",
    "run_model_bench",
    "summary",
]
