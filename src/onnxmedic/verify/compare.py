"""Numeric comparison of ONNX Runtime outputs against PyTorch, with tolerances by dtype."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# (rtol, atol) by dtype name. float32 allows for reordered accumulation in ONNX Runtime kernels;
# integers and booleans must match exactly.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
    "complex64": (1e-4, 1e-5),
    "complex128": (1e-7, 1e-7),
}


# dtypes whose absolute tolerance scales with the output's magnitude (see compare_arrays)
SCALED_ATOL = ("float16", "bfloat16")


def tolerance_for(dtype: str, override: tuple[float, float] | None = None) -> tuple[float, float]:
    if override is not None:
        return override
    return TOLERANCES.get(dtype, (0.0, 0.0))


@dataclass
class OutputComparison:
    """One output compared at one input set."""

    name: str
    input_set: str
    expected_shape: list[int]
    actual_shape: list[int] | None
    expected_dtype: str
    actual_dtype: str | None
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    mismatched: int  # elements outside tolerance
    total: int
    ok: bool
    reason: str = ""  # why it is not ok, when it is structural
    # how it was judged (verify/budget.py): "float64 budget", "scaled normwise", "exact",
    # "fixed tolerance"; "tolerance" where compared by rtol/atol alone (the op tables)
    rule: str = "tolerance"
    budget: float | None = None  # the float64 budget: ONNX Runtime's error / PyTorch's, max
    torch_error: float | None = None  # PyTorch's own relative normwise error vs float64
    onnx_error: float | None = None  # ONNX Runtime's relative normwise error (vs the reference)
    ratio: float | None = None  # onnx_error / torch_error
    unstable: bool = False  # PyTorch's own error says the model is unstable on this input
    histogram: list[list[float]] | None = None  # |error| / rms(output) per decade (HTML)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_arrays(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray | None,
    *,
    input_set: str = "example",
    tolerance: tuple[float, float] | None = None,
    check_dtype: bool = True,
) -> OutputComparison:
    """Compare one output. NaN must match NaN, inf must match inf of the same sign."""
    exp = np.asarray(expected)
    exp_dtype = str(exp.dtype)  # ml_dtypes' bfloat16 prints as "bfloat16"
    rtol, atol = tolerance_for(exp_dtype, tolerance)
    if tolerance is None and exp_dtype in SCALED_ATOL and exp.size:
        atol *= _scale(exp)
    base = dict(name=name, input_set=input_set, expected_shape=list(exp.shape),
                expected_dtype=exp_dtype, rtol=rtol, atol=atol, total=int(exp.size))
    if actual is None:
        return OutputComparison(
            **base, actual_shape=None, actual_dtype=None, max_abs=float("inf"),
            max_rel=float("inf"), mismatched=int(exp.size), ok=False, reason="output missing",
        )
    act = np.asarray(actual)
    act_dtype = str(act.dtype)
    if tuple(act.shape) != tuple(exp.shape):
        return OutputComparison(
            **base, actual_shape=list(act.shape), actual_dtype=act_dtype, max_abs=float("inf"),
            max_rel=float("inf"), mismatched=int(exp.size), ok=False,
            reason=f"shape {list(act.shape)} != expected {list(exp.shape)}",
        )
    reason = ""
    if check_dtype and act_dtype != exp_dtype:
        reason = f"dtype {act_dtype} != expected {exp_dtype}"
    if exp.size == 0:
        return OutputComparison(
            **base, actual_shape=list(act.shape), actual_dtype=act_dtype, max_abs=0.0,
            max_rel=0.0, mismatched=0, ok=not reason, reason=reason,
        )
    if exp.dtype.kind in "biu" and act.dtype.kind in "biu":
        max_abs, max_rel, mismatched = _integer_errors(exp, act)
    else:
        max_abs, max_rel, mismatched = _float_errors(exp, act, rtol, atol)
    return OutputComparison(
        **base, actual_shape=list(act.shape), actual_dtype=act_dtype, max_abs=max_abs,
        max_rel=max_rel, mismatched=mismatched, ok=(mismatched == 0 and not reason),
        reason=reason or (f"{mismatched} of {exp.size} elements outside tolerance"
                          if mismatched else ""),
    )


def _scale(exp: np.ndarray) -> float:
    """float16/bfloat16 intermediates are rounded at ~3 significant digits of *their*
    magnitude, so an element that cancels to near 0 (a normalised activation, a residual sum)
    carries an absolute error proportional to the tensor's scale, not to 1: the absolute
    tolerance is per unit of the output's largest finite magnitude (at least 1)."""
    with np.errstate(invalid="ignore"):
        mags = np.abs(exp.astype(np.float64))
    mags = mags[np.isfinite(mags)]
    return max(1.0, float(mags.max())) if mags.size else 1.0


