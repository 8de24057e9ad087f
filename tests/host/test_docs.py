"""The Python examples in README.md and docs/authoring.md run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

import opsdk

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _blocks(name: str) -> list[str]:
    text = (ROOT / name).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/authoring.md"])
def test_doc_examples_run(doc):
    ns: dict = {"__name__": f"doc_{doc.replace('/', '_').replace('.', '_')}"}
    blocks = _blocks(doc)
    assert blocks
    registered = set()
    try:
        for code in blocks:
            exec(compile(code, doc, "exec"), ns)
            registered |= {d.name for d in opsdk.list_ops()}
        if "swish" in registered:
            assert opsdk.is_registered("swish")
            if doc == "docs/authoring.md":
                e = opsdk.explain("swish", "arm")
                assert e.rule == "arm_cpu.swish_neon", e.reasons
                assert e.asm_stats["neon"] > 0
    finally:
        opsdk.unregister("swish")
