"""The runner interface shared by the local, emulated and remote (RPC) runners."""

from __future__ import annotations

import abc
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "DeviceCrash", "DeviceTimeout", "OutputSpec", "Runner", "RunnerUnavailable",
    "timing_summary",
]

OutputSpec = tuple[tuple[int, ...], str]
_T = TypeVar("_T")

try:  # ml_dtypes is a TVM dependency; keep the import optional all the same.
    import ml_dtypes

    _BF16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BF16 = None


class DeviceCrash(RuntimeError):
    """The process executing the kernel died (illegal instruction, segmentation fault, ...)."""


class RunnerUnavailable(RuntimeError):
    """The device could not be started or reached (emulator set-up, RPC connection): an
    environment problem to report in one line, not a failed check."""


class DeviceTimeout(RuntimeError):
    """A call did not finish within the runner's time-out."""


class Runner(abc.ABC):
    """Executes compiled kernels somewhere and returns numpy outputs.

    Runners are context managers: ``__enter__`` starts what the runner needs (an emulator, a
    connection) and ``__exit__`` stops it; :meth:`close` is idempotent.

    Examples
    --------
    >>> import numpy as np, tvm
    >>> from tvm import te
    >>> from opsdk.runners import LocalRunner
    >>> a = te.placeholder((4,), "float32", name="a")
    >>> b = te.compute((4,), lambda i: a[i] * 2.0, name="b")
    >>> ex = tvm.compile(te.create_prim_func([a, b]), target={"kind": "llvm"})
    >>> with LocalRunner() as r:
    ...     (out,) = r.run(ex, [np.arange(4, dtype="float32")], outputs=[((4,), "float32")])
    >>> out.tolist()
    [0.0, 2.0, 4.0, 6.0]
    """

    name: str = "runner"

    def __enter__(self) -> Runner:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start whatever the runner needs; called by ``__enter__`` (and lazily by ``run``)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the runner started. Safe to call more than once."""

    @abc.abstractmethod
    def device_info(self) -> dict[str, Any]:
        """Describe where kernels run: at least ``{"device": str, "arch": str}``."""

    def run(
        self,
        executable: Any,
        inputs: Sequence[np.ndarray],
        *,
        entry: str = "main",
        outputs: Sequence[OutputSpec] | None = None,
    ) -> list[np.ndarray]:
        """Run ``executable`` on ``inputs`` and return its outputs as numpy arrays.

        Parameters
        ----------
        executable : tvm.runtime.Executable or path
            What ``tvm.compile`` returned, or a library exported already (a path).
        inputs : sequence of numpy.ndarray
            Positional inputs (float32/float16/bfloat16/int8/int32/... arrays).
        entry : str
            Function to call.
        outputs : sequence of (shape, dtype), optional
            None for a Relax module (run through the VM; a tuple result becomes a list).
            For a PrimFunc module in destination-passing style, the output tensors to
            allocate; the function is called as ``f(*inputs, *outputs)``.

        Returns
        -------
        list of numpy.ndarray
        """
        return self._run(executable, inputs, entry, outputs, None)

    def run_timed(
        self, executable: Any, inputs: Sequence[np.ndarray], *, entry: str = "main",
        repeats: int = 10,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """Run a Relax executable (or an exported library: a path) like :meth:`run`, then
        time ``repeats`` more calls on the device.

        Returns the outputs and ``{"first_ms", "samples_ms", "median_ms"}``: the first call
        (wall clock on this host, a remote round trip included) and the warm calls, each
        timed on the device.
        """
        timing: dict[str, Any] = {"repeats": repeats}
        out = self._run(executable, inputs, entry, None, timing)
        return out, timing_summary(timing)

    @abc.abstractmethod
    def _run(
        self,
        executable: Any,
        inputs: Sequence[np.ndarray],
        entry: str,
        outputs: Sequence[OutputSpec] | None,
        timing: dict[str, Any] | None,
    ) -> list[np.ndarray]:
        """:meth:`run`, filling ``timing`` (see :func:`run_on_device`) when given."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.device_info().get('device', '?')}>"


def timing_summary(timing: dict[str, Any]) -> dict[str, Any]:
    """``run_on_device``'s timing dict with the warm median added."""
    samples = timing.get("samples_ms") or []
    return {"first_ms": timing.get("first_ms"), "samples_ms": samples,
            "median_ms": float(np.median(samples)) if samples else None}


# ---------------------------------------------------------------------------------------------
# Helpers shared by the implementations.


