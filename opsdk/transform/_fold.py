"""Constant folding of a whole model in one build: every ``call_tir`` whose arguments are all
constants (a weight's layout change, a batch norm folded into it, the packing a schedule rule
asked for) is computed at compile time.

TVM's ``FoldConstant`` does the same, but builds every folded kernel as a library of its own:
a MobileNetV2 has 158 of them, 12 s of a 30 s compile on a 2-core machine. Here the kernels
met in one round are compiled together in one module (one LLVM run), evaluated on the host,
and the round repeats for chains (a transpose feeding a packing) until nothing is left. TVM's
pass runs after it for whatever is not a plain ``call_tir`` of constants.

Inside :func:`fold_cache` (a model compile with the kernel cache on) every folded value is
also kept on disk, keyed by the kernel (its structural hash and its TVMScript text with names
numbered, as the kernel cache keys it), the digests of its input tensors and the TVM
versions: a recompile of an edited model computes and builds only the folds whose kernel or
inputs changed. Entries are :class:`opsdk._modelcache.ModelCache` entries (checked on every
read, removed and recomputed when damaged).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._kernelcache import _alpha_text
from .._modelcache import _versions
from .._tir import DIVISION_BY_ZERO
from .._walk import calls_of

__all__ = ["FoldConstantsAtOnce", "FoldStats", "fold_cache", "fold_constants"]

#: Rounds of folding (a chain of constant kernels folds one link per round).
_MAX_ROUNDS = 8


#: Bump when the key's ingredients or the stored form change: old entries are then misses.
_FORMAT = 1

#: The folded kernels' build: each runs once, on weights, so LLVM's optimizations cost more
#: than they save (YOLOv8n's 191 folds: 2.3 s at -O3, 1.4 s at -O0; ResNet-50's 1.5 s and
#: 1.0 s). The values are bit for bit the same (checked on both models' constants, the
#: Winograd weight transforms among them).
_HOST = {"kind": "llvm", "opt-level": 0}

_VALUE = "value.bin"


class FoldStats:
    """What the folds inside one :func:`fold_cache` block did: values read from the cache
    (``reused``) and computed (``computed``)."""

    def __init__(self) -> None:
        self.reused = 0
        self.computed = 0


_CACHE: contextvars.ContextVar[tuple[Any, FoldStats] | None] = contextvars.ContextVar(
    "opsdk_fold_cache", default=None)


@contextlib.contextmanager
def fold_cache(store: Any) -> Iterator[FoldStats]:
    """Keep the values :func:`fold_constants` computes in ``store`` (a
    :class:`opsdk._modelcache.ModelCache`; None: no cache) inside the block, and read them
    back from it.

    Examples
    --------
    >>> import tempfile
    >>> from opsdk._modelcache import ModelCache
    >>> from opsdk.transform._fold import fold_cache
    >>> with fold_cache(ModelCache(tempfile.mkdtemp())) as stats:
    ...     pass
    >>> (stats.reused, stats.computed)
    (0, 0)
    """
    stats = FoldStats()
    token = _CACHE.set((store, stats))
    try:
        yield stats
    finally:
        _CACHE.reset(token)


def _func_digest(func: tirx.PrimFunc) -> str:
    """The kernel cache's digest of a kernel: structural hash and the text with every name
    numbered by its first appearance (a 64-bit hash alone could collide)."""
    import tvm_ffi  # heavy: TVM

    canon = func.with_attr("global_symbol", "opsdk_fold")
    h = hashlib.sha256(f"shash:{tvm_ffi.structural_hash(canon)}\0".encode())
    h.update(_alpha_text(canon.script(show_meta=False)).encode())
    return h.hexdigest()


def _tensor_digest(a: np.ndarray) -> str:
    h = hashlib.sha256(f"{a.dtype} {a.shape}\0".encode())
    h.update(memoryview(np.ascontiguousarray(a).reshape(-1).view("uint8")))
    return h.hexdigest()


def _common_material() -> dict[str, Any]:
    return {"format": _FORMAT, "versions": _versions(), "target": _HOST}


def _read_value(store: Any, key: str, specs: list[Any]) -> list[np.ndarray] | None:
    """The stored outputs of one fold, or None (absent; damaged or not matching the call's
    output types: removed, so the fold is computed and stored again)."""
    entry = store.load(key)
    if entry is None:
        return None
    try:
        blob = entry.library.read_bytes()
        outs, pos = [], 0
        for (dtype, shape, nbytes), o in zip(entry.meta["outputs"], specs, strict=True):
            want = [int(d) for d in o.shape.values]
            if list(shape) != want or dtype != str(o.dtype):
                raise ValueError("outputs differ from the call's")
            a = np.frombuffer(blob, dtype=np.dtype(dtype), count=int(np.prod(shape)),
                              offset=pos).reshape(shape)
            if a.nbytes != nbytes:
                raise ValueError("size mismatch")
            outs.append(a)
            pos += nbytes
        if pos != len(blob):
            raise ValueError("size mismatch")
        return outs
    except Exception:  # never trust an entry that does not read back whole
        store.discard(key)
        return None


def _write_value(store: Any, key: str, outs: list[np.ndarray]) -> None:
    def export(path: str) -> None:
        with open(path, "wb") as f:
            for a in outs:
                f.write(memoryview(np.ascontiguousarray(a).reshape(-1).view("uint8")))

    store.store(key, export, {"outputs": [(str(a.dtype), list(a.shape), int(a.nbytes))
                                          for a in outs]}, evict=False)


def _is_tensor_const(e: Any) -> bool:
    # GenericConst also wraps dtypes and strings: tensors only
    return isinstance(e, tvm.ir.expr.GenericConst) and isinstance(e.value, tvm.runtime.Tensor)


def _foldable(call: relax.Call, mod: tvm.IRModule) -> bool:
    if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.call_tir"):
        return False
    if len(call.args) != 2:  # tir_vars: a symbolic shape, not a constant
        return False
    gv, args = call.args
    if not isinstance(gv, relax.GlobalVar) or not isinstance(mod[gv], tirx.PrimFunc):
        return False
    if not isinstance(args, relax.Tuple) or not all(_is_tensor_const(a) for a in args.fields):
        return False
    outs = call.ty_args[0]
    outs = outs.fields if isinstance(outs, relax.TupleType) else [outs]
    return all(isinstance(o, relax.TensorType) and o.shape is not None
               and all(isinstance(d, tirx.IntImm) for d in o.shape.values) for o in outs)


def _calls(mod: tvm.IRModule) -> list[relax.Call]:
    found: list[relax.Call] = []
    for _, f in mod.functions.items():
        if isinstance(f, relax.Function):
            found += [c for c in calls_of(f.body, "relax.call_tir") if _foldable(c, mod)]
    return found


@mutator
class _Replace(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, values: dict) -> None:
        super().__init__(mod)
        self.values = values

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        key = call.__chandle__()
        if key in self.values:
            return self.values[key]
        return super().visit_call_(call)


def fold_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every ``call_tir`` of constants replaced by its value (see the module).

    Examples
    --------
    >>> import numpy as np
    >>> from tvm import relax
    >>> from opsdk.transform._fold import fold_constants
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         w = relax.const(np.arange(6, dtype="float32").reshape(3, 2))
    ...         y = bb.emit_output(relax.op.add(x, relax.op.permute_dims(w)))
    ...     _ = bb.emit_func_output(y)
    >>> mod = fold_constants(relax.transform.LegalizeOps()(bb.get()))
    >>> "transpose" in mod["main"].script()  # the weight's permute was computed
    False
    """
    host = tvm.target.Target(_HOST)
    cached = _CACHE.get()
    store, stats = cached if cached is not None else (None, FoldStats())
    common = _common_material() if store is not None else None
    func_digests: dict[str, str] = {}
    # a constant's Tensor handle -> (the Tensor, kept alive so the handle is not reused; its
    # digest)
    tensor_digests: dict[Any, tuple[Any, str]] = {}
    failed: set[str] = set()
    # Folded values by content: two kernels packing a weight the same way (a decoder's
    # prefill and decode steps) share one constant, so the module holds it once.
    same: dict[tuple, relax.Expr] = {}
    for _ in range(_MAX_ROUNDS):
        calls = [c for c in _calls(mod) if c.args[0].name_hint not in failed]
        if not calls:
            break
        values: dict[Any, relax.Expr] = {}
        todo = calls
        keys: dict[Any, str] = {}
        if store is not None:
            todo = []
            for c in calls:
                key = _fold_key(c, mod, common, func_digests, tensor_digests)
                specs = _out_specs(c)
                got = _read_value(store, key, specs) if key else None
                if got is None:
                    todo.append(c)
                    if key:
                        keys[c.__chandle__()] = key
                    continue
                values[c.__chandle__()] = _as_const(got, specs, c, same)
                stats.reused += 1
        if todo:
            names = sorted({c.args[0].name_hint for c in todo})
            kernels = tvm.IRModule({n: mod[n].with_attr("global_symbol", n) for n in names})
            try:
                with tvm.transform.PassContext(opt_level=3):
                    lib = tvm.tirx.build(kernels, target=host)
            except Exception:  # a kernel the host build refuses: TVM's FoldConstant decides
                lib = None
            if lib is None and not values:
                return mod
            dev = tvm.cpu()
            for c in todo if lib is not None else ():
                specs = _out_specs(c)
                args = [a.value for a in c.args[1].fields]
                res = [tvm.runtime.empty([int(d) for d in o.shape.values], o.dtype, dev)
                       for o in specs]
                try:
                    lib[c.args[0].name_hint](*args, *res)
                except Exception as e:  # left in place, as TVM's FoldConstant leaves what fails
                    if DIVISION_BY_ZERO in str(e):  # opsdk._tir's guard: the
                        # model's constants divide by zero, which no run can get past
                        raise ValueError(f"the model's constants: {e}") from None
                    failed.add(c.args[0].name_hint)
                    continue
                outs = [r.numpy() if r.ndim else np.asarray(r.numpy()) for r in res]
                key = keys.get(c.__chandle__())
                if key:
                    _write_value(store, key, outs)
                values[c.__chandle__()] = _as_const(outs, specs, c, same)
                stats.computed += 1
            if lib is None:
                failed.update(c.args[0].name_hint for c in todo)
        if not values:
            break
        rep = _Replace(mod, values)
        for gv, f in list(mod.functions.items()):
            if isinstance(f, relax.Function):
                rep.builder_.update_func(gv, rep.visit_expr(f))
        mod = rep.builder_.get()
    if store is not None and stats.computed:
        store.evict()  # once, not per stored value
    return mod


