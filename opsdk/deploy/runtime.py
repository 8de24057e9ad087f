"""Where TVM's runtime libraries and C++ headers are, for a deploy program and a device.

An artifact needs ``libtvm_runtime.so`` and ``libtvm_ffi.so`` built for the device's
architecture: the host's come with the ``apache-tvm`` wheel, the aarch64 ones with the
aarch64 wheel that ``opsdk setup arm`` unpacks (a board gets them from ``pip install
apache-tvm`` there, or a copy of these two files). The C++ API of a deploy program is
tvm-ffi's (``tvm/ffi/...`` headers, architecture independent).

    python -m opsdk.deploy.runtime --include            # -I for the C++ headers
    python -m opsdk.deploy.runtime --libdir --arch aarch64

Examples
--------
>>> from opsdk.deploy.runtime import runtime_paths
>>> sorted(runtime_paths("host"))
['include', 'libdirs', 'libs']
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

__all__ = ["RUNTIME_LIBS", "runtime_paths"]

#: The shared libraries a device needs beside the artifact.
RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_ffi.so")


def _dist(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed: pip install apache-tvm")
    return Path(spec.origin).parent


def runtime_paths(arch: str = "host") -> dict[str, list[Path]]:
    """``{"include": [...], "libdirs": [...], "libs": [...]}`` for a deploy program on
    ``arch`` (``host``, ``x86_64`` or ``aarch64``).

    Raises
    ------
    RuntimeError
        When the runtime for ``arch`` is not on this machine (aarch64: run ``opsdk setup
        arm``).
    """
    from ..runners.local import host_arch  # heavy: TVM

    ffi = _dist("tvm_ffi")
    include = [ffi / "include", ffi / "3rdparty" / "dlpack" / "include"]
    if arch in ("host", host_arch()):
        roots = [_dist("tvm") / "lib", ffi / "lib"]
    elif arch == "aarch64":
        from ..runners import arm_env, site_packages

        try:
            env = arm_env()
        except RuntimeError as e:
            raise RuntimeError(f"the aarch64 TVM runtime comes with the emulation set-up: {e}"
                               ) from None
        site = site_packages(env.sysroot)
        roots = [site / "tvm" / "lib", site / "tvm_ffi" / "lib"]
    else:
        raise RuntimeError(f"no TVM runtime known for {arch!r}; use host or aarch64")
    libs = [d / n for d, n in zip(roots, RUNTIME_LIBS)]
    for p in libs:
        if not p.is_file():
            raise RuntimeError(f"{p} is missing; reinstall apache-tvm"
                               + (" (opsdk setup arm --force)" if arch == "aarch64" else ""))
    return {"include": include, "libdirs": roots, "libs": libs}


def main(argv: list[str] | None = None) -> int:
    """``python -m opsdk.deploy.runtime``: print paths for a Makefile."""
    p = argparse.ArgumentParser(prog="python -m opsdk.deploy.runtime",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="host", help="host (default), x86_64 or aarch64")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--include", action="store_true", help="the header folders")
    what.add_argument("--libdir", action="store_true", help="the runtime library folders")
    a = p.parse_args(argv)
    try:
        paths = runtime_paths(a.arch)
    except RuntimeError as e:
        print(f"opsdk.deploy.runtime: error: {e}", file=sys.stderr)
        return 2
    print(" ".join(str(x) for x in paths["include" if a.include else "libdirs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
