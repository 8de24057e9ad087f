"""The house's rules, read from the source: no import circle among opsdk's modules (imports
inside functions count: they hide a circle, they do not remove it), and no module imports a
private name of another package.

A private name is a module or attribute whose name starts with ``_``. It belongs to the
package that defines it, subpackages included (``opsdk._vecmath`` is opsdk's, so
``opsdk.ops.gelu`` may use it); ``opsdk.model`` reaching into ``opsdk.frontend._cli``, or
``opsdk.deploy`` into ``opsdk.runners._base``, is a reach-in.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import opsdk

ROOT = Path(opsdk.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "templates" in path.relative_to(ROOT).parts:
            continue  # scaffolding sources, not modules of the package
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported opsdk module, imported name or None, line) for every import in ``module``."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or \
                _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        else:
            if node.level:
                base = _package(module).split(".")
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            targets = [(f"{src}.{a.name}", None) if f"{src}.{a.name}" in MODULES
                       else (src, a.name) for a in node.names]
        for target, name in targets:
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES:
                yield target, name, node.lineno


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    graph = {m: {t for t, _, _ in _imports(m) if t != m} for m in MODULES}
    assert _circles(graph) == []


def test_no_module_imports_a_private_name_of_another_package() -> None:
    bad = []
    for m in MODULES:
        mine = _package(m)
        for target, name, line in _imports(m):
            theirs = _package(target)
            if mine == theirs or mine.startswith(theirs + "."):
                continue  # its own package, or one it lives in
            inner = target.split(".")[len(theirs.split(".")):]
            private_module = any(p.startswith("_") for p in inner)
            private_name = name is not None and name.startswith("_") \
                and not name.startswith("__")
            if private_module or private_name:
                bad.append(f"{m}:{line} imports {target}" + (f".{name}" if name else ""))
    assert bad == []


def test_the_checks_see_a_circle_and_a_reach_in() -> None:
    # the two checks above pass on an empty answer: show they find what they look for
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert ("opsdk.runners._base", "host_arch") in \
        {(t, n) for t, n, _ in _imports("opsdk.runners.local")}
    assert _package("opsdk.runners._base") == "opsdk.runners"
    assert _package("opsdk.runners") == "opsdk.runners"
