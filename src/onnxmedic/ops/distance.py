"""Distance ops torchlib lacks: cdist (``_cdist_forward``) and pdist (``_pdist_forward``).

Both follow PyTorch's CPU kernels: the direct form reduces |x1_i - x2_j| over the feature dim
(p = 0: count of differing features, 1, 2, inf, general p: (sum |d|^p)^(1/p)); cdist with p = 2
switches to PyTorch's matrix-multiplication form exactly when PyTorch does (compute_mode 1, or
the default with more than 25 rows in either input), since the two forms round differently.
"""

from __future__ import annotations

import math

import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import const, const_f64, ints, static_shape
from onnxmedic.ops._registry import translation

aten = torch.ops.aten


def _reduce_norm(diff, p: float, axis: int, nan_max: bool):
    """The p-norm of ``diff`` over ``axis`` (removed), PyTorch's cdist/pdist definition.

    NaN propagates, except for p = inf with ``nan_max`` False: cdist's CPU kernel takes
    max(agg, |d|) starting from 0, which skips NaN (pdist's propagates it)."""
    ax = ints([axis])
    nan = op.IsNaN(diff)
    if p == 0:  # PyTorch: min(ceil(|d|), 1), NaN for NaN
        nz = op.CastLike(op.Not(op.Equal(diff, const(0, diff))), diff)
        return op.ReduceSum(op.Where(nan, diff, nz), ax, keepdims=0)
    a = op.Abs(diff)
    if p == 1:
        return op.ReduceSum(a, ax, keepdims=0)
    if p == 2:
        return op.Sqrt(op.ReduceSum(op.Mul(a, a), ax, keepdims=0))
    if math.isinf(p):
        m = op.ReduceMax(op.Where(nan, const(0, a), a), ax, keepdims=0)
        if not nan_max:
            return m
        any_nan = op.Cast(op.ReduceMax(op.Cast(nan, to=ir.DataType.INT32), ax, keepdims=0),
                          to=ir.DataType.BOOL)
        return op.Where(any_nan, const(math.nan, m), m)
    s = op.ReduceSum(op.Pow(a, const_f64(float(p), a)), ax, keepdims=0)
    return op.Pow(s, const_f64(1.0 / p, s))


def _zero_features(x1, x2):
    """Zeros of shape [..., P, R] for inputs with no features (M == 0)."""
    rows = op.Shape(x1, start=-2, end=-1)
    cols = op.Shape(x2, start=-2, end=-1)
    batch = op.Shape(op.Add(op.Slice(x1, ints([0]), ints([1]), ints([-2])),
                            op.Slice(x2, ints([0]), ints([1]), ints([-2]))), end=-2)
    shape = op.Concat(batch, rows, cols, axis=0)
    return op.Expand(const(0, x1), shape)


def _euclid_mm(x1, x2):
    """PyTorch's _euclidean_dist: [-2 x1, |x1|^2, 1] @ [x2, 1, |x2|^2]^T, clamped, sqrt."""
    n1 = op.ReduceSum(op.Mul(x1, x1), ints([-1]), keepdims=1)
    n2 = op.ReduceSum(op.Mul(x2, x2), ints([-1]), keepdims=1)
    one1 = op.Expand(const(1, x1), op.Shape(n1))
    one2 = op.Expand(const(1, x2), op.Shape(n2))
    a = op.Concat(op.Mul(x1, const(-2, x1)), n1, one1, axis=-1)
    b = op.Concat(x2, one2, n2, axis=-1)
    rank = len(x2.shape)
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    r = op.MatMul(a, op.Transpose(b, perm=perm))
    return op.Sqrt(op.Max(r, const(0, r)))


@translation(aten._cdist_forward.default)
def aten__cdist_forward(x1, x2, p: float, compute_mode=None):
    """_cdist_forward(Tensor x1, Tensor x2, float p, int? compute_mode) -> Tensor

    x1 [..., P, M], x2 [..., R, M] (batch dims broadcast) -> [..., P, R]. The direct form
    holds a [..., P, R, M] difference tensor. For p = 2 the matrix-multiplication form is used
    when PyTorch uses it: compute_mode 1, or None/0 with P > 25 or R > 25 (the row counts must
    then be known at export time; a dynamic count uses the direct form)."""
    if p < 0:
        raise ValueError(f"cdist: p must be >= 0 (got {p})")
    s1 = static_shape(x1)
    if s1 is not None and s1[-1] == 0:
        return _zero_features(x1, x2)
    if p == 2:
        mode = 0 if compute_mode is None else compute_mode
        p_rows = x1.shape[-2]
        r_rows = x2.shape[-2]
        big = (isinstance(p_rows, int) and p_rows > 25) or (isinstance(r_rows, int)
                                                            and r_rows > 25)
        if mode == 1 or (mode == 0 and big):
            return _euclid_mm(x1, x2)
    diff = op.Sub(op.Unsqueeze(x1, ints([-2])), op.Unsqueeze(x2, ints([-3])))
    return _reduce_norm(diff, p, -1, nan_max=False)


@translation(aten._pdist_forward.default)
def aten__pdist_forward(self, p: float = 2.0):
    """_pdist_forward(Tensor self, float p=2.) -> Tensor

    self [N, M] -> the N(N-1)/2 distances of rows i < j in row-major order: all N x N pairs
    (an [N, N, M] difference tensor) compressed by the i < j mask, so N may be dynamic."""
    if p < 0:
        raise ValueError(f"pdist: p must be >= 0 (got {p})")
    shape = static_shape(self)
    if shape is not None and shape[1] == 0:
        n = shape[0]
        return op.Expand(const(0, self), ints([n * (n - 1) // 2]))
    diff = op.Sub(op.Unsqueeze(self, ints([1])), op.Unsqueeze(self, ints([0])))
    dist = _reduce_norm(diff, p, -1, nan_max=True)
    n = op.Squeeze(op.Shape(self, start=0, end=1), ints([0]))
    pos = op.Range(op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64)), n,
                   op.Constant(value=ir.tensor(1, dtype=ir.DataType.INT64)))
    upper = op.Less(op.Unsqueeze(pos, ints([1])), op.Unsqueeze(pos, ints([0])))
    return op.Compress(op.Reshape(dist, ints([-1])), op.Reshape(upper, ints([-1])), axis=0)
