"""The runner interface shared by the local, emulated and remote (RPC) runners."""

from __future__ import annotations

import abc
import os
import platform
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "DeviceCrash", "DeviceTimeout", "InputMismatch", "KernelWeights", "OutputSpec", "Runner",
    "RunnerUnavailable", "check_inputs", "timing_summary",
]

OutputSpec = tuple[tuple[int, ...], str]
_T = TypeVar("_T")


class KernelWeights(list):
    """Weights already in the form an entry's kernels read (a decoder artifact's): a runner
    passes them after the inputs as they are, where a plain sequence of weights is first
    transformed by ``<entry>_transform_params``."""


class DeviceCrash(RuntimeError):
    """The process executing the kernel died (illegal instruction, segmentation fault, ...)."""


def host_arch() -> str:
    """Normalized host machine name (``x86_64``, ``aarch64``, ...)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


class RunnerUnavailable(RuntimeError):
    """The device could not be started or reached (emulator set-up, RPC connection): an
    environment problem to report in one line, not a failed check."""


class InputMismatch(ValueError):
    """A compiled model was called with inputs its signature refuses (count, rank, dtype, a
    static dim) or on a CPU it was not compiled for; the message names the input, what the
    model takes and what it got."""


# What TVM 0.27's VM says when a call does not match the function's signature (its
# argument checks in relax_vm/builtin.cc, and the LLVM module's architecture check).
_CTX = (r"ErrorContext\(fn=(?P<fn>[^,]+), loc=param\[(?P<i>\d+)\], param=(?P<name>[^,]+), "
        r"annotation=(?P<ann>.*?)\)\s+")
_SIGNATURE_CHECKS = [
    ("dtype", re.compile(_CTX + r"expect Tensor with dtype (?P<want>\S+) but get "
                         r"(?P<got>\S+)")),
    ("ndim", re.compile(_CTX + r"expect Tensor with ndim (?P<want>\d+) but get (?P<got>\d+)")),
    ("dim", re.compile(r"\((?P<got>\d+) vs\. (?P<want>\d+)\) : " + _CTX
                       + r"match_cast error,\s+shape\[(?P<axis>\d+)\]")),
    ("other", re.compile(_CTX + r"(?P<what>expect [^\n]*)")),
    ("count", re.compile(r"args\.size\(\) == params_num \((?P<got>\d+) vs\. (?P<want>\d+)\)")),
    ("arch", re.compile(r"architecture mismatch")),
]


def _signature_error(e: BaseException, inputs: Sequence[Any], entry: str) -> str | None:
    """opsdk's sentence for TVM's refusal of a call's inputs, or None for another error."""
    text = str(e)
    for kind, pat in _SIGNATURE_CHECKS:
        m = pat.search(text)
        if m is None:
            continue
        g = m.groupdict()
        if kind == "count":
            return f"{g['got']} inputs given, {entry} takes {g['want']}"
        if kind == "arch":
            return (f"{entry}: the executable was compiled for another CPU architecture than "
                    f"this {host_arch()} host; run it on its device (--rpc, or --emulate for "
                    "aarch64)")
        i = int(g["i"])
        shape = list(np.shape(inputs[i])) if i < len(inputs) else "?"
        name, ann = g["name"].strip(), g["ann"].strip()
        got = {"dtype": f"dtype {g.get('got')}",
               "ndim": f"shape {shape} ({g.get('got')} dims)",
               "dim": f"shape {shape} (dim {g.get('axis')} is {g.get('got')})"}.get(kind)
        want = {"dtype": f"dtype {g.get('want')}", "ndim": f"{g.get('want')} dims",
                "dim": f"{g.get('want')} there"}.get(kind)
        if got is None:
            return f"input {name!r} (#{i} of {entry}): TVM says {g['what'].strip()}; the model " \
                   f"takes {ann}"
        return f"input {name!r} (#{i} of {entry}): {got}, the model takes {want} ({ann})"
    return None


