"""`opsdk new-op` safety: bad names and existing files change nothing on disk."""

from __future__ import annotations

import os
import pathlib

import pytest

from opsdk import list_ops
from opsdk._scaffold import ScaffoldError, new_op
from opsdk.cli import main


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("1abc", "not a valid Python identifier"),
        ("my-op", "not a valid Python identifier"),
        ("class", "Python keyword"),
        ("match", "Python keyword"),
        ("a/b", "path separators"),
        ("../evil", "path separators"),
        ("pkg.op", "path separators or dots"),
        ("", "plain Python identifier"),
        ("layer_norm", "already exists"),
        ("numpy", "would shadow"),
        ("json", "would shadow"),
        ("_hidden", "starts with '_'"),
    ],
)
def test_bad_names_are_refused_and_nothing_is_written(tmp_path, name, needle):
    (tmp_path / "keep.txt").write_text("mine")
    before = _snapshot(tmp_path)
    with pytest.raises(ScaffoldError, match=needle):
        new_op(name, directory=tmp_path)
    assert _snapshot(tmp_path) == before


def test_bad_kind_target_dir_and_from(tmp_path):
    with pytest.raises(ScaffoldError, match="--kind 'conv'"):
        new_op("ok_name", kind="conv", directory=tmp_path)
    with pytest.raises(ScaffoldError, match="--targets cuda"):
        new_op("ok_name", targets=["cuda"], directory=tmp_path)
    with pytest.raises(ScaffoldError, match="no such directory"):
        new_op("ok_name", directory=tmp_path / "missing")
    (tmp_path / "afile").write_text("")
    with pytest.raises(ScaffoldError, match="is a file, not a directory"):
        new_op("ok_name", directory=tmp_path / "afile")
    (tmp_path / "afile").unlink()
    with pytest.raises(ScaffoldError, match="--from nope"):
        new_op("ok_name", from_op="nope", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_existing_file_is_not_overwritten_without_force(tmp_path):
    mine = tmp_path / "swish2.py"
    mine.write_text("# my own work\n")
    before = _snapshot(tmp_path)
    with pytest.raises(ScaffoldError, match=r"refusing to overwrite.*--force.*swish2\.py"):
        new_op("swish2", directory=tmp_path)
    assert _snapshot(tmp_path) == before  # neither replaced nor the other two files written


def test_force_replaces_and_lists(tmp_path):
    mine = tmp_path / "swish3.py"
    mine.write_text("# my own work\n")
    r = new_op("swish3", directory=tmp_path, force=True)
    assert r.replaced == [mine.resolve()]
    assert "opsdk.op(" in mine.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "swish3.py",
        "swish3_schedules.py",
        "test_swish3.py",
    ]


def test_files_get_the_usual_mode_and_replaced_files_keep_theirs(tmp_path):
    old = os.umask(0o022)
    try:
        r = new_op("moded", directory=tmp_path)
        assert {oct(p.stat().st_mode & 0o777) for p in r.files} == {"0o644"}
        mine = tmp_path / "moded.py"
        mine.chmod(0o664)
        new_op("moded", directory=tmp_path, force=True)
        assert oct(mine.stat().st_mode & 0o777) == "0o664"
    finally:
        os.umask(old)


def test_failure_half_way_leaves_nothing(tmp_path, monkeypatch):
    mine = tmp_path / "half_schedules.py"
    mine.write_text("# mine\n")
    calls = {"n": 0}
    real = os.replace

    def flaky(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    before = _snapshot(tmp_path)
    with pytest.raises(ScaffoldError, match=r"disk full.*nothing was changed"):
        new_op("half", directory=tmp_path, force=True)
    assert _snapshot(tmp_path) == before  # restored, no temp files left


def test_cli_reports_usage_errors_with_exit_2(tmp_path, capsys):
    assert main(["new-op", "class", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "opsdk new-op: error:" in err and "keyword" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_files_and_prints_next_steps(tmp_path, capsys):
    assert (
        main(["new-op", "gated", "--kind", "binary", "--dir", str(tmp_path), "--targets", "x86"])
        == 0
    )
    out = capsys.readouterr().out
    assert "wrote" in out and "opsdk verify gated --module gated --target x86" in out
    assert 'opsdk.rule("gated", "cpu"' in (tmp_path / "gated_schedules.py").read_text()
    assert "arm_cpu" not in (tmp_path / "gated_schedules.py").read_text()


@pytest.mark.parametrize("op", [d.name for d in list_ops()])
def test_from_builtin_copy_has_no_relative_imports(tmp_path, op):
    # e.g. the INT8 ops import log_uniform from opsdk._domains: the copy imports it from opsdk
    # (gelu's copy once kept ``from .._vecmath import``, and failed on import)
    import re

    new_op(f"copy_{op}", from_op=op, directory=tmp_path)
    src = (tmp_path / f"copy_{op}.py").read_text()
    assert not re.findall(r"^\s*from \.", src, flags=re.M)
    compile(src, f"copy_{op}.py", "exec")


@pytest.mark.parametrize(("name", "message"), [
    ("te", "would shadow 'te', which the generated te.py uses"),
    ("np", "would shadow 'np'"),
    ("acc", "would shadow 'acc'"),
    ("a" * 250, "is 250 characters; keep it to 64 or fewer"),
])
def test_names_the_op_file_cannot_have_are_refused(tmp_path, name, message):
    with pytest.raises(ScaffoldError, match=message):
        new_op(name, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_folder_problems_are_refused_before_writing(tmp_path):
    (tmp_path / "zz.py").mkdir()
    with pytest.raises(ScaffoldError, match=r"zz\.py is a directory"):
        new_op("zz", directory=tmp_path, force=True)
    with pytest.raises(ScaffoldError, match="cannot create files there"):
        new_op("ok_name", directory="/proc")


def test_force_replaces_an_earlier_scaffold_found_on_the_path(tmp_path, monkeypatch):
    # ./swash.py is importable from the current directory: it is the user's own earlier
    # scaffold, refused as an existing file without --force, replaced with it.
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    new_op("swash", directory=tmp_path)
    with pytest.raises(ScaffoldError, match="refusing to overwrite existing files"):
        new_op("swash", directory=tmp_path)
    assert new_op("swash", directory=tmp_path, force=True).replaced


@pytest.mark.parametrize("after", [1, 2, 3])
def test_ctrl_c_right_after_a_rename_restores_everything(tmp_path, monkeypatch, after):
    # The interrupt lands just after a rename returned (before the writer could note it):
    # with --force the user's originals come back, the new files go, no temp file stays.
    (tmp_path / "intr.py").write_text("# my own op\n")
    (tmp_path / "test_intr.py").write_text("# my own test\n")
    before = _snapshot(tmp_path)
    calls = {"n": 0}
    real = os.replace

    def interrupted(src, dst):
        real(src, dst)
        calls["n"] += 1
        if calls["n"] == after:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        new_op("intr", directory=tmp_path, force=True)
    assert _snapshot(tmp_path) == before


def test_ctrl_c_during_the_renames_is_held_until_they_finish(tmp_path, monkeypatch):
    # A real SIGINT in the middle of the renames: the scaffold is written whole, then the
    # interrupt is delivered (KeyboardInterrupt), and nothing is left half-done.
    import signal

    real = os.replace
    sent = {"done": False}

    def replace_and_signal(src, dst):
        real(src, dst)
        if not sent["done"]:
            sent["done"] = True
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_and_signal)
    with pytest.raises(KeyboardInterrupt):
        new_op("held", directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "held.py", "held_schedules.py", "test_held.py"]
