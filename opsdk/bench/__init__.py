"""``opsdk bench``: opsdk kernels against TVM's own lowering, TVM dlight, torch eager and a
copy kernel moving the same bytes (the bandwidth roofline), measured side by side; whole
models (``--model``, ``--examples``) against TVM's default pipeline, torch eager and
onnxruntime; fp32 GEMM (``--gemm``) against torch.matmul; op kernels on a board
(:func:`run_remote_bench`) or spread over a farm's boards (:func:`run_remote_bench_sharded`).

Examples
--------
>>> from opsdk.bench import expand_cases
>>> len(expand_cases(["layer_norm"], dtypes=["float32"]))
2
"""

from __future__ import annotations

from ._cases import DEFAULT_CASES, SPECS, Case, OpSpec
from ._int8 import run_int8_bench
from ._model import (
    MODEL_CANDIDATES,
    first_torch_output,
    format_gemm_table,
    format_model_table,
    run_gemm_bench,
    run_model_bench,
)
from ._remote import run_remote_bench, run_remote_bench_sharded
from ._report import add_bench_arguments, format_table, plot, run_bench_command, summary
from ._run import CANDIDATES, expand_cases, run_bench
from ._timing import setup_threads
from ._zoo import ZOO, select_zoo

__all__ = [
    "CANDIDATES",
    "DEFAULT_CASES",
    "MODEL_CANDIDATES",
    "SPECS",
    "ZOO",
    "Case",
    "OpSpec",
    "add_bench_arguments",
    "expand_cases",
    "first_torch_output",
    "format_gemm_table",
    "format_model_table",
    "format_table",
    "plot",
    "run_bench",
    "run_bench_command",
    "run_gemm_bench",
    "run_int8_bench",
    "run_model_bench",
    "run_remote_bench",
    "run_remote_bench_sharded",
    "select_zoo",
    "setup_threads",
    "summary",
]