def _out_specs(call: relax.Call) -> list[Any]:
    outs = call.ty_args[0]
    return list(outs.fields) if isinstance(outs, relax.TupleType) else [outs]


def _as_const(outs: list[np.ndarray], specs: list[Any], call: relax.Call,
              same: dict[tuple, relax.Expr]) -> relax.Expr:
    consts = []
    for a, o in zip(outs, specs):
        a = a if a.flags.c_contiguous else a.copy()  # (ascontiguousarray makes 0-d 1-d)
        key = (str(o.dtype), a.shape, hashlib.blake2b(a.reshape(-1).view(np.uint8),
                                                      digest_size=16).digest())
        if key not in same:
            same[key] = relax.const(a, o.dtype)
        consts.append(same[key])
    return relax.Tuple(consts) if isinstance(call.ty_args[0], relax.TupleType) else consts[0]


def _fold_key(call: relax.Call, mod: tvm.IRModule, common: dict[str, Any],
              func_digests: dict[str, str], tensor_digests: dict[Any, tuple[Any, str]]
              ) -> str | None:
    """The cache key of one fold: the kernel's digest, its inputs' digests, the versions;
    None when the kernel cannot be printed (then it is not cached)."""
    name = call.args[0].name_hint
    if name not in func_digests:
        try:
            func_digests[name] = _func_digest(mod[name])
        except Exception:
            return None
    ins = []
    for a in call.args[1].fields:
        t = a.value
        h = t.__chandle__()
        if h not in tensor_digests:
            tensor_digests[h] = (t, _tensor_digest(t.numpy()))
        ins.append(tensor_digests[h][1])
    material = dict(common, func=func_digests[name], inputs=ins)
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@tvm.transform.module_pass(opt_level=0, name="opsdk.FoldConstantsAtOnce")
class FoldConstantsAtOnce:
    """:func:`fold_constants` as a pass (TVM's ``FoldConstant`` still runs after it)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        return fold_constants(mod)
