"""``opsdk drift``: the fused-vs-unfused drift table of a model, from the command line.

The lead wires it into ``opsdk.cli`` with::

    p = sub.add_parser("drift", help="fused-vs-unfused drift per rewritten site")
    add_drift_arguments(p)
    p.set_defaults(func=run_drift_command)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import tvm

from .._cliargs import model_file, model_path_problem, named_shapes, nonneg_float, output_path
from .._files import write_text_atomic
from .._userfile import (
    UserCodeError,
    call_user,
    import_user_file,
    import_user_module,
    load_onnx_file,
    user_code,
)

__all__ = ["add_drift_arguments", "run_drift_command"]

_REWRITES = ("replace", "fuse")


def add_drift_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``opsdk drift`` arguments to ``parser``.

    Examples
    --------
    >>> import argparse
    >>> from opsdk.frontend._cli import add_drift_arguments
    >>> args = add_drift_arguments(argparse.ArgumentParser()).parse_args(["model.onnx"])
    >>> args.target, args.rewrite
    ('x86', 'replace,fuse')
    """
    parser.add_argument(
        "model",
        help="an .onnx file, or a Python file / module whose ENTRY function returns "
        "(torch module, example args), a torch.export program, or (IRModule, inputs)",
    )
    parser.add_argument(
        "--entry", default="build_model", help="function to call in a Python model (build_model)"
    )
    parser.add_argument("--target", default="x86", help="where to compile and run (x86)")
    parser.add_argument(
        "--rewrite",
        default="replace,fuse",
        help="rewrites to measure, comma-separated: replace (ReplaceTVMOps), fuse (FuseIntoOps)",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=D0,D1,...",
        help="input shape for a symbolic ONNX / IRModule input (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument(
        "--max-rel",
        type=nonneg_float,
        default=None,
        help="exit 1 when a site's local max_rel exceeds this",
    )
    parser.add_argument("--json", default=None, metavar="PATH", type=output_path,
                        help="also write rows as JSON")
    return parser


def _import_python(spec: str) -> Any:
    """A model file (its folder importable, for its sibling modules) or module; what fails in
    it is a :class:`~opsdk._userfile.UserCodeError` naming its line."""
    problem = model_path_problem(spec)  # a folder, m.txt: "No module named 'm'" before
    if problem:
        raise UserCodeError(spec, None, problem)
    path = pathlib.Path(spec)
    if path.suffix == ".py" and path.exists():
        return import_user_file(path, f"_opsdk_drift_{path.stem}")
    return import_user_module(spec)


def _call_entry(module: Any, spec: str, entry: str, **kwargs: Any) -> Any:
    """``module.entry(**kwargs)``: a missing entry is an ``AttributeError`` naming it, what
    the entry raises a :class:`~opsdk._userfile.UserCodeError` at the user's line."""
    fn = getattr(module, entry, None)
    if not callable(fn):
        raise AttributeError(f"{spec} has no function {entry}() (pass --entry NAME)")
    return call_user(fn, where=f"{spec}:{entry}()", **kwargs)


def example_args(built: tuple, spec: str, entry: str) -> tuple:
    """The ``args`` of an entry's ``(model, args)``, checked once at load time: a bare
    tensor there was unpacked along its first dim ("too many positional arguments")."""
    args = built[1]
    if not isinstance(args, (tuple, list)):
        raise UserCodeError(spec, None, f"{entry}() must return (model, args) with args a "
                            "tuple of example inputs, e.g. (model, (x,)); got a "
                            f"{type(args).__name__}")
    return tuple(args)


def export_user_model(export: Any, model: Any, args: tuple, spec: str) -> Any:
    """``export(model, args)`` (``torch.export``) of a user's model: its forward failing is
    the user's error at its line (or, with no frame of theirs, named after ``spec``)."""
    import logging

    path = pathlib.Path(spec)
    anchor = path.resolve().parent if path.is_file() else None
    # torch logs the failing op's traceback at ERROR before raising; the raised error is
    # what the user sees, in one line.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with user_code(f"{spec}: exporting the model failed", anchor):
            return export(model, args)
    finally:
        log.setLevel(level)


def check_shape_names(proto: Any, shapes: dict[str, Any] | None, spec: str,
                      flag: str = "--shape") -> None:
    """Refuse ``--shape NAME=...`` naming no input of the ONNX model ``proto`` (TVM ignored
    it silently: a typo built with the default shape)."""
    if not shapes:
        return
    consts = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in consts]
    unknown = [k for k in shapes if k not in names]
    if unknown:
        raise UserCodeError(spec, None, f"no input named {unknown[0]!r} ({flag} "
                            f"{unknown[0]}=...); its inputs: {', '.join(names) or 'none'}")


def _random_inputs(
    func: tvm.relax.Function, shapes: dict[str, list[int]], rng: np.random.Generator
) -> list[np.ndarray]:
    out = []
    for p in func.params:
        ty = p.ty
        name = str(p.name)
        if name in shapes:
            shape = shapes[name]
        else:
            shape = []
            for d in ty.shape.values:
                if not isinstance(d, tvm.tirx.IntImm):
                    raise ValueError(f"input {name!r} has a symbolic dim; pass --shape {name}=...")
                shape.append(int(d.value))
        dtype = str(ty.dtype)
        if dtype.startswith(("int", "uint")):
            out.append(rng.integers(0, 8, size=shape).astype(dtype))
        else:
            out.append(rng.normal(size=shape).astype(dtype))
    return out


