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


@pytest.fixture(autouse=True)
def _default_sigint():
    """Each test starts with Python's own Ctrl-C handling (a test of Ctrl-C needs it), and a
    test that changes it is named (as a warning) and undone. In two full runs the Ctrl-C
    tests of the scaffold and of the CLI found SIGINT handled otherwise, though neither
    fails alone; the culprit is not known yet."""
    import signal
    import threading
    import warnings

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        warnings.warn(f"SIGINT handler was {signal.getsignal(signal.SIGINT)!r} before this "
                      "test; reset to Python's default", RuntimeWarning, stacklevel=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    yield
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        warnings.warn(f"this test left SIGINT handled by {signal.getsignal(signal.SIGINT)!r}",
                      RuntimeWarning, stacklevel=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
