"""The acceptance rule for a model's outputs: ONNX Runtime's error against a higher-precision
reference must stay within a budget derived from PyTorch's own error on the same input.

With ``y`` PyTorch's output at the model's precision (float32), ``r`` the same model run in
float64 (verify/reference.py) and ``o`` ONNX Runtime's output:

    e_torch = y - r    (how far float32 rounding moves this model on this input)
    e_onnx  = o - r

- **normwise**: ||e_onnx||_2 <= BUDGET * ||e_torch||_2 + FLOOR_ULPS * eps * ||r||_2
- **elementwise**, on the same scale, so one wrong element cannot hide in the norm:
  |e_onnx[i]| <= BUDGET * max|e_torch| + FLOOR_ULPS * eps * (|r[i]| + rms(r))

``eps`` is the output dtype's machine epsilon; the floor is the few ulps a different libm or
kernel may round differently even where PyTorch happens to be exact. BUDGET and FLOOR_ULPS were
chosen from bench/accuracy/verify_calibration.py (real-size models with random weights): there ONNX
Runtime's error is 0.5-3x PyTorch's own, while one weight scaled by 1 + 1e-3 moves the output by
100-1000x PyTorch's own error.

Other input sets of the same verification (random sets, other sizes) are first judged by the
example's measured error (``estimated_budget``): ||o - y|| <= (BUDGET - 1) * ||e_torch|| and the
elementwise counterpart, both relative to the example's scale, imply the budget as far as
PyTorch's own error on that set is the example's. This only accepts: an output it does not show
gets its own float64 run and the rule above (real-size BERT-base: the float64 runs of seven sets
took 4.7 s, of the example alone 0.9 s).

Where there is no reference for an output (the model cannot run in float64, computes that
output in float32 itself, or is too big to copy), the **scaled normwise** rule judges it
against PyTorch's output: ||o - y|| <= NORMWISE_RTOL * ||y|| and, elementwise,
|o[i] - y[i]| <= NORMWISE_RTOL * |y[i]| + NORMWISE_ATOL * max(1, max|y|) - a tolerance that
scales with the output's magnitude, as the op harness's normwise comparators do. Integer and
boolean outputs must match exactly; NaN and inf positions must match (verify/compare.py).
float16/bfloat16 models: the same rule with a float32 copy of the model as the reference.
"""

from __future__ import annotations

import math

import numpy as np

from onnxmedic.verify.compare import OutputComparison, compare_arrays

BUDGET = 10.0  # ONNX Runtime's error may be this many times PyTorch's own
FLOOR_ULPS = 4.0  # ... plus this many ulps of the output's norm
NORMWISE_RTOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}
NORMWISE_ATOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
# PyTorch's own relative normwise error above which the model is numerically unstable on the
# input (its float32 result says little): said in a finding, and the budget still applies
AGREE_ULPS = 16.0  # within this many ulps of PyTorch's own output: accepted without float64
UNSTABLE = {"float32": 1e-2, "float16": 1e-1, "bfloat16": 2e-1}
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps),
       "bfloat16": 2.0**-7}

RULE_AGREE = "float32 agreement"
RULE_PENDING = "needs a reference"  # (not a verdict: the caller runs the reference)
RULE_BUDGET = "float64 budget"
# another input set of the same model accepted by the example's measured float32 error
RULE_ESTIMATED = "float64 budget (example's error)"
RULE_NORMWISE = "scaled normwise"
RULE_EXACT = "exact"
RULE_FIXED = "fixed tolerance"


