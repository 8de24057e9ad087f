"""Vectorizable float32 ``exp``, ``sigmoid``, ``tanh`` and ``erf`` for op computes and kernels.

TVM lowers ``tirx.exp`` / ``sigmoid`` / ``tanh`` / ``erf`` to LLVM intrinsics that the x86 and
aarch64 back ends expand into one libm call per vector lane (``expf``, ``erff``), so a
vectorized loop runs at scalar speed (measured: softmax 4096x768 spent most of its time in
``expf``; a 1x1 conv with a SiLU epilogue ran at a tenth of its ReLU speed). These versions are
plain arithmetic (FMA, floor, integer shift, bit cast), which vectorizes on every CPU target.
Op computes call them directly; :func:`polynomial_math` rewrites the calls left in any
scheduled kernel (the epilogues FuseOps hands a matmul or conv, TVM's own softmax).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.ir.expr import Call as _Call
from tvm.ir.expr import Expr as _Expr
from tvm.ir.expr import TensorLoad

__all__ = ["bind", "cosh_f32", "erf_f32", "exp_f32", "polynomial_math", "sigmoid_f32",
           "sinh_f32", "tanh_f32", "widen_bf16"]
_LN2_HI = 0.693359375  # ln(2) split so that n * _LN2_HI is exact for |n| <= 2^10 (Cody-Waite)
_LN2_LO = -2.12194440e-4
# Minimax polynomial e^r ~ 1 + r + r^2 P(r) on [-ln2/2, ln2/2], P of degree 4 (fitted for
# relative error; 0.05 u from the approximation, so float32 rounding sets the total). Cephes'
# expf uses degree 5, whose extra term (0.001 u) costs one FMA of the ~15 per vector.
_EXP_POLY = (
    1.381447196001793e-3,
    8.368677593132534e-3,
    4.1668387018967544e-2,
    1.6666520966472215e-1,
    4.999999346300205e-1,
)
_EXP_HI = 88.37  # keeps n = round(x / ln2) <= 127
# Inputs clamp here: n = round(x / ln2) = -127 puts 0 in 2^n's exponent bits, so 2^n and the
# result are exactly 0 from x ~ -87.68 on (the true value is below 0.7 * 2^-126 there), and
# between -87.68 and -87.34 the result is the subnormal it should be.
_EXP_LO = -88.0
_LN_FLT_MAX = 88.72283935546875  # above, exp overflows: the result is +inf
_MAGIC = 12582912.0 + 127.0  # 1.5 * 2^23 (round to integer) + the exponent bias


def _f32(v: float) -> tirx.PrimExpr:
    return tirx.const(v, "float32")


def bind(value: tirx.PrimExpr, name: str, body) -> tirx.PrimExpr:
    """``body(v)`` with ``v`` bound once to ``value`` (a ``Let``), so that an expression used
    several times stays one node: TIR expressions are trees, and these chains reuse their
    operands, so without bindings their size doubles at each step (a bfloat16 tanh-GELU
    grew to hundreds of copies of its input conversion and took 1.5 s to compile).
    Variables and constants are used as they are."""
    if hasattr(value, "asobject"):  # a te.Tensor element written x[i]
        value = value.asobject()
    if isinstance(value, (tirx.Var, tirx.IntImm, tirx.FloatImm)):
        return body(value)
    value = widen_casts(value)
    v = tirx.Var(name, str(value.ty))
    return tirx.Let(v, value, widen_casts(body(v)))


_BINARY = tuple(getattr(tirx, n) for n in (
    "Add", "Sub", "Mul", "Div", "Mod", "FloorDiv", "FloorMod", "Min", "Max",
    "EQ", "NE", "LT", "LE", "GT", "GE", "And", "Or"))


def _rebuild(e: tirx.PrimExpr, leaf) -> tirx.PrimExpr:
    """``e`` with ``leaf(node)`` applied bottom-up; nodes whose children are unchanged are
    kept (tensor reads and unknown nodes are never rebuilt)."""
    def go(x):
        if isinstance(x, _BINARY):
            a, b = go(x.a), go(x.b)
            x = x if a.same_as(x.a) and b.same_as(x.b) else type(x)(a, b)
        elif isinstance(x, tirx.Not):
            a = go(x.a)
            x = x if a.same_as(x.a) else tirx.Not(a)
        elif isinstance(x, tirx.Select):
            c, t, f = go(x.condition), go(x.true_value), go(x.false_value)
            if not (c.same_as(x.condition) and t.same_as(x.true_value)
                    and f.same_as(x.false_value)):
                x = tirx.Select(c, t, f)
        elif isinstance(x, tirx.Cast):
            v = go(x.value)
            x = x if v.same_as(x.value) else tirx.Cast(str(x.ty), v)
        elif isinstance(x, tirx.Let):
            v, b = go(x.value), go(x.body)
            x = x if v.same_as(x.value) and b.same_as(x.body) else tirx.Let(x.var, v, b)
        elif isinstance(x, _Call) and getattr(x.op, "name", "").startswith("tirx."):
            args = [go(a) if isinstance(a, _Expr) else a for a in x.args]
            if not all(n.same_as(o) for n, o in zip(args, x.args)):
                x = _Call(x.op, args, attrs=x.attrs, ret_ty=x.ty)
        return leaf(x)
    return go(e)


def widen_casts(e: tirx.PrimExpr) -> tirx.PrimExpr:
    """``e`` with every bfloat16 -> float32 cast written by bits (:func:`widen_bf16`)."""
    def leaf(x):
        if (isinstance(x, tirx.Cast) and str(x.value.ty) == "bfloat16"
                and str(x.ty) == "float32"):
            return widen_bf16(x.value)
        return x
    return _rebuild(e, leaf)


def _reads(e: tirx.PrimExpr, buf) -> bool:
    """True when ``e`` loads from ``buf``."""
    found = []

    def leaf(x):
        if isinstance(x, TensorLoad) and x.source.same_as(buf):
            found.append(x)
        return x
    _rebuild(e, leaf)
    return bool(found)


def has_let(e: tirx.PrimExpr) -> bool:
    """True when ``e`` contains a ``Let`` (from :func:`bind`, ``exp_f32``, ``erf_f32``)."""
    found = []

    def leaf(x):
        if isinstance(x, tirx.Let):
            found.append(x)
        return x
    _rebuild(e, leaf)
    return bool(found)


def narrow(value: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """``value`` (a float32 result) cast to the output ``dtype``, read once.

    TVM lowers a float32 -> bfloat16 cast to integer rounding that reads its operand twice,
    copying the whole expression; one built from ``Let`` bindings (:func:`bind`,
    ``exp_f32``, ``erf_f32``) then binds one variable twice, which the vectorizer refuses.
    Here the rounding (to nearest, ties to even: TVM's own) reads the bits of a bound
    variable instead. Use it for the last cast of a compute built from those helpers.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk.te_utils import exp_f32, narrow
    >>> x = te.placeholder((8,), "bfloat16", name="x")
    >>> y = te.compute((8,), lambda i: narrow(exp_f32(x[i].astype("float32")), "bfloat16"))
    >>> str(y.dtype)
    'bfloat16'
    """
    if dtype_of(value) == dtype:
        return value
    if dtype != "bfloat16" or dtype_of(value) != "float32":
        return value.astype(dtype)

    def rne(bits: tirx.PrimExpr) -> tirx.PrimExpr:
        u16 = tirx.const(16, "uint32")
        half = (bits >> u16 & tirx.const(1, "uint32")) + tirx.const(0x7FFF, "uint32")
        return tirx.reinterpret("bfloat16", ((bits + half) >> u16).astype("uint16"))

    return bind(tirx.reinterpret("uint32", value), "out_bits", rne)


def dtype_of(value: tirx.PrimExpr) -> str:
    """Dtype string of a TIR expression (0.27 exposes it as ``.ty``)."""
    if hasattr(value, "asobject"):  # a te.Tensor element written x[i]
        value = value.asobject()
    return str(value.ty)


def widen_bf16(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """A bfloat16 expression as float32, by its bits (exact). TVM's bfloat16 storage pass
    leaves a plain cast inside a ``Let`` value alone, so it would convert the raw integer."""
    bits = tirx.reinterpret("uint16", value).astype("uint32")
    return tirx.reinterpret("float32", bits << tirx.const(16, "uint32"))


def _lt_select(x: tirx.PrimExpr, bound: float, then: tirx.PrimExpr) -> tirx.PrimExpr:
    # Written as select(x < bound, ...) so that a NaN input falls through unchanged.
    return tirx.Select(x < _f32(bound), then, x)


def exp_f32(x: tirx.PrimExpr, *, nonpositive: bool = False) -> tirx.PrimExpr:
    """``exp(x)`` of a float32 expression in vectorizable arithmetic (max error < 1 ulp).

    Cody-Waite reduction ``x = n ln2 + r`` and a minimax polynomial ``e^r = 1 + r + r^2 P(r)``
    (``P`` of degree 4), evaluated as one Horner chain.
    ``n`` is rounded with the "magic number" trick: adding ``1.5 * 2^23 + 127`` leaves
    ``n + 127`` in the low mantissa bits, so shifting those bits left by 23 gives the float
    ``2^n`` without a float-to-int conversion (15 vector operations in all). Results below
    ``0.7 * 2^-126`` are 0 (absolute error under ``2^-126``), those above ``FLT_MAX`` (x >
    88.7228) +inf; between 88.37 and 88.72, the last float32 binade, the result saturates at
    ~2.4e38. NaN propagates. ``nonpositive=True`` promises ``x <= 0`` (or NaN), as in softmax's
    ``x - max``, and drops the upper clamp and the overflow test (two vector ops of ~20).

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk._vecmath import exp_f32
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> y = te.compute((8,), lambda i: exp_f32(x[i]), name="y")
    >>> str(y.dtype)
    'float32'
    """
    return bind(x, "exp_x", lambda x: _exp(x, nonpositive))


def _exp(x: tirx.PrimExpr, nonpositive: bool) -> tirx.PrimExpr:
    xc = x if nonpositive else tirx.Select(x > _f32(_EXP_HI), _f32(_EXP_HI), x)
    xc = _lt_select(xc, _EXP_LO, _f32(_EXP_LO))
    return bind(xc, "exp_xc", lambda xc: _exp_reduced(x, xc, nonpositive))


def _exp_reduced(x: tirx.PrimExpr, xc: tirx.PrimExpr, nonpositive: bool) -> tirx.PrimExpr:
    kf = xc * _f32(1.4426950408889634) + _f32(_MAGIC)
    # The bit-cast round trip (free in LLVM) keeps TVM's simplifier from folding
    # ``(a + M) - M`` back to ``a``, which would drop the rounding.
    return bind(tirx.reinterpret("int32", kf), "exp_k",
                lambda kbits: _exp_poly(x, xc, kbits, nonpositive))


def _exp_poly(x: tirx.PrimExpr, xc: tirx.PrimExpr, kbits: tirx.PrimExpr,
              nonpositive: bool) -> tirx.PrimExpr:
    n = tirx.reinterpret("float32", kbits) - _f32(_MAGIC)  # round(x / ln2), exact
    return bind(n, "exp_n", lambda n: bind(
        xc - n * _f32(_LN2_HI) - n * _f32(_LN2_LO), "exp_r",
        lambda r: _exp_tail(x, r, kbits, nonpositive)))


def _exp_tail(x: tirx.PrimExpr, r: tirx.PrimExpr, kbits: tirx.PrimExpr,
              nonpositive: bool) -> tirx.PrimExpr:
    # e^r = 1 + r + r^2 P(r) as one Horner chain (the last two coefficients 1, 1): one
    # vector op fewer than forming r^2 (measured max error 1.31 u over [-87.3, 88.37]).
    bits = tirx.shift_left(kbits, tirx.const(23, "int32"))
    p = _f32(_EXP_POLY[0])
    for c in (*_EXP_POLY[1:], 1.0, 1.0):
        p = p * r + _f32(c)
    y = p * tirx.reinterpret("float32", bits)
    if nonpositive:
        return y
    return tirx.Select(x > _f32(_LN_FLT_MAX), tirx.const(float("inf"), "float32"), y)


# Rational minimax approximation erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4] (as in Eigen's
# generic_fast_erf_float); |erf(x)| rounds to 1 beyond |x| = 4 in float32 anyway.
_ERF_P = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_Q = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def erf_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``erf(x)`` of a float32 expression in vectorizable arithmetic.

    The approximation's own error is 6.5e-8; evaluated in float32 the absolute error stays
    under 4e-7 (measured on a dense grid over [-8, 8]). NaN propagates.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk._vecmath import erf_f32
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> y = te.compute((8,), lambda i: erf_f32(x[i]), name="y")
    >>> y.shape[0]
    8
    """
    return bind(x, "erf_x", _erf)


def _erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    xc = tirx.Select(x > _f32(4.0), _f32(4.0), x)
    return bind(_lt_select(xc, -4.0, _f32(-4.0)), "erf_xc", _erf_clamped)


def _erf_clamped(xc: tirx.PrimExpr) -> tirx.PrimExpr:
    return bind(xc * xc, "erf_x2", lambda x2: xc * _horner(x2, _ERF_P) / _horner(x2, _ERF_Q))


def _horner(t: tirx.PrimExpr, coeffs: tuple[float, ...]) -> tirx.PrimExpr:
    """``coeffs[0] t^n + ... + coeffs[n]``, one multiply-add per coefficient."""
    p = _f32(coeffs[0])
    for c in coeffs[1:]:
        p = p * t + _f32(c)
    return p


def sigmoid_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``1 / (1 + exp(-x))`` of a float32 expression with :func:`exp_f32` (vectorizable).

    ``exp(-x)`` overflows to +inf below x ~ -88.7 and the result is then 0, as it rounds in
    float32 from x ~ -103 on anyway; NaN propagates.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk._vecmath import sigmoid_f32
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> y = te.compute((8,), lambda i: x[i] * sigmoid_f32(x[i]), name="silu")
    >>> str(y.dtype)
    'float32'
    """
    return _f32(1.0) / (_f32(1.0) + exp_f32(-x))


# tanh(x) ~ x + x^3 P(x^2) on [0, ln(3)/2]: P of degree 4, fitted for relative error
# (0.02 u from the approximation); above, 1 - 2 / (exp(2|x|) + 1) loses nothing to
# cancellation because tanh >= 1/2 there.
_TANH_SMALL = 0.5493061443340549  # ln(3) / 2
_TANH_POLY = (
    -6.269856646200299e-3,
    2.1067830050935432e-2,
    -5.3851146711941265e-2,
    1.333257211107427e-1,
    -3.3333317012685076e-1,
)


def tanh_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``tanh(x)`` of a float32 expression in vectorizable arithmetic.

    An odd polynomial below ``ln(3)/2`` (relative error, so tiny inputs stay exact), above it
    ``1 - 2 / (exp(2|x|) + 1)`` with :func:`exp_f32`, the sign copied back. Saturates at +-1,
    NaN propagates.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk._vecmath import tanh_f32
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> y = te.compute((8,), lambda i: tanh_f32(x[i]), name="y")
    >>> y.shape[0]
    8
    """
    return bind(x, "tanh_x", lambda v: bind(
        tirx.Select(v < _f32(0.0), -v, v), "tanh_a", lambda a: _tanh(v, a)))


def _tanh(x: tirx.PrimExpr, a: tirx.PrimExpr) -> tirx.PrimExpr:
    def small(a2):
        return a + a * a2 * _horner(a2, _TANH_POLY)

    near = bind(a * a, "tanh_a2", small)
    far = _f32(1.0) - _f32(2.0) / (exp_f32(a * _f32(2.0)) + _f32(1.0))
    return bind(tirx.Select(a < _f32(_TANH_SMALL), near, far), "tanh_t",
                lambda t: tirx.Select(x < _f32(0.0), -t, t))


# sinh(a) ~ a + a^3 P(a^2) below 1: the Taylor terms to a^13 (the next is 8e-13 relative).
_SINH_SMALL = 1.0
_SINH_POLY = tuple(1.0 / math.factorial(k) for k in (13, 11, 9, 7, 5, 3))


def _half_exp_pair(a: tirx.PrimExpr, body) -> tirx.PrimExpr:
    """``body(e / 2, 1 / (2 e))`` for ``e = exp(a)``, ``a >= 0``: through ``h = exp(a / 2)``,
    so ``e / 2 = h * (h / 2)`` overflows only where the result does (``a`` above 89.4, not
    88.7), and ``1 / (2 e)`` is 0 wherever ``h * h`` does."""
    return bind(exp_f32(a * _f32(0.5)), "hyp_h", lambda h: body(
        h * (h * _f32(0.5)), _f32(0.5) / (h * h)))


def cosh_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``cosh(x)`` of a float32 expression in vectorizable arithmetic: ``(e + 1/e) / 2`` with
    :func:`exp_f32` of ``|x| / 2`` (a few ulp; +inf beyond float32's range, as libm).
    TVM 0.27 lowers ``tirx.cosh`` to an intrinsic its LLVM code generator does not know
    ("unknown intrinsic tirx.cosh"), so torch's ``cosh`` did not compile.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk._vecmath import cosh_f32
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> te.compute((8,), lambda i: cosh_f32(x[i])).shape[0]
    8
    """
    return bind(x, "cosh_x", lambda v: bind(
        tirx.Select(v < _f32(0.0), -v, v), "cosh_a",
        lambda a: _half_exp_pair(a, lambda half, inv: half + inv)))


def sinh_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``sinh(x)`` of a float32 expression in vectorizable arithmetic: an odd polynomial
    below ``|x| = 1`` (tiny inputs stay exact), ``(e - 1/e) / 2`` above (the difference
    loses under a bit there), the sign copied back. See :func:`cosh_f32`.

    Examples
    --------
    >>> from tvm import te
    >>> from opsdk._vecmath import sinh_f32
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> te.compute((8,), lambda i: sinh_f32(x[i])).shape[0]
    8
    """
    def signed(v: tirx.PrimExpr, a: tirx.PrimExpr) -> tirx.PrimExpr:
        near = bind(a * a, "sinh_a2", lambda a2: a + a * a2 * _horner(a2, _SINH_POLY))
        far = _half_exp_pair(a, lambda half, inv: half - inv)
        return bind(tirx.Select(a < _f32(_SINH_SMALL), near, far), "sinh_t",
                    lambda t: tirx.Select(v < _f32(0.0), -t, t))

    return bind(x, "sinh_x", lambda v: bind(
        tirx.Select(v < _f32(0.0), -v, v), "sinh_a", lambda a: signed(v, a)))


def _power(base: tirx.PrimExpr, exponent: tirx.PrimExpr) -> tirx.PrimExpr | None:
    """``pow(x, n)`` for a small integer constant ``n`` (GPT-2's ``x ** 3``) by multiplying,
    ``pow(x, 0.5)`` as ``sqrt``; None for any other exponent (left to TVM)."""
    e = exponent.value if isinstance(exponent, (tirx.FloatImm, tirx.IntImm)) else None
    if e is None:
        return None
    if e == 0.5:
        return tirx.sqrt(base)
    if e != int(e) or not 1 <= e <= 8:
        return None

    def times(v):
        out = v
        for _ in range(int(e) - 1):
            out = out * v
        return out

    return bind(base, "pow_x", times)


_REWRITES = {"tirx.exp": exp_f32, "tirx.sigmoid": sigmoid_f32, "tirx.tanh": tanh_f32,
             "tirx.erf": erf_f32, "tirx.sinh": sinh_f32, "tirx.cosh": cosh_f32}


def polynomial_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every float32 ``exp`` / ``sigmoid`` / ``tanh`` / ``erf`` / ``sinh`` /
    ``cosh`` call replaced by this module's vectorizable version, and ``pow`` by a small
    integer constant (or 0.5) by multiplications (or ``sqrt``); other dtypes and functions
    are left to TVM.

    Run on a scheduled kernel: the replacements bind ``Let`` variables, which a schedule that
    inlines one block into two would duplicate (``tirx.transform.ConvertSSA`` renames them
    after, as :func:`opsdk.schedules.apply_schedule` does).

    A replaced call whose argument already holds such bindings (``exp(exp(exp(x)))`` in one
    fused elementwise kernel, ``tanh(exp(...))``) gets that argument through the element
    the statement stores to, written just before it (a register once the loop is
    vectorized), not as a nested ``Let``: TVM's LLVM code generator binds every ``Let`` in
    its arithmetic analyzer, which simplifies the value with each earlier variable replaced
    by its own expansion, so the expansion grows with the product of the variables' uses
    (about 50 per polynomial): three nested ``exp`` took 136 s to generate code, two 0.2 s;
    staged, 0.03 s. The element is one slot per statement: a chain staged level by level,
    or a single staged value; a statement that reads its own buffer keeps its ``Let``.

    Examples
    --------
    >>> from tvm import te, tirx
    >>> from opsdk._vecmath import polynomial_math
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> f = te.create_prim_func([x, te.compute((8,), lambda i: tirx.exp(x[i]))])
    >>> "T.exp(" in polynomial_math(f).script()
    False
    """
    from tvm_ffi.structural import structural_mutate  # heavy: TVM

    # Per enclosing store: the store and the staging stores to put before it.
    stores: list[tuple[tirx.BufferStore, list[tirx.Stmt]]] = []

    def staged(value: tirx.PrimExpr) -> tirx.PrimExpr:
        """``value`` written to the enclosing store's own element first and read back
        there, where that is safe; else ``value`` itself."""
        if not stores or not has_let(value):
            return value
        out, before = stores[-1]
        if str(out.buffer.dtype) != str(value.ty):
            return value
        # The element is one slot: a second, independent chain (one that does not read
        # what the first staged) keeps its Let.
        if before and not _reads(value, out.buffer):
            return value
        before.append(tirx.BufferStore(out.buffer, value, list(out.indices)))
        return tirx.BufferLoad(out.buffer, list(out.indices))

    def call(node: _Call, mut) -> tirx.PrimExpr:
        node = mut.default_mutate(node)
        name = getattr(node.op, "name", "")
        if str(node.ty) != "float32":
            return node
        if name == "tirx.pow" and len(node.args) == 2:
            powered = _power(staged(node.args[0]), node.args[1])
            return node if powered is None else powered
        fn = _REWRITES.get(name)
        return node if fn is None or len(node.args) != 1 else fn(staged(node.args[0]))

    def cast(node: tirx.Cast, mut) -> tirx.PrimExpr:
        # A bfloat16 store of a result that now has Let bindings: TVM's rounding reads its
        # operand twice and would bind each variable twice (as _opdef does for computes).
        node = mut.default_mutate(node)
        if str(node.ty) != "bfloat16" or str(node.value.ty) != "float32" \
                or not has_let(node.value):
            return node
        return narrow(node.value, "bfloat16")

    def store(node: tirx.BufferStore, mut) -> tirx.Stmt:
        if _reads(node.value, node.buffer):  # an update of its own element: no slot
            return mut.default_mutate(node)
        stores.append((node, []))
        node = mut.default_mutate(node)
        _, before = stores.pop()
        return tirx.SeqStmt([*before, node]) if before else node

    body = structural_mutate(func.body, [(_Call, call), (tirx.Cast, cast),
                                         (tirx.BufferStore, store)])
    return func if body.same_as(func.body) else func.with_body(body)
