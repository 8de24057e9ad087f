"""Argument types shared by the subcommands: a bad value is a usage error (exit 2) that
names the flag, what was wrong and the fix, before any work starts; an output path is
checked up front, so a long run never ends in a lost result."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from ._files import check_can_create

__all__ = ["NEGATIVE_NUMBER", "UsageError", "add_farm_arguments", "board_count",
           "distinct_outputs", "host_port", "model_file",
           "model_path_problem", "named_shapes", "nonneg_float", "nonneg_int", "output_path",
           "parse_dims", "parse_entry_args", "parse_name_values", "percent", "positive_float",
           "positive_int", "split_host_port"]


class UsageError(Exception):
    """Bad command-line input: reported on stderr with exit code 2 (``opsdk.cli`` catches
    it; a command's module raises it without importing the CLI)."""


def positive_int(text: str) -> int:
    """An integer >= 1 (``--repeats``, ``--threads``).

    Examples
    --------
    >>> positive_int("3")
    3
    """
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return v


def board_count(text: str) -> int | str:
    """``--boards``: a positive number or ``all`` (every free board of the key).

    Examples
    --------
    >>> board_count("4"), board_count("all")
    (4, 'all')
    """
    if text.strip().lower() == "all":
        return "all"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of boards >= 1 or 'all', got "
                                         f"{text!r}")
    return n


def add_farm_arguments(parser: argparse.ArgumentParser, unit: str) -> None:
    """``--boards`` and ``--cell-timeout``, the flags of a run spread over a tracker's boards
    (``opsdk verify``, ``bench``, ``run``); ``unit`` names what is spread (``"cell"``).

    Examples
    --------
    >>> p = argparse.ArgumentParser()
    >>> add_farm_arguments(p, "cell")
    >>> p.parse_args(["--boards", "all"]).cell_timeout
    900.0
    """
    parser.add_argument("--boards", type=board_count, metavar="N|all",
                        help=f"with --tracker and --key: spread the {unit}s over N (or all) "
                        f"free boards of the key, one worker each; a board that dies or hangs "
                        f"has its {unit} requeued on another and is named in the report "
                        "(docs/farm.md)")
    parser.add_argument("--cell-timeout", type=positive_float, default=900.0, metavar="SECONDS",
                        help=f"with --boards: any {unit} with no result after this long has its "
                        "board counted as hung and is requeued (default 900)")


def nonneg_int(text: str) -> int:
    """An integer >= 0 (``--examples``)."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (``--budget-ms``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (``drift --max-rel``: NaN compared false and passed every site)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (0 <= v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def parse_dims(text: str) -> tuple[int, ...]:
    """A shape as the commands write it, ``4096x768`` or ``4096,768``: positive whole dims,
    no empty part, and an element count TVM's int64 indices can hold (a bigger one failed
    deep inside TVM or numpy).

    Examples
    --------
    >>> parse_dims("4096x768")
    (4096, 768)
    """
    parts = text.lower().replace("x", ",").split(",")
    # ASCII digits only: str.isdigit() took '²' (int() then raised) and '٣'.
    if not all(re.fullmatch(r"[0-9]+", p.strip()) for p in parts) or any(
            int(p) < 1 for p in parts):
        raise ValueError(f"{text!r}: write positive dims like 4096x768")
    dims = tuple(int(p) for p in parts)
    n = 1
    for d in dims:
        n *= d
    if n >= 2**63:
        raise ValueError(f"{text!r} has {n} elements, more than an int64 index can count")
    return dims


def named_shapes(items: Sequence[str] | None, flag: str = "--shape") -> dict[str, list[int]]:
    """``["NAME=D0xD1", ...]`` (``,`` separates dims too) as ``{name: dims}``: each dim as
    :func:`parse_dims` takes it, each name once (a second ``--shape x=...`` silently replaced
    the first).

    Examples
    --------
    >>> named_shapes(["x=1x3x224x224", "mask=1,77"])
    {'x': [1, 3, 224, 224], 'mask': [1, 77]}
    """
    out: dict[str, list[int]] = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{flag} {item!r}: expected NAME=D0xD1...")
        if name in out:
            raise ValueError(f"{flag} {item!r}: {name!r} is given twice")
        try:
            out[name] = list(parse_dims(dims))
        except ValueError as e:
            raise ValueError(f"{flag} {item!r}: {name}={e}") from None
    return out


def split_host_port(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) split and checked: a host, a port in 1..65535.

    Examples
    --------
    >>> split_host_port("192.168.1.7:9090")
    ('192.168.1.7', 9090)
    """
    host, sep, port = addr.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT (e.g. 192.168.1.7:9090), got {addr!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} of {addr!r} is outside 1..65535")
    return host, int(port)


