"""The tuning database: a folder of JSON records, one per (target, workload).

``<root>/<target id>/<workload>.json`` holds a record that passed both gates (verified
against the float64 reference and the unscheduled kernel, faster than the hand rule in the
same measurement); ``<root>/<target id>/rejected/<workload>.json`` the last candidate
rejected for that workload, with why and its reproducer. The target id is readable
(``x86_64-znver4``) plus 8 hex digits of the canonical target, so two targets never share a
record. A record carries the workload's own TVMScript, so it can be re-verified without the
model it came from (``opsdk tune --recheck FILE``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from .._files import cache_dir
from .._version import __version__

__all__ = ["FORMAT", "TuningDB", "TuningDBError", "default_db_dir", "target_id"]

#: Record format; a record of another format is refused, not misread.
FORMAT = 1


class TuningDBError(ValueError):
    """A tuning database or record that cannot be read (the message names the file and the
    fix)."""


def default_db_dir() -> Path:
    """``$OPSDK_TUNING_DIR``, else ``tuning/`` in opsdk's cache folder.

    Examples
    --------
    >>> from opsdk.tune import default_db_dir
    >>> default_db_dir().name
    'tuning'
    """
    if os.environ.get("OPSDK_TUNING_DIR"):
        return Path(os.environ["OPSDK_TUNING_DIR"]).expanduser()
    return cache_dir() / "tuning"


def target_id(target: Any) -> str:
    """The folder name of ``target``'s records: architecture, CPU and a digest of the
    target's kind, triple, CPU and features (what changes the code).

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.tune import target_id
    >>> target_id(opsdk.target("x86")).startswith("x86_64-")
    True
    """
    from ..targets import target_arch  # heavy: TVM

    attrs = dict(target.attrs)
    canon = {"kind": str(target.kind.name), "mtriple": str(attrs.get("mtriple", "") or ""),
             "mcpu": str(attrs.get("mcpu", "") or ""),
             "mattr": sorted(str(a) for a in (attrs.get("mattr") or []))}
    digest = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:8]
    cpu = re.sub(r"[^A-Za-z0-9_.]+", "_", canon["mcpu"] or "generic")
    return f"{target_arch(target)}-{cpu}-{digest}"


class TuningDB:
    """A tuning database folder (created on the first write).

    Examples
    --------
    >>> import tempfile, opsdk
    >>> from opsdk.tune import TuningDB
    >>> db = TuningDB(tempfile.mkdtemp())
    >>> db.records(opsdk.target("x86"))
    []
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_db_dir()
        if self.root.exists() and not self.root.is_dir():
            raise TuningDBError(f"--db {self.root}: not a folder; name a folder for the "
                                "tuning database (it is created when missing)")

    def folder(self, target: Any) -> Path:
        """Where ``target``'s records are."""
        return self.root / target_id(target)

    def put(self, target: Any, record: dict[str, Any], *, kept: bool = True) -> Path:
        """Write ``record`` (a dict with at least ``workload``) for ``target``; a rejected
        one goes to ``rejected/``. Returns the file."""
        folder = self.folder(target) / ("" if kept else "rejected")
        folder.mkdir(parents=True, exist_ok=True)
        rec = {"format": FORMAT, **record, "target": str(target),
               "versions": record.get("versions") or versions()}
        path = folder / f"{record['workload']}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        tmp.replace(path)  # a reader never sees half a record
        if kept:  # a kept record supersedes an earlier rejection of the workload
            (self.folder(target) / "rejected" / path.name).unlink(missing_ok=True)
        return path

    def entries(self, target: Any) -> list[dict[str, Any]]:
        """Every kept record of ``target`` as stored (dicts), sorted by workload."""
        folder = self.folder(target)
        if not folder.is_dir():
            return []
        return [read_record(p) for p in sorted(folder.glob("*.json"))]

    def records(self, target: Any) -> list[Any]:
        """The kept records of ``target`` as :class:`opsdk.schedules.TunedRecord`: what
        ``compile_model(tuning=...)`` and ``opsdk build --tuning`` take."""
        return [as_tuned(e) for e in self.entries(target)]


def versions() -> dict[str, str]:
    """The versions a record was made with."""
    import tvm  # heavy: TVM

    return {"opsdk": __version__, "tvm": str(tvm.__version__)}


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """A record file, checked: TuningDBError naming the file and the fix when it is not one.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from opsdk.tune import TuningDBError, read_record
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "bad.json"
    >>> _ = p.write_text("{")
    >>> try:
    ...     read_record(p)
    ... except TuningDBError as e:
    ...     print("not readable JSON" in str(e))
    True
    """
    p = Path(path)
    fix = "delete it, or run opsdk tune again to rewrite it"
    try:
        rec = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TuningDBError(f"tuning record {p}: not readable JSON ({type(e).__name__}); "
                            f"{fix}") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise TuningDBError(f"tuning record {p}: not a format-{FORMAT} opsdk tuning record; "
                            f"{fix}")
    missing = [k for k in ("workload", "trace", "workload_script") if k not in rec]
    if missing:
        raise TuningDBError(f"tuning record {p}: lacks {', '.join(missing)}; {fix}")
    if not re.fullmatch(r"[0-9a-f]{16}", str(rec["workload"])):
        raise TuningDBError(f"tuning record {p}: workload {rec['workload']!r} is not 16 hex "
                            f"digits; {fix}")
    return rec


def as_tuned(rec: dict[str, Any]) -> Any:
    """A stored record as the driver's :class:`opsdk.schedules.TunedRecord`."""
    from ..schedules import TunedRecord  # heavy: TVM

    return TunedRecord(workload=str(rec["workload"]), trace=rec["trace"],
                       hand_rule=str(rec.get("hand_rule", "")),
                       speedup=float(rec.get("speedup") or 0.0),
                       kernel=str(rec.get("kernel", "")))