def to_tensor(array: np.ndarray, dev: Any) -> Any:
    """Copy a numpy array (bfloat16 included) into a new TVM tensor on ``dev``."""
    import tvm

    array = np.ascontiguousarray(array)
    if _BF16 is not None and array.dtype == _BF16:
        # Allocate as bfloat16 and copy the raw 16-bit patterns: no float round trip.
        tensor = tvm.runtime.empty(array.shape, "bfloat16", dev)
        tensor.copyfrom(array.view(np.uint16))
        return tensor
    return tvm.runtime.tensor(array, dev)


def empty_tensor(shape: Sequence[int], dtype: str, dev: Any) -> Any:
    """Allocate an output tensor of ``shape`` and ``dtype`` on ``dev``."""
    import tvm

    return tvm.runtime.empty(tuple(int(s) for s in shape), str(dtype), dev)


def to_numpy(value: Any) -> list[np.ndarray]:
    """Flatten a VM/kernel result (tensor, scalar or nested tuple) into numpy arrays."""
    import tvm
    import tvm_ffi

    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    if isinstance(value, (tuple, list, tvm_ffi.Array)):
        return [a for v in value for a in to_numpy(v)]
    return [np.asarray(value)]


def run_on_device(
    module: Any,
    vm_factory: Callable[[], Any] | None,
    dev: Any,
    inputs: Sequence[np.ndarray],
    entry: str,
    outputs: Sequence[OutputSpec] | None,
    timing: dict[str, Any] | None = None,
) -> list[np.ndarray]:
    """Run one call on ``dev``; shared by local and remote runners.

    ``module`` is a runtime module holding ``entry`` (destination-passing PrimFunc style);
    ``vm_factory`` returns a ``relax.VirtualMachine`` (used when ``outputs`` is None).
    ``timing`` (VM calls only), a dict with ``repeats``, receives ``first_ms`` (the first
    call, wall clock on this host: a remote call's round trip included) and ``samples_ms``
    (``repeats`` warm calls, each timed on the device by TVM's time evaluator).
    """
    import time

    args = [to_tensor(np.asarray(a), dev) for a in inputs]
    if outputs is None:
        if vm_factory is None:
            raise ValueError("outputs=None needs a Relax executable (VM)")
        vm = vm_factory()
        # set_input/invoke_stateful/get_outputs also works over RPC with tuple results.
        vm.set_input(entry, *args)
        t0 = time.perf_counter()
        vm.invoke_stateful(entry)
        result = to_numpy(vm.get_outputs(entry))
        if timing is not None:
            timing["first_ms"] = (time.perf_counter() - t0) * 1e3
            repeats = int(timing.get("repeats", 10))
            ev = vm.time_evaluator("invoke_stateful", dev, number=1, repeat=repeats)
            timing["samples_ms"] = [float(r) * 1e3 for r in ev(entry).results]
        return result
    outs = [empty_tensor(shape, dtype, dev) for shape, dtype in outputs]
    module[entry](*args, *outs)
    return [o.numpy() for o in outs]


def runtime_module(executable: Any) -> Any:
    """The runnable ``runtime.Module`` of an Executable, of an exported library (a path), or
    the module itself."""
    if isinstance(executable, (str, os.PathLike)):
        import tvm

        return tvm.runtime.load_module(os.fspath(executable))
    return executable.jit() if hasattr(executable, "jit") else executable


class IdentityCache:
    """Values keyed by object identity; weak where the key allows it.

    ``tvm.runtime.Executable`` supports weak references (entries vanish with it); a bare
    ``runtime.Module`` does not, so it is held strongly until :meth:`clear`.
    """

    def __init__(self) -> None:
        self._weak: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._strong: dict[int, tuple[Any, Any]] = {}

    def get(self, key: Any) -> Any | None:
        try:
            return self._weak.get(key)
        except TypeError:
            hit = self._strong.get(id(key))
            return hit[1] if hit is not None and hit[0] is key else None

    def __setitem__(self, key: Any, value: Any) -> None:
        try:
            self._weak[key] = value
        except TypeError:
            self._strong[id(key)] = (key, value)

    def clear(self) -> None:
        self._weak.clear()
        self._strong.clear()


class _CallTimeout(Exception):
    """Internal: the guarded call is still running after its time-out."""


def call_with_timeout(fn: Callable[[], _T], timeout: float | None, what: str = "call") -> _T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout`` seconds.

    TVM's FFI releases the GIL, so a call blocked on a socket does not block this thread.
    On time-out :class:`_CallTimeout` is raised and the thread is abandoned; the caller must
    make the blocked call return (e.g. by killing the server) or discard the session.
    """
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"opsdk-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _CallTimeout(what)
    if "error" in box:
        err = box.pop("error")
        raise err
    return box["value"]
