"""Elementwise gaps: OpInfo samples plus edge values, bit-exact checks, torchlib counter-examples
and one end-to-end model per translation, all against PyTorch."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from onnxmedic.ops.testing import check_call, export_call, run_onnx
from tests.ops._table import OpEntry, make_tests

INF, NAN = math.inf, math.nan
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
EXACT = (0.0, 0.0)
F32 = (1e-5, 1e-6)
F64 = (1e-12, 1e-300)


def _f(values, dtype):
    return torch.tensor(values, dtype=dtype)


def _specials(dtype):
    fi = torch.finfo(dtype)
    return [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 7.75, -7.75, 1e-3, 123456.7, -9.87e5,
            fi.tiny, -fi.tiny, fi.tiny * 2 ** -5, fi.smallest_normal * 0.5, -fi.tiny / 4,
            fi.max, -fi.max, fi.max / 3, INF, -INF, NAN]


def _grid(dtype, a_vals=None, b_vals=None):
    """Every (a, b) pair of special values as one broadcast sample."""
    a = _f(a_vals if a_vals is not None else _specials(dtype), dtype)
    b = _f(b_vals if b_vals is not None else _specials(dtype), dtype)
    return ((a[:, None], b[None, :]), {})


def _shapes(dtype, *samples):
    """0-d and empty samples: once per op (float32), to keep the file's runtime down."""
    return list(samples) if dtype == torch.float32 else []


def _binary_float_edges(dtype):
    return [_grid(dtype), *_shapes(
        dtype, ((_f(2.5, dtype), _f(-0.0, dtype)), {}),
        ((torch.empty(0, 4, dtype=dtype), torch.empty(0, 4, dtype=dtype)), {}))]


def _unary_float_edges(dtype):
    return [((_f(_specials(dtype), dtype),), {}), *_shapes(
        dtype, ((_f(-0.0, dtype),), {}), ((torch.empty(0, 3, dtype=dtype),), {}))]


def _logaddexp_edges(dtype):
    vals = [0.0, -0.0, 1.0, -1.0, 30.0, -30.0, 88.0, 100.0, 500.0, -100.0, -200.0, -1e4, 1e-8,
            1e30, -1e30, INF, -INF, NAN]
    return [_grid(dtype, vals, vals),
            *_shapes(dtype, ((torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)), {}))]


def _mod_edges(dtype):
    if dtype.is_floating_point:
        a = [0.0, -0.0, 5.0, -5.0, 5.5, -5.5, 1e10, -1e10, 3e30, 1e-30, -1e-30, INF, -INF, NAN]
        b = [3.0, -3.0, 0.5, -0.5, 0.0, -0.0, 1e-3, 7e20, INF, -INF, NAN]
        return [_grid(dtype, a, b), *_shapes(
            dtype, ((_f(-7.5, dtype), _f(2.0, dtype)), {}),
            ((torch.empty(2, 0, dtype=dtype), torch.empty(0, dtype=dtype)), {}))]
    info = torch.iinfo(dtype)
    a = [0, 1, 5, 7, info.max, info.max - 1, 100 % info.max]
    b = [1, 3, 7, 100 % info.max, info.max]
    if info.min < 0:
        a += [-5, -7, info.min, info.min + 1]
        b += [-1, -3, -7, info.min]
    big = [2 ** 53 + 1, -(2 ** 62) - 3, 2 ** 63 - 1] if dtype == torch.int64 else []
    return [_grid(dtype, a + big, b)]


def _int_grid_values(dtype):
    info = torch.iinfo(dtype)
    vals = [0, 1, 2, 3, 6, 12, 18, 35, 97, 100, info.max, info.max - 1]
    if info.min < 0:
        vals += [-1, -6, -18, -35, info.min + 1]
    if dtype == torch.int64:
        vals += [2 ** 40 * 3, 2 ** 40 * 9, 7 * 2 ** 55, -(2 ** 62) - 2]
    if dtype in (torch.int32, torch.int64):
        vals += [1836311903, 1134903170]  # consecutive Fibonacci numbers: Euclid's worst case
    return vals


