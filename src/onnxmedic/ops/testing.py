"""Check a translation against PyTorch: export one op call, run it in ONNX Runtime, compare.

Used by the op-test tables (tests/ops) and the OpInfo coverage harness (bench/). Runs ONNX
Runtime in-process for speed: these are onnxmedic's own tests, not untrusted models.

Outputs are compared element by element, except for ops whose outputs PyTorch defines only up
to sign (eigen- and singular vectors: each column may be negated, and inside a repeated value
any orthonormal basis of the eigenspace is as right as LAPACK's), and ops accurate only
relative to the size of their result (FFTs, matrix_exp: see NORMWISE_COMPARATOR). For those,
:func:`comparator_for` gives a documented :class:`Comparator` that checks what *is* defined;
its name is reported with every result it produced (``OpCheck.comparator``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
import torch.utils._pytree as pytree

from onnxmedic._tensors import flatten_tensors, to_numpy
from onnxmedic.ops._registry import REGISTRY, TranslationRegistry
from onnxmedic.verify.compare import OutputComparison, compare_outputs


class _CallOp(torch.nn.Module):
    """forward(*tensors) rebuilds the call's arguments and calls ``fn``."""

    def __init__(self, fn: Callable[..., Any], spec: Any, consts: list[Any], slots: list[int]):
        super().__init__()
        self.fn = fn
        self.spec = spec
        self.consts = consts
        self.slots = slots

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.consts)
        for slot, t in zip(self.slots, tensors):
            leaves[slot] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


def wrap_call(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A module whose forward calls ``fn(*args, **kwargs)`` with the tensors as inputs."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = tuple(leaves[i] for i in slots)
    consts = [None if i in slots else leaf for i, leaf in enumerate(leaves)]
    return _CallOp(fn, spec, consts, slots), tensors


def export_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    registry: TranslationRegistry | None = REGISTRY,
    opset: int | None = None,
) -> tuple[onnx.ModelProto, tuple[torch.Tensor, ...]]:
    """Export ``fn(*args, **kwargs)``; ``registry=None`` exports with plain torch.onnx."""
    from onnxmedic.stages.translate import onnx_export

    if registry is not None:
        registry.load_builtin()  # before capture: a family may make an op traceable
    module, tensors = wrap_call(fn, args, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, tensors, strict=False)
    program = onnx_export(ep, tensors, None, registry=registry, opset=opset)
    return program.model_proto, tensors


