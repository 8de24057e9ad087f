"""Device runners: execute compiled kernels and return numpy outputs.

One interface (:class:`Runner`) over three places to run:

- :class:`LocalRunner`: the host CPU;
- :class:`EmulatedRunner`: aarch64 under qemu-user, through TVM RPC (needs :func:`setup_arm`);
- :class:`RPCRunner`: a real board running TVM's RPC server, directly or through a tracker;
  :class:`FarmRunner` one of a tracker's boards that names the board it is on (a sharded
  verify or bench runs one per board, :func:`run_on_farm` the queue of cells they share;
  :func:`start_farm` starts a local farm of emulated boards).

Examples
--------
>>> import numpy as np, tvm
>>> from tvm import te
>>> from opsdk.runners import runner_for
>>> a = te.placeholder((8,), "float32", name="a")
>>> b = te.compute((8,), lambda i: a[i] + 1.0, name="b")
>>> ex = tvm.compile(te.create_prim_func([a, b]), target={"kind": "llvm"})
>>> with runner_for("x86") as r:
...     (out,) = r.run(ex, [np.zeros(8, "float32")], outputs=[((8,), "float32")])
>>> float(out.sum())
8.0

Submodules are imported lazily, so ``import opsdk.runners`` does not import TVM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._cliargs import split_host_port

if TYPE_CHECKING:
    from ._base import (
        DeviceCrash,
        DeviceTimeout,
        InputMismatch,
        KernelWeights,
        Runner,
        RunnerUnavailable,
        check_inputs,
        to_numpy,
        to_tensor,
    )
    from ._farm import (
        FarmError,
        FarmRunner,
        farm_state,
        farm_status,
        probe_board,
        request_board,
        start_farm,
        stop_farm,
        tracker_boards,
        tracker_summary,
    )
    from ._farmqueue import FarmCell, FarmOutcome, run_on_farm
    from ._provision import (
        arm_env,
        arm_ready,
        arm_tools_available,
        cross_compiler,
        setup_arm,
        site_packages,
    )
    from .emulated import EmulatedRunner
    from .local import LocalRunner
    from .rpc import RPCRunner

__all__ = [
    "DeviceCrash",
    "DeviceTimeout",
    "EmulatedRunner",
    "FarmCell",
    "FarmError",
    "FarmOutcome",
    "FarmRunner",
    "InputMismatch",
    "KernelWeights",
    "LocalRunner",
    "RPCRunner",
    "Runner",
    "RunnerUnavailable",
    "arm_env",
    "arm_ready",
    "arm_tools_available",
    "check_inputs",
    "cross_compiler",
    "farm_state",
    "farm_status",
    "probe_board",
    "request_board",
    "run_on_farm",
    "runner_for",
    "setup_arm",
    "site_packages",
    "start_farm",
    "stop_farm",
    "to_numpy",
    "to_tensor",
    "tracker_boards",
    "tracker_summary",
]

_LAZY = {
    "DeviceCrash": "._base",
    "DeviceTimeout": "._base",
    "InputMismatch": "._base",
    "KernelWeights": "._base",
    "Runner": "._base",
    "RunnerUnavailable": "._base",
    "check_inputs": "._base",
    "to_numpy": "._base",
    "to_tensor": "._base",
    "arm_env": "._provision",
    "cross_compiler": "._provision",
    "site_packages": "._provision",
    "arm_ready": "._provision",
    "arm_tools_available": "._provision",
    "setup_arm": "._provision",
    "EmulatedRunner": ".emulated",
    **{n: "._farm" for n in ("FarmError", "FarmRunner", "farm_state", "farm_status",
                             "probe_board", "request_board", "start_farm", "stop_farm",
                             "tracker_boards", "tracker_summary")},
    **{n: "._farmqueue" for n in ("FarmCell", "FarmOutcome", "run_on_farm")},
    "LocalRunner": ".local",
    "RPCRunner": ".rpc",
}

# Friendly target names -> (arch, qemu -cpu matching the target's features).
_TARGET_ARCH = {
    "x86": ("x86_64", None),
    "x86_64": ("x86_64", None),
    "host": (None, None),
    "llvm": (None, None),
    "c": (None, None),
    "arm": ("aarch64", "cortex-a72"),
    "aarch64": ("aarch64", "cortex-a72"),
    "arm-dotprod": ("aarch64", "cortex-a76"),
    "arm-sve": ("aarch64", "max"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _target_arch(target_kind: str) -> tuple[str | None, str | None]:
    """(arch, default qemu cpu) of a friendly target name; arch None means the host."""
    try:  # the target registry knows the exact qemu -cpu of each named target
        from opsdk.targets import TARGETS

        spec = TARGETS.get(target_kind)
        if spec is not None:
            return spec.arch, spec.qemu_cpu
    except Exception:  # registry unavailable or changed shape: use the built-in table
        pass
    if target_kind in _TARGET_ARCH:
        return _TARGET_ARCH[target_kind]
    if target_kind.startswith(("arm", "aarch64")):
        return "aarch64", "max"
    return None, None


def runner_for(
    target_kind: str,
    *,
    rpc: str | None = None,
    tracker: str | None = None,
    key: str | None = None,
    qemu_cpu: str | None = None,
) -> Runner:
    """Pick the runner for a target name.

    Parameters
    ----------
    target_kind : str
        Friendly target name (``x86``, ``arm``, ``arm-dotprod``, ``arm-sve``, ``c``, ...).
    rpc : str, optional
        ``HOST:PORT`` of a TVM RPC server: run there.
    tracker : str, optional
        ``HOST:PORT`` of a TVM RPC tracker; ``key`` selects the device.
    key : str, optional
        Device key (with ``tracker``) or server key (with ``rpc``).
    qemu_cpu : str, optional
        qemu ``-cpu`` for the emulator; default matches the target (``arm``: cortex-a72,
        ``arm-dotprod``: cortex-a76, ``arm-sve``: the target registry's choice).

    Returns
    -------
    Runner
        :class:`RPCRunner` when ``rpc``/``tracker`` is given; :class:`LocalRunner` when the
        target runs on the host; :class:`EmulatedRunner` for aarch64 on a non-aarch64 host.

    Examples
    --------
    >>> from opsdk.runners import runner_for
    >>> runner_for("x86").name
    'local'
    >>> runner_for("arm", rpc="192.168.1.20:9090").device_info()["device"]
    'rpc 192.168.1.20:9090'
    """
    from .local import LocalRunner, host_arch  # heavy: TVM
    from .rpc import RPCRunner  # heavy: TVM

    arch, default_cpu = _target_arch(target_kind)
    remote_arch = arch or host_arch()
    if tracker:
        if not key:
            raise ValueError("tracker= needs key= (the device key registered with the tracker)")
        host, port = split_host_port(tracker)
        return RPCRunner.from_tracker(host, port, key, arch=remote_arch)
    if rpc:
        host, port = split_host_port(rpc)
        return RPCRunner(host, port, key=key or "", arch=remote_arch)
    if arch is None or arch == host_arch():
        return LocalRunner()
    if arch == "aarch64":
        from .emulated import EmulatedRunner

        return EmulatedRunner(cpu=qemu_cpu or default_cpu or "cortex-a72")
    raise ValueError(
        f"no runner for target {target_kind!r} (runs on {arch}) from this {host_arch()} host; "
        "pass rpc= or tracker= to run it on a remote device"
    )
