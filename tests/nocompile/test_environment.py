"""The execution environment's faults get one clear message (and exit 2 from the CLI), never
a traceback: a damaged aarch64 cache in each way it breaks, and a bad OPSDK_QEMU."""

from __future__ import annotations

import json

import pytest

from opsdk.runners import _provision as prov
from opsdk.verify._cli import add_verify_arguments, run_verify_command


def _fake_env(root, what: str) -> None:
    root.mkdir(parents=True)
    stamp = json.dumps(prov._wanted())
    (root / "sysroot/usr/bin").mkdir(parents=True)
    files = {"stamp.json": stamp, "python3": "#!/bin/sh\n",
             f"sysroot/usr/bin/python{prov._PY}": "elf"}
    if what == "stamp garbage":
        files["stamp.json"] = "[1, 2]"
    elif what == "stamp unreadable":
        files["stamp.json"] = "{not json"
    elif what == "missing wrapper":
        del files["python3"]
    elif what == "truncated python":
        files[f"sysroot/usr/bin/python{prov._PY}"] = ""
    elif what == "missing python":
        del files[f"sysroot/usr/bin/python{prov._PY}"]
    for name, text in files.items():
        (root / name).write_text(text)


@pytest.mark.parametrize("what", ["stamp garbage", "stamp unreadable", "missing wrapper",
                                  "truncated python", "missing python"])
def test_a_damaged_arm_cache_says_how_to_rebuild_it(tmp_path, monkeypatch, capsys, what):
    monkeypatch.setenv("OPSDK_CACHE", str(tmp_path))
    monkeypatch.delenv("OPSDK_QEMU", raising=False)
    monkeypatch.setattr(prov, "find_qemu", lambda: "/usr/bin/qemu-aarch64-static")
    _fake_env(tmp_path / "arm", what)
    with pytest.raises(RuntimeError, match=r"missing, incomplete or damaged.*--force"):
        prov.arm_env()


def test_a_bad_qemu_override_is_named_before_anything_runs(tmp_path, monkeypatch, capsys):
    import argparse

    monkeypatch.setenv("OPSDK_QEMU", str(tmp_path / "no-qemu"))
    with pytest.raises(RuntimeError, match="is not an executable file; unset it"):
        prov.arm_env()
    p = argparse.ArgumentParser()
    add_verify_arguments(p)
    assert run_verify_command(p.parse_args(["gelu", "--target", "arm", "--quiet"])) == 2
    err = capsys.readouterr().err
    assert "opsdk verify: error: cannot start the arm runner: OPSDK_QEMU=" in err


def test_setup_without_apt_get_names_the_packages_not_root(monkeypatch):
    # As root on a system without apt-get, "run as root" was the wrong advice.
    monkeypatch.setattr(prov, "arm_tools_available", lambda: False)
    monkeypatch.setattr(prov, "find_qemu", lambda: None)
    monkeypatch.setattr(prov, "find_cross_cxx", lambda: None)
    monkeypatch.setattr(prov.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="has no apt-get") as e:
        prov._ensure_host_tools(lambda *_: None)
    assert "run as root" not in str(e.value) and "qemu-user-static" in str(e.value)
