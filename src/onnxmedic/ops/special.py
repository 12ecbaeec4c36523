"""Special functions torchlib does not translate (or translates wrongly): erfinv, lgamma,
digamma, polygamma, mvlgamma, zeta, the Bessel functions, erfcx, ndtr, ndtri, log_ndtr, xlogy...

Each translation is a traced ONNX Script function using standard ONNX ops only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import const
from onnxmedic.ops._registry import translation

aten = torch.ops.aten

# M. Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011): single-precision
# polynomials, relative error below 4e-7 on (-1, 1).
_GILES_CENTRAL = (
    2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
    -0.00125372503, -0.00417768164, 0.246640727, 1.50140941,
)
_GILES_TAIL = (
    -0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
    -0.0076224613, 0.00943887047, 1.00167406, 2.83297682,
)


def _horner(coeffs: tuple[float, ...], w, like):
    p = const(coeffs[0], like)
    for c in coeffs[1:]:
        p = op.Add(op.Mul(p, w), const(c, like))
    return p


def _erfinv(x):
    one = const(1.0, x)
    w = op.Neg(op.Log(op.Mul(op.Sub(one, x), op.Add(one, x))))
    central = op.Less(w, const(5.0, x))
    # Clamp each branch's argument to its own range so the unused branch stays finite.
    w_c = op.Sub(op.Min(w, const(5.0, x)), const(2.5, x))
    w_t = op.Sub(op.Sqrt(op.Max(w, const(5.0, x))), const(3.0, x))
    p = op.Where(central, _horner(_GILES_CENTRAL, w_c, x), _horner(_GILES_TAIL, w_t, x))
    y = op.Mul(p, x)
    ax = op.Abs(x)
    inf = op.Mul(x, const(float("inf"), x))  # +-inf at x = +-1
    y = op.Where(op.Equal(ax, one), inf, y)
    nan = const(float("nan"), x)
    return op.Where(op.Greater(ax, one), nan, y)


def _erfinv_any(x):
    """float64: Giles' single-precision start, then two Newton steps on Cephes' double erf/erfc
    (ONNX Runtime has no double Erf kernel); the residual uses 1 - |y| - erfc(|x|), which is
    exact near +-1 where erf(x) - y would cancel. Other float types: Giles alone."""
    if x.dtype != _DOUBLE:
        return _erfinv(x)
    y = x
    x0 = _erfinv(y)
    ay = op.Abs(y)
    sgn = op.Where(op.Less(y, _d(0.0)), _d(-1.0), _d(1.0))
    for _ in range(2):
        ax0 = op.Abs(x0)
        tail = op.Mul(sgn, op.Sub(op.Sub(_d(1.0), ay), _erfc(ax0)))
        r = op.Where(op.Greater(ay, _d(0.5)), tail, op.Sub(_erf(x0), y))
        deriv = op.Mul(_d(2.0 * _INV_SQRT_PI), op.Exp(op.Neg(op.Mul(x0, x0))))
        step = op.Div(r, deriv)
        finite = op.And(op.Less(ay, _d(1.0)), op.Not(op.IsNaN(step)))
        x0 = op.Where(finite, op.Sub(x0, step), x0)
    return _from_d(x0, _DOUBLE, x)


@translation(aten.erfinv.default)
def aten_erfinv(self):
    """erfinv(Tensor self) -> Tensor"""
    return _erfinv_any(self)


@translation(aten.special_erfinv.default)
def aten_special_erfinv(self):
    """special_erfinv(Tensor self) -> Tensor"""
    return _erfinv_any(self)


# ---------------------------------------------------------------------------------------------
# Shared machinery for the Cephes-style translations below. Every function is evaluated in
# float64 (ONNX Runtime has double kernels for every op used here: it lacks only Erf, Tan and
# Atan, which are avoided), then cast back to the input's float type. Computing in double keeps
# float32 results within an ulp or two of the correctly rounded value, so they match PyTorch's
# float32 kernels to ~1e-6 relative except where PyTorch's own float32 evaluation loses accuracy
# (near the zeros of a function, documented per op).
# ---------------------------------------------------------------------------------------------

_DOUBLE = ir.DataType.DOUBLE
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _d(value: float):
    """A float64 constant of shape [1].

    Not a 0-d scalar on purpose: onnxscript's optimizer (0.7) removes ``x + c`` and ``x - c``
    for any *scalar* constant with |c| < 1e-8 and ``x * c`` / ``x / c`` for |c - 1| < 1e-5
    (its no-op rules match with a tolerance), which silently drops the small Chebyshev and
    rational coefficients. Shape-[1] constants are not matched; :func:`_from_d` restores the
    rank of 0-d results.
    """
    return op.Constant(value=ir.tensor(np.array([value], dtype=np.float64)))


def _out_type(*xs) -> ir.DataType:
    """Result type of a unary/binary float op: the widest float input, float32 for integers."""
    dts = [getattr(x, "dtype", None) for x in xs]
    if ir.DataType.DOUBLE in dts:
        return ir.DataType.DOUBLE
    for dt in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        if dt in dts:
            return dt
    return ir.DataType.FLOAT


def _to_d(x):
    return op.Cast(x, to=_DOUBLE)


def _from_d(y, dtype: ir.DataType, *refs):
    """Cast the double result back; drop the [1] dim the constants added when all inputs are 0-d."""
    ranks = [len(r.shape) if getattr(r, "shape", None) is not None else None
             for r in refs if hasattr(r, "dtype")]
    if ranks and all(rk == 0 for rk in ranks):
        y = op.Squeeze(y, op.Constant(value_ints=[0]))
    return op.Cast(y, to=dtype)


def _polevl(x, coeffs):
    """Cephes polevl: coeffs[0]*x^n + ... + coeffs[n] (Horner)."""
    p = _d(coeffs[0])
    for c in coeffs[1:]:
        p = op.Add(op.Mul(p, x), _d(c))
    return p


def _p1evl(x, coeffs):
    """Cephes p1evl: like polevl with an implicit leading coefficient 1."""
    return _polevl(x, (1.0, *coeffs))


def _chbevl(x, coeffs):
    """Cephes chbevl: Chebyshev series sum at x (coefficients highest order first)."""
    b0 = _d(coeffs[0])
    b1 = _d(0.0)
    b2 = _d(0.0)
    for c in coeffs[1:]:
        b2 = b1
        b1 = b0
        b0 = op.Add(op.Sub(op.Mul(x, b1), b2), _d(c))
    return op.Mul(_d(0.5), op.Sub(b0, b2))


def _is_int(x):
    """x == trunc(x) (true for +-inf; false for NaN)."""
    trunc = op.Where(op.Less(x, _d(0.0)), op.Ceil(x), op.Floor(x))
    return op.Equal(x, trunc)


def _trunc(x):
    return op.Where(op.Less(x, _d(0.0)), op.Ceil(x), op.Floor(x))


def _log1p(u):
    """Accurate log(1 + u) without a Log1p op (Goldberg's trick); inf for u = +inf."""
    w = op.Add(_d(1.0), u)
    den = op.Sub(w, _d(1.0))
    safe_den = op.Where(op.Equal(den, _d(0.0)), _d(1.0), den)
    r = op.Mul(op.Log(w), op.Div(u, safe_den))
    r = op.Where(op.Equal(den, _d(0.0)), u, r)
    return op.Where(op.IsInf(u, detect_negative=0), u, r)


# pi split in three (fdlibm's pio2_1, pio2_2, pio2_2t doubled): the first two have 33 significant
# bits, so k * part is exact for |k| < 2^20
_PI_1 = 2 * 1.57079632673412561417e+00
_PI_2 = 2 * 6.07710050630396597660e-11
_PI_3 = 2 * 2.02226624879595063154e-21


def _reduce_pi(a):
    """(r, k) with a = k*pi + r, |r| <= pi/2 (Cody-Waite, three-part pi), so that sin/cos of r are
    accurate: ONNX Runtime's double Sin loses relative accuracy near multiples of pi."""
    k = op.Round(op.Div(a, _d(math.pi)))
    r = op.Sub(op.Sub(op.Sub(a, op.Mul(k, _d(_PI_1))), op.Mul(k, _d(_PI_2))), op.Mul(k, _d(_PI_3)))
    return r, k


def _sin_accurate(a):
    r, k = _reduce_pi(a)
    odd = op.Equal(op.Sub(k, op.Mul(_d(2.0), op.Floor(op.Div(k, _d(2.0))))), _d(1.0))
    sr = op.Sin(r)
    return op.Where(odd, op.Neg(sr), sr)


def _tan_accurate(a):
    r, _ = _reduce_pi(a)  # tan has period pi
    return op.Div(op.Sin(r), op.Cos(r))


_INF = float("inf")
_NAN = float("nan")
_PI = math.pi


# --- gamma family ------------------------------------------------------------------------------

# Lanczos approximation (g = 7, n = 9): relative error ~1e-15 for Gamma on Re(x) >= 0.5.
_LANCZOS_G = 7.0
_LANCZOS = (
    0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
    -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
    1.5056327351493116e-7,
)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _lgamma_pos(x):
    """log Gamma(x) for x >= 0.5 (double)."""
    z = op.Sub(x, _d(1.0))
    a = _d(_LANCZOS[0])
    for i, c in enumerate(_LANCZOS[1:], start=1):
        a = op.Add(a, op.Div(_d(c), op.Add(z, _d(float(i)))))
    t = op.Add(z, _d(_LANCZOS_G + 0.5))
    return op.Add(
        op.Sub(op.Add(_d(_HALF_LOG_2PI), op.Mul(op.Add(z, _d(0.5)), op.Log(t))), t), op.Log(a)
    )


def _sin_pi_reduced(x):
    """|sin(pi x)| computed on x - round(x), exact zeros at the integers."""
    r = op.Sub(x, op.Round(x))
    return op.Abs(op.Sin(op.Mul(_d(_PI), r)))


def _lgamma(x):
    """log|Gamma(x)| in double: Lanczos for x >= 0.5, reflection below; +inf at poles/inf."""
    small = op.Less(x, _d(0.5))
    xr = op.Where(small, op.Sub(_d(1.0), x), x)
    lg = _lgamma_pos(xr)
    refl = op.Sub(op.Sub(_d(math.log(math.pi)), op.Log(_sin_pi_reduced(x))), lg)
    y = op.Where(small, refl, lg)
    return op.Where(op.IsInf(x), _d(_INF), y)


_DIGAMMA_A = (
    8.33333333333333333333e-2, -2.10927960927960927961e-2, 7.57575757575757575758e-3,
    -4.16666666666666666667e-3, 3.96825396825396825397e-3, -8.33333333333333333333e-3,
    8.33333333333333333333e-2,
)


def _digamma(x):
    """Cephes psi as in ATen calc_digamma, in double."""
    neg = op.Less(x, _d(0.0))
    r = op.Sub(x, _trunc(x))  # modf fractional part
    refl = op.Div(_d(_PI), _tan_accurate(op.Mul(_d(_PI), r)))  # pi / tan(pi r)
    xr = op.Where(neg, op.Sub(_d(1.0), x), x)
    res = _d(0.0)
    for _ in range(10):  # push x to >= 10
        m = op.Less(xr, _d(10.0))
        res = op.Sub(res, op.Where(m, op.Reciprocal(xr), _d(0.0)))
        xr = op.Where(m, op.Add(xr, _d(1.0)), xr)
    z = op.Reciprocal(op.Mul(xr, xr))
    y = op.Where(op.Less(xr, _d(1e17)), op.Mul(z, _polevl(z, _DIGAMMA_A)), _d(0.0))
    out = op.Sub(op.Sub(op.Add(res, op.Log(xr)), op.Div(_d(0.5), xr)), y)
    out = op.Where(neg, op.Sub(out, refl), out)
    out = op.Where(op.And(neg, _is_int(x)), _d(_NAN), out)
    zero = op.Equal(x, _d(0.0))
    # digamma(+-0) = -+inf (copysign(inf, -x)): 1/x tells the sign of zero
    signed_inf = op.Where(op.Less(op.Reciprocal(x), _d(0.0)), _d(_INF), _d(-_INF))
    return op.Where(zero, signed_inf, out)


def _trigamma(x, sin_arg):
    """ATen's trigamma in double; ``sin_arg`` is pi*x as PyTorch forms it (in the input type)."""
    small = op.Less(x, _d(0.5))
    s = _sin_accurate(sin_arg)
    res = op.Where(small, op.Neg(op.Div(_d(_PI * _PI), op.Mul(s, s))), _d(0.0))
    xr = op.Where(small, op.Sub(_d(1.0), x), x)
    for _ in range(6):
        res = op.Add(res, op.Reciprocal(op.Mul(xr, xr)))
        xr = op.Add(xr, _d(1.0))
    ixx = op.Reciprocal(op.Mul(xr, xr))
    inner = op.Mul(ixx, op.Sub(_d(1.0 / 30), op.Mul(ixx, _d(1.0 / 42))))
    tail = op.Add(op.Add(_d(1.0), op.Reciprocal(op.Mul(_d(2.0), xr))),
                  op.Mul(ixx, op.Sub(_d(1.0 / 6), inner)))
    res = op.Add(res, op.Div(tail, xr))
    return op.Where(small, op.Neg(res), res)


_ZETA_A = (
    12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
    -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
    1.8152105401943546773e17, -7.1661652561756670113e18,
)
# Direct-sum terms unrolled for the Hurwitz zeta: PyTorch sums (q+k)^-x until q+k > 9, so q
# down to 9 - _ZETA_TERMS is covered; below that the result is NaN (documented).
_ZETA_TERMS = 40


def _zeta(x, q):
    """Hurwitz zeta(x, q) as in ATen's Cephes-derived zeta, in double."""
    mx = op.Neg(x)
    s = op.Pow(q, mx)
    # number of direct terms PyTorch's loop takes: i = max(9, floor(9 - q) + 1)
    n_terms = op.Max(_d(9.0), op.Add(op.Floor(op.Sub(_d(9.0), q)), _d(1.0)))
    for k in range(1, _ZETA_TERMS + 1):
        term = op.Pow(op.Add(q, _d(float(k))), mx)
        s = op.Add(s, op.Where(op.LessOrEqual(_d(float(k)), n_terms), term, _d(0.0)))
    w = op.Add(q, n_terms)
    b = op.Pow(w, mx)
    s = op.Add(s, op.Div(op.Mul(b, w), op.Sub(x, _d(1.0))))
    s = op.Sub(s, op.Mul(_d(0.5), b))
    a = _d(1.0)
    k = 0.0
    for coef in _ZETA_A:
        a = op.Mul(a, op.Add(x, _d(k)))
        b = op.Div(b, w)
        s = op.Add(s, op.Div(op.Mul(a, b), _d(coef)))
        k += 1.0
        a = op.Mul(a, op.Add(x, _d(k)))
        b = op.Div(b, w)
        k += 1.0
    s = op.Where(op.Greater(n_terms, _d(float(_ZETA_TERMS))), _d(_NAN), s)
    # domain rules, applied in PyTorch's order (last assignment here = first check there)
    q_nonpos = op.LessOrEqual(q, _d(0.0))
    s = op.Where(op.And(q_nonpos, op.Not(op.Equal(x, op.Floor(x)))), _d(_NAN), s)
    s = op.Where(op.And(q_nonpos, op.Equal(q, op.Floor(q))), _d(_INF), s)
    s = op.Where(op.Less(x, _d(1.0)), _d(_NAN), s)
    return op.Where(op.Equal(x, _d(1.0)), _d(_INF), s)


def _unary(fn, self):
    """Apply a double-precision kernel to a tensor and cast to its float result type."""
    return _from_d(fn(_to_d(self)), _out_type(self), self)


def _compute_type(x) -> ir.DataType:
    """The type PyTorch's CPU kernel computes in: float64 for double, else float32."""
    return ir.DataType.DOUBLE if _out_type(x) == ir.DataType.DOUBLE else ir.DataType.FLOAT


def _rt(v, ct: ir.DataType):
    """Round a double value through PyTorch's compute type (float32 rounding/overflow)."""
    if ct == ir.DataType.DOUBLE:
        return v
    return _to_d(op.Cast(v, to=ct))


def _unary_ct(fn, self):
    """Like _unary, for kernels that reproduce a float32 rounding step of PyTorch's kernel."""
    return _from_d(fn(_to_d(self), _compute_type(self)), _out_type(self), self)


@translation(aten.lgamma.default)
def aten_lgamma(self):
    """lgamma(Tensor self) -> Tensor

    Lanczos (g=7) in float64 with the reflection formula below 0.5; +inf at 0, the negative
    integers and +-inf, like PyTorch. Max error vs PyTorch float32: ~1 ulp.
    """
    return _unary(_lgamma, self)


@translation(aten.digamma.default)
def aten_digamma(self):
    """digamma(Tensor self) -> Tensor

    ATen's Cephes algorithm (recurrence to x >= 10 + asymptotic series, reflection for x < 0)
    in float64. digamma(+-0) = -+inf, NaN at negative integers and -inf. Near the root
    x0 = 1.4616... PyTorch's own float32 kernel loses relative accuracy; compare with an atol.
    """
    return _unary(_digamma, self)


def _polygamma(n: int, self):
    out = _out_type(self)
    x = _to_d(self)
    if n == 0:
        return _from_d(_digamma(x), out, self)
    if n == 1:
        # PyTorch forms pi*x in the input's precision before sin(): reproduce that so the
        # huge finite values it returns at the non-positive integers match.
        xin = op.Cast(self, to=out)
        sin_arg = _to_d(op.Mul(op.CastLike(op.Constant(value_float=math.pi), xin), xin)) \
            if out != ir.DataType.DOUBLE else op.Mul(_d(math.pi), x)
        return _from_d(_trigamma(x, sin_arg), out, self)
    sign = 1.0 if n % 2 else -1.0
    y = op.Mul(_d(sign * float(math.factorial(n))), _zeta(_d(float(n + 1)), x))
    return _from_d(y, out, self)


@translation(aten.polygamma.default)
def aten_polygamma(n: int, self):
    """polygamma(int n, Tensor self) -> Tensor

    n = 0: digamma; n = 1: ATen's trigamma (recurrence + asymptotic, reflection below 0.5);
    n >= 2: (-1)^(n+1) n! zeta(n+1, x) with ATen's Euler-Maclaurin zeta, all in float64.
    For n >= 2 and x < -31 the unrolled direct sum is too short and the result is NaN.
    """
    return _polygamma(n, self)


@translation(aten.special_polygamma.default)
def aten_special_polygamma(n: int, self):
    """special_polygamma(int n, Tensor self) -> Tensor"""
    return _polygamma(n, self)


def _mvlgamma(self, p: int):
    out = _out_type(self)
    x = _to_d(self)
    acc = _d(p * (p - 1) / 4.0 * math.log(math.pi))
    for j in range(p):
        acc = op.Add(acc, _lgamma(op.Sub(x, _d(j / 2.0))))
    return _from_d(acc, out, self)


@translation(aten.mvlgamma.default)
def aten_mvlgamma(self, p: int):
    """mvlgamma(Tensor self, int p) -> Tensor

    sum_j lgamma(x - j/2) + p(p-1)/4 log(pi). PyTorch raises in eager mode when some
    x <= (p-1)/2; the exported graph does not check (data-dependent) and returns the formula.
    """
    return _mvlgamma(self, p)


@translation(aten.special_multigammaln.default)
def aten_special_multigammaln(self, p: int):
    """special_multigammaln(Tensor self, int p) -> Tensor"""
    return _mvlgamma(self, p)


def _zeta_call(x, q, out, *refs):
    return _from_d(_zeta(x, q), out, *refs)


@translation(aten.special_zeta.default)
def aten_special_zeta(self, other):
    """special_zeta(Tensor self, Tensor other) -> Tensor

    Hurwitz zeta(x=self, q=other): ATen's Cephes algorithm (direct sum to q+k > 9, then
    Euler-Maclaurin with 12 Bernoulli terms) in float64. The direct sum is unrolled for
    q >= -31; below that the result is NaN.
    """
    return _zeta_call(_to_d(self), _to_d(other), _out_type(self, other), self, other)


@translation(aten.special_zeta.self_scalar)
def aten_special_zeta_self_scalar(self: float, other):
    """special_zeta.self_scalar(Scalar self, Tensor other) -> Tensor"""
    return _zeta_call(_d(float(self)), _to_d(other), _out_type(other), other)


@translation(aten.special_zeta.other_scalar)
def aten_special_zeta_other_scalar(self, other: float):
    """special_zeta.other_scalar(Tensor self, Scalar other) -> Tensor"""
    return _zeta_call(_to_d(self), _d(float(other)), _out_type(self), self)


# --- modified Bessel functions (Cephes Chebyshev expansions, as in ATen) ----------------------

_I0_A = (
    -4.41534164647933937950e-18, 3.33079451882223809783e-17, -2.43127984654795469359e-16,
    1.71539128555513303061e-15, -1.16853328779934516808e-14, 7.67618549860493561688e-14,
    -4.85644678311192946090e-13, 2.95505266312963983461e-12, -1.72682629144155570723e-11,
    9.67580903537323691224e-11, -5.18979560163526290666e-10, 2.65982372468238665035e-9,
    -1.30002500998624804212e-8, 6.04699502254191894932e-8, -2.67079385394061173391e-7,
    1.11738753912010371815e-6, -4.41673835845875056359e-6, 1.64484480707288970893e-5,
    -5.75419501008210370398e-5, 1.88502885095841655729e-4, -5.76375574538582365885e-4,
    1.63947561694133579842e-3, -4.32430999505057594430e-3, 1.05464603945949983183e-2,
    -2.37374148058994688156e-2, 4.93052842396707084878e-2, -9.49010970480476444210e-2,
    1.71620901522208775349e-1, -3.04682672343198398683e-1, 6.76795274409476084995e-1,
)
_I0_B = (
    -7.23318048787475395456e-18, -4.83050448594418207126e-18, 4.46562142029675999901e-17,
    3.46122286769746109310e-17, -2.82762398051658348494e-16, -3.42548561967721913462e-16,
    1.77256013305652638360e-15, 3.81168066935262242075e-15, -9.55484669882830764870e-15,
    -4.15056934728722208663e-14, 1.54008621752140982691e-14, 3.85277838274214270114e-13,
    7.18012445138366623367e-13, -1.79417853150680611778e-12, -1.32158118404477131188e-11,
    -3.14991652796324136454e-11, 1.18891471078464383424e-11, 4.94060238822496958910e-10,
    3.39623202570838634515e-9, 2.26666899049817806459e-8, 2.04891858946906374183e-7,
    2.89137052083475648297e-6, 6.88975834691682398426e-5, 3.36911647825569408990e-3,
    8.04490411014108831608e-1,
)
_I1_A = (
    2.77791411276104639959e-18, -2.11142121435816608115e-17, 1.55363195773620046921e-16,
    -1.10559694773538630805e-15, 7.60068429473540693410e-15, -5.04218550472791168711e-14,
    3.22379336594557470981e-13, -1.98397439776494371520e-12, 1.17361862988909016308e-11,
    -6.66348972350202774223e-11, 3.62559028155211703701e-10, -1.88724975172282928790e-9,
    9.38153738649577178388e-9, -4.44505912879632808065e-8, 2.00329475355213526229e-7,
    -8.56872026469545474066e-7, 3.47025130813767847674e-6, -1.32731636560394358279e-5,
    4.78156510755005422638e-5, -1.61760815825896745588e-4, 5.12285956168575772895e-4,
    -1.51357245063125314899e-3, 4.15642294431288815669e-3, -1.05640848946261981558e-2,
    2.47264490306265168283e-2, -5.29459812080949914269e-2, 1.02643658689847095384e-1,
    -1.76416518357834055153e-1, 2.52587186443633654823e-1,
)
_I1_B = (
    7.51729631084210481353e-18, 4.41434832307170791151e-18, -4.65030536848935832153e-17,
    -3.20952592199342395980e-17, 2.96262899764595013876e-16, 3.30820231092092828324e-16,
    -1.88035477551078244854e-15, -3.81440307243700780478e-15, 1.04202769841288027642e-14,
    4.27244001671195135429e-14, -2.10154184277266431302e-14, -4.08355111109219731823e-13,
    -7.19855177624590851209e-13, 2.03562854414708950722e-12, 1.41258074366137813316e-11,
    3.25260358301548823856e-11, -1.89749581235054123450e-11, -5.58974346219658380687e-10,
    -3.83538038596423702205e-9, -2.63146884688951950684e-8, -2.51223623787020892529e-7,
    -3.88256480887769039346e-6, -1.10588938762623716291e-4, -9.76109749136146840777e-3,
    7.78576235018280120474e-1,
)
_K0_A = (
    1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11,
    1.90451637722020886025e-09, 2.53479107902614945675e-07, 2.28621210311945178607e-05,
    1.26461541144692592338e-03, 3.59799365153615016266e-02, 3.44289899924628486886e-01,
    -5.35327393233902768720e-01,
)
_K0_B = (
    5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17,
    -1.67823109680541210385e-16, 5.51205597852431940784e-16, -1.84859337734377901440e-15,
    6.34007647740507060557e-15, -2.22751332699166985548e-14, 8.03289077536357521100e-14,
    -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
    1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10,
    -1.69753450938905987466e-09, 8.57403401741422608519e-09, -4.66048989768794782956e-08,
    2.76681363944501510342e-07, -1.83175552271911948767e-06, 1.39498137188764993662e-05,
    -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
    2.44030308206595545468e+00,
)
_K1_A = (
    -7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13,
    -1.41148839263352776110e-10, -2.21338763073472585583e-08, -2.43340614156596823496e-06,
    -1.73028895751305206302e-04, -6.97572385963986435018e-03, -1.22611180822657148235e-01,
    -3.53155960776544875667e-01, 1.52530022733894777053e+00,
)
_K1_B = (
    -5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17,
    1.83809354436663880070e-16, -6.05704724837331885336e-16, 2.03870316562433424052e-15,
    -7.01983709041831346144e-15, 2.47715442448130437068e-14, -8.97670518232499435011e-14,
    3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
    -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10,
    2.01504975519703286596e-09, -1.03457624656780970260e-08, 5.74108412545004946722e-08,
    -3.50196060308781257119e-07, 2.40648494783721712015e-06, -1.93619797416608296024e-05,
    1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
    2.72062619048444266945e+00,
)


def _i0e_abs(ax):
    """exp(-|x|) I0(|x|) for ax = |x|."""
    lo = _chbevl(op.Sub(op.Div(ax, _d(2.0)), _d(2.0)), _I0_A)
    hi = op.Div(_chbevl(op.Sub(op.Div(_d(32.0), ax), _d(2.0)), _I0_B), op.Sqrt(ax))
    return op.Where(op.LessOrEqual(ax, _d(8.0)), lo, hi)


def _i1e_abs(ax):
    """exp(-|x|) I1(|x|) for ax = |x|."""
    lo = op.Mul(_chbevl(op.Sub(op.Div(ax, _d(2.0)), _d(2.0)), _I1_A), ax)
    hi = op.Div(_chbevl(op.Sub(op.Div(_d(32.0), ax), _d(2.0)), _I1_B), op.Sqrt(ax))
    return op.Where(op.LessOrEqual(ax, _d(8.0)), lo, hi)


def _i0(x, ct=_DOUBLE):
    ax = op.Abs(x)
    ex = _rt(op.Exp(ax), ct)  # exp(|x|) overflows in PyTorch's float32 kernel above ~88.7
    lo = op.Mul(ex, _chbevl(op.Sub(op.Div(ax, _d(2.0)), _d(2.0)), _I0_A))
    # exp(x) * chbevl / sqrt(x): at +-inf this is inf/inf = NaN, as in PyTorch
    hi = op.Div(op.Mul(ex, _chbevl(op.Sub(op.Div(_d(32.0), ax), _d(2.0)), _I0_B)),
                op.Sqrt(ax))
    return op.Where(op.LessOrEqual(ax, _d(8.0)), lo, hi)


def _i0e(x):
    return _i0e_abs(op.Abs(x))


def _signed(x, v):
    return op.Where(op.Less(x, _d(0.0)), op.Neg(v), v)


def _i1(x, ct=_DOUBLE):
    ax = op.Abs(x)
    ex = _rt(op.Exp(ax), ct)
    lo = op.Mul(op.Mul(ex, ax), _chbevl(op.Sub(op.Div(ax, _d(2.0)), _d(2.0)), _I1_A))
    hi = op.Div(op.Mul(ex, _chbevl(op.Sub(op.Div(_d(32.0), ax), _d(2.0)), _I1_B)),
                op.Sqrt(ax))
    return _signed(x, op.Where(op.LessOrEqual(ax, _d(8.0)), lo, hi))


def _i1e(x):
    return _signed(x, _i1e_abs(op.Abs(x)))


def _k_domain(x, y):
    y = op.Where(op.Less(x, _d(0.0)), _d(_NAN), y)
    return op.Where(op.Equal(x, _d(0.0)), _d(_INF), y)


def _k0(x, scaled: bool):
    small = op.LessOrEqual(x, _d(2.0))
    lo = op.Sub(_chbevl(op.Sub(op.Mul(x, x), _d(2.0)), _K0_A),
                op.Mul(op.Log(op.Mul(_d(0.5), x)), _i0(x)))
    hi = op.Div(_chbevl(op.Sub(op.Div(_d(8.0), x), _d(2.0)), _K0_B), op.Sqrt(x))
    if scaled:
        lo = op.Mul(lo, op.Exp(x))
    else:
        hi = op.Mul(op.Exp(op.Neg(x)), hi)
    return _k_domain(x, op.Where(small, lo, hi))


def _k1(x, scaled: bool):
    small = op.LessOrEqual(x, _d(2.0))
    lo = op.Add(op.Mul(op.Log(op.Mul(_d(0.5), x)), _i1(x)),
                op.Div(_chbevl(op.Sub(op.Mul(x, x), _d(2.0)), _K1_A), x))
    hi = op.Div(_chbevl(op.Sub(op.Div(_d(8.0), x), _d(2.0)), _K1_B), op.Sqrt(x))
    if scaled:
        lo = op.Mul(lo, op.Exp(x))
    else:
        hi = op.Mul(op.Exp(op.Neg(x)), hi)
    return _k_domain(x, op.Where(small, lo, hi))


@translation(aten.i0.default)
def aten_i0(self):
    """i0(Tensor self) -> Tensor

    Cephes Chebyshev expansions on [0, 8] and (8, inf) in float64 (NaN at +-inf, like PyTorch).
    """
    return _unary_ct(_i0, self)


@translation(aten.special_i0e.default)
def aten_special_i0e(self):
    """special_i0e(Tensor self) -> Tensor"""
    return _unary(_i0e, self)


@translation(aten.special_i1.default)
def aten_special_i1(self):
    """special_i1(Tensor self) -> Tensor

    Cephes in float64 with the full double coefficient set (PyTorch's float32 kernel uses a
    truncated set, accurate to ~1e-7 relative).
    """
    return _unary_ct(_i1, self)


@translation(aten.special_i1e.default)
def aten_special_i1e(self):
    """special_i1e(Tensor self) -> Tensor"""
    return _unary(_i1e, self)


@translation(aten.special_modified_bessel_i0.default)
def aten_special_modified_bessel_i0(self):
    """special_modified_bessel_i0(Tensor self) -> Tensor"""
    return _unary_ct(_i0, self)


@translation(aten.special_modified_bessel_i1.default)
def aten_special_modified_bessel_i1(self):
    """special_modified_bessel_i1(Tensor self) -> Tensor"""
    return _unary_ct(_i1, self)


@translation(aten.special_modified_bessel_k0.default)
def aten_special_modified_bessel_k0(self):
    """special_modified_bessel_k0(Tensor self) -> Tensor

    Cephes: Chebyshev in x^2 on (0, 2] with the log(x/2) I0(x) term, in 8/x above. +inf at 0,
    NaN below 0.
    """
    return _unary(lambda x: _k0(x, False), self)


@translation(aten.special_modified_bessel_k1.default)
def aten_special_modified_bessel_k1(self):
    """special_modified_bessel_k1(Tensor self) -> Tensor"""
    return _unary(lambda x: _k1(x, False), self)


@translation(aten.special_scaled_modified_bessel_k0.default)
def aten_special_scaled_modified_bessel_k0(x):
    """special_scaled_modified_bessel_k0(Tensor x) -> Tensor"""
    return _unary(lambda v: _k0(v, True), x)


@translation(aten.special_scaled_modified_bessel_k1.default)
def aten_special_scaled_modified_bessel_k1(x):
    """special_scaled_modified_bessel_k1(Tensor x) -> Tensor"""
    return _unary(lambda v: _k1(v, True), x)


# --- Bessel functions of the first and second kind (Cephes, as in ATen) ------------------------

_J0_PP = (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e+00,
          5.44725003058768775090e+00, 8.74716500199817011941e+00, 5.30324038235394892183e+00,
          9.99999999999999997821e-01)
_J0_PQ = (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e+00,
          5.47097740330417105182e+00, 8.76190883237069594232e+00, 5.30605288235394617618e+00,
          1.00000000000000000218e+00)
_J0_QP = (-1.13663838898469149931e-02, -1.28252718670509318512e+00, -1.95539544257735972385e+01,
          -9.32060152123768231369e+01, -1.77681167980488050595e+02, -1.47077505154951170175e+02,
          -5.14105326766599330220e+01, -6.05014350600728481186e+00)
_J0_QQ = (6.43178256118178023184e+01, 8.56430025976980587198e+02, 3.88240183605401609683e+03,
          7.24046774195652478189e+03, 5.93072701187316984827e+03, 2.06209331660327847417e+03,
          2.42005740240291393179e+02)
_J0_RP = (-4.79443220978201773821e+09, 1.95617491946556577543e+12, -2.49248344360967716204e+14,
          9.70862251047306323952e+15)
_J0_RQ = (4.99563147152651017219e+02, 1.73785401676374683123e+05, 4.84409658339962045305e+07,
          1.11855537045356834862e+10, 2.11277520115489217587e+12, 3.10518229857422583814e+14,
          3.18121955943204943306e+16, 1.71086294081043136091e+18)
_J1_PP = (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e+00,
          5.11207951146807644818e+00, 8.42404590141772420927e+00, 5.21451598682361504063e+00,
          1.00000000000000000254e+00)
_J1_PQ = (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e+00,
          5.07386386128601488557e+00, 8.39985554327604159757e+00, 5.20982848682361821619e+00,
          9.99999999999999997461e-01)
_J1_QP = (5.10862594750176621635e-02, 4.98213872951233449420e+00, 7.58238284132545283818e+01,
          3.66779609360150777800e+02, 7.10856304998926107277e+02, 5.97489612400613639965e+02,
          2.11688757100572135698e+02, 2.52070205858023719784e+01)
_J1_QQ = (7.42373277035675149943e+01, 1.05644886038262816351e+03, 4.98641058337653607651e+03,
          9.56231892404756170795e+03, 7.99704160447350683650e+03, 2.82619278517639096600e+03,
          3.36093607810698293419e+02)
_J1_RP = (-8.99971225705559398224e+08, 4.52228297998194034323e+11, -7.27494245221818276015e+13,
          3.68295732863852883286e+15)
_J1_RQ = (6.20836478118054335476e+02, 2.56987256757748830383e+05, 8.35146791431949253037e+07,
          2.21511595479792499675e+10, 4.74914122079991414898e+12, 7.84369607876235854894e+14,
          8.95222336184627338078e+16, 5.32278620332680085395e+18)
_Y0_YP = (1.55924367855235737965e+04, -1.46639295903971606143e+07, 5.43526477051876500413e+09,
          -9.82136065717911466409e+11, 8.75906394395366999549e+13, -3.46628303384729719441e+15,
          4.42733268572569800351e+16, -1.84950800436986690637e+16)
_Y0_YQ = (1.04128353664259848412e+03, 6.26107330137134956842e+05, 2.68919633393814121987e+08,
          8.64002487103935000337e+10, 2.02979612750105546709e+13, 3.17157752842975028269e+15,
          2.50596256172653059228e+17)
_Y1_YP = (1.26320474790178026440e+09, -6.47355876379160291031e+11, 1.14509511541823727583e+14,
          -8.12770255501325109621e+15, 2.02439475713594898196e+17, -7.78877196265950026825e+17)
_Y1_YQ = (5.94301592346128195359e+02, 2.35564092943068577943e+05, 7.34811944459721705660e+07,
          1.87601316108706159478e+10, 3.88231277496238566008e+12, 6.20557727146953693363e+14,
          6.87141087355300489866e+16, 3.97270608116560655612e+18)
_SQ2OPI = 0.797884560802865355879892119868763737  # sqrt(2/pi)
_TWO_OPI = 0.636619772367581343075535053490057448  # 2/pi
_PIO4 = 0.785398163397448309615660845819875721
_THPIO4 = 2.356194490192344928846982537459627163


def _polevl0(x, coeffs):
    """ATen's loop form: r = 0; r = r*x + c for c in coeffs (same as polevl)."""
    return _polevl(x, coeffs)


def _asym(x, pp, pq, qp, qq, phase, y_kind: bool, ct=_DOUBLE):
    """Hankel asymptotic form for x > 5: (P cos/sin - 5/x Q sin/cos) sqrt(2/pi)/sqrt(x)."""
    z = op.Div(_d(25.0), op.Mul(x, x))
    p = op.Div(_polevl0(z, pp), _polevl0(z, pq))
    q = op.Div(_polevl0(z, qp), _polevl0(z, qq))
    # PyTorch forms x - phase in the input's precision; for large float32 x that rounding
    # dominates the result, so reproduce it
    xn = _rt(op.Sub(x, _rt(_d(phase), ct)), ct)
    fq = op.Mul(op.Div(_d(5.0), x), q)
    if y_kind:
        v = op.Add(op.Mul(p, op.Sin(xn)), op.Mul(fq, op.Cos(xn)))
    else:
        v = op.Sub(op.Mul(p, op.Cos(xn)), op.Mul(fq, op.Sin(xn)))
    return op.Div(op.Mul(v, _d(_SQ2OPI)), op.Sqrt(x))


def _j0_abs(x, ct=_DOUBLE):
    x2 = op.Mul(x, x)
    small = op.Div(op.Mul(op.Mul(op.Sub(x2, _d(5.78318596294678452118e+00)),
                                 op.Sub(x2, _d(3.04712623436620863991e+01))),
                          _polevl0(x2, _J0_RP)), _polevl0(x2, _J0_RQ))
    tiny = op.Sub(_d(1.0), op.Div(x2, _d(4.0)))
    small = op.Where(op.Less(x, _d(1e-5)), tiny, small)
    big = _asym(x, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PIO4, False, ct)
    return op.Where(op.LessOrEqual(x, _d(5.0)), small, big)


def _j0(x, ct=_DOUBLE):
    return _j0_abs(op.Abs(x), ct)


def _j1_abs(x, ct=_DOUBLE):
    x2 = op.Mul(x, x)
    small = op.Mul(op.Mul(op.Mul(op.Div(_polevl0(x2, _J1_RP), _polevl0(x2, _J1_RQ)), x),
                          op.Sub(x2, _d(1.46819706421238932572e+01))),
                   op.Sub(x2, _d(4.92184563216946036703e+01)))
    big = _asym(x, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _THPIO4, False, ct)
    return op.Where(op.LessOrEqual(x, _d(5.0)), small, big)


def _j1(x, ct=_DOUBLE):
    return _signed(x, _j1_abs(op.Abs(x), ct))


def _y0(x, ct=_DOUBLE):
    x2 = op.Mul(x, x)
    small = op.Add(op.Div(_polevl0(x2, _Y0_YP), _polevl0(x2, _Y0_YQ)),
                   op.Mul(op.Mul(_d(_TWO_OPI), op.Log(x)), _j0_abs(x, ct)))
    big = _asym(x, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PIO4, True, ct)
    y = op.Where(op.LessOrEqual(x, _d(5.0)), small, big)
    y = op.Where(op.Less(x, _d(0.0)), _d(_NAN), y)
    return op.Where(op.Equal(x, _d(0.0)), _d(-_INF), y)


def _y1(x, ct=_DOUBLE):
    x2 = op.Mul(x, x)
    small = op.Add(op.Mul(x, op.Div(_polevl0(x2, _Y1_YP), _polevl0(x2, _Y1_YQ))),
                   op.Mul(_d(_TWO_OPI), op.Sub(op.Mul(_j1_abs(x, ct), op.Log(x)),
                                               op.Reciprocal(x))))
    big = _asym(x, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _THPIO4, True, ct)
    y = op.Where(op.LessOrEqual(x, _d(5.0)), small, big)
    y = op.Where(op.Less(x, _d(0.0)), _d(_NAN), y)
    return op.Where(op.Equal(x, _d(0.0)), _d(-_INF), y)


@translation(aten.special_bessel_j0.default)
def aten_special_bessel_j0(self):
    """special_bessel_j0(Tensor self) -> Tensor

    Cephes rational approximation on [0, 5], Hankel asymptotic form above, in float64. Near
    the zeros of J0 PyTorch's float32 kernel (sin/cos of a float32 argument) has absolute
    error ~1e-7, so relative comparisons there need an atol.
    """
    return _unary_ct(_j0, self)


@translation(aten.special_bessel_j1.default)
def aten_special_bessel_j1(self):
    """special_bessel_j1(Tensor self) -> Tensor"""
    return _unary_ct(_j1, self)


@translation(aten.special_bessel_y0.default)
def aten_special_bessel_y0(self):
    """special_bessel_y0(Tensor self) -> Tensor

    -inf at 0, NaN for x < 0 (as PyTorch).
    """
    return _unary_ct(_y0, self)


@translation(aten.special_bessel_y1.default)
def aten_special_bessel_y1(self):
    """special_bessel_y1(Tensor self) -> Tensor"""
    return _unary_ct(_y1, self)


# --- error-function family ---------------------------------------------------------------------
# Cephes erf/erfc (ndtr.c) in float64: ONNX Runtime has no double Erf kernel.

_ERF_T = (9.60497373987051638749E0, 9.00260197203842689217E1, 2.23200534594684319226E3,
          7.00332514112805075473E3, 5.55923013010394962768E4)
_ERF_U = (3.35617141647503099647E1, 5.21357949780152679795E2, 4.59432382970980127987E3,
          2.26290000613890934246E4, 4.92673942608635921086E4)
_ERFC_P = (2.46196981473530512524E-10, 5.64189564831068821977E-1, 7.46321056442269912687E0,
           4.86371970985681366614E1, 1.96520832956077098242E2, 5.26445194995477358631E2,
           9.34528527171957607540E2, 1.02755188689515710272E3, 5.57535335369399327526E2)
_ERFC_Q = (1.32281951154744992508E1, 8.67072140885989742329E1, 3.54937778887819891062E2,
           9.75708501743205489753E2, 1.82390916687909736289E3, 2.24633760818710981792E3,
           1.65666309194161350182E3, 5.57535340817727675546E2)
_ERFC_R = (5.64189583547755073984E-1, 1.27536670759978104416E0, 5.01905042251180477414E0,
           6.16021097993053585195E0, 7.40974269950448939160E0, 2.97886665372100240670E0)
_ERFC_S = (2.26052863220117276590E0, 9.39603524938001434673E0, 1.20489539808096656605E1,
           1.70814450747565897222E1, 9.60896809063285878198E0, 3.36907645100081516050E0)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)


