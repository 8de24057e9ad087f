"""Quiet by default: third-party warnings and TVM log lines that opsdk knows are harmless.

Each entry is narrow — a message pattern, and for Python warnings a category and a module —
so a new or real warning still shows. ``opsdk -v`` (or ``OPSDK_VERBOSE=1``) shows everything.

TVM's C++ ``LOG(WARNING)`` writes straight to file descriptor 2, past Python, so the CLI points
fd 2 at a temporary file while a command runs and a thread copies every line that is not a
known-harmless one to the real stderr as it arrives (a regular file never blocks the writer,
unlike a pipe whose reader would need the GIL).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator

__all__ = ["HARMLESS_LOG_LINES", "HARMLESS_WARNINGS", "fd_silenced", "filter_log_line", "quiet",
           "verbose"]

#: Python warnings opsdk silences: (message regex, category, module regex, why).
HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"copyreg",
     "torch 2.13's pytree deprecation, raised from torch.export's own code on every load"),
)

#: TVM log lines opsdk drops: (regex searched in the line, why).
HARMLESS_LOG_LINES: tuple[tuple[str, str], ...] = (
    (r"executable\.cc:\d+: Warning: Scope (Saving|Loaded):",
     "TVM 0.27 logs every memory scope when a VM executable is saved or loaded (a debug "
     "leftover)"),
    (r"Warning: Fast mode segfaults when there are out-of-bounds indices",
     "TVM warns on every take/gather in fast mode; torch.export's embeddings are in range"),
    (r"op\.cc:\d+: Warning: Detected pow\(x, y\) where y >= 3",
     "TVM warns on pow(x, 3) (GPT-2's tanh-GELU) whatever the sign of x; scheduled kernels "
     "compute an integer power by multiplying (opsdk._vecmath.polynomial_math), exact for "
     "negative x too"),
    (r"codegen_cpu\.cc:\d+: Warning: Unknown pragma pragma_scope",
     "TOPI's scatter kernels (index_put, scatter_elements) mark their loops with a "
     "'pragma_scope' that TVM's own CPU codegen does not read; the loops run as written"),
    (r"Failed to load \S*torchao/_C\S*\.so: Could not load this library",
     "torchao (executorch's dependency, imported by transformers when installed) tries its "
     "CUDA / mxfp8 kernels at import; beside a CPU torch they do not load and are not used"),
    (r"torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass and is now natively "
     r"supported by torch\.compile",
     "torchao registers its enums as pytree constants at import, deprecated in torch 2.13"),
)

_LOG_RES = tuple(re.compile(p) for p, _ in HARMLESS_LOG_LINES)


@contextlib.contextmanager
def fd_silenced(fd: int) -> Iterator[None]:
    """File descriptor ``fd`` (1 or 2) to /dev/null for the block: C++ writers (torch.onnx's
    graph dump, a peer's CPU probing) bypass ``sys.stdout`` / ``sys.stderr``.

    Examples
    --------
    >>> from opsdk._quiet import fd_silenced
    >>> with fd_silenced(2):
    ...     pass
    """
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def verbose() -> bool:
    """Whether ``OPSDK_VERBOSE`` asks for every warning and log line.

    Examples
    --------
    >>> import os
    >>> from opsdk._quiet import verbose
    >>> os.environ.pop("OPSDK_VERBOSE", None) and None
    >>> verbose()
    False
    """
    return os.environ.get("OPSDK_VERBOSE", "") not in ("", "0")


def filter_log_line(line: str) -> bool:
    """True when ``line`` (one line of native stderr) is shown, False for a known-harmless one.

    Examples
    --------
    >>> from opsdk._quiet import filter_log_line
    >>> filter_log_line("[10:13:26] /project/src/runtime/vm/executable.cc:276: "
    ...                 "Warning: Scope Saving:global")
    False
    >>> filter_log_line("error: something real")
    True
    """
    return not any(r.search(line) for r in _LOG_RES)


def _install_warning_filters() -> None:
    for message, category, module, _why in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class _Fd2Filter:
    """fd 2 -> a temporary file, copied line by line (minus harmless lines) to the real fd 2."""

    def __init__(self) -> None:
        self.real = os.dup(2)
        # Closed in close(): the file outlives this constructor by design.
        self.file = tempfile.TemporaryFile(prefix="opsdk-stderr-")  # noqa: SIM115
        self.reader = os.dup(self.file.fileno())
        self.done = threading.Event()
        self.pending = b""
        self.offset = 0
        self.faulthandler_was_on = faulthandler.is_enabled()
        sys.stderr.flush()
        os.dup2(self.file.fileno(), 2)
        # A crash must still reach the terminal: faulthandler writes to the real stderr.
        self._fh = os.fdopen(os.dup(self.real), "w")
        faulthandler.enable(self._fh)
        self.thread = threading.Thread(target=self._copy, name="opsdk-stderr", daemon=True)
        self.thread.start()

    def _drain(self) -> bool:
        pos = 0
        got = False
        while True:
            chunk = os.pread(self.reader, 1 << 16, self.offset + pos)
            if not chunk:
                break
            pos += len(chunk)
            got = True
            self.pending += chunk
        self.offset += pos
        *lines, self.pending = self.pending.split(b"\n")
        out = b"".join(b + b"\n" for b in lines
                       if filter_log_line(b.decode("utf-8", "replace")))
        if out:
            os.write(self.real, out)
        return got

    def _copy(self) -> None:
        while not self.done.is_set():
            if not self._drain():
                self.done.wait(0.05)
        self._drain()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(self.real, 2)
        self.done.set()
        self.thread.join(timeout=5)
        if self.pending and filter_log_line(self.pending.decode("utf-8", "replace")):
            os.write(self.real, self.pending)
        if self.faulthandler_was_on:
            faulthandler.enable(sys.__stderr__ or sys.stderr)
        else:
            faulthandler.disable()
        for f in (self._fh, self.file):
            with contextlib.suppress(OSError):
                f.close()
        for fd in (self.reader, self.real):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def quiet(show_all: bool = False) -> Iterator[None]:
    """Silence the known-harmless warnings and TVM log lines while the block runs.

    ``show_all`` (``opsdk -v``) or ``OPSDK_VERBOSE=1`` leaves everything as it is. The log
    filter needs a real fd 2 behind ``sys.stderr``; where stderr was replaced (a test capturing
    it) only the Python warning filters apply.

    Examples
    --------
    >>> import warnings
    >>> from opsdk._quiet import quiet
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     with quiet():
    ...         for text in ("`isinstance(treespec, LeafSpec)` is deprecated, use ...",
    ...                      "a warning nobody vetted"):
    ...             warnings.warn_explicit(text, FutureWarning, "copyreg.py", 105,
    ...                                    module="copyreg")
    >>> [str(w.message) for w in seen]
    ['a warning nobody vetted']
    """
    if show_all or verbose():
        yield
        return
    with warnings.catch_warnings():
        _install_warning_filters()
        flt = None
        try:
            if sys.stderr is sys.__stderr__ and sys.stderr.fileno() == 2:
                flt = _Fd2Filter()
        except (OSError, ValueError, AttributeError):  # no usable fd 2: warnings only
            flt = None
        try:
            yield
        finally:
            if flt is not None:
                flt.close()
