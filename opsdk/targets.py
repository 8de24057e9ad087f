"""Friendly target names and target feature queries.

TVM 0.27 accepts only dict targets, rejects ``mcpu: native`` (LLVM 22) and exposes x86
features through LLVM rather than ``target.features``; this module hides all three.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass, field
from typing import Any

from tvm.target import Target, codegen

__all__ = [
    "LINK_OPTIONS",
    "TARGETS",
    "TargetSpec",
    "target",
    "target_arch",
    "target_features",
    "target_spec",
    "vector_bits",
    "vector_registers",
]

#: Linker options of every model library opsdk writes (any target; gcc or a cross gcc).
#: TVM's LLVM code generator emits DWARF that nothing at run time reads: MobileNetV2's
#: library was 1.13 MB with it, 0.81 MB without (YOLOv8n 1.72 MB for 12.6 MB of weights).
#: The symbol tables stay (profilers and backtraces name the kernels).
LINK_OPTIONS: tuple[str, ...] = ("-Wl,--strip-debug",)


@dataclass(frozen=True)
class TargetSpec:
    """A named target: the TVM Target dict, where it runs and what emulates it."""

    name: str
    description: str
    config: dict[str, Any]
    arch: str
    qemu_cpu: str | None = None
    aliases: tuple[str, ...] = field(default=())


def _host_config() -> dict[str, Any]:
    return {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": os.cpu_count() or 1}


def _host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


_ARM = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}

TARGETS: dict[str, TargetSpec] = {
    s.name: s
    for s in (
        TargetSpec("x86", "host CPU through LLVM with the detected -mcpu", {}, "x86_64"),
        TargetSpec(
            "arm",
            "aarch64 with NEON (Cortex-A72 class)",
            {**_ARM, "mcpu": "cortex-a72", "mattr": ["+neon"]},
            "aarch64",
            qemu_cpu="cortex-a72",
        ),
        TargetSpec(
            "arm-dotprod",
            "aarch64 with NEON and the dot-product extension (Cortex-A76 class)",
            {**_ARM, "mcpu": "cortex-a76", "mattr": ["+neon", "+dotprod"]},
            "aarch64",
            qemu_cpu="cortex-a76",
        ),
        TargetSpec(
            "arm-sve",
            "aarch64 with SVE (A64FX class, 512-bit vectors)",
            {**_ARM, "mcpu": "a64fx", "mattr": ["+neon", "+sve"]},
            "aarch64",
            qemu_cpu="a64fx",
        ),
        TargetSpec("c", "portable C source (scalar schedules only)", {"kind": "c"}, _host_arch()),
        TargetSpec("cuda", "NVIDIA GPU (sm_90)", {"kind": "cuda", "arch": "sm_90"}, "cuda"),
    )
}


def target_spec(name: str) -> TargetSpec:
    """The :class:`TargetSpec` for a friendly name; ``x86`` resolves the host CPU.

    Examples
    --------
    >>> from opsdk.targets import target_spec
    >>> target_spec("arm").qemu_cpu
    'cortex-a72'
    """
    if name in ("host", "native"):
        name = "x86" if _host_arch() == "x86_64" else "arm"
    try:
        spec = TARGETS[name]
    except KeyError:
        raise ValueError(
            f"unknown target {name!r}; use one of {', '.join(TARGETS)} or a TVM target dict"
        ) from None
    if name == "x86":
        spec = TargetSpec(spec.name, spec.description, _host_config(), "x86_64")
    return spec


def target(name: str | dict | Target) -> Target:
    """Resolve a friendly name (``x86``, ``arm``, ``arm-dotprod``, ``arm-sve``, ``c``, ``cuda``),
    a TVM target dict or a Target into a :class:`tvm.target.Target`.

    Examples
    --------
    >>> import opsdk
    >>> tuple(opsdk.target("arm").keys)
    ('arm_cpu', 'cpu')
    """
    if isinstance(name, Target):
        return _checked(name)
    if isinstance(name, dict):
        if name.get("kind") == "llvm":  # before TVM: it only logs an unknown mcpu
            _check_llvm(str(name.get("mtriple", "") or ""), str(name.get("mcpu", "") or ""))
        try:
            t = Target(name)
        except Exception as e:  # TVM's own message, with the input named
            raise ValueError(f"target {name!r} is not a valid TVM target: "
                             f"{str(e).strip().splitlines()[-1]}") from None
        return _checked(t)
    return Target(target_spec(name).config)


def _checked(t: Target) -> Target:
    """Refuse an LLVM target whose triple or CPU this LLVM does not know, before anything
    asks LLVM about it (querying features of an unknown triple crashes the process)."""
    if t.kind.name == "llvm":
        _check_llvm(str(t.attrs.get("mtriple", "") or ""), str(t.attrs.get("mcpu", "") or ""))
    return t


@functools.lru_cache(maxsize=1)
def _llvm_targets() -> frozenset[str]:
    """The architectures this LLVM has back ends for (asked once: rule choice checks them)."""
    return frozenset(str(a) for a in codegen.llvm_get_targets())


def _check_llvm(triple: str, cpu: str) -> None:
    if triple:
        arch = triple.split("-")[0]
        known = _llvm_targets()
        aliases = {"arm64": "aarch64", "amd64": "x86_64"}
        if aliases.get(arch, arch) not in known:
            raise ValueError(
                f"target mtriple {triple!r}: LLVM here has no {arch!r} back end; use a triple "
                f"such as x86_64-linux-gnu or aarch64-linux-gnu (known architectures: "
                f"{', '.join(sorted(known))})")
    full = triple or str(codegen.llvm_get_system_triple())
    if cpu and cpu != "native" and not codegen.llvm_is_valid_cpu(cpu, full):
        raise ValueError(f"target mcpu {cpu!r} is not a CPU LLVM knows for {full}; name one "
                         "(e.g. cortex-a76, neoverse-n1, x86-64-v4) or drop mcpu")


def target_arch(t: Target) -> str:
    """Machine architecture a target generates code for (``x86_64``, ``aarch64``, ...)."""
    if t.kind.name == "llvm":
        triple = str(t.attrs.get("mtriple", "") or codegen.llvm_get_system_triple())
        arch = triple.split("-")[0]
        return {"arm64": "aarch64", "amd64": "x86_64"}.get(arch, arch)
    if t.kind.name == "c":
        return _host_arch()
    return t.kind.name


def target_features(t: Target) -> frozenset[str]:
    """Feature names of a target: ``arch:<arch>``, ``kind:<kind>`` plus LLVM CPU features
    (``avx512f``, ``neon``, ``dotprod``, ``sve``, ...); for non-LLVM targets no more.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.targets import target_features
    >>> "dotprod" in target_features(opsdk.target("arm-dotprod"))
    True
    """
    key = str(t)
    feats = _FEATURES.get(key)
    if feats is None:
        feats = _FEATURES[key] = _query_features(t)
    return feats


#: target_features by the target's text: the rules ask for every kernel of a model, and
#: LLVM's feature query takes about 0.3 ms.
_FEATURES: dict[str, frozenset[str]] = {}


def _query_features(t: Target) -> frozenset[str]:
    if t.kind.name == "llvm":  # plain tvm.compile lands here (rule choice) unchecked: an
        # unknown triple made llvm_get_cpu_features segfault (an unknown mcpu TVM only logs)
        _check_llvm(str(t.attrs.get("mtriple", "") or ""), "")
    feats = {f"arch:{target_arch(t)}", f"kind:{t.kind.name}"}
    if t.kind.name == "llvm":
        with contextlib.suppress(Exception):  # an LLVM without the target's backend
            feats |= {str(f) for f in codegen.llvm_get_cpu_features(t)}
        for m in t.attrs.get("mattr", []) or []:
            m = str(m)
            if m.startswith("+"):
                feats.add(m[1:])
            elif m.startswith("-"):
                feats.discard(m[1:])
    return frozenset(feats)


def vector_bits(t: Target) -> int:
    """Width in bits of one SIMD register of ``t``, from its CPU features (128 at least).

    TVM 0.27's ``llvm_get_vector_width`` answers 512 for every x86 CPU, AVX2-only ones
    (Zen 3, Haswell) included, so x86 is read from the features: 512 with ``avx512f``, 256
    with ``avx``, else 128. Other LLVM targets keep LLVM's answer (aarch64: 128).

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.targets import vector_bits
    >>> vector_bits(opsdk.target({"kind": "llvm", "mcpu": "haswell"}))
    256
    >>> vector_bits(opsdk.target("arm"))
    128
    """
    if t.kind.name != "llvm":
        return 128
    feats = target_features(t)
    if "arch:x86_64" in feats:
        return 512 if "avx512f" in feats else 256 if "avx" in feats else 128
    try:
        width = int(codegen.llvm_get_vector_width(t))
    except Exception:  # an LLVM without the target's backend
        width = 128
    return max(width, 128)


def vector_registers(t: Target) -> int:
    """Architectural SIMD registers of ``t``: 32 on AVX-512 and on aarch64 (NEON, SVE),
    16 on other x86 CPUs (AVX2's ymm0-15) and on unknown targets.

    Register-blocked rules size their accumulator tiles from this: a tile planned for 32
    registers spills on 16.

    Examples
    --------
    >>> import opsdk
    >>> from opsdk.targets import vector_registers
    >>> vector_registers(opsdk.target({"kind": "llvm", "mcpu": "haswell"}))
    16
    >>> vector_registers(opsdk.target("arm"))
    32
    """
    if t.kind.name != "llvm":
        return 16
    feats = target_features(t)
    if "arch:aarch64" in feats or "avx512f" in feats:
        return 32
    return 16
