"""Run kernels on the host CPU."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._base import (
    DeviceTimeout,
    IdentityCache,
    OutputSpec,
    Runner,
    _CallTimeout,
    call_with_timeout,
    host_arch,
    run_on_device,
    runtime_module,
)

__all__ = ["LocalRunner", "pool_defaults"]


def pool_defaults(threads: int | None = None) -> int:
    """Set TVM's host thread-pool defaults, before the pool starts (its first parallel
    call); returns the thread count. An explicit ``TVM_NUM_THREADS`` / ``TVM_BIND_THREADS``
    in the environment wins.

    - ``TVM_NUM_THREADS``: ``threads``, else every CPU (TVM 0.27 takes half the logical
      CPUs on x86 unless told, assuming hyper-threads).
    - ``TVM_BIND_THREADS=0``: workers are not pinned to cores. A pinned worker whose core a
      background process shares cannot move, and its idle spin (``sched_yield``) hands
      that core to the other process for a whole time slice at every kernel: MobileNetV2 on
      2 cores beside one busy process stalled at 186-228 ms a call (40-50x) in 3 of 11
      runs, never unpinned (0 of 11), and alone both run equally fast
      (``scripts/bench_load.py``, docs/deployment.md).

    Examples
    --------
    >>> from opsdk.runners.local import pool_defaults
    >>> pool_defaults() >= 1
    True
    """
    n = threads or os.cpu_count() or 1
    os.environ.setdefault("TVM_NUM_THREADS", str(n))
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    return int(os.environ["TVM_NUM_THREADS"]) if os.environ["TVM_NUM_THREADS"].isdigit() else n


class LocalRunner(Runner):
    """Run kernels in this process on ``tvm.cpu()``.

    Parameters
    ----------
    timeout : float, optional
        If given, each call runs in a helper thread and :class:`DeviceTimeout` is raised when
        it takes longer. The kernel cannot be stopped: it keeps running in the background.

    Examples
    --------
    >>> from opsdk.runners import LocalRunner
    >>> LocalRunner().device_info()["arch"] in ("x86_64", "aarch64")
    True
    """

    name = "local"

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._vms = IdentityCache()  # executable -> VirtualMachine

    def device_info(self) -> dict[str, Any]:
        import tvm  # heavy: TVM

        cpu = tvm.target.codegen.llvm_get_system_cpu()
        arch = host_arch()
        return {"device": f"host {arch} ({cpu})", "arch": arch, "cpu": cpu, "runner": self.name}

    def close(self) -> None:
        self._vms.clear()

    def _run(
        self,
        executable: Any,
        inputs: Sequence[np.ndarray],
        entry: str,
        outputs: Sequence[OutputSpec] | None,
        timing: dict[str, Any] | None,
        weights: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        import tvm  # heavy: TVM

        dev = tvm.cpu()

        def vm() -> Any:
            machine = self._vms.get(executable)
            if machine is None:
                machine = tvm.relax.VirtualMachine(runtime_module(executable), dev)
                self._vms[executable] = machine
            return machine

        def call() -> list[np.ndarray]:
            module = runtime_module(executable) if outputs is not None else None
            return run_on_device(module, vm, dev, inputs, entry, outputs, timing, weights)

        try:
            return call_with_timeout(call, self.timeout, "local-run")
        except _CallTimeout:
            raise DeviceTimeout(
                f"kernel {entry!r} did not finish within {self.timeout} s on the host"
            ) from None