def host_port(text: str) -> str:
    """An argparse type for ``--rpc`` / ``--tracker``: checked, returned as given."""
    try:
        split_host_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def output_path(text: str) -> str:
    """A file to write at the end of a run: checked before the run (its folder exists and is
    writable, it is not a folder), so a long run never loses its result."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a file path")
    p = pathlib.Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path in it")
    if p.exists() and not p.is_file():  # /dev/null, a FIFO: written into, not replaced
        import os

        if not os.access(p, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text}: not writable")
        return text
    parent = p.resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory does not exist; create it "
                                         "first")
    try:
        check_can_create(parent)
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{text}: cannot create files in {parent} ({e.strerror or e})") from None
    return text


def distinct_outputs(**paths: str | None) -> None:
    """Raise ``ValueError`` when two output flags (``report=..., junit=...``) name one file:
    the second write would silently replace the first.

    Examples
    --------
    >>> distinct_outputs(json="r.json", plot="r.png")
    """
    seen: dict[pathlib.Path, str] = {}
    for flag, path in paths.items():
        if not path or not isinstance(path, str):  # `opsdk list --json` is a switch
            continue
        p = pathlib.Path(path)
        if p.exists() and not p.is_file():  # /dev/null twice is fine
            continue
        key, name = p.resolve(), "--" + flag.replace("_", "-")
        if key in seen:
            raise ValueError(f"{seen[key]} and {name} name the same file ({path}); give two "
                             "paths")
        seen[key] = name


#: The model files the model commands load (anything else is a module name).
MODEL_SUFFIXES = (".py", ".pt2", ".onnx")
_MODEL_KINDS = "pass a model file (.py with build_model(), .pt2 or .onnx)"


def model_path_problem(text: str) -> str | None:
    """What is wrong with ``text`` as a model path: a folder, or an existing file of another
    kind than :data:`MODEL_SUFFIXES` (both were taken for module names: "No module named
    'm'"); None when nothing is (a module name is no path).

    Examples
    --------
    >>> model_path_problem("my_models.resnet") is None
    True
    """
    p = pathlib.Path(text)
    if p.is_dir() and not (p / "__init__.py").is_file():  # a package is a module name
        return f"is a folder; {_MODEL_KINDS}"
    if p.is_file() and p.suffix not in MODEL_SUFFIXES:
        return f"a {p.suffix or 'suffix-less'} file is no model; {_MODEL_KINDS}"
    return None


def model_file(text: str) -> str:
    """A model to load: a file (``.py``, ``.pt2``, ``.onnx``, or any path with a ``/``), which
    must exist, or the name of an importable Python module."""
    problem = model_path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    looks_like_file = text.endswith(MODEL_SUFFIXES) or "/" in text
    if not text.strip() or (looks_like_file and not pathlib.Path(text).is_file()):
        raise argparse.ArgumentTypeError(f"model file {text!r} does not exist")
    return text


def percent(text: str) -> float:
    """A number in [0, 100] (``quantize --percentile``: 200 was refused only after the
    calibration ran, and blamed the model file)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentile in [0, 100], got {text!r}")
    return v


#: What argparse takes for a negative number, not an option: its own (-1, -.5) and a shape
#: with a leading minus (-4x768), which the shape parsers then refuse by name ("expected
#: one argument" named neither the value nor the rule).
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+[xX,][\d,xX-]*$")


def parse_name_values(items: Sequence[str] | None, flag: str) -> dict[str, Any]:
    """``["NAME=VALUE", ...]`` of a repeated ``flag``: JSON values, else strings; a missing
    ``=`` or a name given twice is a ``ValueError`` naming ``flag``.

    Examples
    --------
    >>> from opsdk._cliargs import parse_name_values
    >>> parse_name_values(["eps=1e-5", "mode=fast"], "--attr")
    {'eps': 1e-05, 'mode': 'fast'}
    """
    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} expects NAME=VALUE, got {item!r}")
        if k in out:  # the second silently replaced the first
            raise ValueError(f"{flag} {item!r}: {k!r} is given twice")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def parse_entry_args(items: Sequence[str] | None) -> dict[str, Any] | None:
    """``["NAME=VALUE", ...]`` (JSON values, else strings) as keyword arguments of a model
    file's entry function; None for no items (then the file's ``DEFAULT_ARGS`` apply).

    Examples
    --------
    >>> from opsdk._cliargs import parse_entry_args
    >>> parse_entry_args(["size=16", "name=tiny"])
    {'size': 16, 'name': 'tiny'}
    """
    return parse_name_values(items, "--model-arg") if items else None
