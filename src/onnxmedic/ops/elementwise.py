"""Elementwise ops torchlib lacks or gets wrong at the edges.

Missing in torchlib (export fails): hypot, copysign, nextafter, frexp, gcd, lcm, rrelu (eval),
``__lshift__.Tensor`` / ``__rshift__.Tensor``.

Overridden because torchlib's translation silently differs from PyTorch:

* signbit: ``x < 0`` is False for -0.0.
* heaviside: NaN input gives 1 (PyTorch: 0, since ``NaN > 0`` is false).
* logaddexp / logaddexp2: ``log(exp(a) + exp(b))`` overflows to inf for a, b > 88 and underflows
  to -inf for a, b < -104 (float32); PyTorch uses ``max + log1p(exp(-|a - b|))``.
* remainder (floats): ``a - floor(a / b) * b`` gives NaN for a finite ``a`` and an infinite ``b``
  and loses all precision when ``a / b`` is large; PyTorch uses fmod plus a sign fix-up.
* fmod (int64): ONNX Runtime's ``Mod(fmod=1)`` goes through ``std::fmod`` on doubles, so int64
  values above 2**53 come out wrong; integers use ``a - trunc(a / b) * b`` instead.
* fmod / remainder (signed ints): ``MIN % -1`` kills the process with SIGFPE in ONNX Runtime
  (x86 idiv overflow); PyTorch returns 0. The divisor -1 is replaced by 1 (same result).
* bitwise shifts: ONNX Runtime has no 16-bit BitShift kernel, and shift counts at or above the
  bit width (or negative) are undefined in C++; PyTorch defines them (0 for left shifts, the
  sign fill for right shifts).

Everything is built from standard opset-18 ops. There is no bit reinterpretation (Bitcast) in
opset 18, so the sign bit of a NaN cannot be read: signbit/copysign treat every NaN as positive.
Exponent extraction (nextafter, frexp) is done with exact power-of-two arithmetic in float64.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.evaluator
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._registry import translation

aten = torch.ops.aten

F32 = ir.DataType.FLOAT
F64 = ir.DataType.DOUBLE
F16 = ir.DataType.FLOAT16
BF16 = ir.DataType.BFLOAT16
_FLOATS = (F32, F64, F16, BF16)

# (precision p incl. the implicit bit, minimum normal exponent, largest finite) per float dtype
_FLOAT_FORMAT = {
    F32: (24, -126, float(np.finfo(np.float32).max)),
    F64: (53, -1022, float(np.finfo(np.float64).max)),
    F16: (11, -14, 65504.0),
    BF16: (8, -126, 3.3895313892515355e38),
}

_UNSIGNED = {8: ir.DataType.UINT8, 16: ir.DataType.UINT16, 32: ir.DataType.UINT32,
             64: ir.DataType.UINT64}


# ----------------------------------------------------------------------------- helpers

def _k(value, dtype: ir.DataType):
    """An exact 0-d constant of ``dtype`` (stored in that dtype, no CastLike rounding)."""
    if dtype == BF16:
        return op.Cast(op.Constant(value=ir.tensor(np.array(value, dtype=np.float32))), to=BF16)
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


def _is_float(x) -> bool:
    return x.dtype in _FLOATS


def _promote_float(*xs):
    """Cast the inputs to one floating dtype the way PyTorch promotes them (ints -> float32)."""
    dts = [x.dtype for x in xs]
    floats = [d for d in dts if d in _FLOATS]
    if not floats:
        target = F32
    elif F64 in floats:
        target = F64
    elif F32 in floats:
        target = F32
    elif len(set(floats)) > 1:  # float16 with bfloat16
        target = F32
    else:
        target = floats[0]
    return target, [x if x.dtype == target else op.Cast(x, to=target) for x in xs]


def _common(*xs):
    """Cast the inputs to their common dtype by PyTorch's promotion rules (usually a no-op).

    Values without a recorded dtype are constants this module made in the right dtype."""
    dts = [x.dtype for x in xs if x.dtype is not None]
    if all(d == dts[0] for d in dts):
        return dts[0], list(xs)
    target_t = _TORCH_DTYPE[dts[0]]
    for d in dts[1:]:
        target_t = torch.promote_types(target_t, _TORCH_DTYPE[d])
    target = next(k for k, v in _TORCH_DTYPE.items() if v == target_t)
    return target, [x if x.dtype in (target, None) else op.Cast(x, to=target) for x in xs]


_TORCH_DTYPE = {
    F32: torch.float32, F64: torch.float64, F16: torch.float16, BF16: torch.bfloat16,
    ir.DataType.INT8: torch.int8, ir.DataType.INT16: torch.int16, ir.DataType.INT32: torch.int32,
    ir.DataType.INT64: torch.int64, ir.DataType.UINT8: torch.uint8, ir.DataType.BOOL: torch.bool,
}


_NARROW = (ir.DataType.INT8, ir.DataType.INT16)


def _widen(dt, *xs):
    """int8/int16 are computed as int32 (ONNX Runtime has no int16 Where/Max/BitShift kernels);
    returns the working dtype and the values. Narrow results are cast back modulo 2**bits."""
    if dt in _NARROW:
        return ir.DataType.INT32, [op.Cast(x, to=ir.DataType.INT32) for x in xs]
    return dt, list(xs)


def _narrow(r, dt, wdt):
    return r if dt == wdt else op.Cast(r, to=dt)


def _scalar_like(value, like):
    """A Python scalar as a 0-d constant of ``like``'s dtype."""
    return _k(value, like.dtype)


