"""A user's model file: imported with its folder importable, its entry function called, its
example arguments checked and its torch export run, every failure reported at the user's line
(:class:`~opsdk._userfile.UserCodeError`), never as a traceback from inside opsdk.

Examples
--------
>>> from opsdk.frontend import call_entry
>>> import types
>>> call_entry(types.SimpleNamespace(build=lambda n: n + 1), "m.py", "build", n=1)
2
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import numpy as np
import tvm

from .._userfile import UserCodeError, call_entry, example_args, import_model_module, user_code

__all__ = ["call_entry", "check_shape_names", "example_args", "export_user_model",
           "import_model_module", "random_inputs"]


def export_user_model(export: Any, model: Any, args: tuple, spec: str) -> Any:
    """``export(model, args)`` (``torch.export``) of a user's model: its forward failing is
    the user's error at its line (or, with no frame of theirs, named after ``spec``)."""

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


def random_inputs(
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