def _gcd_edges(dtype):
    v = _int_grid_values(dtype)
    extra = [((_f(0, dtype), _f(0, dtype)), {}),
             ((torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)), {})]
    return [_grid(dtype, v, v), *(extra if dtype == torch.int32 else [])]


def _lcm_edges(dtype):
    v = [0, 1, 2, 3, 4, 6, 12, 18, 35, 97]
    if dtype.is_signed:
        v += [-4, -6, -35]
    return [_grid(dtype, v, v)]


def _shift_edges(dtype):
    info = torch.iinfo(dtype)
    bits = info.bits
    vals = [0, 1, 3, 5, 100 % info.max, info.max, info.max - 1]
    counts = list(range(0, bits + 2)) + [bits + 7]
    if info.min < 0:
        vals += [-1, -2, -5, -100 % info.min, info.min, info.min + 1]
        counts += [-1, -bits]
    else:
        counts += [200]
    counts = [c for c in counts if info.min <= c <= info.max]
    return [_grid(dtype, vals, counts)]


def _scalar_shift_edges(dtype):
    x = _f([0, 1, 5, torch.iinfo(dtype).max] + ([-7, torch.iinfo(dtype).min]
                                                if dtype.is_signed else []), dtype)
    return [((x, 3), {}), ((x, torch.iinfo(dtype).bits), {})]


def _signbit_edges(dtype):
    if dtype.is_floating_point:
        return _unary_float_edges(dtype)
    info = torch.iinfo(dtype)
    return [((_f([0, 1, info.max] + ([-1, info.min] if info.min < 0 else []), dtype),), {})]


def _heaviside_edges(dtype):
    if dtype.is_floating_point:
        return [_grid(dtype, [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, INF, -INF, NAN],
                      [0.5, -0.0, 2.0, INF, NAN])]
    return [_grid(dtype, [0, 1, -1, 5, -100], [0, 1, 7, -3])]


def _frexp_edges(dtype):
    fi = torch.finfo(dtype)
    x = _f(_specials(dtype) + [2.0 ** k for k in range(-20, 21, 3)] + [fi.max, fi.eps,
                                                                        1 - fi.eps / 2], dtype)
    return [((x,), {}), *_shapes(dtype, ((torch.empty(0, dtype=dtype),), {}),
                                 ((_f(-0.75, dtype),), {}))]


def _ldexp_edges(dtype):
    x = _f([1.0, -1.5, 0.0, -0.0, 3.0, INF, NAN, 1e-30], dtype)
    e = torch.tensor([0, 1, -1, 10, -10, 100, -149, -160, 200, 300, -1100, 2000, -3000])
    return [((x[:, None], e[None, :]), {})]


def _float_power_edges(dtype):
    return [_grid(dtype, [0.0, -0.0, 1.0, -2.0, 2.0, 0.5, 1e30, INF, -INF, NAN],
                  [0.0, 1.0, -1.0, 0.5, 2.0, 3.0, -3.0, 100.0, INF, NAN])]


def _lshift(x, y):
    return x << y


def _rshift(x, y):
    return x >> y


def _lshift_s(x, y):
    return x << y


