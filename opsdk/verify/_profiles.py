"""Verify's profiles (how many random examples a cell draws, and the strategy's knobs) and
the hypothesis example database shrunk failures are replayed from."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, configuration, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from .._files import cache_dir
from ._strategies import StrategyKnobs

__all__ = ["PROFILES", "Profile", "database_path", "default_profile"]


@dataclass(frozen=True)
class Profile:
    """How much a verify run explores: random examples per cell and the strategy's knobs."""

    name: str
    max_examples: int
    knobs: StrategyKnobs = field(default_factory=StrategyKnobs)
    corners: bool = True
    #: Which examples also run the generic lowering (schedule invariance): ``"all"``, or
    #: ``"corners"`` (the corner cases of the common signature; others only when they fail,
    #: to assign the blame). Each generic build is a second compile per signature.
    invariance: str = "all"


PROFILES: dict[str, Profile] = {
    "dev": Profile("dev", 10, StrategyKnobs(p_common=80, p_long=12, p_static=0, max_extra_rank=2),
                   invariance="corners"),
    "ci": Profile("ci", 25, StrategyKnobs(p_long=12, p_static=6, max_extra_rank=3)),
    "thorough": Profile("thorough", 250, StrategyKnobs(p_long=15, p_static=10, max_extra_rank=5)),
}


_HYPOTHESIS_BASE: dict[str, Any] = dict(
    deadline=None,  # a first example compiles its kernels
    suppress_health_check=list(HealthCheck),
    verbosity=Verbosity.quiet,  # failures are reported by verify itself
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    print_blob=False,
)


def _register_hypothesis_profiles() -> None:
    # Namespaced: hypothesis itself ships a "ci" profile, and users may have a "dev" one.
    for p in PROFILES.values():
        settings.register_profile(f"opsdk.{p.name}", max_examples=p.max_examples,
                                  **_HYPOTHESIS_BASE)




def default_profile() -> str:
    """``$OPSDK_VERIFY_PROFILE`` or ``$HYPOTHESIS_PROFILE`` if it names a verify profile,
    else ``dev``."""
    for var in ("OPSDK_VERIFY_PROFILE", "HYPOTHESIS_PROFILE"):
        if os.environ.get(var) in PROFILES:
            return os.environ[var]
    return "dev"


def database_path() -> Path:
    """Where failing examples are kept: ``hypothesis`` in opsdk's cache directory
    (``$OPSDK_CACHE``, else ``$XDG_CACHE_HOME/opsdk``, else ``~/.cache/opsdk``).

    Examples
    --------
    >>> from opsdk.verify import database_path
    >>> database_path().name
    'hypothesis'
    """

    return cache_dir() / "hypothesis"


def _database(database: Any) -> ExampleDatabase | None:
    if database is None:
        return None
    if database == "default":
        return DirectoryBasedExampleDatabase(str(database_path()))
    if isinstance(database, (str, os.PathLike)):
        return DirectoryBasedExampleDatabase(str(database))
    return database


@contextlib.contextmanager
def _temporary_hypothesis_home() -> Iterator[None]:
    """Hypothesis's storage in a temporary folder for the block (deleted after), unless
    ``$HYPOTHESIS_STORAGE_DIRECTORY`` chooses one."""

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    prev = getattr(configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="opsdk-hypothesis-") as tmp:
        configuration.set_hypothesis_home_dir(tmp)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(prev)


_register_hypothesis_profiles()
