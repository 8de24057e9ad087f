"""opsdk's TIR pipeline (:func:`opsdk.transform.tir_pipeline`): a register tile's ``local``
buffer stays on the stack (an ``alloca`` LLVM keeps in registers) instead of a workspace
allocated, zeroed and freed per tile; large and non-local buffers are left to TVM."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import s_tir, te, tirx

import opsdk
from opsdk._tir import MAX_STACK_BYTES, StackLocalTiles
from opsdk.model import LoadedModel, compile_model, within_tolerance
from opsdk.transform import tir_pipeline


def _tiled_matmul(rows: int, cols: int) -> tirx.PrimFunc:
    """A 64 x 128 x 64 matmul whose accumulator is a ``local`` rows x cols tile (dividing
    64 x 128)."""
    a = te.placeholder((64, 64), "float32", name="a")
    b = te.placeholder((64, 128), "float32", name="b")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((64, 128), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    d = te.compute((64, 128), lambda i, j: tirx.max(c[i, j], 0.0), name="d")
    sch = s_tir.Schedule(te.create_prim_func([a, b, d]))
    cb = sch.get_sblock("c")
    sch.set_scope(cb, 0, "local")
    i, j, kk = sch.get_loops(cb)
    io, ii = sch.split(i, [None, rows])
    jo, ji = sch.split(j, [None, cols])
    sch.reorder(io, jo, kk, ii, ji)
    sch.reverse_compute_at(sch.get_sblock("d"), jo)
    return sch.mod["main"]


def _allocs(mod: tvm.IRModule) -> list[tuple[int, bool]]:
    from tvm_ffi.structural import structural_walk

    nodes: list = []
    for f in mod.functions.values():
        structural_walk(f.body, [(tirx.AllocBuffer, nodes.append)])
    out = []
    for n in nodes:
        if n.buffer.scope() == "local":
            size = int(np.prod([int(d) for d in n.buffer.shape])) * 4
            out.append((size, "disable_lower_builtin" in (n.annotations or {})))
    return out


@pytest.mark.parametrize(("rows", "cols", "stacked"), [(8, 64, True), (64, 128, False)])
def test_small_local_tiles_are_marked_for_the_stack_and_large_ones_are_not(rows, cols,
                                                                            stacked):
    mod = tvm.IRModule({"main": _tiled_matmul(rows, cols)})
    for p in (s_tir.transform.LowerInitBlock(),
              s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
              s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(),
              s_tir.transform.LowerOpaqueBlock()):
        mod = p(mod)  # the tile is now an allocation of its own, inside the tile loops
    allocs = _allocs(StackLocalTiles(mod))
    assert allocs and all(size == rows * cols * 4 for size, _ in allocs), allocs
    assert all(marked == stacked for _, marked in allocs), allocs
    assert (rows * cols * 4 <= MAX_STACK_BYTES) == stacked


def test_a_tile_over_1kb_is_neither_a_workspace_nor_zeroed_by_memset():
    # 8 x 64 floats = 2 KB: TVM's default lowering allocates it with
    # TVMBackendAllocWorkspace on every tile.
    f = _tiled_matmul(8, 64).with_attr("global_symbol", "k")
    x86 = opsdk.target("x86")
    asm = {p: tvm.tirx.build(tvm.IRModule({"k": f}), target=x86, pipeline=p).inspect_source("asm")
           for p in ("default", tir_pipeline())}
    calls = {p: len(re.findall(r"memset|TVMBackendAllocWorkspace", a)) for p, a in asm.items()}
    assert calls["default"] > 0 and calls[tir_pipeline()] == 0, calls


def test_a_model_built_with_it_matches_torch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(16, 96, 1), torch.nn.ReLU6(),
                              torch.nn.Conv2d(96, 96, 3, padding=1, groups=96)).eval()
    x = torch.randn(1, 16, 28, 28)
    m = LoadedModel.from_torch("pw_dw", net, (x,), baselines=False)
    cm = compile_model(m.opsdk_mod, "x86", cache=False)
    out = tvm.relax.VirtualMachine(cm.ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    got = (out[0] if isinstance(out, tvm.ir.Array) else out).numpy()
    check = within_tolerance(got, net.double()(x.double()).detach().numpy())
    assert check["ok"], check