def _erf_small(x):
    """erf(x) for |x| <= 1 (meaningful there only)."""
    z = op.Mul(x, x)
    return op.Div(op.Mul(x, _polevl(z, _ERF_T)), _p1evl(z, _ERF_U))


def _erfcx_ge1(x):
    """exp(x^2) erfc(x) for x >= 1 (Cephes P/Q on [1, 8), R/S above, 1/(x sqrt(pi)) far out)."""
    pq = op.Div(_polevl(x, _ERFC_P), _p1evl(x, _ERFC_Q))
    rs = op.Div(_polevl(x, _ERFC_R), _p1evl(x, _ERFC_S))
    far = op.Div(_d(_INV_SQRT_PI), x)
    y = op.Where(op.Less(x, _d(8.0)), pq, rs)
    return op.Where(op.Greater(x, _d(1e8)), far, y)


def _erf(x):
    ax = op.Abs(x)
    big = op.Sub(_d(1.0), op.Mul(op.Exp(op.Neg(op.Mul(x, x))), _erfcx_ge1(ax)))
    big = op.Where(op.Less(x, _d(0.0)), op.Neg(big), big)
    return op.Where(op.LessOrEqual(ax, _d(1.0)), _erf_small(x), big)


def _erfc(x):
    ax = op.Abs(x)
    tail = op.Mul(op.Exp(op.Neg(op.Mul(x, x))), _erfcx_ge1(ax))  # erfc(|x|), |x| >= 1
    tail = op.Where(op.Less(x, _d(0.0)), op.Sub(_d(2.0), tail), tail)
    return op.Where(op.Less(ax, _d(1.0)), op.Sub(_d(1.0), _erf_small(x)), tail)