def _float_signbit(x, dt):
    """Sign bit of a float tensor, -0.0 included (via 1/-0 = -inf); NaN counts as positive."""
    zero = _k(0, dt)
    return op.Or(op.Less(x, zero), op.Less(op.Reciprocal(x), zero))


def _signbit(x):
    if x.dtype in _FLOATS:
        return _float_signbit(x, x.dtype)
    if x.dtype == ir.DataType.BOOL or not x.dtype.is_signed():
        return op.Expand(op.Constant(value=ir.tensor(np.array(False))), op.Shape(x))
    return op.Less(x, _k(0, x.dtype))


def _with_sign(mag, negative, dt):
    """|mag| with the sign given by a bool tensor, -0.0 included.

    ONNX Runtime's Where (and float Mod) return +0.0 for a -0.0 input, so a result whose zero
    sign matters is selected as a magnitude and then signed by a product with +-1."""
    return op.Mul(op.Abs(mag), op.Where(negative, _k(-1.0, dt), _k(1.0, dt)))


def _bsel(cond, a, b):
    """Where for bool tensors (ONNX Runtime has no bool Where kernel)."""
    return op.Or(op.And(cond, a), op.And(op.Not(cond), b))


_POW2_MIN, _POW2_MAX = -1074, 1023
_POW2_TABLE = np.ldexp(1.0, np.arange(_POW2_MIN, _POW2_MAX + 1)).astype(np.float64)


def _pow2(e):
    """2**e for a float64 tensor of integral values in [-1074, 1023] (exact, clamped).

    A Gather from a table of every float64 power of two: exact by construction and ~20x faster
    in ONNX Runtime than Pow(2.0, e) on doubles."""
    idx = op.Cast(op.Sub(e, _k(float(_POW2_MIN), F64)), to=ir.DataType.INT64)
    idx = op.Clip(idx, _k(0, ir.DataType.INT64), _k(_POW2_MAX - _POW2_MIN, ir.DataType.INT64))
    return op.Gather(op.Constant(value=ir.tensor(_POW2_TABLE)), idx, axis=0)


def _exponent(ax):
    """(e, 2**e) with e = floor(log2(ax)) exactly, for finite ax > 0 (float64).

    A log2 estimate, corrected by one step against exact powers of two (one table Gather)."""
    e = op.Floor(op.Mul(op.Log(ax), _k(1.0 / math.log(2.0), F64)))
    # the estimate may round up to 1024 just below DBL_MAX: keep it inside the table
    e = op.Max(op.Min(e, _k(float(_POW2_MAX), F64)), _k(float(_POW2_MIN), F64))
    p = _pow2(e)
    one = _k(1.0, F64)
    dec = op.Greater(p, ax)
    inc = op.LessOrEqual(op.Mul(p, _k(2.0, F64)), ax)
    e = op.Add(op.Sub(e, op.Where(dec, one, _k(0.0, F64))), op.Where(inc, one, _k(0.0, F64)))
    p = op.Mul(p, op.Where(dec, _k(0.5, F64), op.Where(inc, _k(2.0, F64), one)))  # exact
    return e, p


def _finite_nonzero(x, dt):
    return op.Not(op.Or(op.Or(op.IsNaN(x), op.IsInf(x)), op.Equal(x, _k(0.0, dt))))


# ----------------------------------------------------------------------------- hypot