ENTRIES = [
    # hypot in float64 arithmetic is correctly rounded for float32, so bit-equal to glibc hypotf.
    OpEntry("hypot", dtypes=(torch.float32, torch.float64), max_samples=2,
            edge=_binary_float_edges, tolerance={"float32": EXACT, "float64": F64}),
    # fmax/fmin: torchlib raises NotImplementedError; NaN on one side gives the other operand
    OpEntry("fmax", dtypes=(torch.float32, torch.float64), max_samples=2,
            edge=_binary_float_edges, tolerance={"float32": EXACT, "float64": EXACT}),
    OpEntry("fmin", dtypes=(torch.float32, torch.float64, torch.float16),
            max_samples=2, edge=_binary_float_edges,
            tolerance={"float32": EXACT, "float64": EXACT, "float16": EXACT}),
    OpEntry("copysign", dtypes=(torch.float32, torch.float64), max_samples=2,
            edge=_binary_float_edges,
            tolerance={"float32": EXACT, "float64": EXACT}),
    # bfloat16 is translated too, but the harness cannot feed bfloat16 to ONNX Runtime.
    OpEntry("nextafter", dtypes=(torch.float32, torch.float64, torch.float16), max_samples=2,
            edge=_binary_float_edges,
            tolerance={"float32": EXACT, "float64": EXACT, "float16": EXACT}),
    OpEntry("frexp", dtypes=(torch.float32, torch.float64), max_samples=2, edge=_frexp_edges,
            tolerance={"float32": EXACT, "float64": EXACT}),
    # float32 tolerance: for fractional exponents PyTorch rounds 2**other to float32 before the
    # product (two roundings, 1 ulp off the exact result we round once); integer exponents match
    # exactly (test_torchlib_differs_and_onnxmedic_matches[ldexp-large-exponent]).
    OpEntry("ldexp", dtypes=(torch.float32, torch.float64), max_samples=2, edge=_ldexp_edges,
            tolerance={"float32": F32, "float64": EXACT}),
    OpEntry("gcd", dtypes=(torch.int32, torch.int64, torch.int8, torch.uint8), max_samples=1,
            edge=_gcd_edges),
    OpEntry("lcm", dtypes=(torch.int32, torch.int64, torch.int16), max_samples=1,
            edge=_lcm_edges),
    OpEntry("logaddexp", dtypes=(torch.float32, torch.float64), max_samples=2,
            edge=_logaddexp_edges, tolerance={"float32": F32, "float64": F64}),
    # float64 atol 1e-15: results that cancel to 0 (logaddexp2(-1, -1)) may be 1 ulp of 1 off.
    OpEntry("logaddexp2", dtypes=(torch.float32, torch.float64), max_samples=2,
            edge=_logaddexp_edges, tolerance={"float32": F32, "float64": (1e-12, 1e-15)}),
    # float_power computes in float64 (PyTorch promotes), so the float64 tolerance applies.
    OpEntry("float_power", dtypes=(torch.float32,), max_samples=2, edge=_float_power_edges,
            tolerance={"float32": F64}),
    OpEntry("heaviside", dtypes=(torch.float32, torch.int64), max_samples=2,
            edge=_heaviside_edges, tolerance={"float32": EXACT}),
    OpEntry("fmod", dtypes=(torch.float32, torch.float64, torch.int64, torch.int8),
            max_samples=1, edge=_mod_edges, tolerance={"float32": EXACT, "float64": EXACT}),
    OpEntry("remainder", dtypes=(torch.float32, torch.float64, torch.int32, torch.uint8), max_samples=1, edge=_mod_edges,
            tolerance={"float32": EXACT, "float64": EXACT}),
    OpEntry("signbit", dtypes=(torch.float32, torch.float64, torch.int32),
            max_samples=2, edge=_signbit_edges),
    # The edge grid holds every value class against every count from -bits to bits + 7.
    OpEntry("bitwise_left_shift", variant="edges", fn=torch.bitwise_left_shift, dtypes=INTS,
            use_opinfo=False, edge=_shift_edges),
    OpEntry("bitwise_right_shift", variant="edges", fn=torch.bitwise_right_shift, dtypes=INTS,
            use_opinfo=False, edge=_shift_edges),
    OpEntry("bitwise_left_shift", dtypes=(torch.int32,), max_samples=2),
    OpEntry("bitwise_right_shift", dtypes=(torch.int64,), max_samples=2),
    OpEntry("__lshift__", fn=_lshift, dtypes=(torch.int16,), use_opinfo=False, edge=_shift_edges),
    OpEntry("__rshift__", fn=_rshift, dtypes=(torch.int64,), use_opinfo=False, edge=_shift_edges),
    OpEntry("__lshift__", variant="scalar", fn=_lshift_s, dtypes=(torch.int32,),
            use_opinfo=False, edge=_scalar_shift_edges),
    OpEntry("bitwise_right_shift", variant="scalar", fn=torch.bitwise_right_shift,
            dtypes=(torch.int16,), use_opinfo=False, edge=_scalar_shift_edges),
]