def _erfcx(x):
    ax = op.Abs(x)
    pos = op.Where(op.Less(ax, _d(1.0)),
                   op.Mul(op.Exp(op.Mul(x, x)), op.Sub(_d(1.0), _erf_small(ax))),
                   _erfcx_ge1(ax))  # erfcx(|x|)
    neg = op.Sub(op.Mul(_d(2.0), op.Exp(op.Mul(x, x))), pos)  # erfcx(-|x|)
    return op.Where(op.Less(x, _d(0.0)), neg, pos)


_SQRT1_2 = math.sqrt(0.5)


def _log_ndtr(x):
    t = op.Mul(x, _d(_SQRT1_2))
    lower = op.Sub(op.Log(op.Div(_erfcx(op.Neg(t)), _d(2.0))), op.Mul(t, t))
    upper = _log1p(op.Neg(op.Div(_erfc(t), _d(2.0))))
    return op.Where(op.Less(x, _d(-1.0)), lower, upper)


@translation(aten.special_erfcx.default, overrides_torchlib=True)
def aten_special_erfcx(self):
    """special_erfcx(Tensor self) -> Tensor

    Cephes erfc rational approximations (which are erfcx times exp(-x^2)) evaluated without the
    exponential for x >= 1, exp(x^2)(1 - erf(x)) below, and 2 exp(x^2) - erfcx(-x) for x < 0,
    in float64. torchlib computes exp(x^2) * erfc(x) in the input type, which is inf * 0 = NaN
    or 0 for x > ~9 in float32.
    """
    return _unary(_erfcx, self)


