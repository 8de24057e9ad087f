"""``opsdk build --watch``: one resident process that rebuilds a model's artifact whenever a
file it was built from changes.

A one-shot build of an edited model spends most of its time on work that does not depend on
the edit: starting Python, importing torch, TVM and the model's packages (timm imports
``torch._dynamo``), and the first call of each of torch.export's and TVM's code paths. A
watch pays them once. Each rebuild then runs the model file's code again (so anything it
computes or reads is current), exports and imports it again, and takes every kernel whose
scheduled function did not change from the kernel cache.

What is watched is what the build read: the model file, the user's own modules it imported
(each imported afresh on a rebuild, and the ops they registered registered afresh), and the
data files its code opened (a config, a checkpoint); never the output folder or the caches,
which the build writes. A file counts as changed when its size, modification time or inode
changed (saving it unchanged rebuilds once: the up-to-date check then keeps the artifact).

A rebuild that fails (a syntax error, a layer opsdk cannot lower) prints its one-line error
and the watch goes on; the last good artifact stays in place, since a build only replaces
it when complete. The watch replaces the artifact it wrote itself without ``--force``; an
artifact that changed under it is refused as any build refuses it.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .._cliargs import UsageError
from .._files import cache_dir
from .._modelcache import default_dir
from .._timings import CompileTimings, record_timings
from .._userfile import UserCodeError, one_line, user_modules
from ._uptodate import data_files, reads

__all__ = ["Sources", "watch_build"]

_Stat = tuple[int, int, int] | None


def _stat(p: Path) -> _Stat:
    try:
        st = p.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Sources:
    """The files a build read, each with its size, modification time and inode when taken.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from opsdk.deploy._watch import Sources
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> m = d / "model.py"
    >>> _ = m.write_text("A = 1\\n")
    >>> s = Sources(exclude=[d / "out"])
    >>> s.take([m, d / "out" / "weights.params"])
    >>> [p.name for p in s.files]
    ['model.py']
    >>> s.changed()
    []
    >>> _ = m.write_text("A = 22\\n")
    >>> [p.name for p in s.changed()]
    ['model.py']
    """

    def __init__(self, exclude: Iterable[str | os.PathLike] = ()) -> None:
        self.exclude = [Path(os.path.realpath(p)) for p in exclude]
        self.files: dict[Path, _Stat] = {}

    def _kept(self, p: Path) -> bool:
        return not any(p == e or e in p.parents for e in self.exclude)

    def take(self, paths: Iterable[str | os.PathLike]) -> None:
        """Watch ``paths`` (the excluded ones and those gone left out) as they are now,
        besides the files watched already."""
        for p in paths:
            real = Path(os.path.realpath(p))
            if self._kept(real) and (now := _stat(real)) is not None:
                self.files[real] = now

    def changed(self) -> list[Path]:
        """The watched files that changed (or went) since taken, sorted."""
        return sorted(p for p, was in self.files.items() if _stat(p) != was)


def _artifact_digest(out: Path) -> str | None:
    try:
        return hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


def _forget(modules: Mapping[str, Path]) -> None:
    """Drop the user's modules (imported afresh by the next build) and the ops they
    registered (their new definitions register again under the same names)."""
    from ..registry import registered_ops, unregister  # heavy: TVM (imported by the build)

    for d in registered_ops():
        if d.module in modules:
            unregister(d)
    for name in modules:
        sys.modules.pop(name, None)


def _error_line(e: BaseException) -> str:
    """A user's error and a usage error say what and where already; anything else gets
    its type (a TVM error its message, not its traceback)."""
    return str(e) if isinstance(e, (UserCodeError, UsageError)) else one_line(e)


def watch_build(
    build: Callable[[bool], Mapping[str, Any]],
    model: str | os.PathLike,
    out: str | os.PathLike,
    *,
    report: Callable[[Mapping[str, Any], CompileTimings, float, int], Any],
    force: bool = False,
    say: Callable[[str], Any] = print,
    poll: float = 0.25,
    stop: threading.Event | None = None,
) -> int:
    """Build, then rebuild whenever a file the build read changes, until ``stop`` is set or
    Ctrl-C; returns 0.

    Parameters
    ----------
    build
        One build: ``build(force)`` writes the artifact ``out`` and returns its manifest,
        raising on failure (a ``UserCodeError``, a usage error).
    model
        The model file (always watched, even when its import failed).
    out
        The artifact folder: never watched; the watch replaces what it wrote there.
    report
        Called after each build that succeeded: ``report(manifest, timings, seconds,
        round)``, ``round`` 0 for the first build.
    force
        The first build replaces an earlier artifact (``--force``); the later ones replace
        the watch's own.
    say
        Progress and errors, a line each.
    poll
        Seconds between two looks at the files.
    stop
        Ends the watch when set (tests; the command line stops on Ctrl-C).

    Examples
    --------
    >>> import pathlib, tempfile, threading
    >>> from opsdk.deploy._watch import watch_build
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "m.py").write_text("")
    >>> stop, seen = threading.Event(), []
    >>> def build(force):
    ...     stop.set()  # one build, then the watch ends
    ...     return {"kernels": []}
    >>> watch_build(build, d / "m.py", d / "out", stop=stop, say=lambda s: None,
    ...             report=lambda m, t, s, n: seen.append(n))
    0
    >>> seen
    [0]
    """
    stop = stop or threading.Event()
    model_path, out_path = Path(model), Path(out).expanduser().absolute()
    # What the build writes: never a reason to rebuild (its folder beside ``out`` is gone
    # once the build ends, and files gone are not watched).
    sources = Sources(exclude=[out_path, cache_dir(), default_dir(),
                               *filter(None, [os.environ.get("OPSDK_KERNEL_CACHE_DIR")])])
    from ..schedules import reused_decisions  # heavy: TVM

    try:
        with reused_decisions():  # a rebuild's unchanged kernels: scheduled once
            return _rounds(build, model_path, out_path, report, force, say, poll, stop,
                           sources)
    except KeyboardInterrupt:
        say(f"stopped watching; {out_path} holds the last good build")
        return 0
    finally:
        gc.unfreeze()  # a caller going on (a test, a script) gets its collector back


def _rounds(build: Callable[[bool], Mapping[str, Any]], model_path: Path, out_path: Path,
            report: Callable[[Mapping[str, Any], CompileTimings, float, int], Any],
            force: bool, say: Callable[[str], Any], poll: float, stop: threading.Event,
            sources: Sources) -> int:
    """Build, then wait and rebuild until stopped (:func:`watch_build`)."""
    baseline = set(user_modules())  # the caller's own code (a test, a script): kept
    ours: str | None = None  # the digest of the artifact this watch wrote last
    round_ = 0
    while True:
        t0 = time.perf_counter()
        try:
            with reads() as seen, record_timings() as timings:
                manifest = build(force if ours is None else
                                 _artifact_digest(out_path) == ours)
        except Exception as e:  # a failed rebuild keeps the watch going
            if round_ == 0 and not isinstance(e, UserCodeError):
                raise  # a wrong folder or option: nothing to wait for
            say(f"opsdk build: error: {_error_line(e)}")
            say(f"{out_path} is left as it was; fix the error and save")
        else:
            report(manifest, timings, time.perf_counter() - t0, round_)
            ours = _artifact_digest(out_path)
        mods = {n: p for n, p in user_modules().items() if n not in baseline}
        sources.take([model_path, *mods.values(), *data_files(seen)])
        say(f"watching {len(sources.files)} file{'s' * (len(sources.files) != 1)} for "
            "changes (Ctrl-C stops)")
        _settle_heap()
        changed = _wait(sources, poll, stop)
        if not changed:
            return 0
        say(f"changed: {', '.join(p.name for p in changed)}; rebuilding")
        _forget(mods)
        sources = Sources(exclude=sources.exclude)
        round_ += 1


def _settle_heap() -> None:
    """Collect the build's garbage now, while waiting, and exempt what survives from later
    collections (``gc.freeze``): the rebuild's own collections then scan only what it
    makes. The first rebuild after a cold build spent 0.2-0.3 s more in the collector
    without it (ResNet-50); what the last round froze is collected again each round, so
    nothing is kept longer than a round."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _wait(sources: Sources, poll: float, stop: threading.Event) -> list[Path]:
    """The changed files once they stop changing (an editor saves in steps); [] when
    stopped."""
    while not stop.wait(poll):
        changed = sources.changed()
        if not changed:
            continue
        while True:  # settled: the same stats twice, one poll apart
            before = {p: _stat(p) for p in sources.files}
            if stop.wait(poll):
                return []
            if before == {p: _stat(p) for p in sources.files}:
                return sources.changed()
    return []