def judge_output(name: str, expected: np.ndarray, actual: np.ndarray | None,
                 reference: np.ndarray | None, *, input_set: str = "example",
                 tolerance: tuple[float, float] | None = None,
                 fast: bool = False) -> OutputComparison:
    """One output judged by the rule that fits it (see the module docstring). ``tolerance``
    given by the user keeps its exact meaning: fixed rtol/atol elementwise. ``fast``: a float
    output within AGREE_ULPS of PyTorch's (normwise and at every element) is accepted without
    a reference (rule "float32 agreement"); any other is left with rule RULE_PENDING for the
    caller to judge again with its reference - so the float64 run is only paid for outputs
    that are not already as close as float32 rounding allows."""
    c = compare_arrays(name, expected, actual, input_set=input_set, tolerance=tolerance)
    exp = np.asarray(expected)
    if tolerance is not None or exp.dtype.kind in "c":
        c.rule = RULE_FIXED
        return c
    if exp.dtype.kind in "biu":
        c.rule = RULE_EXACT
        return c
    dtype = str(exp.dtype)
    if actual is None or c.reason and "elements outside" not in c.reason or exp.size == 0 \
            or dtype not in EPS:
        c.rule = RULE_FIXED if dtype not in EPS else RULE_NORMWISE
        return c
    act = np.asarray(actual)
    special = _special_mismatch(exp, act)
    if fast:
        _agreement(c, exp, act, dtype, special)
        return c
    ref = _usable(reference, exp)
    if ref is not None:
        _budget(c, exp, act, ref, dtype, special)
    else:
        _normwise(c, exp, act, dtype, special)
    return c


def _agreement(c: OutputComparison, exp: np.ndarray, act: np.ndarray, dtype: str,
               special: int) -> None:
    y, o = exp.astype(np.float64), act.astype(np.float64)
    fin = _finite(y, o)
    d, yf = (o - y)[fin], y[fin]
    eps = EPS[dtype]
    norm_y = float(np.linalg.norm(yf))
    rms = norm_y / math.sqrt(max(yf.size, 1))
    close = (not special and float(np.linalg.norm(d)) <= AGREE_ULPS * eps * norm_y
             and bool(np.all(np.abs(d) <= AGREE_ULPS * eps * (np.abs(yf) + rms))))
    c.rule = RULE_AGREE if close else RULE_PENDING
    c.onnx_error = float(np.linalg.norm(d)) / norm_y if norm_y else 0.0
    if close:
        c.ok, c.mismatched, c.reason = True, 0, ""
        c.histogram = error_histogram(d, rms)


def _special_masks(exp: np.ndarray, act: np.ndarray) -> list[tuple[np.ndarray, str, str]]:
    """The disjoint ways NaN or inf do not match (NaN must be NaN, inf the same inf): (mask,
    what ONNX Runtime has there, what PyTorch has)."""
    e, a = np.asarray(exp).astype(np.float64), np.asarray(act).astype(np.float64)
    nan_e, nan_a, inf_e, inf_a = np.isnan(e), np.isnan(a), np.isinf(e), np.isinf(a)
    with np.errstate(invalid="ignore"):
        other_inf = inf_a & ~nan_e & ~(inf_e & (e == a))
    return [(nan_a & ~nan_e, "NaN", "a number"), (nan_e & ~nan_a, "a number", "NaN"),
            (other_inf, "infinite", "not that infinity"),
            (inf_e & ~inf_a & ~nan_a, "finite", "infinite")]


def _special_mismatch(exp: np.ndarray, act: np.ndarray) -> int:
    """Elements where NaN or inf does not match (NaN must be NaN, inf the same inf)."""
    return sum(int(np.count_nonzero(m)) for m, _, _ in _special_masks(exp, act))


def special_reason(exp: np.ndarray, act: np.ndarray) -> str:
    """Where NaN or inf do not match (:func:`_special_mismatch`), in words: "NaN at 3 of 64
    elements where PyTorch's is a number" ("" where they match)."""
    size = np.asarray(exp).size
    return " and ".join(f"{what} at {n} of {size} elements where PyTorch's is {theirs}"
                        for m, what, theirs in _special_masks(exp, act)
                        if (n := int(np.count_nonzero(m))))


def _usable(reference: np.ndarray | None, exp: np.ndarray) -> np.ndarray | None:
    """The reference as float64, when it is one (same shape, more precise than ``exp``)."""
    if reference is None:
        return None
    ref = np.asarray(reference)
    more_precise = {"float32": ("float64",), "float16": ("float32", "float64"),
                    "bfloat16": ("float32", "float64")}.get(str(exp.dtype), ())
    if ref.shape != exp.shape or str(ref.dtype) not in more_precise:
        return None
    return ref.astype(np.float64)


