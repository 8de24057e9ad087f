"""Shared pytest configuration: tests are grouped by directory into what they need.

- ``nocompile/``: schema, type inference, registration; no code generation.
- ``host/``: compile with LLVM (x86 and aarch64 cross-compilation) and run on the host.
- ``arm/``: execute aarch64 code (cross compiler + qemu-user, prepared by ``opsdk setup arm``).
"""

from __future__ import annotations

import os
import pathlib

import pytest

# The suite compiles afresh (what most tests check) and leaves the user's compile cache of
# built models alone; tests of the cache pass cache=<folder> explicitly.
os.environ.setdefault("OPSDK_NO_CACHE", "1")

_GROUPS = {"host": "compile", "arm": "arm", "gpu": "gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for folder, marker in _GROUPS.items():
            if folder in parts:
                item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(scope="module")
def relu_mod():
    """``main(x: (n, 16) float32) -> relu(x)``: a one-kernel model with a free dim, for tests
    of what a model refuses (inputs, targets)."""
    from tvm import relax, tirx

    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(x))
        bb.emit_func_output(y)
    return bb.get()
