"""One home per op (issue #32): an op file holds every fact of its op, and the import and
rewrite machinery (``opsdk.frontend``, ``opsdk.transform``) names no built-in op. Adding a
built-in op with a torch mapping and a fusion pattern touches its op file and the explicit op
list only."""

from __future__ import annotations

import ast
import pathlib

import pytest
from tvm import relax, te
from tvm.relax.dpl import is_op, wildcard

import opsdk
import opsdk.ops
from opsdk.frontend import _onnx, _torch
from opsdk.transform import _fuse, _replace

ROOT = pathlib.Path(opsdk.__file__).parent
MECHANISM = ("frontend", "transform")

#: Modules that still name a built-in op, with the reason; an entry that no longer applies
#: fails the test, so the list only shrinks.
KNOWN = {
    "transform/_layout.py": "sinks layout transposes around opsdk.group_norm's NHWC layout "
                            "(to move into group_norm's op file)",
}


def _builtin_names() -> list[str]:
    return [d.name for d in opsdk.ops.BUILTIN_OPS]


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (prose and doctests may name ops as examples)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _names_op(identifier: str, op: str) -> bool:
    """Whether an identifier spells the op's name as whole ``_``-separated words
    (``_layer_norm``, ``LAYER_NORM_RULES``; not ``dequantize`` for ``quantize``)."""
    words, want = identifier.lower().strip("_").split("_"), op.split("_")
    return any(words[i:i + len(want)] == want for i in range(len(words) - len(want) + 1))


def _hits(path: pathlib.Path, ops: list[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        idents: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            s = node.value
            for op in ops:
                if s in (op, f"opsdk.{op}", f"fuse.{op}", f"replace.{op}", f"relax.nn.{op}"):
                    out.append(f"{path.name}:{node.lineno}: string {s!r}")
            continue
        if isinstance(node, ast.Name):
            idents = [node.id]
        elif isinstance(node, ast.Attribute):
            idents = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            idents = [node.name]
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
            idents = [node.arg]
        elif isinstance(node, ast.alias):
            idents = [node.asname or node.name.rsplit(".", 1)[-1]]
        for ident in idents:
            for op in ops:
                if _names_op(ident, op):
                    out.append(f"{path.name}:{getattr(node, 'lineno', '?')}: identifier {ident}")
    return out


def test_the_word_check_finds_whole_words_only():
    assert _names_op("_layer_norm_rules", "layer_norm") and _names_op("_GELU_OPS", "gelu")
    assert not _names_op("dequantize", "quantize") and not _names_op("layer", "layer_norm")


@pytest.mark.parametrize("package", MECHANISM)
def test_frontend_and_transform_name_no_builtin_op(package):
    ops = _builtin_names()
    bad = {}
    for path in sorted((ROOT / package).glob("*.py")):
        rel = f"{package}/{path.name}"
        hits = _hits(path, ops)
        if rel in KNOWN:
            assert hits, f"{rel} names no built-in op any more: drop it from KNOWN"
            continue
        if hits:
            bad[rel] = hits
    assert not bad, ("the mechanism names built-in ops; their facts belong in the op files "
                     f"(OpDef.torch / onnx / fusion / replaces): {bad}")


def test_builtin_facts_come_from_the_op_files():
    # The public tables are the op files' declarations, in the op list's order.
    ops = opsdk.ops.BUILTIN_OPS
    assert {d.name: tuple(d.torch_maps) for d in ops if d.torch_maps} == _torch.TORCH_OPS
    assert opsdk.frontend.TORCH_OPS == _torch.TORCH_OPS
    assert list(_fuse.FUSION_RULES) == ["conv_bn", "conv_branches",
                                        *(n.removeprefix("fuse.") for d in ops
                                          for n, _ in d.fusions)]
    assert list(_replace.REPLACEABLE_OPS) == [t.removeprefix("relax.nn.") for d in ops
                                              for t, _, _ in d.replacements]
    assert {v["opsdk"] for v in _onnx.ONNX_OPS.values()} <= {d.name for d in ops}


def _throwaway_op():
    """A new elementwise op as a built-in would be written: its file's facts only."""

    @opsdk.op(reference=lambda x: x * x, domain={"x": (-2.0, 2.0)})
    def square_homes(x: opsdk.Tensor) -> te.Tensor:
        return te.compute(x.shape, lambda *i: x(*i) * x(*i), name="square_homes")

    def convert(node, imp):
        a, b = node.args
        if a is not b:
            return imp.block_builder.emit(relax.op.multiply(imp.env[a], imp.env[b]))
        return imp.block_builder.emit(square_homes(imp.env[a]))

    square_homes.torch("mul.Tensor", convert=convert)

    @square_homes.fusion()
    def _squared():
        x = wildcard()
        return is_op("relax.multiply")(x, x), lambda call, m: square_homes(m[x])

    return square_homes


@pytest.fixture
def builtin_throwaway(monkeypatch):
    d = _throwaway_op()
    # "adding it to the explicit op list": the one other place a new built-in touches
    monkeypatch.setattr(opsdk.ops, "BUILTIN_OPS", (*opsdk.ops.BUILTIN_OPS, d))
    opsdk.register(d, replace=True)
    try:
        yield d
    finally:
        opsdk.unregister(d)


def test_a_new_builtin_op_reaches_the_importer_and_the_fusion_pass(builtin_throwaway):
    torch = pytest.importorskip("torch")
    d = builtin_throwaway
    assert _torch.TORCH_OPS[d.name] == ("mul.Tensor",)
    assert list(opsdk.frontend.torch_convert_map([d.name])) == ["mul.Tensor"]
    assert _fuse.FUSION_RULES[-1] == d.name
    assert list(_fuse.op_fusion_rules())[-1] == f"fuse.{d.name}"  # after the other built-ins

    # from_torch converts through it as it does the other built-ins (selected by ops=, not
    # counted among the user mappings)
    class Square(torch.nn.Module):
        def forward(self, x):
            return x * x

    ep = torch.export.export(Square().eval(), (torch.randn(2, 8),))
    mod = opsdk.frontend.from_torch(ep, ops=[d.name], decompose=False)
    assert opsdk.transform.op_counts(mod, "opsdk.") == {f"opsdk.{d.name}": 1}
    assert opsdk.frontend.mapping_counts(mod) == {}
    plain = opsdk.frontend.from_torch(ep, ops=(), decompose=False)
    assert opsdk.transform.op_counts(plain, "opsdk.") == {}

    # FuseIntoOps runs its rule by the short name, as for the built-ins
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.multiply(x, x))
        bb.emit_func_output(y)
    fused = opsdk.transform.FuseIntoOps([d.name])(bb.get())
    assert opsdk.transform.op_counts(fused, "opsdk.") == {f"opsdk.{d.name}": 1}
    assert [s.rule for s in opsdk.transform.rewrite_sites(fused)] == [f"fuse.{d.name}"]


def test_ops_import_no_mechanism():
    # Ops sit below the importers, the passes and the verifier: not even a function-level
    # import of them from an op file.
    for path in sorted((ROOT / "ops").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert not any(mod.lstrip(".").startswith(p) or mod.startswith(f"opsdk.{p}")
                               for p in ("transform", "frontend", "verify")), (path.name, mod)