def _finite(*arrays: np.ndarray) -> np.ndarray:
    mask = np.ones(arrays[0].shape, bool)
    for a in arrays:
        mask &= np.isfinite(a)
    return mask


def _budget(c: OutputComparison, exp: np.ndarray, act: np.ndarray, ref: np.ndarray,
            dtype: str, special: int) -> None:
    y, o = exp.astype(np.float64), act.astype(np.float64)
    fin = _finite(y, o, ref)
    r = ref[fin]  # the finite positions only: no inf - inf (a RuntimeWarning) elsewhere
    e_t, e_o = y[fin] - r, o[fin] - r
    eps = EPS[dtype]
    norm_r = float(np.linalg.norm(r))
    norm_t, norm_o = float(np.linalg.norm(e_t)), float(np.linalg.norm(e_o))
    rms = norm_r / math.sqrt(max(r.size, 1))
    floor = FLOOR_ULPS * eps * norm_r
    max_t = float(np.abs(e_t).max()) if e_t.size else 0.0
    bound = BUDGET * max_t + FLOOR_ULPS * eps * (np.abs(r) + rms)
    over = np.abs(e_o) > bound
    mismatched = int(np.count_nonzero(over)) + special
    normwise_ok = norm_o <= BUDGET * norm_t + floor
    c.rule = RULE_BUDGET
    c.budget = BUDGET
    c.torch_error = norm_t / norm_r if norm_r else 0.0
    c.onnx_error = norm_o / norm_r if norm_r else 0.0
    c.ratio = norm_o / norm_t if norm_t else (0.0 if norm_o == 0 else math.inf)
    c.unstable = c.torch_error > UNSTABLE[dtype]
    c.histogram = error_histogram(e_o, norm_r / math.sqrt(max(r.size, 1)))
    c.mismatched = mismatched
    c.ok = normwise_ok and mismatched == 0
    if special:  # NaN/inf where PyTorch has none (or the reverse): said first, in words
        over_n = mismatched - special
        c.reason = (f"ONNX Runtime's output is {special_reason(exp, act)}" + (
            f"; on the others its error is {_times(c.ratio)} PyTorch's own float32 error"
            + (f", {over_n} of them over the budget ({BUDGET:g}x)" if over_n else "")
            if e_o.size else ""))
        return
    c.reason = "" if c.ok else (
        f"ONNX Runtime's error is {_times(c.ratio)} PyTorch's own float32 error (budget "
        f"{BUDGET:g}x)" + ("" if normwise_ok else " normwise")
        + (f"; {mismatched} of {exp.size} elements over it" if mismatched else ""))


def torch_error_scale(expected: np.ndarray, reference: np.ndarray | None
                      ) -> tuple[float, float] | None:
    """PyTorch's own float32 error on one output, relative to the output's scale: normwise
    ||y - r|| / ||r|| and elementwise max|y - r| / rms(r); None without a usable reference or
    where NaN/inf make the measure meaningless."""
    exp = np.asarray(expected)
    ref = _usable(reference, exp) if str(exp.dtype) in EPS else None
    if ref is None or exp.size == 0 or not np.all(np.isfinite(ref)) \
            or not np.all(np.isfinite(exp)):
        return None
    e_t = exp.astype(np.float64) - ref
    norm_r = float(np.linalg.norm(ref))
    if norm_r == 0:
        return None
    rms = norm_r / math.sqrt(ref.size)
    return float(np.linalg.norm(e_t)) / norm_r, float(np.abs(e_t).max()) / rms