def _integer_errors(exp: np.ndarray, act: np.ndarray) -> tuple[float, float, int]:
    """(max abs, max rel, mismatched) of integer/boolean outputs: they must match exactly."""
    e64, a64 = exp.astype(np.int64), act.astype(np.int64)
    diff = np.abs(e64 - a64).astype(np.float64)
    denom = np.abs(e64).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.maximum(denom, 1.0))
    return float(diff.max()), float(rel.max()), int(np.count_nonzero(diff > 0))


def _float_errors(exp: np.ndarray, act: np.ndarray, rtol: float, atol: float
                  ) -> tuple[float, float, int]:
    """(max abs, max rel, mismatched) of float/complex outputs against rtol/atol; NaN must
    match NaN and inf the same inf (a mismatch there makes both maxima inf)."""
    if exp.dtype.kind == "c" or act.dtype.kind == "c":
        e, a = exp.astype(np.complex128), act.astype(np.complex128)
    else:
        e, a = exp.astype(np.float64), act.astype(np.float64)
        if np.isfinite(e).all() and np.isfinite(a).all():  # the usual case, in fewer passes
            diff, mag = np.abs(e - a), np.abs(e)
            bad_n = int(np.count_nonzero(diff > atol + rtol * mag))
            mag += atol
            mag += np.finfo(np.float64).tiny
            return float(diff.max()), float((diff / mag).max()), bad_n
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    inf_e, inf_a = np.isinf(e), np.isinf(a)
    same_inf = inf_e & inf_a & (e == a)
    special_bad = (nan_e ^ nan_a) | ((inf_e | inf_a) & ~same_inf & ~(nan_e | nan_a))
    finite = ~(nan_e | nan_a | inf_e | inf_a)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(finite, np.abs(e - a), 0.0)
        bad = special_bad | (finite & (diff > atol + rtol * np.abs(e)))
        rel = np.where(finite, diff / (np.abs(e) + atol + np.finfo(np.float64).tiny), 0.0)
    if special_bad.any():
        return float(np.inf), float(np.inf), int(np.count_nonzero(bad))
    return float(diff.max()), float(rel.max()), int(np.count_nonzero(bad))


def compare_outputs(
    names: list[str],
    expected: list[np.ndarray],
    actual: list[np.ndarray],
    *,
    input_set: str = "example",
    tolerance: tuple[float, float] | None = None,
    judge: Any = None,
) -> list[OutputComparison]:
    """Compare output lists position by position; a missing output is a failed comparison.
    ``judge(name, expected, actual, index)``: the comparison of one output (default:
    compare_arrays with ``tolerance``)."""
    results = []
    for i, exp in enumerate(expected):
        name = names[i] if i < len(names) else f"output_{i}"
        act = actual[i] if i < len(actual) else None
        results.append(judge(name, exp, act, i) if judge is not None else
                       compare_arrays(name, exp, act, input_set=input_set,
                                      tolerance=tolerance))
    for j in range(len(expected), len(actual)):
        results.append(
            OutputComparison(
                name=names[j] if j < len(names) else f"output_{j}", input_set=input_set,
                expected_shape=[], actual_shape=list(np.asarray(actual[j]).shape),
                expected_dtype="(none)", actual_dtype=str(np.asarray(actual[j]).dtype),
                max_abs=float("inf"), max_rel=float("inf"), rtol=0.0, atol=0.0, mismatched=0,
                total=0, ok=False, reason="ONNX model has an extra output PyTorch does not",
            )
        )
    return results