@translation(aten.special_log_ndtr.default, overrides_torchlib=True)
def aten_special_log_ndtr(self):
    """special_log_ndtr(Tensor self) -> Tensor

    ATen's formula: log(erfcx(-x/sqrt2)/2) - x^2/2 for x < -1, log1p(-erfc(x/sqrt2)/2) above,
    in float64. torchlib's log(ndtr(x)) underflows to -inf for x < ~-14 in float32.
    """
    return _unary(_log_ndtr, self)


@translation(aten.special_ndtr.default, overrides_torchlib=True)
def aten_special_ndtr(self):
    """special_ndtr(Tensor self) -> Tensor

    PyTorch computes 0.5 * (1 + erf(x / sqrt2)) (so its lower tail flushes to 0 below x ~ -5.4
    in float32 and ~ -8.3 in float64); this reproduces that formula. float32 uses ONNX Erf, as
    torchlib does; float64 uses the Cephes erf in double, because ONNX Runtime has no double
    Erf kernel (torchlib's translation fails to run for float64).
    """
    out = _out_type(self)
    if out == ir.DataType.DOUBLE:
        x = _to_d(self)
        y = op.Mul(_d(0.5), op.Add(_d(1.0), _erf(op.Mul(x, _d(_SQRT1_2)))))
        return _from_d(y, out, self)
    x = op.Cast(self, to=ir.DataType.FLOAT)
    half = op.Constant(value_float=0.5)
    y = op.Mul(half, op.Add(op.Constant(value_float=1.0),
                            op.Erf(op.Mul(x, op.Constant(value_float=_SQRT1_2)))))
    return op.Cast(y, to=out)


