"""``opsdk bench --zoo``: run the zoo through :func:`run_model_bench`, the table, the ratio
chart and the JSON."""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._files import write_bytes_atomic
from ._model import PEER_LABELS

__all__ = ["DEFAULT_PEERS", "format_zoo_table", "plot_zoo", "zoo_geomeans"]

#: Peers of ``--zoo`` unless ``--peers`` says otherwise (``tvm_default`` is opt-in: TVM's
#: default pipeline takes seconds per call on real models).
DEFAULT_PEERS = ("onnxruntime", "openvino", "executorch", "torch", "torch_compile")
_CHART_LABELS = {"onnxruntime": "onnxruntime", "openvino": "OpenVINO",
                 "executorch": "ExecuTorch XNNPACK", "torch": "torch eager",
                 "torch_compile": "torch.compile", "tvm_default": "TVM default"}


def _f(v: Any, fmt: str) -> str:
    """``v`` formatted, or ``-`` padded to the format's width."""
    if v is not None:
        return format(v, fmt)
    width = "".join(ch for ch in fmt.split(".")[0] if ch.isdigit())
    return format("-", (">" if not fmt.startswith("<") else "<") + (width or "1"))


def _geomean(vals: Sequence[float | None]) -> float | None:
    vals = [v for v in vals if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def zoo_geomeans(rows: Sequence[dict[str, Any]], peers: Sequence[str]) -> dict[str, Any]:
    """Per peer: the geometric mean of its time / opsdk's over the models both ran, and
    how many models that is.

    Examples
    --------
    >>> from opsdk.bench._zooreport import zoo_geomeans
    >>> g = zoo_geomeans([{"speedup_torch": 2.0}, {"speedup_torch": 0.5}], ["torch"])
    >>> round(g["torch"]["geomean"], 6), g["torch"]["models"]
    (1.0, 2)
    """
    out = {}
    for p in peers:
        vals = [r.get(f"speedup_{p}") for r in rows if r.get(f"speedup_{p}")]
        out[p] = {"geomean": _geomean(vals), "models": len(vals)}
    return out


def _delta(r: dict[str, Any]) -> float | None:
    peak, before = r.get("peak_rss_mb"), r.get("rss_before_mb")
    return None if peak is None or before is None else peak - before


def format_zoo_table(rows: Sequence[dict[str, Any]], peers: Sequence[str]) -> str:
    """The zoo bench as text: per model opsdk's numerics, compile and latency figures and
    the ratio of each peer's time to opsdk's, a geomean row, then every candidate's median
    time and time to ready.

    Examples
    --------
    >>> from opsdk.bench._zooreport import format_zoo_table
    >>> format_zoo_table([], ["onnxruntime"]).split()[:2]
    ['model', 'check']
    """
    ratio_head = "".join(f" {'x ' + PEER_LABELS.get(p, p):>9}" for p in peers)
    head = (f"{'model':<20} {'check':<5} {'max abs':>8} {'max rel':>8} {'import':>7} "
            f"{'compile':>8} {'lib MB':>7} {'peak MB':>8} {'+MB':>6} {'ms':>8} {'p99 ms':>8}"
            + ratio_head)
    lines = [head, "-" * len(head)]
    notes = []
    for r in rows:
        name = r["model"][:20]
        if r.get("failed"):
            lines.append(f"{name:<20} FAILED {r['failed']}")
            continue
        chk = r.get("check_opsdk")
        ok = "-" if chk is None else ("ok" if chk["ok"] else "FAIL")
        ratios = "".join(f" {_f(r.get(f'speedup_{p}'), '9.2f')}" for p in peers)
        lines.append(
            f"{name:<20} {ok:<5} {_f(chk and chk['max_abs'], '8.1e')} "
            f"{_f(chk and chk['max_rel'], '8.1e')} {_f(r.get('import_s'), '7.1f')} "
            f"{_f(r.get('compile_s'), '8.1f')}{'*' if r.get('compile_cached') else ' '}"
            f"{_f(r.get('artifact_mb'), '6.2f')} {_f(r.get('peak_rss_mb'), '8.0f')} "
            f"{_f(_delta(r), '6.0f')} "
            f"{_f(r.get('opsdk_ms'), '8.3f')} {_f(r.get('opsdk_p99_ms'), '8.3f')}" + ratios)
        for p in ("opsdk", *peers):
            c = r.get(f"check_{p}")
            if c is not None and not c["ok"]:
                notes.append(f"  {r['model']}: {p} differs from torch ("
                             + (c["error"] if "error" in c else
                                f"output {c.get('output', 0)}: max abs {c['max_abs']:.2e}, "
                                f"max rel {c['max_rel']:.2e}") + ")")
        for p, e in r.get("errors", {}).items():
            lines.append(f"  {p}: {e}")
    geo = zoo_geomeans(rows, peers)
    lines.append("-" * len(head))
    lines.append(f"{'geomean':<{len(head) - 10 * len(peers)}}"
                 + "".join(f" {_f(geo[p]['geomean'], '9.2f')}" for p in peers))
    lines += notes
    cands = ["opsdk", *peers]
    lines.append("")
    lines.append(f"{'median ms / ready s':<20}" + "".join(
        f" {PEER_LABELS.get(c, c):>15}" for c in cands))
    for r in rows:
        if r.get("failed"):
            continue
        lines.append(f"{r['model'][:20]:<20}" + "".join(
            f" {_f(r.get(f'{c}_ms'), '8.2f')}/{_f(r.get(f'{c}_ready_s'), '<6.1f')}"
            for c in cands))
    lines.append(
        "check = opsdk's output against torch eager within opsdk.model's tolerance (max abs/"
        "rel error); import = torch.export + opsdk import (s); compile = opsdk compile (s, "
        "* = from the compile cache); lib MB = exported library; peak MB = process peak RSS "
        "over import + compile, +MB = that peak less the RSS before the import; ms / p99 ms = "
        "opsdk's median (of per-round means) and 99th "
        "percentile of single calls; x P = P's time / opsdk's, median of per-round ratios "
        "(> 1: opsdk faster), all candidates interleaved in one run, same thread count; "
        "ready s = from the imported model to a runnable one (a peer's convert + compile; "
        "torch.compile's first call)")
    return "\n".join(lines)


def plot_zoo(rows: Sequence[dict[str, Any]], peers: Sequence[str], path: str) -> None:
    """A bar chart of each peer's time / opsdk's per model and the geomean, log scale, with
    the 1.0 line; ``path`` ending in ``.svg`` or ``.html`` gets SVG (the HTML embeds it,
    self-contained), else PNG.
    """
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    ran = [r for r in rows if not r.get("failed")]
    geo = zoo_geomeans(ran, peers)
    labels = [r["model"] for r in ran] + ["geomean"]
    fig, ax = plt.subplots(figsize=(min(22.0, max(8.0, 1.1 * len(labels) + 3)), 5.5))
    width = 0.8 / max(1, len(peers))
    for k, p in enumerate(peers):
        vals = [r.get(f"speedup_{p}") for r in ran] + [geo[p]["geomean"]]
        xs = [i + (k - len(peers) / 2 + 0.5) * width for i in range(len(labels))]
        ax.bar([x for x, v in zip(xs, vals) if v], [v for v in vals if v], width,
               label=_CHART_LABELS.get(p, p))
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("peer time / opsdk time (> 1: opsdk faster)")
    failed = [r["model"] for r in rows if r.get("failed")]
    ax.set_title("opsdk bench --zoo: speed relative to opsdk"
                 + (f" (opsdk failed: {', '.join(failed)})" if failed else ""), fontsize=10)
    ax.legend(fontsize=8, ncols=min(6, max(1, len(peers))))
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    buf = io.BytesIO()
    ext = os.path.splitext(path)[1].lower()
    fig.savefig(buf, format="svg" if ext in (".svg", ".html", ".htm") else "png", dpi=120)
    plt.close(fig)
    data = buf.getvalue()
    if ext in (".html", ".htm"):
        data = (b"<!doctype html><meta charset='utf-8'><title>opsdk bench --zoo</title>\n"
                + data[data.find(b"<svg"):] + b"\n")
    write_bytes_atomic(path, data)


def machine_load() -> dict[str, Any]:
    """CPUs and load averages while the zoo ran (other work skews the absolute times)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "loadavg": load, "platform": sys.platform}
