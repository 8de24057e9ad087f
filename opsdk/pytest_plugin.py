"""pytest plugin: opsdk's generic op suite for the ops of any package.

One line of configuration gives a third-party op package the suite opsdk runs on its own
ops (like torch's OpInfo tests): every claimed dtype x layout cell verified against the
float64 reference on the host, the refusals of unclaimed inputs, and the schedule lints.

Enable the plugin (installed opsdk registers it as the ``opsdk`` pytest11 entry point;
otherwise add ``-p opsdk.pytest_plugin`` to ``addopts``, or ``pytest_plugins =
["opsdk.pytest_plugin"]`` to the root ``conftest.py``) and name the modules holding your ops::

    # pyproject.toml
    [tool.pytest.ini_options]
    opsdk_ops = ["mypkg.ops"]            # a module with OPS = [...], or "mypkg.ops:MY_OPS"

``pytest`` then collects, per op::

    opsdk::<op>[<dtype>-<layout>]        verify one cell (hypothesis, shrunk failures)
    opsdk::<op>[refusals]                unclaimed dtypes/ranks raise a clear ValueError
    opsdk::<op>[lints]                   the schedule's claims (vectorize, parallel) hold

Options (command line, or the ini keys in brackets): ``--opsdk-target`` [``opsdk_target``,
default ``host``], ``--opsdk-profile`` [``opsdk_profile``: dev, ci or thorough; default
``$HYPOTHESIS_PROFILE`` if it names one, else ci], ``--opsdk-seed``, ``--opsdk-examples``.
Items are marked ``opsdk`` and ``compile``; select with ``-m opsdk`` or ``-k <op>``. A
failure prints the shrunk example, the lowered TIR and the one-line reproducer.

Examples
--------
>>> import opsdk.pytest_plugin as plugin
>>> plugin.parse_op_spec("mypkg.ops:EXTRA")
('mypkg.ops', 'EXTRA')
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["OpsdkItem", "parse_op_spec"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opsdk", "opsdk generic op suite")
    group.addoption("--opsdk-target", default=None, help="target to verify on (default: host)")
    group.addoption("--opsdk-profile", default=None, choices=["dev", "ci", "thorough"],
                    help="verify profile (default: $HYPOTHESIS_PROFILE or ci)")
    group.addoption("--opsdk-seed", type=int, default=None, help="hypothesis seed")
    group.addoption("--opsdk-examples", type=int, default=None,
                    help="random examples per cell (profile default)")
    parser.addini("opsdk_ops", type="linelist", default=[],
                  help="modules (or module:ATTR) whose ops get the opsdk generic suite")
    parser.addini("opsdk_target", default="host", help="target for the opsdk suite")
    parser.addini("opsdk_profile", default="", help="verify profile for the opsdk suite")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "opsdk: opsdk generic op suite (opsdk.pytest_plugin)")
    config.addinivalue_line("markers", "compile: needs TVM compilation for the host")


def parse_op_spec(spec: str) -> tuple[str, str | None]:
    """``"pkg.mod"`` or ``"pkg.mod:ATTR"`` -> (module, attribute or None)."""
    mod, _, attr = spec.strip().partition(":")
    return mod, attr or None


def _load(specs: list[str]) -> list[Any]:
    import opsdk
    from opsdk._plugins import ops_of

    found = []
    for spec in specs:
        mod_name, attr = parse_op_spec(spec)
        if mod_name == "opsdk.ops" and attr is None:
            found += opsdk.load_plugins(["opsdk.ops"], entry_points=False)
            continue
        mod = importlib.import_module(mod_name)
        obj = getattr(mod, attr) if attr else mod
        found += [opsdk.register(d) for d in ops_of(obj, spec)]
    return found


def _option(config: pytest.Config, name: str) -> Any:
    value = config.getoption(f"--opsdk-{name}")
    if value is None and name in ("target", "profile"):
        value = config.getini(f"opsdk_{name}") or None
    return value


def _profile(config: pytest.Config) -> str:
    from opsdk.verify._engine import PROFILES

    value = _option(config, "profile")
    if value:
        return value
    env = os.environ.get("HYPOTHESIS_PROFILE", "")
    return env if env in PROFILES else "ci"


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection sees the item list
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    specs = config.getini("opsdk_ops")
    if not specs:
        return
    suite = OpsdkSuite.from_parent(session, name="opsdk")
    items.extend(suite.collect())


class OpsdkSuite(pytest.Collector):
    """The generic suite's items for every configured op."""

    def collect(self) -> Iterator[pytest.Item]:
        from opsdk.verify import capabilities
        from opsdk.verify._engine import _target_name

        config = self.config
        target = _target_name(_option(config, "target") or "host")
        for d in _load(config.getini("opsdk_ops")):
            for cell in capabilities(d, [target]):
                if cell["claimed"]:
                    yield OpsdkItem.from_parent(
                        self, name=f"{d.name}[{cell['dtype']}-{cell['layout']}]", op=d,
                        what="cell", dtype=cell["dtype"], layout=cell["layout"], target=target,
                    )
            yield OpsdkItem.from_parent(self, name=f"{d.name}[refusals]", op=d, what="refusals",
                                        target=target)
            yield OpsdkItem.from_parent(self, name=f"{d.name}[lints]", op=d, what="lints",
                                        target=target)


class OpsdkFailure(Exception):
    """An opsdk suite item failed; the message is the verify report."""


class OpsdkItem(pytest.Item):
    """One check of the generic suite: a cell, the refusals or the lints of an op."""

    def __init__(self, *, op: Any, what: str, target: str, dtype: str = "", layout: str = "",
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.op, self.what, self.target = op, what, target
        self.dtype, self.layout = dtype, layout
        self.add_marker("opsdk")
        self.add_marker("compile")

    def runtest(self) -> None:
        from opsdk.verify import check_refusals, lint_cell, verify_op

        if self.what == "refusals":
            bad = [r for r in check_refusals(self.op) if not r.ok]
            if bad:
                raise OpsdkFailure("\n".join(f"{r.what}: {r.detail}" for r in bad))
            return
        if self.what == "lints":
            failed = []
            for cell in self.op.dtypes:
                for layout in self.op.layouts:
                    failed += [x for x in lint_cell(self.op, self.target, cell, layout)
                               if x.status == "fail"]
            if failed:
                raise OpsdkFailure("\n".join(
                    f"{x.dtype}/{x.layout} {x.check} [{x.rule}]: {x.detail}" for x in failed))
            return
        report = verify_op(
            self.op,
            self.target,
            dtypes=[self.dtype],
            layouts=[self.layout],
            profile=_profile(self.config),
            seed=_option(self.config, "seed"),
            max_examples=_option(self.config, "examples"),
            lints=False,
            refusals=False,
        )
        if not report.ok:
            parts = [f.format() for f in report.failures]
            parts += [f"error: {c.error}" for c in report.cells if c.error]
            raise OpsdkFailure("\n\n".join(parts))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
                     ) -> str:
        if isinstance(excinfo.value, OpsdkFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        mod = importlib.import_module(self.op.module) if self.op.module else None
        path = getattr(mod, "__file__", None) or self.path
        return path, None, f"opsdk verify {self.op.name} {self.what} {self.dtype} {self.layout}"