_NDTRI_P0 = (-5.99633501014107895267E1, 9.80010754185999661536E1, -5.66762857469070293439E1,
             1.39312609387279679503E1, -1.23916583867381258016E0)
_NDTRI_Q0 = (1.00000000000000000000E0, 1.95448858338141759834E0, 4.67627912898881538453E0,
             8.63602421390890590575E1, -2.25462687854119370527E2, 2.00260212380060660359E2,
             -8.20372256168333339912E1, 1.59056225126211695515E1, -1.18331621121330003142E0)
_NDTRI_P1 = (4.05544892305962419923E0, 3.15251094599893866154E1, 5.71628192246421288162E1,
             4.40805073893200834700E1, 1.46849561928858024014E1, 2.18663306850790267539E0,
             -1.40256079171354495875E-1, -3.50424626827848203418E-2, -8.57456785154685413611E-4)
_NDTRI_Q1 = (1.00000000000000000000E0, 1.57799883256466749731E1, 4.53907635128879210584E1,
             4.13172038254672030440E1, 1.50425385692907503408E1, 2.50464946208309415979E0,
             -1.42182922854787788574E-1, -3.80806407691578277194E-2, -9.33259480895457427372E-4)
_NDTRI_P2 = (3.23774891776946035970E0, 6.91522889068984211695E0, 3.93881025292474443415E0,
             1.33303460815807542389E0, 2.01485389549179081538E-1, 1.23716634817820021358E-2,
             3.01581553508235416007E-4, 2.65806974686737550832E-6, 6.23974539184983293730E-9)
