"""Files: writing what the user keeps whole or not at all, with the mode an editor would
give; where opsdk's own caches live."""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

__all__ = ["OutputError", "cache_dir", "check_can_create", "new_file_mode", "sha256_file",
           "write_bytes_atomic", "write_text_atomic"]


def cache_dir() -> pathlib.Path:
    """Return the user cache directory of opsdk.

    ``$OPSDK_CACHE`` if set, else ``$XDG_CACHE_HOME/opsdk``, else ``~/.cache/opsdk``.
    """
    if os.environ.get("OPSDK_CACHE"):
        return pathlib.Path(os.environ["OPSDK_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "opsdk"


class OutputError(OSError):
    """A result file could not be written (a full disk, a folder gone meanwhile); the message
    names the file, and the file is as it was before."""

    def __str__(self) -> str:  # the sentence, without OSError's "[Errno 28]" prefix
        return str(self.strerror)


def new_file_mode() -> int:
    """The mode a new regular file gets under the current umask (0644 under the usual 022);
    ``tempfile.mkstemp`` makes 0600 files, so a temporary file renamed into place needs it."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks: artifacts and cached
    libraries are checked with it before they are trusted."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_can_create(folder: str | os.PathLike) -> None:
    """Raise ``OSError`` unless a file can be created in ``folder``: tried, since permission
    bits say nothing to root, and /proc or a read-only mount refuse files whatever they say."""
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".opsdk.", suffix=".probe")
    os.close(fd)
    os.unlink(probe)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, then rename: a full disk
    or an interrupt leaves the old file (or none), never half a file.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from opsdk._files import write_text_atomic
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.json"
    >>> write_text_atomic(p, "{}")
    >>> p.read_text()
    '{}'
    """
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """:func:`write_text_atomic` for bytes (a PNG plot). A path that is not a regular file
    (``/dev/null``, ``/dev/stdout``, a FIFO) is written into, and a symbolic link's target is
    replaced, not the link: renaming over them would replace the device node or the link."""
    target = pathlib.Path(path)
    try:
        if target.exists() and not target.is_file():
            with open(target, "wb") as f:
                f.write(data)
            return
        target = pathlib.Path(os.path.realpath(target))
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(e.errno, f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, target)
    except BaseException as e:
        pathlib.Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # a traceback after a long run hid which file and why
            raise OutputError(e.errno, f"cannot write {path}: {e.strerror or e}; nothing "
                              "was written to it") from None
        raise