def _hypot(a, b):
    dt, (a, b) = _promote_float(a, b)
    if dt != F64:
        # Squares of float32 values are exact in float64 and cannot overflow there: one rounding
        # of the sum, a correctly rounded sqrt, then the cast back (what glibc's hypotf does).
        a64, b64 = op.Cast(a, to=F64), op.Cast(b, to=F64)
        r = op.Sqrt(op.Add(op.Mul(a64, a64), op.Mul(b64, b64)))
        r = op.Cast(r, to=dt)
    else:
        aa, ab = op.Abs(a), op.Abs(b)
        m, n = op.Max(aa, ab), op.Min(aa, ab)
        zero = _k(0.0, F64)
        safe_m = op.Where(op.Equal(m, zero), _k(1.0, F64), m)
        q = op.Div(n, safe_m)
        r = op.Mul(m, op.Sqrt(op.Add(_k(1.0, F64), op.Mul(q, q))))
        r = op.Where(op.Equal(m, zero), zero, r)
        r = op.Where(op.Or(op.IsNaN(a), op.IsNaN(b)), _k(float("nan"), F64), r)
    # hypot(+-inf, anything) is +inf, NaN included.
    return op.Where(op.Or(op.IsInf(a), op.IsInf(b)), _k(float("inf"), dt), r)


@translation(aten.hypot.default)
def aten_hypot(self, other):
    """hypot(Tensor self, Tensor other) -> Tensor

    float32/float16/bfloat16: ``sqrt(a*a + b*b)`` evaluated in float64 (no overflow, one
    rounding); float64: ``m * sqrt(1 + (n/m)**2)`` with m = max(|a|, |b|), within 2 ulp.
    """
    return _hypot(self, other)


# ----------------------------------------------------------------------------- copysign / signbit

def _copysign(a, b):
    neg = _signbit(b)  # from the original dtype: the sign survives any promotion
    dt, (a, _) = _promote_float(a, b)
    return _with_sign(a, neg, dt)


@translation(aten.copysign.Tensor)
def aten_copysign_tensor(self, other):
    """copysign.Tensor(Tensor self, Tensor other) -> Tensor

    The sign of ``other`` includes -0.0; a NaN ``other`` counts as positive (opset 18 cannot
    read a NaN's sign bit).
    """
    return _copysign(self, other)


@translation(aten.copysign.Scalar)
def aten_copysign_scalar(self, other):
    """copysign.Scalar(Tensor self, Scalar other) -> Tensor"""
    mag = op.Abs(self if _is_float(self) else op.Cast(self, to=F32))
    neg = math.copysign(1.0, float(other)) < 0
    return op.Neg(mag) if neg else mag


@translation(aten.signbit.default, overrides_torchlib=True)
def aten_signbit(self):
    """signbit(Tensor self) -> Tensor

    True for negative values and -0.0 (torchlib's ``x < 0`` misses -0.0). NaN counts as
    positive: opset 18 has no way to read a NaN's sign bit.
    """
    return _signbit(self)


# ----------------------------------------------------------------------------- nextafter

def _nextafter(x, y):
    dt, (x, y) = _common(x, y)
    p, emin, fmax = _FLOAT_FORMAT[dt]
    x64 = x if dt == F64 else op.Cast(x, to=F64)
    y64 = y if dt == F64 else op.Cast(y, to=F64)
    zero = _k(0.0, F64)
    one = _k(1.0, F64)
    ax = op.Abs(x64)
    ok = _finite_nonzero(x64, F64)
    safe = op.Where(ok, ax, one)
    e, p2e = _exponent(safe)
    tiny = float(2.0 ** (emin - (p - 1)))
    # spacing above |x|: 2**(e - p + 1), or the denormal spacing below the normal range
    # (powers of two scale exactly; an underflow to 0 is caught by the Max).
    up = op.Max(op.Mul(p2e, _k(2.0 ** -(p - 1), F64)), _k(tiny, F64))
    # spacing below |x|: half as large when |x| is a normal power of two
    halve = op.And(op.Equal(safe, p2e), op.Greater(e, _k(float(emin), F64)))
    down = op.Where(halve, op.Mul(up, _k(0.5, F64)), up)
    away = op.Equal(op.Greater(y64, x64), op.Greater(x64, zero))
    # Magnitude and sign are chosen separately (Where drops the sign of -0.0).
    mag = op.Where(away, op.Add(safe, up), op.Sub(safe, down))
    neg = op.Less(x64, zero)
    x_zero = op.Equal(x64, zero)
    mag = op.Where(x_zero, _k(tiny, F64), mag)
    neg = _bsel(x_zero, op.Less(y64, zero), neg)
    mag = op.Where(op.IsInf(x64), _k(fmax, F64), mag)
    same = op.Equal(x64, y64)
    mag = op.Where(same, y64, mag)
    neg = _bsel(same, _float_signbit(y64, F64), neg)
    mag = op.Where(op.Or(op.IsNaN(x64), op.IsNaN(y64)), _k(float("nan"), F64), mag)
    r = _with_sign(mag, neg, F64)
    # Every candidate is representable in dt (or overflows to inf), so the cast is exact.
    return r if dt == F64 else op.Cast(r, to=dt)