_NDTRI_Q2 = (1.00000000000000000000E0, 6.02427039364742014255E0, 3.67983563856160859403E0,
             1.37702099489081330271E0, 2.16236993594496635890E-1, 1.34204006088543189037E-2,
             3.28014464682127739104E-4, 2.89247864745380683936E-6, 6.79019408009981274425E-9)
_EXPM2 = 0.13533528323661269189


def _ndtri(y0):
    upper = op.Greater(y0, _d(1.0 - _EXPM2))
    y = op.Where(upper, op.Sub(_d(1.0), y0), y0)
    # central region
    yc = op.Sub(y, _d(0.5))
    y2 = op.Mul(yc, yc)
    central = op.Mul(op.Add(yc, op.Mul(yc, op.Div(op.Mul(y2, _polevl(y2, _NDTRI_P0)),
                                                   _polevl(y2, _NDTRI_Q0)))),
                     _d(2.50662827463100050242E0))
    # tails
    ys = op.Max(y, _d(1e-300))  # keep the unused branch finite
    x = op.Sqrt(op.Mul(_d(-2.0), op.Log(ys)))
    x0 = op.Sub(x, op.Div(op.Log(x), x))
    z = op.Reciprocal(x)
    x1a = op.Div(op.Mul(z, _polevl(z, _NDTRI_P1)), _polevl(z, _NDTRI_Q1))
    x1b = op.Div(op.Mul(z, _polevl(z, _NDTRI_P2)), _polevl(z, _NDTRI_Q2))
    tail = op.Sub(x0, op.Where(op.Less(x, _d(8.0)), x1a, x1b))
    tail = op.Where(upper, tail, op.Neg(tail))
    out = op.Where(op.Greater(y, _d(_EXPM2)), central, tail)
    out = op.Where(op.Or(op.Less(y0, _d(0.0)), op.Greater(y0, _d(1.0))), _d(_NAN), out)
    out = op.Where(op.Equal(y0, _d(1.0)), _d(_INF), out)
    return op.Where(op.Equal(y0, _d(0.0)), _d(-_INF), out)


