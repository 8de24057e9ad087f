"""Shared steps of the examples: import a torch model through opsdk, compile for x86 and
aarch64, compare with torch eager, and time opsdk against TVM's default pipeline, torch eager
and onnxruntime.

TVM is imported when a step needs it, not with this module: ``opsdk build`` of an unchanged
example imports the file (and so this module) to see whether it changed, and TVM's import
would be half of that check."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import opsdk

if TYPE_CHECKING:
    import tvm


def import_model(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], dynamic_batch: bool = False
) -> dict[str, Any]:
    """Export with torch.export, import with opsdk's converters, then fuse."""
    ep = opsdk.model.export_torch(model.eval(), args, dynamic_batch)
    imported = opsdk.frontend.from_torch(ep)
    fused = opsdk.transform.FuseIntoOps()(imported)
    return {"ep": ep, "imported": imported, "fused": fused}


def compare(out: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """Max abs / rel error of ``out`` against ``ref`` and whether it is within tolerance."""
    return opsdk.model.within_tolerance(out, ref)


def run_x86(mod: tvm.IRModule, args: tuple[torch.Tensor, ...]) -> tuple[Any, np.ndarray]:
    import tvm
    from tvm import relax

    ex = opsdk.compile(mod, "x86")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in args])
    return vm, _first(out)


def _first(out: Any) -> np.ndarray:
    import tvm

    while not isinstance(out, tvm.runtime.Tensor):
        out = out[0]
    return out.numpy()


def arm(mod: tvm.IRModule, args: tuple[torch.Tensor, ...], ref: np.ndarray) -> dict[str, Any]:
    """Cross-compile for aarch64 (NEON), count NEON vector instructions, and run under qemu
    when opsdk's emulated runner is set up."""
    from opsdk._explain import asm_of, asm_vector_stats

    ex = opsdk.compile(mod, "arm")
    result: dict[str, Any] = {
        "compiled": True,
        "neon_instructions": asm_vector_stats(asm_of(ex), "aarch64")["neon"],
    }
    try:
        from opsdk.runners import arm_ready, runner_for
    except ImportError:
        result["emulated"] = "skipped: opsdk.runners is not available"
        return result
    if not arm_ready():
        result["emulated"] = "skipped: opsdk.runners.arm_ready() is False (run `opsdk setup arm`)"
        return result
    with runner_for("arm") as r:
        out = r.run(ex, [a.numpy() for a in args])
    result["emulated"] = compare(out[0], ref)
    return result


def bench(
    stages: dict[str, Any],
    model: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    repeats: int = 7,
) -> dict[str, Any]:
    """End-to-end latency, interleaved in one process with the same threads: opsdk (opsdk
    import + FuseIntoOps + opsdk.compile) vs TVM's default pipeline (TVM's import +
    tvm.compile), torch eager and onnxruntime (``opsdk.bench.run_model_bench``)."""
    from opsdk.bench import run_model_bench
    from opsdk.model import LoadedModel

    m = LoadedModel.from_torch("model", model, args, exported=stages["ep"])
    (row,) = run_model_bench([m], repeats=repeats)
    return row


def _now() -> float:
    import time

    return time.perf_counter()


def report(name: str, res: dict[str, Any]) -> None:
    """Print an example's results."""
    # float32 tolerance against torch eager (opsdk.model.within_tolerance): |ours - torch|
    # <= ATOL * max(1, max|torch|) + RTOL * |torch|.
    atol, rtol = opsdk.model.ATOL, opsdk.model.RTOL
    print(f"== {name}")
    print(f"opsdk ops after import + FuseIntoOps: {res['opsdk_op_count']} {res['opsdk_ops']}")
    print(f"rewrites: {res['rewrites']}")
    x = res["x86"]
    print(
        f"x86 vs torch eager: max abs {x['max_abs']:.2e}, max rel {x['max_rel']:.2e} "
        f"(tolerance atol={atol:g}*max(1,|ref|max) + rtol={rtol:g}*|ref|): "
        + ("OK" if x["ok"] else "FAIL")
    )
    if "x86_other_batch" in res:
        o = res["x86_other_batch"]
        print(
            f"same executable, batch {o['batch']}: max abs {o['max_abs']:.2e}, "
            + ("OK" if o["ok"] else "FAIL")
        )
    if "arm" in res:
        a = res["arm"]
        em = a["emulated"]
        em_s = (
            em
            if isinstance(em, str)
            else (f"max abs {em['max_abs']:.2e}, " + ("OK" if em["ok"] else "FAIL"))
        )
        print(
            f"arm (aarch64 NEON): compiled, {a['neon_instructions']} NEON vector instructions; "
            f"emulated run: {em_s}"
        )
    if "bench" in res:
        from opsdk.bench import format_model_table

        print(format_model_table([{**res["bench"], "model": name}]))


def run_example(
    name: str,
    model: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    *,
    arm_target: bool,
    do_bench: bool,
    repeats: int = 7,
    dynamic_batch: bool = False,
) -> dict[str, Any]:
    """Import, rewrite, compile, compare (and optionally cross-compile and time) one model.

    With ``dynamic_batch`` the model is exported with a symbolic batch dim and the one x86
    executable is also run on a batch of ``batch + 2`` (result ``x86_other_batch``).
    """
    model = model.eval()
    with torch.no_grad():
        ref = _torch_first(model(*args))
    stages = import_model(model, args, dynamic_batch)
    fused = stages["fused"]
    counts = opsdk.transform.op_counts(fused, "opsdk.")
    rewrites: dict[str, int] = {}
    for s in opsdk.transform.rewrite_sites(fused):
        rewrites[s.rule] = rewrites.get(s.rule, 0) + 1
    vm, out = run_x86(fused, args)
    res: dict[str, Any] = {
        "opsdk_ops": counts,
        "opsdk_op_count": sum(counts.values()),
        "rewrites": rewrites,
        "x86": compare(out, ref),
    }
    if dynamic_batch:
        import tvm

        more = tuple(torch.cat([a] + [a[:1]] * 2) for a in args)
        with torch.no_grad():
            ref_more = _torch_first(model(*more))
        got = _first(vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in more]))
        res["x86_other_batch"] = {"batch": int(more[0].shape[0]), **compare(got, ref_more)}
    if arm_target:
        res["arm"] = arm(fused, args, ref)
    if do_bench:
        res["bench"] = bench(stages, model, args, repeats=repeats)
    report(name, res)
    return res


def _torch_first(out: Any) -> np.ndarray:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out.detach().numpy()