@translation(aten.nextafter.default)
def aten_nextafter(self, other):
    """nextafter(Tensor self, Tensor other) -> Tensor

    Bit-exact: the exponent of |x| is found exactly (log2 estimate corrected with exact powers
    of two in float64) and x +- one ulp is exact in floating arithmetic. Handles denormals, +-0
    (nextafter(0, y) is the signed smallest denormal, nextafter(x, x) is y), +-inf and overflow
    to inf. float32/float16/bfloat16 are computed in float64 and cast back exactly.
    """
    return _nextafter(self, other)


# ----------------------------------------------------------------------------- frexp

@translation(aten.frexp.Tensor)
def aten_frexp_tensor(self):
    """frexp.Tensor(Tensor self) -> (Tensor mantissa, Tensor exponent)

    mantissa in [0.5, 1) with the sign of x, x = mantissa * 2**exponent, exponent int32.
    0, -0, inf and NaN give (x, 0) like std::frexp. Exact (power-of-two scaling in float64).
    """
    dt = self.dtype
    x64 = self if dt == F64 else op.Cast(self, to=F64)
    ok = _finite_nonzero(x64, F64)
    one = _k(1.0, F64)
    safe = op.Where(ok, op.Abs(x64), one)
    e, p2e = _exponent(safe)
    e = op.Add(e, one)  # |x| = m * 2**e, m in [0.5, 1)
    # x / 2**floor(log2|x|) is exact (in [1, 2), even for denormal x), then halved exactly.
    # For 0, inf and NaN (safe = 1, p2e = 1) this is x / 2 = x, signed zeros included; no Where
    # (ONNX Runtime's Where drops the sign of -0.0).
    m = op.Mul(op.Div(x64, p2e), _k(0.5, F64))
    if dt != F64:
        m = op.Cast(m, to=dt)
    exp = op.Where(ok, op.Cast(e, to=ir.DataType.INT32), _k(0, ir.DataType.INT32))
    return m, exp


# ----------------------------------------------------------------------------- ldexp

@translation(aten.ldexp.Tensor, overrides_torchlib=True)
def aten_ldexp_tensor(self, other):
    """ldexp.Tensor(Tensor self, Tensor other) -> Tensor

    ``self * 2**other`` rounded once. PyTorch's decomposition (``self * pow(2., other)``) builds
    2**other in float32, which is inf/0 for |other| > 127/149 even when the product is finite
    (ldexp(1e-30, 200) = 1.6e30 eagerly, inf after export). float32/float16/bfloat16 and ints
    are scaled exactly in float64 (exponent clamped to +-400, beyond which every result is
    already 0 or inf) and cast back; float64 uses three power-of-two factors (exponent clamped
    to +-2200), which can round twice only when the result is a float64 denormal.
    """
    dt = self.dtype
    if dt not in _FLOATS:
        dt = F32
    x64 = self if self.dtype == F64 else op.Cast(self, to=F64)
    e = op.Cast(other, to=F64) if other.dtype != F64 else other
    if dt == F64:
        e = op.Max(op.Min(e, _k(2200.0, F64)), _k(-2200.0, F64))
        a = op.Floor(op.Div(e, _k(3.0, F64)))
        b = op.Floor(op.Div(op.Sub(e, a), _k(2.0, F64)))
        c = op.Sub(op.Sub(e, a), b)
        return op.Mul(op.Mul(op.Mul(x64, op.Pow(_k(2.0, F64), a)), op.Pow(_k(2.0, F64), b)),
                      op.Pow(_k(2.0, F64), c))
    e = op.Max(op.Min(e, _k(400.0, F64)), _k(-400.0, F64))
    return op.Cast(op.Mul(x64, op.Pow(_k(2.0, F64), e)), to=dt)


# ----------------------------------------------------------------------------- gcd / lcm