@translation(aten.special_ndtri.default)
def aten_special_ndtri(self):
    """special_ndtri(Tensor self) -> Tensor

    Cephes ndtri (three rational approximations) in float64; -inf at 0, +inf at 1, NaN outside.
    """
    return _unary(_ndtri, self)


# --- xlogy / xlog1py ---------------------------------------------------------------------------


def _xlogy_core(x, y, log_fn):
    """x * log_fn(y), 0 where x == 0, NaN where y is NaN (PyTorch's order of checks)."""
    r = op.Mul(x, log_fn(y))
    r = op.Where(op.Equal(x, _d(0.0)), _d(0.0), r)
    return op.Where(op.IsNaN(y), _d(_NAN), r)


def _scalar(v) -> Any:
    return _d(float(v))


@translation(aten.xlogy.Tensor, overrides_torchlib=True)
def aten_xlogy_tensor(self, other):
    """xlogy.Tensor(Tensor self, Tensor other) -> Tensor

    torchlib returns 0 for xlogy(0, NaN); PyTorch returns NaN. Computed in float64.
    """
    return _from_d(_xlogy_core(_to_d(self), _to_d(other), op.Log), _out_type(self, other), self, other)


@translation(aten.xlogy.Scalar_Self, overrides_torchlib=True)
def aten_xlogy_scalar_self(self: float, other):
    """xlogy.Scalar_Self(Scalar self, Tensor other) -> Tensor"""
    return _from_d(_xlogy_core(_scalar(self), _to_d(other), op.Log), _out_type(other), other)


