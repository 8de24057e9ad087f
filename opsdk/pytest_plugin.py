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

The suite belongs to the op module's file: ``pytest`` collects it when that file is among
the paths it collects (the package's directory, or the file itself), and never adds items
to a run of other paths. Per op::
    mypkg/ops.py::<op>[<dtype>-<layout>]   verify one cell (hypothesis, shrunk failures)
    mypkg/ops.py::<op>[refusals]           unclaimed dtypes/ranks raise a clear ValueError
    mypkg/ops.py::<op>[lints]              the schedule's claims (vectorize, parallel) hold

Those node ids re-run one check (``pytest "mypkg/ops.py::my_op[float32-default]"``). The
modules are found from the rootdir without a ``pythonpath`` setting. Options (command line,
or the ini keys in brackets): ``--opsdk-target`` [``opsdk_target``, default ``host``],
``--opsdk-profile`` [``opsdk_profile``: dev, ci or thorough; default ``$HYPOTHESIS_PROFILE``
if it names one, else ci], ``--opsdk-seed``, ``--opsdk-examples``. Items are marked ``opsdk``
and ``compile``; select with ``-m opsdk`` or ``-k <op>``. A failure prints the shrunk
example, the lowered TIR and the one-line reproducer. The test file ``opsdk new-op`` writes
skips itself for an op the plugin covers, so nothing is verified twice.

Examples
--------
>>> import opsdk.pytest_plugin as plugin
>>> plugin.parse_op_spec("mypkg.ops:EXTRA")
('mypkg.ops', 'EXTRA')
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import opsdk

__all__ = ["OpsdkFile", "OpsdkItem", "covers", "parse_op_spec"]

_TARGETS_HELP = "x86, arm, arm-dotprod, arm-sve or host"
# Per-run state on the config: op module file -> its specs, and the modules collected.
_FILES = pytest.StashKey[dict]()
_COLLECTED = pytest.StashKey[set]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opsdk", "opsdk generic op suite")
    group.addoption("--opsdk-target", default=None,
                    help=f"target to verify on: {_TARGETS_HELP} (default: host)")
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
    chosen = config.getoption("--opsdk-target")
    if chosen is not None or config.getini("opsdk_ops"):
        # A bad target is a usage error now, not a traceback per item later.
        from opsdk.targets import target_spec

        name = chosen or config.getini("opsdk_target") or "host"
        try:
            target_spec(name)
        except ValueError as e:
            where = "--opsdk-target" if chosen else "opsdk_target (ini)"
            raise pytest.UsageError(f"{where} {name!r}: {e}") from None
    if config.getini("opsdk_ops"):
        _spec_files(config)  # an unknown module is a usage error, before collection


def parse_op_spec(spec: str) -> tuple[str, str | None]:
    """``"pkg.mod"`` or ``"pkg.mod:ATTR"`` -> (module, attribute or None)."""
    mod, _, attr = spec.strip().partition(":")
    return mod, attr or None


def _importable(config: pytest.Config) -> None:
    """Op modules resolve from the rootdir (and the ini file's folder), as ``python -m`` would
    from there, so a package needs no ``pythonpath`` setting."""
    for folder in (config.rootpath, getattr(config, "inipath", None)):
        if folder is None:
            continue
        p = str(folder if folder.is_dir() else folder.parent)
        if p not in sys.path:
            sys.path.insert(0, p)


def _spec_files(config: pytest.Config) -> dict[pathlib.Path, list[str]]:
    """Source file of each configured op module -> its specs (cached on the config)."""
    if _FILES in config.stash:
        return config.stash[_FILES]
    _importable(config)
    files: dict[pathlib.Path, list[str]] = {}
    for spec in config.getini("opsdk_ops"):
        mod, _ = parse_op_spec(spec)
        try:
            found = importlib.util.find_spec(mod)
        except (ImportError, ValueError) as e:
            raise pytest.UsageError(
                f"opsdk_ops: cannot find module {mod!r} ({e}); name an importable module "
                f"from the rootdir {config.rootpath}") from None
        if found is None or not found.origin or not os.path.isfile(found.origin):
            raise pytest.UsageError(
                f"opsdk_ops: no module {mod!r} under the rootdir {config.rootpath} or on "
                f"sys.path; name the module holding OPS = [...] (e.g. mypkg.ops)")
        files.setdefault(pathlib.Path(found.origin).resolve(), []).append(spec)
    config.stash[_FILES] = files
    return files


def covers(config: pytest.Config, module: str) -> bool:
    """Whether this run's collected items include the plugin's suite for the ops of
    ``module`` (the test ``opsdk new-op`` writes then skips itself instead of verifying
    them a second time)."""
    return module in config.stash.get(_COLLECTED, set())


def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector) -> pytest.File | None:
    if not parent.config.getini("opsdk_ops"):
        return None
    specs = _spec_files(parent.config).get(file_path.resolve())
    if not specs:
        return None
    collected = parent.config.stash.setdefault(_COLLECTED, set())
    collected.update(parse_op_spec(s)[0] for s in specs)
    return OpsdkFile.from_parent(parent, path=file_path, specs=specs)


def _load(specs: list[str]) -> list[Any]:
    from opsdk._plugins import ops_of  # heavy: TVM

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
    from opsdk.verify import PROFILES  # heavy: hypothesis, TVM

    value = _option(config, "profile")
    if value:
        return value
    env = os.environ.get("HYPOTHESIS_PROFILE", "")
    return env if env in PROFILES else "ci"


class OpsdkFile(pytest.File):
    """An op module's file: the generic suite's items for the ops it provides."""

    def __init__(self, *, specs: list[str], **kw: Any) -> None:
        super().__init__(**kw)
        self.specs = specs

    def collect(self) -> Iterator[pytest.Item]:
        from opsdk.targets import target_spec  # heavy: TVM
        from opsdk.verify import capabilities  # heavy: hypothesis, TVM

        config = self.config
        target = target_spec(_option(config, "target") or "host").name
        for d in _load(self.specs):
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
        from opsdk.verify import check_refusals, lint_cell, verify_op  # heavy: hypothesis, TVM

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
        where = f"{self.dtype}-{self.layout}" if self.what == "cell" else self.what
        return self.path, None, f"opsdk verify {self.op.name} [{where}]"
