"""The execution environment's faults get one clear message (and exit 2 from the CLI), never
a traceback: a damaged aarch64 cache in each way it breaks, and a bad OPSDK_QEMU."""

from __future__ import annotations

import json
import os

import pytest

from opsdk.runners import _provision as prov
from opsdk.verify._cli import add_verify_arguments, run_verify_command


def _fake_env(root, what: str) -> None:
    root.mkdir(parents=True)
    stamp = json.dumps(prov._wanted())
    (root / "sysroot/usr/bin").mkdir(parents=True)
    site = f"sysroot/usr/local/lib/python{prov._PY}/dist-packages"
    runtime = f"{site}/tvm/lib/libtvm_runtime.so"
    files = {"stamp.json": stamp, "python3": "#!/bin/sh\n",
             f"sysroot/usr/bin/python{prov._PY}": "elf", runtime: "elf",
             f"{site}/tvm_ffi/lib/libtvm_ffi.so": "elf"}
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
    elif what == "missing runtime lib":
        del files[runtime]
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("what", ["intact", "stamp garbage", "stamp unreadable",
                                  "missing wrapper", "truncated python", "missing python",
                                  "missing runtime lib"])
def test_a_damaged_arm_cache_says_how_to_rebuild_it(tmp_path, monkeypatch, capsys, what):
    monkeypatch.setenv("OPSDK_CACHE", str(tmp_path))
    monkeypatch.delenv("OPSDK_QEMU", raising=False)
    monkeypatch.setattr(prov, "find_qemu", lambda: "/usr/bin/qemu-aarch64-static")
    _fake_env(tmp_path / "arm", what)
    if what == "intact":  # the control: every file a run needs is there
        assert prov.arm_env().root == tmp_path / "arm"
        return
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


def test_setup_without_apt_get_names_the_packages_not_root(monkeypatch, capsys):
    # As root on a system without apt-get, "run as root" was the wrong advice.
    monkeypatch.setattr(prov, "arm_tools_available", lambda: False)
    monkeypatch.setattr(prov, "find_qemu", lambda: None)
    monkeypatch.setattr(prov, "find_cross_cxx", lambda: None)
    monkeypatch.setattr(prov.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="has no apt-get") as e:
        prov._ensure_host_tools(lambda *_: None)
    assert "run as root" not in str(e.value) and "qemu-user-static" in str(e.value)
    from opsdk.cli import main

    assert main(["setup", "arm"]) == 2  # one line naming the packages, not a traceback
    err = capsys.readouterr().err
    assert err.startswith("opsdk setup: error: opsdk's arm support needs")
    assert "has no apt-get" in err


# Each way the guest server dies at start-up, and what the one-line message must say.
GUEST_START_FAULTS = [
    # the guest interpreter stands in for one whose TVM runtime cannot load
    ("damaged runtime", None,
     "echo 'Traceback (most recent call last):'\n"
     "echo 'RuntimeError: Cannot find library libtvm_runtime.so; searched:'\n"
     "echo '  /usr/local/lib'\nexit 1\n",
     ["exited with status 1 during start-up (RuntimeError: Cannot find library "
      "libtvm_runtime.so", "opsdk setup arm --force"]),
    # an executable OPSDK_QEMU that is no qemu passes arm_env(): name it, not only the cache
    ("OPSDK_QEMU not qemu", "/bin/false", 'exec "$OPSDK_QEMU" "$@"\n',
     ["exited with status 1 during start-up (no output); check that OPSDK_QEMU=/bin/false "
      "is qemu-aarch64(-static)", "opsdk setup arm --force"]),
]


@pytest.mark.parametrize(("fault", "qemu", "wrapper", "needles"), GUEST_START_FAULTS,
                         ids=[f[0] for f in GUEST_START_FAULTS])
def test_a_guest_server_that_dies_at_start_up_says_why_in_one_line(
        tmp_path, monkeypatch, fault, qemu, wrapper, needles):
    from opsdk.runners.emulated import _GuestServer

    if qemu:
        monkeypatch.setenv("OPSDK_QEMU", qemu)
    else:
        monkeypatch.delenv("OPSDK_QEMU", raising=False)
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\n" + wrapper)
    fake.chmod(0o755)
    env = prov.ArmEnv(root=tmp_path, sysroot=tmp_path, python=fake, qemu=qemu or "/bin/true")
    server = _GuestServer(env, None, "127.0.0.1", 0, "")
    try:
        with pytest.raises(RuntimeError) as e:
            server.start(30)
    finally:
        server.cleanup()
    msg = str(e.value)
    assert all(n in msg for n in needles), msg
    assert ("OPSDK_QEMU" in msg) == bool(qemu)
    assert "\n" not in msg and "{tail}" not in msg


def test_pool_defaults_unpin_the_workers_unless_the_environment_says(monkeypatch):
    # A pinned worker sharing its core with a busy process stalls every kernel
    # (docs/deployment.md): opsdk's runners leave TVM's workers unpinned, one per core.
    from opsdk.runners.local import pool_defaults

    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.delenv("TVM_BIND_THREADS", raising=False)
    assert pool_defaults(3) == 3
    assert (os.environ["TVM_NUM_THREADS"], os.environ["TVM_BIND_THREADS"]) == ("3", "0")
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    monkeypatch.setenv("TVM_BIND_THREADS", "1")
    assert pool_defaults(4) == 1  # the environment wins
    assert os.environ["TVM_BIND_THREADS"] == "1"