def _load_model(
    spec: str,
    entry: str = "build_model",
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
) -> tuple[tvm.IRModule, list[np.ndarray], tvm.IRModule | None]:
    """The unfused Relax module of a model, inputs for it, and TVM's own import when the
    registered ops' torch / ONNX mappings changed the first.

    ``spec`` is an ``.onnx`` path (imported with TVM's plain ONNX frontend), or a Python file
    or module whose ``entry`` function returns one of: ``(torch.nn.Module, example_args)``,
    a ``torch.export.ExportedProgram`` (both imported with ``from_torch(..., ops=(),
    op_mappings=True)``: TVM's converters for the built-ins, which the rewrites then replace,
    and each op's own mapping, e.g. a user's op for hardswish), ``(tvm.IRModule, inputs)`` or a
    ``tvm.IRModule`` (random inputs).

    Returns
    -------
    (tvm.IRModule, list of numpy.ndarray, tvm.IRModule or None)
    """
    from . import from_onnx, from_torch, mapping_counts, onnx_mapping_counts
    from ._compat import prepare_model_imports

    prepare_model_imports()  # timm / torchvision / transformers beside a CPU torch

    shapes = shapes or {}
    rng = np.random.default_rng(seed)
    if spec.endswith(".onnx"):
        proto = load_onnx_file(spec)
        check_shape_names(proto, shapes, spec)
        mod = from_onnx(proto, shape_dict=shapes or None, ops=())
        plain = (from_onnx(proto, shape_dict=shapes or None, ops=(), op_mappings=False)
                 if onnx_mapping_counts(mod) else None)
        return mod, _random_inputs(mod["main"], shapes, rng), plain
    built = _call_entry(_import_python(spec), spec, entry)
    if isinstance(built, tvm.IRModule):
        return built, _random_inputs(built["main"], shapes, rng), None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], tvm.IRModule):
        from ..runners._base import check_inputs

        inputs = [np.asarray(a) for a in built[1]]
        check_inputs(built[0]["main"], inputs)  # InputMismatch (a ValueError): named, early
        return built[0], inputs, None
    import torch

    if isinstance(built, torch.export.ExportedProgram):
        ep, args = built, built.example_inputs[0]
    elif isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module):
        model, args = built[0], example_args(built, spec, entry)
        ep = export_user_model(torch.export.export, model.eval(), args, spec)
    else:
        raise TypeError(
            f"{spec}:{entry}() returned {type(built).__name__}; expected (torch module, args), "
            "an ExportedProgram, an IRModule or (IRModule, inputs)"
        )
    inputs = [a.detach().cpu().numpy() for a in args if isinstance(a, torch.Tensor)]
    mod = from_torch(ep, ops=(), op_mappings=True)
    plain = from_torch(ep, ops=()) if any(mapping_counts(mod).values()) else None
    return mod, inputs, plain


def _parse_shapes(items: Sequence[str]) -> dict[str, list[int]]:
    return named_shapes(items)


def run_drift_command(args: argparse.Namespace) -> int:
    """Run ``opsdk drift``: print the drift table; 0 on success, 1 when ``--max-rel`` is
    exceeded, 2 on a usage error.

    Examples
    --------
    >>> import argparse
    >>> from opsdk.frontend._cli import add_drift_arguments, run_drift_command
    >>> parser = add_drift_arguments(argparse.ArgumentParser(prog="opsdk drift"))
    >>> run_drift_command(parser.parse_args(["model.onnx", "--rewrite", "inline"]))
    2
    """
    from .. import drift
    from ..transform import FuseIntoOps, ReplaceTVMOps, op_counts
    from . import mapping_counts, onnx_mapping_counts

    try:
        names = [r.strip() for r in args.rewrite.split(",") if r.strip()]
        bad = [r for r in names if r not in _REWRITES]
        if bad or not names:
            raise ValueError(f"--rewrite {args.rewrite!r}: choose from {', '.join(_REWRITES)}")
        from ..targets import target as resolve_target

        resolve_target(args.target)  # a typo was a traceback after the model loaded
        try:  # a missing file was "No module named '/path/m'"
            model_file(args.model)
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
        mod, inputs, plain = _load_model(args.model, args.entry, _parse_shapes(args.shape),
                                         args.seed)
    except (ValueError, TypeError, FileNotFoundError, ImportError, AttributeError) as e:
        print(f"opsdk drift: error: {e}", file=sys.stderr)
        return 2
    passes = {"replace": ReplaceTVMOps(), "fuse": FuseIntoOps()}
    rewrite = tvm.transform.Sequential([passes[n] for n in names], name="opsdk.drift")
    after = rewrite(mod)
    # The output rows compare with TVM's own import, so an op's own torch / ONNX mapping
    # (made at import, not a rewrite site) counts in the end-to-end drift too.
    rows = drift.report(mod, after, inputs, target=args.target, reference=plain)
    counts = op_counts(after, "opsdk.")
    print(f"model: {args.model}   target: {args.target}   rewrites: {', '.join(names)}")
    print("opsdk ops: " + (", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"))
    mapped = {**mapping_counts(mod), **onnx_mapping_counts(mod)}
    if any(mapped.values()):
        print("mapped at import (drift in the output rows, against TVM's import): "
              + ", ".join(f"{k} x{v}" for k, v in mapped.items() if v))
    print(drift.format(rows))
    if args.json:
        write_text_atomic(args.json, json.dumps([r.as_dict() for r in rows], indent=2))
    if args.max_rel is not None:
        worst = [r for r in rows if r.rule != "output" and r.max_rel > args.max_rel]
        if worst:
            print(f"{len(worst)} site(s) drift more than max_rel={args.max_rel}", file=sys.stderr)
            return 1
    return 0