def check_inputs(func: Any, inputs: Sequence[Any], entry: str = "main") -> None:
    """Raise :class:`InputMismatch` unless ``inputs`` fit the Relax function ``func``'s
    parameters: their count, and each tensor's rank, dtype and static dims (checked before a
    compile, where TVM would check them only when the compiled model runs).

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import relax
    >>> from opsdk.runners._base import InputMismatch, check_inputs
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> f = relax.Function([x], x)
    >>> try:
    ...     check_inputs(f, [np.zeros((2, 4), "float32")])
    ... except InputMismatch as e:
    ...     print(e)
    input 'x' (#0 of main): shape [2, 4], the model takes [2, 3] (float32)
    """
    from tvm import relax, tirx  # heavy: TVM

    params = list(func.params)
    if len(params) != len(inputs):
        raise InputMismatch(f"{len(inputs)} inputs given, {entry} takes {len(params)}")
    for i, (p, a) in enumerate(zip(params, inputs)):
        si = p.ty
        if not isinstance(si, relax.TensorType):
            continue
        a = np.asarray(a)
        dims = None if not isinstance(si.shape, relax.ShapeExpr) else [
            int(d.value) if isinstance(d, tirx.IntImm) else str(d) for d in si.shape.values]
        want = f"{dims if dims is not None else f'{si.ndim} dims'} ({si.dtype})"
        where = f"input {str(p.name)!r} (#{i} of {entry})"
        if str(a.dtype) != str(si.dtype) and str(si.dtype) != "void":
            raise InputMismatch(f"{where}: dtype {a.dtype}, the model takes {want}")
        if (si.ndim >= 0 and a.ndim != si.ndim) or (dims is not None and any(
                isinstance(d, int) and d != n for d, n in zip(dims, a.shape))):
            raise InputMismatch(f"{where}: shape {list(a.shape)}, the model takes {want}")


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
        weights: Sequence[np.ndarray] | None = None,
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
        weights : sequence of numpy.ndarray, optional
            The original weights of a model compiled with its weight transforms lifted
            (:mod:`opsdk.transform._lift`): the first call on a loaded executable runs
            ``<entry>_transform_params`` on them once and keeps its results on the device;
            every call passes them after ``inputs``. :class:`KernelWeights` (already in
            the kernels' form) are uploaded and passed as they are.

        Returns
        -------
        list of numpy.ndarray
        """
        return self._checked(executable, inputs, entry, outputs, None, weights)

    def run_timed(
        self, executable: Any, inputs: Sequence[np.ndarray], *, entry: str = "main",
        repeats: int = 10, weights: Sequence[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """Run a Relax executable (or an exported library: a path) like :meth:`run`, then
        time ``repeats`` more calls on the device.

        Returns the outputs and ``{"first_ms", "samples_ms", "median_ms"}``: the first call
        (wall clock on this host, a remote round trip included) and the warm calls, each
        timed on the device; with ``weights``, ``load_ms``: their upload and transform (wall
        clock on this host, the first call on this executable only).
        """
        timing: dict[str, Any] = {"repeats": repeats}
        out = self._checked(executable, inputs, entry, None, timing, weights)
        return out, timing_summary(timing)

    def _checked(self, executable: Any, inputs: Sequence[np.ndarray], entry: str,
                 outputs: Sequence[OutputSpec] | None,
                 timing: dict[str, Any] | None,
                 weights: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`_run`, with TVM's refusal of the inputs (a multi-part internal check) told
        as :class:`InputMismatch`: the input, what the model takes and what it got."""
        try:
            if weights is None:  # runners written before weights keep working
                return self._run(executable, inputs, entry, outputs, timing)
            return self._run(executable, inputs, entry, outputs, timing, weights=weights)
        except (DeviceCrash, DeviceTimeout, RunnerUnavailable):
            raise
        except Exception as e:
            msg = _signature_error(e, inputs, entry)
            if msg is None:
                raise
            raise InputMismatch(msg) from None

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
            "median_ms": float(np.median(samples)) if samples else None,
            **({"load_ms": timing["load_ms"]} if "load_ms" in timing else {})}


# ---------------------------------------------------------------------------------------------
# Helpers shared by the implementations.


def to_tensor(array: np.ndarray, dev: Any) -> Any:
    """Copy a numpy array (bfloat16 included) into a new TVM tensor on ``dev``."""
    import tvm  # heavy: TVM

    array = np.ascontiguousarray(array)
    # (a bfloat16 array exists only once ml_dtypes is imported: not imported here, 0.6 s)
    if array.dtype.name == "bfloat16":
        # Allocate as bfloat16 and copy the raw 16-bit patterns: no float round trip.
        tensor = tvm.runtime.empty(array.shape, "bfloat16", dev)
        tensor.copyfrom(array.view(np.uint16))
        return tensor
    return tvm.runtime.tensor(array, dev)


def empty_tensor(shape: Sequence[int], dtype: str, dev: Any) -> Any:
    """Allocate an output tensor of ``shape`` and ``dtype`` on ``dev``."""
    import tvm  # heavy: TVM

    return tvm.runtime.empty(tuple(int(s) for s in shape), str(dtype), dev)


def to_numpy(value: Any) -> list[np.ndarray]:
    """Flatten a VM/kernel result (tensor, scalar or nested tuple) into numpy arrays."""
    import tvm  # heavy: TVM
    import tvm_ffi  # heavy: TVM

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
    weights: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Run one call on ``dev``; shared by local and remote runners.

    ``module`` is a runtime module holding ``entry`` (destination-passing PrimFunc style);
    ``vm_factory`` returns a ``relax.VirtualMachine`` (used when ``outputs`` is None).
    ``timing`` (VM calls only), a dict with ``repeats``, receives ``first_ms`` (the first
    call, wall clock on this host: a remote call's round trip included) and ``samples_ms``
    (``repeats`` warm calls, each timed on the device by TVM's time evaluator).
    ``weights`` (VM calls only): see :meth:`Runner.run`.
    """

    args = [to_tensor(np.asarray(a), dev) for a in inputs]
    if outputs is None:
        if vm_factory is None:
            raise ValueError("outputs=None needs a Relax executable (VM)")
        vm = vm_factory()
        if weights is not None:
            args += transformed_weights(vm, dev, weights, entry, timing)
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


def transformed_weights(vm: Any, dev: Any, weights: Sequence[np.ndarray], entry: str,
                        timing: dict[str, Any] | None = None) -> list[Any]:
    """``<entry>_transform_params(*weights)`` on ``dev``, run on the first call with these
    weights on ``vm`` and kept with it (the uploaded originals are dropped once it ran);
    :class:`KernelWeights` are uploaded as they are."""

    kept = vm.__dict__.setdefault("_opsdk_weights", {})
    hit = kept.get(entry)
    if hit is not None and hit[0] is weights:
        return hit[1]
    t0 = time.perf_counter()
    name = entry + "_transform_params"
    originals = [to_tensor(np.asarray(a), dev) for a in weights]
    if isinstance(weights, KernelWeights):
        got = originals
    elif int(dev.dlpack_device_type()) >= 128:  # RPC_SESS_MASK: a tuple result travels so only
        vm.set_input(name, *originals)
        vm.invoke_stateful(name)
        got = list(vm.get_outputs(name))
    else:
        got = list(vm[name](*originals))
    del originals
    kept[entry] = (weights, got)
    if timing is not None:
        timing["load_ms"] = (time.perf_counter() - t0) * 1e3
    return got


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
