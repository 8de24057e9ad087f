"""``opsdk verify``: hypothesis-driven differential verification of opsdk ops.

For each op and target, every claimed cell (dtype x layout) is searched with examples
derived from the op's definition (shapes, attributes, optional inputs, hard data) and checked
against the float64 numpy reference within a rounding-error bound, against the op's generic
(unscheduled) lowering, and against its inferred Relax type. Schedule claims are linted on
the lowered TIR and the assembly; unclaimed inputs must be refused with a clear ValueError.

Examples
--------
>>> from opsdk.verify import verify_op
>>> report = verify_op("softmax", "x86", dtypes=["float32"], max_examples=2, database=None)
>>> report.ok
True
"""

from __future__ import annotations

from ._compose import norm_model, per_output, reduction_model, rounding_model
from ._cover import KernelCell, kernel_cell, verify_cells
from ._engine import (
    capabilities,
    check_refusals,
    lint_cell,
    run_case,
    verify,
    verify_op,
)
from ._profiles import PROFILES, Profile, database_path
from ._report import CaseResult, CellResult, LintResult, RefusalResult, VerifyReport
from ._shard import verify_sharded
from ._strategies import Case, StrategyKnobs, case_strategy, corner_cases, make_inputs
from ._tolerance import MATH_ULPS, ModelInput, error_model, model_for, output_bound

__all__ = [
    "MATH_ULPS",
    "PROFILES",
    "Case",
    "CaseResult",
    "CellResult",
    "KernelCell",
    "LintResult",
    "ModelInput",
    "Profile",
    "RefusalResult",
    "StrategyKnobs",
    "VerifyReport",
    "capabilities",
    "case_strategy",
    "check_refusals",
    "corner_cases",
    "database_path",
    "error_model",
    "kernel_cell",
    "lint_cell",
    "make_inputs",
    "model_for",
    "norm_model",
    "output_bound",
    "per_output",
    "reduction_model",
    "rounding_model",
    "run_case",
    "verify",
    "verify_cells",
    "verify_op",
    "verify_sharded",
]
