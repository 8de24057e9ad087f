"""Shared pytest configuration: tests are grouped by directory into what they need.

- ``nocompile/``: schema, type inference, registration; no code generation.
- ``host/``: compile with LLVM (x86 and aarch64 cross-compilation) and run on the host.
- ``arm/``: execute aarch64 code (cross compiler + qemu-user, prepared by ``opsdk setup arm``).
"""

from __future__ import annotations

import pathlib

import pytest

_GROUPS = {"host": "compile", "arm": "arm", "gpu": "gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for folder, marker in _GROUPS.items():
            if folder in parts:
                item.add_marker(getattr(pytest.mark, marker))
