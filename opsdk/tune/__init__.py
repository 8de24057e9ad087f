"""``opsdk tune``: MetaSchedule tuning of a model's kernels whose every record is verified.

A record is a MetaSchedule trace for one kernel (its workload: the structural hash of the
unscheduled function) on one target. It enters the database only after two gates: opsdk's
differential verify (the trace replayed from its stored form, against a float64 reference and
the unscheduled kernel) and a side-by-side timing against the hand rule in the compiled
model (on the boards of a device target: :mod:`opsdk.tune._remote`). A kept record is a rule
of the registry (``tuned:<hash8>``, :func:`opsdk.schedules.tuned_rules`), chosen by the same
driver as the hand rules;
``compile_model(tuning=...)``, ``opsdk build --tuning`` and ``opsdk explain --tuning`` use
it. See docs/tuning.md.
"""

from __future__ import annotations

from ._cli import format_tuned
from ._db import FORMAT, TuningDB, TuningDBError, default_db_dir, read_record, target_id
from ._gate import GateResult, float64_twin, reduction_length, speed_ratios, verify_trace
from ._remote import kernel_harness, kernel_inputs
from ._search import Candidate, search, trace_json
from ._tune import TUNABLE_KINDS, KernelTuning, TuneReport, recheck, tune_model

__all__ = [
    "FORMAT",
    "TUNABLE_KINDS",
    "Candidate",
    "GateResult",
    "KernelTuning",
    "TuneReport",
    "TuningDB",
    "TuningDBError",
    "default_db_dir",
    "float64_twin",
    "format_tuned",
    "kernel_harness",
    "kernel_inputs",
    "read_record",
    "recheck",
    "reduction_length",
    "search",
    "speed_ratios",
    "target_id",
    "trace_json",
    "tune_model",
    "verify_trace",
]
