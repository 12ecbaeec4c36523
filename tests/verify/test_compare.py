"""Per-dtype tolerances of verify.compare: float16/bfloat16 absolute tolerance scales with the
output's magnitude (errors of low-precision intermediates are relative to their scale); float32
and integers are unaffected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxmedic.verify.compare import compare_arrays


def _pair(dtype, scale, err):
    """An output of magnitude ``scale`` with one element cancelled to ~0 and off by ``err``."""
    e = np.linspace(-scale, scale, 101).astype(dtype)
    e[50] = dtype(0.004)
    a = e.copy()
    a[50] = dtype(float(e[50]) + err)
    return e, a


@pytest.mark.parametrize("scale,ok", [(4.0, True), (1.0, False), (0.5, False)])
def test_float16_absolute_tolerance_scales_with_the_output(scale, ok):
    """3 ulps of 1.0 in float16 (0.0029) on a near-zero element: within tolerance for an output
    of magnitude 4 (atol 1e-3 x 4), not for one of magnitude <= 1 (atol 1e-3)."""
    e, a = _pair(np.float16, scale, 0.0029)
    c = compare_arrays("y", e, a)
    assert c.ok is ok and c.mismatched == (0 if ok else 1)
    assert c.atol == pytest.approx(1e-3 * max(1.0, scale))


def test_bfloat16_scaled_and_explicit_tolerance_is_not():
    e = torch.linspace(-8, 8, 33, dtype=torch.bfloat16)
    a = e.clone()
    a[16] = 0.05  # exact 0 in e; 0.05 off: beyond atol 1e-2, within 1e-2 x 8
    ev, av = e.view(torch.int16).numpy(), a.view(torch.int16).numpy()
    import ml_dtypes
    ev, av = ev.view(ml_dtypes.bfloat16), av.view(ml_dtypes.bfloat16)
    assert compare_arrays("y", ev, av).ok
    assert not compare_arrays("y", ev, av, tolerance=(2e-2, 1e-2)).ok  # the user's, as given


def test_float32_and_nonfinite_are_unaffected():
    e = np.linspace(-100, 100, 11).astype(np.float32)
    a = e.copy()
    a[5] = 1e-3  # e[5] == 0: 1e-3 > atol 1e-5, whatever the magnitude
    assert not compare_arrays("y", e, a).ok
    e16 = np.array([np.inf, 1.0, np.nan], dtype=np.float16)
    assert compare_arrays("y", e16, e16.copy()).ok
    a16 = e16.copy()
    a16[0] = -np.inf
    assert not compare_arrays("y", e16, a16).ok


def _errors_elementwise(exp, act, rtol, atol):
    """max abs, max rel and the mismatched count, one element at a time (NaN matches NaN, an
    inf the same inf; a special mismatch makes both maxima inf)."""
    max_abs = max_rel = 0.0
    bad = 0
    special = False
    for e, a in zip(np.asarray(exp, np.float64).ravel(), np.asarray(act, np.float64).ravel()):
        if np.isnan(e) or np.isnan(a) or np.isinf(e) or np.isinf(a):
            same = (np.isnan(e) and np.isnan(a)) or (e == a)
            special |= not same
            bad += not same
            continue
        d = abs(e - a)
        max_abs = max(max_abs, d)
        max_rel = max(max_rel, d / (abs(e) + atol + np.finfo(np.float64).tiny))
        bad += d > atol + rtol * abs(e)
    return (np.inf, np.inf, bad) if special else (max_abs, max_rel, bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("special", [None, "nan", "inf", "nan both", "inf both"])
def test_the_error_measures_match_an_element_by_element_count(dtype, special):
    rng = np.random.default_rng(3)
    exp = (rng.standard_normal(300) * 10.0 ** rng.uniform(-6, 3, 300)).astype(dtype)
    act = (exp.astype(np.float64) * (1 + rng.standard_normal(300) * 1e-3)).astype(dtype)
    act[:3] = exp[:3]
    if special == "nan":
        act[5] = np.nan
    elif special == "inf":
        exp[7] = np.inf
    elif special == "nan both":
        exp[5] = act[5] = np.nan
    elif special == "inf both":
        exp[7] = act[7] = -np.inf
    c = compare_arrays("y", exp, act, tolerance=(1e-3, 1e-5))
    want = _errors_elementwise(exp, act, 1e-3, 1e-5)
    assert (c.max_abs, c.mismatched) == (want[0], want[2])
    assert c.max_rel == pytest.approx(want[1], rel=1e-12)
