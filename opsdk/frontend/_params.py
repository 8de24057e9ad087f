"""Bind model parameters kept as function inputs into constants."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm
from tvm import relax

__all__ = ["bind_params"]


def bind_params(
    mod: tvm.IRModule, params: Mapping[str, Any] | None = None, func_name: str = "main"
) -> tvm.IRModule:
    """Bind parameters of ``func_name`` as constants, so rewrites can fold them.

    With ``params=None`` the values the importers attach when parameters are kept as inputs
    (``keep_params_as_input=True`` / ``keep_params_in_input=True``: the function attributes
    ``num_input`` and ``params``) are bound to the trailing parameters, and both attributes
    are dropped. Otherwise ``params`` maps parameter names to arrays.

    Parameters
    ----------
    mod : tvm.IRModule
    params : mapping of str to array, optional
    func_name : str

    Returns
    -------
    tvm.IRModule

    Examples
    --------
    >>> import numpy as np, opsdk, tvm
    >>> from tvm import relax
    >>> x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    >>> w = relax.Var("w", relax.TensorType((4,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x, w], attrs={"num_input": 1}):
    ...     with bb.dataflow():
    ...         y = bb.emit_output(relax.op.add(x, w))
    ...     _ = bb.emit_func_output(y)
    >>> mod = bb.get()
    >>> mod["main"] = mod["main"].with_attr("params", [tvm.runtime.tensor(np.ones(4, "float32"))])
    >>> [p.name for p in opsdk.frontend.bind_params(mod)["main"].params]
    ['x']
    """
    func = mod[func_name]
    attrs = func.attrs or {}
    if params is None:
        if "params" not in attrs:
            return mod
        n = int(attrs["num_input"]) if "num_input" in attrs else 0
        values = list(attrs["params"])
        names = [p.name for p in func.params[n:]]
        if len(names) != len(values):
            raise ValueError(
                f"{func_name}: {len(values)} values in attribute 'params' but "
                f"{len(names)} parameters after num_input={n}"
            )
        params = dict(zip(names, values))
        func = func.without_attr("params").without_attr("num_input")
    mod = tvm.IRModule(
        {**dict(mod.functions_items()), mod.get_global_var(func_name): func}, mod.attrs
    )
    arrays = {
        k: v if isinstance(v, tvm.runtime.Tensor) else np.asarray(v) for k, v in params.items()
    }
    out = relax.transform.BindParams(func_name, arrays)(mod)
    return out if mod.attrs is None or out.attrs is not None else out.with_attrs(mod.attrs)