def run_onnx(model: onnx.ModelProto, tensors: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    """Run in-process in ONNX Runtime (CPU) with the model's inputs fed in order."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    from onnxmedic._sandbox_worker import from_ortvalue, to_ortvalue

    names = [i.name for i in sess.get_inputs()]
    feeds = {n: to_ortvalue(ort, np, to_numpy(t)) for n, t in zip(names, tensors)}
    return [from_ortvalue(np, v) for v in sess.run_with_ort_values(None, feeds)]


# --------------------------------------------------------------------------------------------
# Comparators for outputs defined only up to sign / rotation
# --------------------------------------------------------------------------------------------

Tolerance = tuple[float, float] | None


@dataclass(frozen=True)
class Comparator:
    """Compares (expected, actual) output lists of one op; ``name`` labels the results."""

    name: str
    description: str
    fn: Callable[[list[np.ndarray], list[np.ndarray], Tolerance], list[OutputComparison]]

    def __call__(self, expected: list[np.ndarray], actual: list[np.ndarray],
                 tolerance: Tolerance = None) -> list[OutputComparison]:
        return self.fn(expected, actual, tolerance)


def _scaled(tolerance: Tolerance, dtype: np.dtype, scale: float) -> tuple[float, float]:
    """The dtype's tolerance with atol scaled by the matrix's magnitude (``scale``, >= 1):
    products such as V diag(w) V^T carry absolute errors ~ eps * |A|."""
    from onnxmedic.verify.compare import tolerance_for

    rtol, atol = tolerance_for(str(np.dtype(dtype)), tolerance)
    return rtol, atol * max(1.0, scale)


def _mT(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _distinct(values: np.ndarray, rel: float) -> np.ndarray:
    """[..., k] bool: the value is at least ``rel`` * max|values| away from its neighbours
    (``values`` sorted along the last axis), so its vector is unique up to sign."""
    k = values.shape[-1]
    if k == 0:
        return np.zeros(values.shape, dtype=bool)
    scale = np.max(np.abs(values), axis=-1, keepdims=True)
    gap = np.full(values.shape, np.inf)
    d = np.abs(np.diff(values, axis=-1))
    gap[..., 1:] = d
    gap[..., :-1] = np.minimum(gap[..., :-1], d)
    return gap > rel * np.maximum(scale, np.finfo(np.float64).tiny)


def _align_signs(ref: np.ndarray, act: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, ...]:
    """Columns of ``act`` [..., m, k] flipped to point like ``ref``'s; columns not in ``keep``
    [..., k] zeroed in both (their direction is not defined). Returns (ref, act, signs)."""
    dots = np.sum(ref * act, axis=-2, keepdims=True)
    signs = np.where(dots < 0, -1.0, 1.0)
    mask = keep[..., None, :].astype(ref.dtype)
    return ref * mask, act * signs * mask, signs


def _cmp(name: str, exp: np.ndarray, act: np.ndarray, tol: tuple[float, float]):
    from onnxmedic.verify.compare import compare_arrays

    return compare_arrays(name, exp, act, tolerance=tol)


def _shapes_differ(expected, actual) -> list[OutputComparison] | None:
    from onnxmedic.verify.compare import compare_outputs

    if len(expected) != len(actual) or any(
            np.asarray(e).shape != np.asarray(a).shape for e, a in zip(expected, actual)):
        return compare_outputs([f"out{i}" for i in range(len(expected))], expected, actual)
    return None


def _compare_eigh(expected, actual, tolerance):
    """(w, V): w elementwise; V through V diag(w) V^T, V^T V = I and, for each eigenvalue
    distinct from its neighbours, its column up to sign."""
    bad = _shapes_differ(expected, actual)
    if bad is not None:
        return bad
    w_e, v_e = (np.asarray(x, dtype=np.float64) for x in expected)
    w_a, v_a = (np.asarray(x, dtype=np.float64) for x in actual)
    dt = np.asarray(expected[0]).dtype
    scale = float(np.max(np.abs(w_e), initial=0.0)) if np.isfinite(w_e).all() else 1.0
    tol = _scaled(tolerance, dt, scale)
    rtol1, atol1 = _scaled(tolerance, dt, 1.0)
    keep = _distinct(w_e, max(rtol1, 1e3 * np.finfo(dt).eps))
    ref, act, _ = _align_signs(v_e, v_a, keep)
    eye = np.broadcast_to(np.eye(v_e.shape[-1]), v_e.shape)
    return [
        _cmp("out0 (eigenvalues)", expected[0], actual[0], tolerance),
        _cmp("out1: V diag(w) V^T", (v_e * w_e[..., None, :]) @ _mT(v_e),
             (v_a * w_a[..., None, :]) @ _mT(v_a), tol),
        _cmp("out1: V^T V = I", eye, _mT(v_a) @ v_a, (rtol1, atol1 * 10)),
        _cmp("out1: columns of distinct eigenvalues, up to sign", ref, act, (rtol1, atol1 * 10)),
    ]


def _compare_svd(expected, actual, tolerance, *, v_not_vh: bool = False):
    """(U, S, Vh) (torch.svd: (U, S, V)): S elementwise; U diag(S) Vh over the min(m, n)
    leading columns; U^T U = I and Vh Vh^T = I; for each singular value that is distinct from
    its neighbours and not 0, its U column and Vh row with one shared sign. Columns beyond
    min(m, n) (full_matrices=True) are any orthonormal completion: checked by U^T U = I only."""
    bad = _shapes_differ(expected, actual)
    if bad is not None:
        return bad
    u_e, s_e, vh_e = (np.asarray(x, dtype=np.float64) for x in expected)
    u_a, s_a, vh_a = (np.asarray(x, dtype=np.float64) for x in actual)
    if v_not_vh:
        vh_e, vh_a = _mT(vh_e), _mT(vh_a)
    dt = np.asarray(expected[1]).dtype
    out = [_cmp("out1 (singular values)", expected[1], actual[1], tolerance)]
    k = s_e.shape[-1]
    if u_e.size == 0 or vh_e.size == 0 or k == 0 or u_e.shape[-1] < k or not np.any(u_e):
        # empty, or not computed (torch.svd(compute_uv=False) returns zero-filled U and V)
        out.insert(0, _cmp("out0", expected[0], actual[0], tolerance))
        out.append(_cmp("out2", expected[2], actual[2], tolerance))
        return out
    scale = float(np.max(s_e, initial=0.0)) if np.isfinite(s_e).all() else 1.0
    tol = _scaled(tolerance, dt, scale)
    rtol1, atol1 = _scaled(tolerance, dt, 1.0)
    uk_e, uk_a = u_e[..., :, :k], u_a[..., :, :k]
    vk_e, vk_a = _mT(vh_e[..., :k, :]), _mT(vh_a[..., :k, :])
    keep = _distinct(s_e, max(rtol1, 1e3 * np.finfo(dt).eps)) & (
        s_e > max(rtol1, 1e3 * np.finfo(dt).eps) * np.maximum(scale, np.finfo(np.float64).tiny))
    u_ref, u_al, signs = _align_signs(uk_e, uk_a, keep)
    v_ref = vk_e * keep[..., None, :]
    v_al = vk_a * signs * keep[..., None, :]
    eye_u = np.broadcast_to(np.eye(u_e.shape[-1]), u_e.shape[:-2] + (u_e.shape[-1],) * 2)
    eye_v = np.broadcast_to(np.eye(vh_e.shape[-2]), vh_e.shape[:-2] + (vh_e.shape[-2],) * 2)
    return out + [
        _cmp("U diag(S) Vh", (uk_e * s_e[..., None, :]) @ _mT(vk_e),
             (uk_a * s_a[..., None, :]) @ _mT(vk_a), tol),
        _cmp("U^T U = I", eye_u, _mT(u_a) @ u_a, (rtol1, atol1 * 10)),
        _cmp("Vh Vh^T = I", eye_v, vh_a @ _mT(vh_a), (rtol1, atol1 * 10)),
        _cmp("U columns of distinct singular values, up to sign", u_ref, u_al,
             (rtol1, atol1 * 10)),
        _cmp("Vh rows, with the sign of their U column", v_ref, v_al, (rtol1, atol1 * 10)),
    ]


EIGH_COMPARATOR = Comparator(
    "eigh-up-to-sign",
    "eigenvalues elementwise; eigenvectors through V diag(w) V^T, V^T V = I and, for "
    "eigenvalues distinct from their neighbours, each column up to sign",
    _compare_eigh,
)
SVD_COMPARATOR = Comparator(
    "svd-up-to-sign",
    "singular values elementwise; U diag(S) Vh, U^T U = I, Vh Vh^T = I and, for distinct "
    "non-zero singular values, each U column and Vh row up to one shared sign",
    _compare_svd,
)
TORCH_SVD_COMPARATOR = Comparator(
    "svd-up-to-sign", SVD_COMPARATOR.description + " (torch.svd returns V, not Vh)",
    lambda e, a, t: _compare_svd(e, a, t, v_not_vh=True),
)

def _compare_normwise(expected, actual, tolerance):
    """Each output with the dtype's tolerance, its atol scaled by the output's largest finite
    magnitude (at least 1). NaN/inf must still match exactly."""
    bad = _shapes_differ(expected, actual)
    if bad is not None:
        return bad
    out = []
    for i, (e, a) in enumerate(zip(expected, actual)):
        e = np.asarray(e)
        if e.dtype.kind not in "fc" or e.size == 0:
            out.append(_cmp(f"out{i}", e, a, tolerance))
            continue
        mags = np.abs(e.astype(np.complex128 if e.dtype.kind == "c" else np.float64))
        finite = mags[np.isfinite(mags)]
        scale = float(finite.max()) if finite.size else 1.0
        out.append(_cmp(f"out{i} (atol x {max(1.0, scale):.3g})", e, a,
                        _scaled(tolerance, e.real.dtype if e.dtype.kind == "c" else e.dtype,
                                scale)))
    return out


NORMWISE_COMPARATOR = Comparator(
    "normwise",
    "elementwise with the absolute tolerance scaled by the output's largest magnitude: FFTs "
    "and matrix functions are accurate relative to the size of their result (rounding of ~eps "
    "x log n x |y|, ~eps x |exp(A)|), so an element that cancels to ~0 carries an error of the "
    "result's scale, in PyTorch's kernels as in ONNX Runtime's",
    _compare_normwise,
)

# OpInfo names whose outputs PyTorch defines only up to sign (or rotation in a repeated value),
# and those whose accuracy is normwise rather than elementwise
_COMPARATORS = {"linalg.eigh": EIGH_COMPARATOR, "linalg.svd": SVD_COMPARATOR,
                "svd": TORCH_SVD_COMPARATOR, "matrix_exp": NORMWISE_COMPARATOR,
                "linalg.matrix_exp": NORMWISE_COMPARATOR, "stft": NORMWISE_COMPARATOR,
                "istft": NORMWISE_COMPARATOR,
                **{f"fft.{n}": NORMWISE_COMPARATOR for n in (
                    "fft", "fft2", "fftn", "hfft", "hfft2", "hfftn", "ifft", "ifft2", "ifftn",
                    "ihfft", "ihfft2", "ihfftn", "irfft", "irfft2", "irfftn", "rfft", "rfft2",
                    "rfftn")}}


def comparator_for(name: str, variant: str = "") -> Comparator | None:
    """The comparator for an OpInfo op whose outputs are unique only up to sign, or accurate
    only normwise (FFTs, matrix_exp), else None (compare element by element)."""
    return _COMPARATORS.get(f"{name}.{variant}" if variant else name)


@dataclass
class OpCheck:
    """The result of checking one call: where it failed, or the comparison per output.

    ``comparator`` names the per-op comparator used instead of an elementwise comparison
    (empty when the outputs were compared element by element)."""

    stage: str  # "passed", "eager", "export", "runtime", "compare"
    error: str = ""
    comparisons: list[OutputComparison] = field(default_factory=list)
    comparator: str = ""

    @property
    def ok(self) -> bool:
        return self.stage == "passed"

    @property
    def max_abs(self) -> float:
        return max((c.max_abs for c in self.comparisons), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((c.max_rel for c in self.comparisons), default=0.0)


def check_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    tolerance: tuple[float, float] | None = None,
    registry: TranslationRegistry | None = REGISTRY,
    opset: int | None = None,
    comparator: Comparator | None = None,
) -> OpCheck:
    """Export, run and compare one call. Never raises for a failure of the translation.

    ``comparator`` replaces the elementwise comparison (see :func:`comparator_for`)."""
    try:
        with torch.no_grad():
            expected = flatten_tensors(fn(*args, **(kwargs or {})))
    except Exception as e:
        return OpCheck("eager", f"{type(e).__name__}: {e}")
    try:
        model, tensors = export_call(fn, args, kwargs, registry=registry, opset=opset)
    except Exception as e:
        return OpCheck("export", _short(e))
    try:
        actual = run_onnx(model, tensors)
    except Exception as e:
        return OpCheck("runtime", _short(e))
    exp_np = [to_numpy(t) for t in expected]
    label = comparator.name if comparator is not None else ""
    if comparator is not None:
        comps = comparator(exp_np, actual, tolerance)
    else:
        comps = compare_outputs([f"out{i}" for i in range(len(expected))], exp_np, actual,
                                tolerance=tolerance)
    if all(c.ok for c in comps):
        return OpCheck("passed", comparisons=comps, comparator=label)
    bad = next(c for c in comps if not c.ok)
    via = f" [compared {label}]" if label else ""
    return OpCheck(
        "compare",
        f"{bad.name}: {bad.reason}; max abs {bad.max_abs:.3g}, max rel {bad.max_rel:.3g}{via}",
        comps, comparator=label,
    )


def _short(e: BaseException) -> str:
    """The innermost useful line of an exporter error."""
    text = f"{type(e).__name__}: {e}"
    for line in str(e).splitlines():
        if "No ONNX function found" in line or "DispatchError" in line:
            return line.strip()[:500]
    cause = e.__cause__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    return text.strip().splitlines()[0][:500] if text.strip() else type(e).__name__