def estimated_budget(name: str, expected: np.ndarray, actual: np.ndarray,
                     scale: tuple[float, float], *, input_set: str) -> OutputComparison | None:
    """Accept an output of another input set of the same model without its own float64 run,
    by the example's measured float32 error ``scale`` (torch_error_scale): where ONNX Runtime
    is within (BUDGET - 1) x that error of PyTorch's output (plus the floor), it is within
    BUDGET x of the float64 result as far as PyTorch's error is the example's - by the
    triangle inequality, normwise and elementwise. None when that does not show it: the set
    is then judged by the exact rule with its own reference. Accepts only; never refuses."""
    exp, act = np.asarray(expected), np.asarray(actual)
    dtype = str(exp.dtype)
    if dtype not in EPS or exp.shape != act.shape or exp.size == 0 \
            or not np.all(np.isfinite(exp)) or not np.all(np.isfinite(act)):
        return None
    y, o = exp.astype(np.float64), act.astype(np.float64)
    d = o - y
    eps, (rel_norm, rel_max) = EPS[dtype], scale
    norm_y = float(np.linalg.norm(y))
    rms = norm_y / math.sqrt(y.size)
    normwise_ok = float(np.linalg.norm(d)) <= ((BUDGET - 1) * rel_norm + FLOOR_ULPS * eps) \
        * norm_y
    bound = (BUDGET - 1) * rel_max * rms + FLOOR_ULPS * eps * (np.abs(y) + rms)
    if not normwise_ok or bool(np.any(np.abs(d) > bound)):
        return None
    c = compare_arrays(name, exp, act, input_set=input_set)
    c.ok, c.mismatched, c.reason, c.rule, c.budget = True, 0, "", RULE_ESTIMATED, BUDGET
    c.torch_error = rel_norm
    c.onnx_error = float(np.linalg.norm(d)) / norm_y if norm_y else 0.0
    c.histogram = error_histogram(d, rms)
    return c


def budget_excess(expected: np.ndarray, actual: np.ndarray, reference: np.ndarray | None
                  ) -> tuple[float, int] | None:
    """The budget rule for one intermediate value (localisation): ONNX Runtime's error over
    its budget - the larger of the normwise and the elementwise ratio, above 1 out of budget
    (inf where NaN/inf positions differ) - and the number of elements over it. None where
    ``reference`` is not a usable higher-precision value of ``expected``'s kind."""
    exp = np.asarray(expected)
    dtype = str(exp.dtype)
    ref = _usable(reference, exp) if dtype in EPS else None
    if ref is None or exp.size == 0:
        return None
    act = np.asarray(actual)
    special = _special_mismatch(exp, act)
    y, o = exp.astype(np.float64), act.astype(np.float64)
    fin = _finite(y, o, ref)
    r = ref[fin]  # the finite positions only: no inf - inf (a RuntimeWarning) elsewhere
    e_t, e_o = y[fin] - r, o[fin] - r
    if not e_o.size:
        return (math.inf, special) if special else (0.0, 0)
    eps = EPS[dtype]
    norm_r = float(np.linalg.norm(r))
    rms = norm_r / math.sqrt(r.size)
    allowed = BUDGET * float(np.linalg.norm(e_t)) + FLOOR_ULPS * eps * norm_r
    bound = BUDGET * float(np.abs(e_t).max()) + FLOOR_ULPS * eps * (np.abs(r) + rms)
    norm_o = float(np.linalg.norm(e_o))
    with np.errstate(divide="ignore", invalid="ignore"):
        elementwise = float(np.max(np.where(bound > 0, np.abs(e_o) / bound,
                                            np.where(e_o == 0, 0.0, np.inf))))
    normwise = norm_o / allowed if allowed > 0 else (0.0 if norm_o == 0 else math.inf)
    over = int(np.count_nonzero(np.abs(e_o) > bound)) + special
    return (math.inf if special else max(normwise, elementwise)), over


def _normwise(c: OutputComparison, exp: np.ndarray, act: np.ndarray, dtype: str,
              special: int) -> None:
    y, o = exp.astype(np.float64), act.astype(np.float64)
    fin = _finite(y, o)
    d, yf = (o - y)[fin], y[fin]
    scale = max(1.0, float(np.abs(yf).max())) if yf.size else 1.0
    rtol, atol = NORMWISE_RTOL[dtype], NORMWISE_ATOL[dtype] * scale
    norm_y, norm_d = float(np.linalg.norm(yf)), float(np.linalg.norm(d))
    normwise_ok = norm_d <= rtol * norm_y + atol
    mismatched = int(np.count_nonzero(np.abs(d) > rtol * np.abs(yf) + atol)) + special
    c.rule = RULE_NORMWISE
    c.rtol, c.atol = rtol, atol
    c.onnx_error = norm_d / norm_y if norm_y else 0.0
    c.histogram = error_histogram(d, norm_y / math.sqrt(max(yf.size, 1)))
    c.mismatched = mismatched
    c.ok = normwise_ok and mismatched == 0
    c.reason = "" if c.ok else (
        (f"ONNX Runtime's output is {special_reason(exp, act)}; " if special else "")
        + f"{mismatched} of {exp.size} elements outside rtol={rtol:g}, atol={atol:.3g} "
        f"(scaled normwise rule; normwise error {c.onnx_error:.3g})")