@translation(aten.xlogy.Scalar_Other, overrides_torchlib=True)
def aten_xlogy_scalar_other(self, other: float):
    """xlogy.Scalar_Other(Tensor self, Scalar other) -> Tensor"""
    return _from_d(_xlogy_core(_to_d(self), _scalar(other), op.Log), _out_type(self), self)


@translation(aten.special_xlog1py.default, overrides_torchlib=True)
def aten_special_xlog1py(self, other):
    """special_xlog1py(Tensor self, Tensor other) -> Tensor

    x * log1p(y) with an accurate log1p (torchlib's log(1 + y) is 0 for |y| < 6e-8 in float32),
    0 where x == 0, NaN where y is NaN. Computed in float64.
    """
    return _from_d(_xlogy_core(_to_d(self), _to_d(other), _log1p), _out_type(self, other), self, other)


@translation(aten.special_xlog1py.self_scalar)
def aten_special_xlog1py_self_scalar(self: float, other):
    """special_xlog1py.self_scalar(Scalar self, Tensor other) -> Tensor"""
    return _from_d(_xlogy_core(_scalar(self), _to_d(other), _log1p), _out_type(other), other)


@translation(aten.special_xlog1py.other_scalar)
def aten_special_xlog1py_other_scalar(self, other: float):
    """special_xlog1py.other_scalar(Tensor self, Scalar other) -> Tensor"""
    return _from_d(_xlogy_core(_to_d(self), _scalar(other), _log1p), _out_type(self), self)