def _euclid_body(dtype: ir.DataType) -> ir.Graph:
    """Loop body carrying (a, b): one step (a, b) -> (b % a, a) where a != 0; stop when all a == 0."""
    tape = ir.tape.Tape()
    it = ir.Value(name="gcd_iter", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond_in = ir.Value(name="gcd_cond_in", type=ir.TensorType(ir.DataType.BOOL),
                       shape=ir.Shape([]))
    a = ir.Value(name="gcd_a_in", type=ir.TensorType(dtype))
    b = ir.Value(name="gcd_b_in", type=ir.TensorType(dtype))

    def const(v, dt):
        return tape.op("Constant", [], attributes={"value": ir.tensor(np.array(v, dtype=dt))})

    zero = const(0, dtype.numpy())
    one = const(1, dtype.numpy())
    az = tape.op("Equal", [a, zero])
    safe_a = tape.op("Where", [az, one, a])
    r = tape.op("Mod", [b, safe_a])  # a, b >= 0 here, so Python- and C-style modulo agree
    new_a = tape.op("Where", [az, zero, r])
    new_b = tape.op("Where", [az, b, a])
    nz = tape.op("Not", [tape.op("Equal", [new_a, zero])])
    any_nz = tape.op("ReduceMax", [tape.op("Cast", [nz], attributes={"to": ir.DataType.INT32})],
                     attributes={"keepdims": 0})
    cond_out = tape.op("Greater", [any_nz, const(0, np.int32)])
    return ir.Graph([it, cond_in, a, b], [cond_out, new_a, new_b], nodes=tape.nodes,
                    name="euclid")


def _loop(trips, cond, carried: list, body: ir.Graph) -> list:
    """An ONNX Loop with several loop-carried values.

    torch.onnx 2.13's OpRecorder binds *all* positional arguments to a variadic input that
    follows named ones (Loop(M, cond, *v) gets inputs M, cond, M, cond, *v), so the node is
    recorded directly with the inputs named.
    """
    rec = onnxscript.evaluator.default()
    if hasattr(rec, "_call_op"):
        sig = ir.schemas.OpSignature.from_op_schema(onnx.defs.get_schema("Loop", 18))
        outs = rec._call_op(sig, {"M": trips, "cond": cond, "v_initial": tuple(carried)},
                            {"body": body}, len(carried))
        return list(outs)
    out = op.Loop(trips, cond, *carried, body=body)
    return list(out) if isinstance(out, (list, tuple)) else [out]


# Euclid needs at most ~1.44 * bits + 2 steps (consecutive Fibonacci numbers are the worst case);
# the loop also stops as soon as every element is done.
_EUCLID_TRIPS = {8: 16, 16: 28, 32: 52, 64: 100}


def _gcd(a, b):
    """gcd in the working dtype (int32 for int8/int16); returns (g, working dtype)."""
    dt, (a, b) = _common(a, b)
    if dt in _FLOATS or dt == ir.DataType.BOOL:
        raise ValueError(f"gcd: integer inputs only (got {dt})")
    dt, (a, b) = _widen(dt, a, b)
    if dt.is_signed():
        a, b = op.Abs(a), op.Abs(b)
    shape = op.Shape(op.Add(a, b))
    a, b = op.Expand(a, shape), op.Expand(b, shape)
    trips = op.Constant(value=ir.tensor(np.array(_EUCLID_TRIPS[dt.bitwidth], dtype=np.int64)))
    cond = op.Constant(value=ir.tensor(np.array(True)))
    _, g = _loop(trips, cond, [a, b], _euclid_body(dt))
    return g, dt


@translation(aten.gcd.default)
def aten_gcd(self, other):
    """gcd(Tensor self, Tensor other) -> Tensor

    Euclid's algorithm in an ONNX Loop (trip bound from the bit width, early exit when every
    element is done); exact. gcd(0, 0) = 0. Known difference: when an input is the dtype's most
    negative value (whose abs overflows), PyTorch's int8 result can be negative (gcd(-128, 68)
    = -4) while this gives the positive gcd computed in int32 (4); int16/int32/int64 agree.
    """
    dt, _ = _common(self, other)
    g, wdt = _gcd(self, other)
    return _narrow(g, dt, wdt)


@translation(aten.lcm.default)
def aten_lcm(self, other):
    """lcm(Tensor self, Tensor other) -> Tensor

    |a / gcd(a, b) * b| with integer wrap-around like PyTorch; lcm(x, 0) = 0.
    """
    dt, (a, b) = _common(self, other)
    g, wdt = _gcd(self, other)
    _, (a, b) = _widen(dt, a, b)
    zero = _k(0, wdt)
    gz = op.Equal(g, zero)
    q = op.Mul(op.Div(a, op.Where(gz, _k(1, wdt), g)), b)
    if wdt.is_signed():
        q = op.Abs(q)
    return _narrow(op.Where(gz, zero, q), dt, wdt)


# ----------------------------------------------------------------------------- logaddexp(2)

def _log1p(t, dt):
    """log(1 + t) accurate for small t (Goldberg's trick: log(u) * t / (u - 1), u = 1 + t)."""
    one = _k(1.0, dt)
    u = op.Add(one, t)
    um1 = op.Sub(u, one)
    same = op.Equal(um1, _k(0.0, dt))
    return op.Where(same, t, op.Mul(op.Log(u), op.Div(t, op.Where(same, one, um1))))


def _logaddexp(a, b, base2: bool):
    dt, (a, b) = _promote_float(a, b)
    work = dt if dt in (F32, F64) else F32
    if work != dt:
        a, b = op.Cast(a, to=work), op.Cast(b, to=work)
    m = op.Max(a, b)
    d = op.Neg(op.Abs(op.Sub(a, b)))
    if base2:
        t = op.Pow(_k(2.0, work), d)
        r = op.Add(m, op.Div(_log1p(t, work), _k(math.log(2.0), work)))
    else:
        r = op.Add(m, _log1p(op.Exp(d), work))
    r = op.Where(op.And(op.IsInf(a), op.Equal(a, b)), a, r)
    r = op.Where(op.Or(op.IsNaN(a), op.IsNaN(b)), _k(float("nan"), work), r)
    return r if work == dt else op.Cast(r, to=dt)


@translation(aten.logaddexp.default, overrides_torchlib=True)
def aten_logaddexp(self, other):
    """logaddexp(Tensor self, Tensor other) -> Tensor

    ``max(a, b) + log1p(exp(-|a - b|))`` like PyTorch; torchlib's ``log(exp(a) + exp(b))``
    overflows/underflows for |a|, |b| beyond ~88 (float32). Real dtypes only.
    """
    return _logaddexp(self, other, base2=False)


@translation(aten.logaddexp2.default, overrides_torchlib=True)
def aten_logaddexp2(self, other):
    """logaddexp2(Tensor self, Tensor other) -> Tensor

    ``max(a, b) + log1p(2**-|a - b|) / ln 2`` like PyTorch (torchlib's form overflows).
    """
    return _logaddexp(self, other, base2=True)


# ----------------------------------------------------------------------------- heaviside

@translation(aten.heaviside.default, overrides_torchlib=True)
def aten_heaviside(self, values):
    """heaviside(Tensor self, Tensor values) -> Tensor

    ``values`` where x == 0, else ``x > 0`` (so NaN gives 0; torchlib gives 1).
    """
    dt, (x, v) = _common(self, values)
    if dt == ir.DataType.BOOL:
        return op.Where(x, x, v)  # True -> True, False (== 0) -> values
    wdt, (x, v) = _widen(dt, x, v)
    step = op.Cast(op.Greater(x, _k(0, wdt)), to=wdt)
    at_zero = op.Equal(x, _k(0, wdt))
    r = op.Where(at_zero, v, step)
    if dt in _FLOATS:  # values = -0.0 at x == 0 gives -0.0 (Where would drop the sign)
        r = _with_sign(r, op.And(at_zero, _float_signbit(v, dt)), dt)
    return _narrow(r, dt, wdt)


# ----------------------------------------------------------------------------- fmod / remainder

def _no_minus_one(b, dt):
    """x % -1 is 0 for every x, but MIN % -1 (and MIN / -1) traps (SIGFPE) in x86 integer
    division inside ONNX Runtime: divide by 1 instead, which gives the same 0."""
    if not dt.is_signed():
        return b
    return op.Where(op.Equal(b, _k(-1, dt)), _k(1, dt), b)


def _trunc_mod_int(a, b, dt):
    """C-style a % b for integers, exact for every width (a - trunc(a / b) * b)."""
    b = _no_minus_one(b, dt)
    return op.Sub(a, op.Mul(op.Div(a, b), b))


def _fmod(a, b):
    dt, (a, b) = _common(a, b)
    if dt in _FLOATS:
        return op.Mod(a, b, fmod=1)
    wdt, (a, b) = _widen(dt, a, b)
    return _narrow(_trunc_mod_int(a, b, wdt), dt, wdt)


def _remainder(a, b):
    dt, (a, b) = _common(a, b)
    if dt not in _FLOATS:
        wdt, (a, b) = _widen(dt, a, b)
        # Python-style modulo for integers, exact
        return _narrow(op.Mod(a, _no_minus_one(b, wdt)), dt, wdt)
    mod = op.Mod(a, b, fmod=1)
    zero = _k(0.0, dt)
    mod_zero = op.Equal(mod, zero)
    fix = op.And(op.Not(mod_zero), op.Not(op.Equal(op.Less(b, zero), op.Less(mod, zero))))
    r = op.Where(fix, op.Add(mod, b), mod)
    # A zero result is fmod's, signed like a (ORT's Where returns +0.0 for -0.0).
    return _with_sign(r, _bsel(mod_zero, _float_signbit(a, dt), op.Less(r, zero)), dt)


@translation(aten.fmod.Tensor, overrides_torchlib=True)
def aten_fmod_tensor(self, other):
    """fmod.Tensor(Tensor self, Tensor other) -> Tensor

    Floats: ONNX ``Mod(fmod=1)`` (std::fmod: exact, NaN for a zero divisor or infinite
    dividend). Note PyTorch's own vectorized CPU kernel (contiguous inputs of 8+ elements)
    returns NaN when a / b overflows (e.g. fmod(1, 1e-39)); its scalar path and this
    translation return the exact std::fmod value. Integers: ``a - trunc(a / b) * b`` so int64 beyond 2**53 stays exact.
    """
    return _fmod(self, other)


@translation(aten.fmod.Scalar, overrides_torchlib=True)
def aten_fmod_scalar(self, other):
    """fmod.Scalar(Tensor self, Scalar other) -> Tensor"""
    return _fmod(self, _scalar_like(other, self))


@translation(aten.remainder.Tensor, overrides_torchlib=True)
def aten_remainder_tensor(self, other):
    """remainder.Tensor(Tensor self, Tensor other) -> Tensor

    PyTorch's definition: ``m = fmod(a, b); m + b if m != 0 and sign(m) != sign(b) else m``.
    Exact; remainder(x, +-inf) is x or +-inf like PyTorch (torchlib's floor form gives NaN).
    """
    return _remainder(self, other)


@translation(aten.remainder.Scalar, overrides_torchlib=True)
def aten_remainder_scalar(self, other):
    """remainder.Scalar(Tensor self, Scalar other) -> Tensor"""
    return _remainder(self, _scalar_like(other, self))


@translation(aten.remainder.Scalar_Tensor, overrides_torchlib=True)
def aten_remainder_scalar_tensor(self, other):
    """remainder.Scalar_Tensor(Scalar self, Tensor other) -> Tensor"""
    return _remainder(_scalar_like(self, other), other)


# ----------------------------------------------------------------------------- shifts

def _shift_left(a, b):
    dt, (a, b) = _common(a, b)
    width = dt.bitwidth
    wdt, (wa, wb) = _widen(dt, a, b)
    udt = _UNSIGNED[wdt.bitwidth]
    # Where is evaluated in the signed/working dtype: ONNX Runtime lacks uint64 Where.
    too_far = op.GreaterOrEqual(wb, _k(width, wdt))
    if wdt.is_signed():
        too_far = op.Or(too_far, op.Less(wb, _k(0, wdt)))  # PyTorch: unsigned(count) >= width
    count = op.Where(too_far, _k(0, wdt), wb)
    ua = wa if wdt == udt else op.Cast(wa, to=udt)
    uc = count if wdt == udt else op.Cast(count, to=udt)
    s = op.BitShift(ua, uc, direction="LEFT")
    s = s if wdt == udt else op.Cast(s, to=wdt)
    return _narrow(op.Where(too_far, _k(0, wdt), s), dt, wdt)  # wraps modulo 2**width


def _shift_right(a, b):
    dt, (a, b) = _common(a, b)
    width = dt.bitwidth
    if not dt.is_signed():
        count_ok = op.Less(b, _k(width, dt))  # counts >= width (>= 128 too, as int8 < 0) -> 0
        r = op.BitShift(a, op.Where(count_ok, b, _k(0, dt)), direction="RIGHT")
        return op.Where(count_ok, r, _k(0, dt))
    wdt, (wa, wb) = _widen(dt, a, b)
    udt = _UNSIGNED[wdt.bitwidth]
    max_shift = _k(width - 1, wdt)
    # PyTorch: a negative count or one >= width - 1 shifts by width - 1 (all sign bits).
    clamp = op.Or(op.Less(wb, _k(0, wdt)), op.Greater(wb, max_shift))
    count = op.Cast(op.Where(clamp, max_shift, wb), to=udt)
    neg = op.Less(wa, _k(0, wdt))
    # Arithmetic shift from logical shifts: for negative a, ~((~a) >>> n).
    u = op.Cast(op.Where(neg, op.BitwiseNot(wa), wa), to=udt)
    s = op.Cast(op.BitShift(u, count, direction="RIGHT"), to=wdt)
    return _narrow(op.Where(neg, op.BitwiseNot(s), s), dt, wdt)


@translation(aten.bitwise_left_shift.Tensor, overrides_torchlib=True)
def aten_bitwise_left_shift_tensor(self, other):
    """bitwise_left_shift.Tensor(Tensor self, Tensor other) -> Tensor

    All integer dtypes; counts >= the bit width or negative give 0, like PyTorch.
    """
    return _shift_left(self, other)


@translation(aten.bitwise_left_shift.Tensor_Scalar, overrides_torchlib=True)
def aten_bitwise_left_shift_tensor_scalar(self, other):
    """bitwise_left_shift.Tensor_Scalar(Tensor self, Scalar other) -> Tensor"""
    return _shift_left(self, _scalar_like(int(other), self))


@translation(aten.bitwise_left_shift.Scalar_Tensor, overrides_torchlib=True)
def aten_bitwise_left_shift_scalar_tensor(self, other):
    """bitwise_left_shift.Scalar_Tensor(Scalar self, Tensor other) -> Tensor"""
    return _shift_left(_scalar_like(int(self), other), other)


@translation(aten.__lshift__.Tensor)
def aten___lshift___tensor(self, other):
    """__lshift__.Tensor(Tensor self, Tensor other) -> Tensor"""
    return _shift_left(self, other)


@translation(aten.__lshift__.Scalar, overrides_torchlib=True)
def aten___lshift___scalar(self, other):
    """__lshift__.Scalar(Tensor self, Scalar other) -> Tensor"""
    return _shift_left(self, _scalar_like(int(other), self))


@translation(aten.bitwise_right_shift.Tensor, overrides_torchlib=True)
def aten_bitwise_right_shift_tensor(self, other):
    """bitwise_right_shift.Tensor(Tensor self, Tensor other) -> Tensor

    Arithmetic shift for signed dtypes, logical for uint8; negative counts or counts >= the
    bit width give the sign fill (0 or -1), like PyTorch.
    """
    return _shift_right(self, other)


@translation(aten.bitwise_right_shift.Tensor_Scalar, overrides_torchlib=True)
def aten_bitwise_right_shift_tensor_scalar(self, other):
    """bitwise_right_shift.Tensor_Scalar(Tensor self, Scalar other) -> Tensor"""
    return _shift_right(self, _scalar_like(int(other), self))


@translation(aten.bitwise_right_shift.Scalar_Tensor, overrides_torchlib=True)
def aten_bitwise_right_shift_scalar_tensor(self, other):
    """bitwise_right_shift.Scalar_Tensor(Scalar self, Tensor other) -> Tensor"""
    return _shift_right(_scalar_like(int(self), other), other)


@translation(aten.__rshift__.Tensor)
def aten___rshift___tensor(self, other):
    """__rshift__.Tensor(Tensor self, Tensor other) -> Tensor"""
    return _shift_right(self, other)


@translation(aten.__rshift__.Scalar, overrides_torchlib=True)
def aten___rshift___scalar(self, other):
    """__rshift__.Scalar(Tensor self, Scalar other) -> Tensor"""
    return _shift_right(self, _scalar_like(int(other), self))


# ----------------------------------------------------------------------------- fmax / fmin

def _fmaxmin(self, other, pick):
    """PyTorch's fmax/fmin: where exactly one operand is NaN the other is the result (NaN only
    when both are); otherwise the larger/smaller. Integers: plain Max/Min."""
    _, (a, b) = _common(self, other)
    m = pick(a, b)
    if not _is_float(a):
        return m
    return op.Where(op.IsNaN(a), b, op.Where(op.IsNaN(b), a, m))


@translation(aten.fmax.default)
def aten_fmax(self, other):
    """fmax(Tensor self, Tensor other) -> Tensor (torchlib: not implemented)"""
    return _fmaxmin(self, other, op.Max)


@translation(aten.fmin.default)
def aten_fmin(self, other):
    """fmin(Tensor self, Tensor other) -> Tensor (torchlib: not implemented)"""
    return _fmaxmin(self, other, op.Min)


# ----------------------------------------------------------------------------------------- rrelu

@translation(aten.rrelu_with_noise_functional.default)
def aten_rrelu_with_noise_functional(self, noise, lower=0.125, upper=1.0 / 3.0, training=False,
                                     generator=None):
    """rrelu_with_noise_functional(Tensor self, Tensor noise, Scalar lower=0.125,
    Scalar upper=0.3333333333333333, bool training=False, Generator? generator=None)
    -> (Tensor, Tensor noise_out) (torchlib: not implemented)

    Inference (``training=False``, what ``nn.RReLU`` does in eval mode): a leaky ReLU with the
    mean slope ``(lower + upper) / 2``, the noise passed through unchanged. Training mode
    draws random slopes: no deterministic ONNX form, refused.
    """
    if training:
        raise NotImplementedError("rrelu in training mode draws random slopes; export the "
                                  "model in eval mode")
    return op.LeakyRelu(self, alpha=(float(lower) + float(upper)) / 2.0), op.Identity(noise)