def error_histogram(err: np.ndarray, scale: float, bins: int = 12) -> list[list[float]]:
    """[[upper edge, count], ...]: |error| / the output's rms, in decades from 1e-10 to 10
    (the first bin also counts exact zeros). For the HTML report."""
    if err.size == 0:
        return []
    rel = np.abs(err) / (scale if scale > 0 else 1.0)
    edges = 10.0 ** np.arange(-10, -10 + bins)
    # np.histogram's bins [0, 1e-10), [1e-10, 1e-9) ... [1, 10] (values over 10 counted in
    # the last), counted without the sort np.histogram makes for uneven bins
    at = np.minimum(np.searchsorted(edges, rel.ravel(), side="right"), bins - 1)
    counts = np.bincount(at, minlength=bins)
    return [[float(e), int(n)] for e, n in zip(edges, counts)]


def _times(ratio: float | None) -> str:
    if ratio is None:
        return "?"
    return "inf x" if math.isinf(ratio) else f"{ratio:.3g}x"


def budget_note(c: OutputComparison) -> str:
    """'ONNX Runtime's error is 1.7x PyTorch's own float32 error (budget 10x)' for a
    comparison judged by the budget; '' otherwise."""
    if c.rule != RULE_BUDGET:
        return ""
    return (f"ONNX Runtime's error is {_times(c.ratio)} PyTorch's own float32 error (budget "
            f"{BUDGET:g}x)")


# -- quantized (QDQ) outputs ------------------------------------------------------------------
# An output a DequantizeLinear produces is s * (q - z) with q an integer: PyTorch's reference
# (float arithmetic between quantize/dequantize pairs, as PT2E's convert_pt2e leaves it) and
# ONNX Runtime's quantized kernels (QDQ fused into QLinearMatMul/QGemm/QLinearConv, integer
# accumulation, their own requantisation rounding - which differs between instruction sets)
# may round a value that lies near a half step to neighbouring integers, so they may differ by
# one step s at an element, and by no more where every step before agrees. A real fault (a
# wrong weight, scale or zero point, a wrong op) moves the integers by more: see
# tests/test_quantized.py's fault injection.
RULE_QUANT = "one quantization step"
QUANT_STEPS = 1.0


def quantization_scales(proto: object) -> dict[str, float]:
    """Graph output name -> the output scale of the DequantizeLinear that produces it (the
    largest, for a per-channel scale), where the scale is an initializer or Constant."""
    from onnx import numpy_helper

    graph = proto.graph  # type: ignore[attr-defined]
    consts = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    producers = {o: n for n in graph.node for o in n.output}
    out: dict[str, float] = {}
    for o in graph.output:
        node = producers.get(o.name)
        if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 2:
            continue
        scale = consts.get(node.input[1])
        if scale is not None:
            out[o.name] = float(np.max(np.abs(numpy_helper.to_array(scale))))
    return out


def judge_quantized(c: OutputComparison, expected: np.ndarray, actual: np.ndarray | None,
                    scale: float) -> OutputComparison:
    """``c`` (a float comparison that did not accept the output) judged again for an output of
    quantization step ``scale``: accepted when every element is within QUANT_STEPS steps
    (and NaN/inf positions match); otherwise ``c`` as it was, its reason naming the step."""
    if actual is None or c.reason and "elements outside" not in c.reason:
        return c
    atol = QUANT_STEPS * scale * (1 + 1e-6)
    q = compare_arrays(c.name, expected, actual, input_set=c.input_set, tolerance=(0.0, atol))
    q.rule = RULE_QUANT
    if q.ok:
        return q
    c.reason = (f"{c.reason or 'outside the budget'}; beyond one quantization step "
                f"({scale:.3g}) of the output's DequantizeLinear too")
    return c
