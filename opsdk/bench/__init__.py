"""``opsdk bench``: opsdk kernels against TVM's own lowering, TVM dlight, torch eager and a
copy kernel moving the same bytes (the bandwidth roofline), measured side by side.

Examples
--------
>>> from opsdk.bench import expand_cases
>>> len(expand_cases(["layer_norm"], dtypes=["float32"]))
2
"""

from __future__ import annotations

from ._cases import DEFAULT_CASES, SPECS, Case, OpSpec
from ._report import add_bench_arguments, format_table, plot, run_bench_command, summary
from ._run import CANDIDATES, expand_cases, run_bench

__all__ = [
    "CANDIDATES",
    "DEFAULT_CASES",
    "SPECS",
    "Case",
    "OpSpec",
    "add_bench_arguments",
    "expand_cases",
    "format_table",
    "plot",
    "run_bench",
    "run_bench_command",
    "summary",
]
