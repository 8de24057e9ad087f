"""Value domains for test generation beyond a plain ``(lo, hi)`` range.

``domain={"x": (lo, hi)}`` draws test data uniformly; a scale, a gain or a variance matters
across orders of magnitude instead, and a uniform draw over ``(1e-4, 1e2)`` almost never
goes below ``1``. :func:`log_uniform` spreads the draws evenly over the decades.

A plain range is the *ordinary* data; the stress recipes (``tiny``, ``large``, ``offset``,
``mixed``) deliberately leave it to break naive kernels. An input that can never leave its
range (a sine table in ``[-1, 1]``, a probability) says so with :func:`bounded`: every recipe
then stays inside.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Bounded", "LogUniform", "bounded", "log_uniform"]


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _range_problem(lo: Any, hi: Any) -> str | None:
    """What is wrong with ``(lo, hi)`` as a range, or None."""
    if not (_is_real(lo) and _is_real(hi)):
        return f"bounds must be real numbers, got {lo!r} and {hi!r}"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"bounds must be finite, got {lo!r} and {hi!r}"
    if not hi > lo:
        return f"hi must be > lo, got lo={lo!r} hi={hi!r}"
    return None


@dataclass(frozen=True)
class LogUniform:
    """Values spread evenly over the decades of ``[lo, hi]`` (``0 < lo < hi``).

    In ``domain=`` every element of the tensor input is drawn log-uniformly (the ``domain``
    recipe; ``normal``, ``constant`` and ``rowconst`` work in log space too), and the values
    stay positive. In ``attr_domain=`` a ``float`` attribute is drawn log-uniformly; its first
    example (and hypothesis's shrink target) is the attribute's default when that lies in the
    range, else :attr:`typical`.

    It unpacks like a ``(lo, hi)`` range (``lo, hi = d.domain["scale"]``), so code that only
    needs the bounds keeps working. Create one with :func:`log_uniform`; the bounds are
    checked when the op is defined (``OpDefinitionError`` naming the op and the argument).

    Examples
    --------
    >>> import numpy as np
    >>> from opsdk import log_uniform
    >>> dom = log_uniform(1e-4, 1e2)
    >>> lo, hi = dom
    >>> lo, hi, dom.typical
    (0.0001, 100.0, 0.1)
    >>> x = dom.sample(np.random.default_rng(0), (10000,))
    >>> bool(x.min() >= 1e-4 and x.max() <= 1e2), int(np.sum(x < 1e-3)) > 1000
    (True, True)
    """

    lo: float
    hi: float

    def __iter__(self) -> Iterator[float]:
        return iter((self.lo, self.hi))

    def __repr__(self) -> str:
        return f"log_uniform({self.lo!r}, {self.hi!r})"

    def problem(self) -> str | None:
        """What is wrong with the bounds, or None when they are usable."""
        if _is_real(self.lo) and math.isfinite(self.lo) and not self.lo > 0:
            return f"lo must be > 0 (a log-uniform range is positive), got {self.lo!r}"
        return _range_problem(self.lo, self.hi)

    def __contains__(self, v: Any) -> bool:
        return _is_real(v) and self.lo <= v <= self.hi

    @property
    def decades(self) -> float:
        """Orders of magnitude the range spans, ``log10(hi / lo)``."""
        return math.log10(self.hi / self.lo)

    @property
    def typical(self) -> float:
        """A round value in the middle of the range: the geometric mean to one significant
        digit (kept inside the range)."""
        g = math.sqrt(self.lo) * math.sqrt(self.hi)
        r = float(f"{g:.1g}")
        return r if self.lo <= r <= self.hi else g

    def at(self, u: float) -> float:
        """The value a fraction ``u`` of the way through the log range (0: lo, 1: hi)."""
        if u <= 0:
            return float(self.lo)
        if u >= 1:
            return float(self.hi)
        a, b = math.log(self.lo), math.log(self.hi)
        return min(max(math.exp(a + u * (b - a)), float(self.lo)), float(self.hi))

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...] = ()) -> np.ndarray:
        """Log-uniform float64 samples in ``[lo, hi]``."""
        a, b = math.log(self.lo), math.log(self.hi)
        return np.clip(np.exp(rng.uniform(a, b, shape)), self.lo, self.hi)


def log_uniform(lo: float, hi: float) -> LogUniform:
    """A log-uniform domain over ``[lo, hi]`` (``0 < lo < hi``) for ``domain=`` /
    ``attr_domain=`` of :func:`opsdk.op`: scales, gains and other positive quantities whose
    behaviour changes across orders of magnitude.

    Examples
    --------
    >>> import opsdk
    >>> opsdk.log_uniform(1e-4, 100)
    log_uniform(0.0001, 100.0)
    """
    # Bounds that are not real numbers are kept as given, for the definition-time error.
    return LogUniform(*(float(v) if _is_real(v) else v for v in (lo, hi)))


@dataclass(frozen=True)
class Bounded:
    """A hard range ``[lo, hi]`` for a tensor input: every data recipe stays inside it.

    The ``domain`` recipe draws uniformly over it like a plain ``(lo, hi)``; the stress recipes
    are clipped into it (``large`` lands on the ends, ``tiny`` near zero when zero is inside).
    It unpacks like a ``(lo, hi)`` range. Create one with :func:`bounded`.

    Examples
    --------
    >>> from opsdk import bounded
    >>> lo, hi = bounded(-1, 1)
    >>> lo, hi
    (-1.0, 1.0)
    """

    lo: float
    hi: float

    def __iter__(self) -> Iterator[float]:
        return iter((self.lo, self.hi))

    def __repr__(self) -> str:
        return f"bounded({self.lo!r}, {self.hi!r})"

    def problem(self) -> str | None:
        """What is wrong with the bounds, or None when they are usable."""
        return _range_problem(self.lo, self.hi)


def bounded(lo: float, hi: float) -> Bounded:
    """A hard input range for ``domain=`` of :func:`opsdk.op`: no data recipe of
    ``opsdk verify`` leaves ``[lo, hi]`` (a plain ``(lo, hi)`` is only the ordinary range).

    Examples
    --------
    >>> import opsdk
    >>> opsdk.bounded(-1, 1)
    bounded(-1.0, 1.0)
    """
    return Bounded(*(float(v) if _is_real(v) else v for v in (lo, hi)))