make_tests(ENTRIES, globals())


# ----------------------------------------------------------------------------- bit-exact checks
# The table's comparison treats -0.0 == 0.0; these compare the bits of every output.

def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f":
        out = a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize]).copy()
        out[np.isnan(a)] = 0  # NaN payloads/signs are not compared (see test_nan_sign_*)
        return out
    return a


def _assert_bit_exact(fn, args, **export_kwargs):
    model, tensors = export_call(fn, args, **export_kwargs)
    actual = run_onnx(model, tensors)
    expected = fn(*args)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    for e, a in zip(expected, actual, strict=True):
        e = e.numpy()
        assert e.dtype == a.dtype and e.shape == a.shape
        bad = _bits(e) != _bits(a)
        assert not bad.any(), f"{bad.sum()} mismatches, e.g. {e[bad][:5]} vs {a[bad][:5]}"


def _random_floats(dtype, n, seed):
    """Random bit patterns: every exponent, denormals included, plus the special values."""
    g = np.random.default_rng(seed)
    if dtype == torch.float32:
        raw = g.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    else:
        raw = g.integers(0, 2 ** 63, n, dtype=np.int64).view(np.float64) * g.choice([-1, 1], n)
    t = torch.from_numpy(raw.copy())
    fi = torch.finfo(dtype)
    sp = torch.tensor([0.0, -0.0, fi.tiny, -fi.tiny, fi.max, -fi.max, INF, -INF, 1.0, -1.0,
                       2.0, 0.5, fi.tiny * fi.eps, -fi.tiny * fi.eps, fi.tiny * (1 - fi.eps)],
                      dtype=dtype)
    return torch.cat([t, sp])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_nextafter_bit_exact(dtype):
    x = _random_floats(dtype, 3000, 1)
    specials = x[-15:]
    toward = torch.stack([torch.full_like(x, INF), torch.full_like(x, -INF),
                          torch.zeros_like(x), -torch.zeros_like(x), x.flip(0), x])
    _assert_bit_exact(torch.nextafter, (x.expand(6, -1).contiguous(), toward))
    # every special against every special (denormal <-> 0, max <-> inf, -0 <-> 0, ...)
    _assert_bit_exact(torch.nextafter, (specials[:, None], specials[None, :]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_frexp_bit_exact(dtype):
    _assert_bit_exact(torch.frexp, (_random_floats(dtype, 3000, 2),))


@pytest.mark.parametrize(
    ("fn", "dtype"),
    [(torch.copysign, torch.float32), (torch.fmod, torch.float32),
     (torch.remainder, torch.float32), (torch.remainder, torch.float64),
     (torch.hypot, torch.float32)],
    ids=["copysign", "fmod", "remainder-float32", "remainder-float64", "hypot"],
)
def test_signed_zeros_bit_exact(fn, dtype):
    x = _random_floats(dtype, 200, 3)
    x = x[torch.isfinite(x) & (x.abs() < 1e30)]
    a = torch.cat([x, torch.tensor([-0.0, 0.0, -6.0, 6.0, -0.0], dtype=dtype)])
    b = torch.cat([x.flip(0), torch.tensor([3.0, -3.0, 3.0, -3.0, -0.0], dtype=dtype)])
    if fn is not torch.copysign:
        b = torch.where(b == 0, torch.ones_like(b), b)
    if fn in (torch.fmod, torch.remainder):
        # PyTorch's vectorized fmod gives NaN where a / b overflows (its scalar path does not):
        # keep the quotient finite so eager PyTorch is itself exact.
        b = torch.where((a / b).abs() < 1e30, b, torch.ones_like(b))
    _assert_bit_exact(fn, (a, b))


def test_remainder_matches_pytorch_on_large_quotients():
    a = torch.tensor([1e10, -1e10, 3.3e30, 16777217.0, -123456789.0])
    b = torch.tensor([3.0, 7.0, 0.7, 3.0, 1e-3])
    res = check_call(torch.remainder, (a, b), tolerance=EXACT)
    assert res.ok, res.error


# NaN signs: opset 18 has no bit reinterpretation and every arithmetic op may drop a NaN's sign,
# so the sign bit of a NaN cannot be read.
@pytest.mark.xfail(strict=True, reason="opset 18 cannot read a NaN's sign bit (no Bitcast)")
def test_nan_sign_signbit():
    res = check_call(torch.signbit, (torch.tensor([-NAN, NAN, -1.0]),))
    assert torch.signbit(torch.tensor(-NAN)).item() is True
    assert res.ok, res.error


@pytest.mark.xfail(strict=True, reason="opset 18 cannot read a NaN's sign bit (no Bitcast)")
def test_nan_sign_copysign():
    res = check_call(torch.copysign, (torch.tensor([1.0, 2.0]), torch.tensor([-NAN, NAN])))
    assert res.ok, res.error


# ----------------------------------------------------------------------------- torchlib is wrong
# Each case shows plain torch.onnx (torchlib) silently differing from PyTorch, and onnxmedic not.

_I16 = torch.int16
TORCHLIB_WRONG = [
    ("signbit-negzero", torch.signbit, (torch.tensor([-0.0, 0.0, -1.0]),)),
    ("heaviside-nan", torch.heaviside, (torch.tensor([NAN, 1.0, 0.0]), torch.tensor([0.5]))),
    ("logaddexp-overflow", torch.logaddexp, (torch.tensor([100.0, -200.0]),
                                             torch.tensor([100.0, -200.0]))),
    ("logaddexp2-overflow", torch.logaddexp2, (torch.tensor([200.0, -300.0]),
                                               torch.tensor([200.0, -300.0]))),
    ("remainder-inf-divisor", torch.remainder, (torch.tensor([5.0, -5.0]),
                                                torch.tensor([INF, INF]))),
    ("remainder-large-quotient", torch.remainder, (torch.tensor([1e10]), torch.tensor([3.0]))),
    ("fmod-int64-beyond-2**53", torch.fmod, (torch.tensor([2 ** 62 + 1, -(2 ** 60) - 7]),
                                             torch.tensor([3, 10]))),
    ("right-shift-int16", torch.bitwise_right_shift, (torch.tensor([-100, 100], dtype=_I16),
                                                      torch.tensor([2, 3], dtype=_I16))),
    # torchlib returns int8 for uint8 shifts
    ("left-shift-uint8", torch.bitwise_left_shift,
     (torch.tensor([5, 200, 1], dtype=torch.uint8), torch.tensor([1, 1, 9], dtype=torch.uint8))),
    ("right-shift-uint8", torch.bitwise_right_shift,
     (torch.tensor([5, 200, 255], dtype=torch.uint8), torch.tensor([1, 0, 3], dtype=torch.uint8))),
    # torchlib: Where with int16 has no ONNX Runtime kernel
    ("heaviside-int16", torch.heaviside, (torch.tensor([0, 3, -2], dtype=_I16),
                                          torch.tensor([7], dtype=_I16))),
    # torchlib: MIN % -1 traps in ONNX Runtime (SIGFPE) - not run here, it kills the process.
    ("signed-zero-remainder", torch.remainder, (torch.tensor([-6.0, 0.0]),
                                                torch.tensor([3.0, 3.0]))),
    ("ldexp-large-exponent", torch.ldexp, (torch.tensor([1e-30, 3.0]), torch.tensor([200, -150]))),
]


# Cases ONNX Runtime itself fixed (the torchlib export is right on these versions and later;
# onnxmedic keeps its translation for the older runtimes its range supports).
FIXED_IN_ORT = {"fmod-int64-beyond-2**53": (1, 32)}  # int64 Mod no longer goes through double
ORT_VERSION = tuple(int(v) for v in ort.__version__.split(".")[:2])


@pytest.mark.parametrize("case", TORCHLIB_WRONG, ids=[c[0] for c in TORCHLIB_WRONG])
def test_torchlib_differs_and_onnxmedic_matches(case):
    name, fn, args = case

    def matches(**registry):
        if name.startswith("signed-zero"):  # the table's comparison ignores zero signs
            try:
                _assert_bit_exact(fn, args, **registry)
            except AssertionError as e:
                return False, str(e)
            return True, ""
        tol = EXACT if args[0].is_floating_point() else None
        res = check_call(fn, args, tolerance=tol, **registry)
        return res.ok, res.error

    plain_ok, _ = matches(registry=None)
    if plain_ok:  # the override stays for older runtimes; only a known fix is accepted
        assert ORT_VERSION >= FIXED_IN_ORT.get(name, (99,)), (
            "torchlib now matches PyTorch: the override may be unnecessary")
    ok, error = matches()
    assert ok, error


# ----------------------------------------------------------------------------- in a model

class _FloatModel(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        h = self.lin(x)
        return self.fn(h, x)


class _IntModel(_FloatModel):
    def forward(self, x):
        h = (self.lin(x) * 50).round().to(torch.int32)
        k = (x * 4).abs().round().to(torch.int32)
        return self.fn(h, k)


MODELS = [
    # F32 tolerance: the Linear before the op is itself not bit-exact in ONNX Runtime.
    ("hypot", _FloatModel(torch.hypot), F32),
    ("copysign", _FloatModel(torch.copysign), F32),
    ("nextafter", _FloatModel(torch.nextafter), F32),
    ("frexp", _FloatModel(lambda h, x: torch.frexp(h * x)[0]), F32),
    ("logaddexp", _FloatModel(lambda h, x: torch.logaddexp(h * 60, x * 60)), F32),
    ("logaddexp2", _FloatModel(lambda h, x: torch.logaddexp2(h * 90, x)), F32),
    ("heaviside", _FloatModel(lambda h, x: torch.heaviside(torch.relu(h), x)), EXACT),
    ("fmod", _FloatModel(torch.fmod), F32),
    ("remainder", _FloatModel(lambda h, x: h % x), F32),
    ("signbit", _FloatModel(lambda h, x: torch.signbit(h * torch.relu(-x))), None),
    ("ldexp", _FloatModel(lambda h, x: torch.ldexp(h, (x * 50).round().int())), F32),
    ("gcd", _IntModel(torch.gcd), None),
    ("lcm", _IntModel(torch.lcm), None),
    ("left_shift", _IntModel(lambda h, k: h << k), None),
    ("right_shift", _IntModel(lambda h, k: torch.bitwise_right_shift(h, k - 2)), None),
]


@pytest.mark.parametrize(("model", "tol"), [m[1:] for m in MODELS], ids=[m[0] for m in MODELS])
def test_in_model(model, tol):
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    x[0, 0] = torch.tensor([0.0, -0.0, 2.0, -3.0])
    res = check_call(model, (x,), tolerance=tol)
    assert res.ok, res.error
    assert res.comparisons and all(c.total > 0 for c in res.comparisons)


@pytest.mark.parametrize("fn", [torch.fmax, torch.fmin], ids=["fmax", "fmin"])
def test_fmax_fmin_integers_and_mixed(fn):
    a, b = torch.tensor([3, -2, 7], dtype=torch.int32), torch.tensor([1, 5, 7], dtype=torch.int64)
    assert check_call(fn, (a, b)).ok  # int32 with int64: promoted, no NaN logic
    assert check_call(fn, (a, torch.tensor([0.5, float("nan"), 9.0]))).ok  # int with float


@pytest.mark.parametrize("bounds", [(0.125, 1.0 / 3.0), (0.01, 0.5)])
def test_rrelu_in_eval_mode_exports_and_verifies(bounds) -> None:
    """nn.RReLU in eval mode is a leaky ReLU with the mean slope; torch.onnx had no
    translation for rrelu_with_noise_functional (OM201, found by the torch.nn sweep of
    bench/zoo/internal_errors.py)."""
    import onnxmedic

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    x[0, 0, :3] = torch.tensor([-0.0, -INF, NAN])
    result = onnxmedic.export(torch.nn.RReLU(*bounds).eval(), (x,))
    assert result.ok, [(f.code, f.message) for f in result.findings]
