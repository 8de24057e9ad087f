"""What the rules work out, kept between the builds of one process while asked
(:func:`reused_decisions`, which ``opsdk build --watch`` rebuilds in), and the flag
switching the package's modes share."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tvm_ffi

__all__ = ["memoized", "nothing_decided", "rebuild_memo", "remember", "reused_decisions",
           "switched_on"]


@contextlib.contextmanager
def switched_on(flag: threading.local) -> Iterator[None]:
    """``flag.on`` True within the block, as it was after."""
    prev = getattr(flag, "on", False)
    flag.on = True
    try:
        yield
    finally:
        flag.on = prev


#: What was worked out inside :func:`reused_decisions`, one dict a kind (``choose``: the
#: decisions by function, target and rules); the oldest go first past :data:`_MEMO_SIZE`.
_MEMOS: dict[str, dict[Any, Any]] = {}
_MEMO_SIZE = 1024
_REUSE = threading.local()


def rebuild_memo(name: str) -> dict[Any, Any] | None:
    """Inside :func:`reused_decisions`, the memo named ``name`` (a dict kept until the
    outermost block ends); None outside, where nothing is kept between builds. A user
    keys it by everything the memoized result depends on and bounds it with
    :func:`remember`.

    Examples
    --------
    >>> from opsdk.schedules import rebuild_memo, reused_decisions
    >>> rebuild_memo("example") is None
    True
    >>> with reused_decisions():
    ...     rebuild_memo("example")["k"] = 1
    ...     rebuild_memo("example")
    {'k': 1}
    """
    if not getattr(_REUSE, "on", False):
        return None
    return _MEMOS.setdefault(name, {})


def nothing_decided() -> bool:
    """Inside :func:`reused_decisions` with no schedule decision kept yet (a watch's first
    build); False outside."""
    return getattr(_REUSE, "on", False) and not _MEMOS.get("choose")


def _without_symbol(func: Any) -> Any:
    """``func`` without its ``global_symbol``: a memo keys a kernel by its code, not by its
    name in the module (an edited model renumbers its kernels)."""
    return func.without_attr("global_symbol") if "global_symbol" in (func.attrs or {}) \
        else func


def remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    """``memo[key] = value``, the oldest entry dropped past :data:`_MEMO_SIZE`."""
    if len(memo) >= _MEMO_SIZE:
        del memo[next(iter(memo))]
    memo[key] = value


def memoized(name: str, func: Any, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` for the kernel ``func``, or inside :func:`reused_decisions` what it gave
    an earlier build for the same code (``func`` structurally equal, its name aside) and the
    same ``key`` (everything else the result depends on), from the memo ``name``.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.schedules import memoized, reused_decisions
    >>> a = te.placeholder((4,), name="a")
    >>> f = te.create_prim_func([a, te.compute((4,), lambda i: a[i] + 1)])
    >>> with reused_decisions():
    ...     first = memoized("example", f, "x86", lambda: ["scheduled"])
    ...     memoized("example", f, "x86", lambda: ["again"]) is first
    True
    """
    memo = rebuild_memo(name)
    if memo is None:
        return compute()
    bare = _without_symbol(func)
    full = (tvm_ffi.structural_hash(bare), key)
    hit = memo.get(full)
    if hit is not None and tvm_ffi.structural_equal(hit[0], bare):
        return hit[1]
    value = compute()
    remember(memo, full, (bare, value))
    return value


@contextlib.contextmanager
def reused_decisions() -> Iterator[None]:
    """Within this block, what a build works out for a kernel is kept for the next build
    (each a :func:`rebuild_memo`):

    - :func:`~opsdk.schedules.choose` gives a function it already scheduled (structurally
      the same, with the same op name and kind, target and applicable rules: the very rule
      functions, so a rule defined again is another) the earlier decision back, its
      scheduled function included, instead of running the rules again;
    - :func:`~opsdk.schedules.classify` answers a function it classified;
    - :func:`opsdk.transform.LegalizeOpsOnce` gives a call it legalized before (the same op,
      legalization function, attributes, types and target) the kernel it built then.

    ``opsdk build --watch`` rebuilds in it: a rebuild schedules most kernels again (10-15 ms
    each) only to find them in the kernel cache, and builds each conv's TE compute again.
    It holds for rules and legalizations that are functions of the kernel and the target,
    as opsdk's are; state one reads from elsewhere (a global switched between two compiles)
    is not in the key, so the block is the caller's choice.

    Examples
    --------
    >>> from opsdk.schedules import reused_decisions
    >>> with reused_decisions():
    ...     pass
    """
    outermost = not getattr(_REUSE, "on", False)
    try:
        with switched_on(_REUSE):
            yield
    finally:
        if outermost:
            _MEMOS.clear()
