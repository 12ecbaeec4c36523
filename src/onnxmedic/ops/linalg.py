"""Linear algebra torchlib does not translate: inv, solve, slogdet, cholesky, LU, QR, eigh, SVD, ...

Every translation here unrolls a direct algorithm over the matrix size, so the matrix size
(the last two dims) must be static at export time; batch dims may be dynamic. All work is
vectorised over the batch: each unrolled step is a handful of whole-tensor ops on [..., n, n].

Algorithms (standard ONNX ops only, opset 18):

* inv / solve: Gauss-Jordan elimination with partial pivoting. Rows are *selected* (the pivot is
  the largest |entry| among rows not used yet, exactly the row LAPACK's getrf picks) instead of
  swapped; the result rows are permuted once at the end with a permutation matrix.
* slogdet / det / lu_factor / lu / lu_solve: LU with partial pivoting and real row swaps
  (LAPACK ``getrf`` semantics: 1-based int32 pivots, first zero pivot reported in ``info``).
* cholesky (+ solve / inverse): right-looking Cholesky; triangular solves by substitution.
* qr: Householder QR with LAPACK's ``geqrf`` sign convention (R's diagonal is
  ``-sign(alpha) * norm``), so Q and R match PyTorch, not just up to signs.
* eigh / eigvalsh: cyclic Jacobi with a round-robin (parallel) ordering: each step applies n/2
  disjoint rotations as one orthogonal matrix. Eigenvectors are unique only up to sign (and
  within repeated eigenvalues up to rotation): they do not match PyTorch's sign choice.
* svd / svdvals (and pinv, matrix_rank, matrix norms ord=2/'nuc', cond through ``_linalg_svd``):
  one-sided (Hestenes) Jacobi on the columns, which keeps small singular values accurate
  (unlike an eigen-decomposition of A^T A). Singular vectors are unique only up to sign.
* matrix_exp: scaling and squaring with a degree-18 Taylor polynomial (Paterson-Stockmeyer).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import const, ints, static_shape
from onnxmedic.ops._registry import translation

aten = torch.ops.aten

_INT32 = ir.DataType.INT32
_INT64 = ir.DataType.INT64
_BOOL = ir.DataType.BOOL


# ----------------------------------------------------------------------------- helpers


def _matrix_size(x, opname: str) -> tuple[int, int]:
    """The static (rows, cols) of a [..., m, n] input, or a ValueError the user can act on."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(f"{opname}: expected a [..., m, n] matrix input (got shape {shape})")
    m, n = shape[-2], shape[-1]
    if not isinstance(m, int) or not isinstance(n, int):
        raise ValueError(
            f"{opname}: the matrix size must be static at export time (got {m} x {n}); "
            f"export with static matrix dims (batch dims may stay dynamic)"
        )
    return m, n


def _square(x, opname: str) -> int:
    m, n = _matrix_size(x, opname)
    if m != n:
        raise ValueError(f"{opname}: expected square matrices (got {m} x {n})")
    return n


def _rank(x) -> int:
    return len(x.shape)


def _k(i: int):
    """A 0-d int64 index (Gather with it drops the axis)."""
    return op.Constant(value_int=i)


def _np_const(arr: np.ndarray, like):
    """A float constant from numpy, cast like ``like``; stored as float64 for exactness."""
    return op.CastLike(op.Constant(value=ir.tensor(np.asarray(arr, dtype=np.float64))), like)


def _bool_const(arr: np.ndarray):
    return op.Constant(value=ir.tensor(np.asarray(arr, dtype=np.bool_)))


def _i64_const(arr) -> object:
    return op.Constant(value=ir.tensor(np.asarray(arr, dtype=np.int64)))


def _mT(x, r: int):
    """Swap the last two dims of a rank-r tensor (intermediate values carry no shape)."""
    perm = list(range(r - 2)) + [r - 1, r - 2]
    return op.Transpose(x, perm=perm)


def _batch_shape(x):
    """The dynamic batch shape (all dims but the last two) as a 1-D int64 tensor."""
    return op.Shape(x, start=0, end=-2)


def _split_last(x, k: int):
    """(x[..., :k], x[..., k:])."""
    return (op.Slice(x, ints([0]), ints([k]), ints([-1])),
            op.Slice(x, ints([k]), ints([2**62]), ints([-1])))


def _eye(n: int, like):
    return _np_const(np.eye(n), like)


def _diag(x):
    """The diagonal of a square [..., n, n] as [..., n]."""
    n = x.shape[-1]
    return op.ReduceSum(op.Mul(x, _eye(n, x)), ints([-1]), keepdims=0)


def _diag_embed(d, n: int):
    """[..., n] -> [..., n, n] diagonal matrix."""
    return op.Mul(op.Unsqueeze(d, ints([-1])), _eye(n, d))


def _int32(x):
    return op.Cast(x, to=_INT32)


def _first_true_1based(flags, n: int):
    """info-style output: 1 + index of the first True along the last axis, 0 if none. int32."""
    any_ = op.ReduceMax(op.Cast(flags, to=_INT32), ints([-1]), keepdims=0)
    first = op.ArgMax(op.Cast(flags, to=_INT32), axis=-1, keepdims=0)
    info = op.Where(op.Cast(any_, to=_BOOL), op.Add(first, op.Constant(value_int=1)),
                    op.Constant(value_int=0))
    return _int32(info)


def _zeros_i32(shape):
    return op.ConstantOfShape(shape, value=ir.tensor(np.zeros((1,), dtype=np.int32)))


def _broadcast_batch(A, B, same: bool):
    """Broadcast the batch dims of [..., m, n] A and [..., m, k] B against each other."""
    if same:
        return A, B
    one = const(1.0, A)
    A2 = op.Mul(A, op.Expand(one, op.Concat(_batch_shape(B), ints([1, 1]), axis=0)))
    B2 = op.Mul(B, op.Expand(one, op.Concat(_batch_shape(A), ints([1, 1]), axis=0)))
    return A2, B2


def _empty_like_dtype(like):
    """A 1-D empty tensor of ``like``'s dtype (PyTorch returns these for outputs not computed)."""
    return op.CastLike(op.Constant(value=ir.tensor(np.zeros((0,), dtype=np.float32))), like)


# ----------------------------------------------------------------------------- Gauss-Jordan


def _gauss_jordan(A, B, n: int, m: int, same_batch: bool = False):
    """Solve A X = B for square [..., n, n] A and [..., n, m] B (broadcast batch dims).

    Returns (X, pivots [..., n] as the list of pivot values, 1-based info int32).
    Pivot choice = LAPACK partial pivoting (largest |entry| among rows not yet used; first on
    ties). A singular matrix divides by a zero pivot (inf/nan results, as LAPACK's getri would
    refuse); ``info`` is the 1-based step of the first zero pivot, like getrf's.
    """
    rng_r = _i64_const(np.arange(n).reshape(1, n))
    rng_c = _i64_const(np.arange(n).reshape(n, 1))
    neg1 = const(-1.0, A)
    zero = const(0.0, A)
    A, B = _broadcast_batch(A, B, same_batch)
    M = op.Concat(A, B, axis=-1)  # [..., n, n + m]; one column is retired per step
    width = n + m
    used = _bool_const(np.zeros((n, 1), dtype=bool))
    onehots = []
    pivots = []
    for _ in range(n):
        col, rest = _split_last(M, 1)  # [..., n, 1]
        width -= 1
        score = op.Where(used, neg1, op.Abs(col))
        p = op.ArgMax(score, axis=-2, keepdims=1)  # [..., 1, 1]
        ohc_b = op.Equal(rng_c, p)  # [..., n, 1]
        ohr = op.CastLike(op.Equal(rng_r, p), M)  # [..., 1, n]
        row = op.MatMul(ohr, M)  # [..., 1, w]: the pivot row
        piv, rowrest = _split_last(row, 1)  # [..., 1, 1]
        pivots.append(piv)
        rown = op.Div(rowrest, piv)
        f = op.Sub(col, op.CastLike(ohc_b, M))  # the pivot row ends up as rown
        M = op.Sub(rest, op.Mul(f, rown))
        used = op.Or(used, ohc_b)
        onehots.append(ohr)
    perm = op.Concat(*onehots, axis=-2) if n > 1 else onehots[0]  # perm[k, p_k] = 1
    X = op.MatMul(perm, M)
    piv_all = op.Concat(*pivots, axis=-1) if n > 1 else pivots[0]  # [..., 1, n]
    info = _first_true_1based(op.Squeeze(op.Equal(piv_all, zero), ints([-2])), n)
    return X, info


def _inverse(A, opname: str):
    n = _square(A, opname)
    if n == 0:
        return A, _zeros_i32(_batch_shape(A))
    eye = op.Expand(_eye(n, A), op.Concat(_batch_shape(A), ints([n, n]), axis=0))
    return _gauss_jordan(A, eye, n, n, same_batch=True)


@translation(aten.linalg_inv.default, static_shapes=True)
def aten_linalg_inv_default(A):
    """linalg_inv(Tensor A) -> Tensor"""
    return _inverse(A, "linalg_inv")[0]


@translation(aten.inverse.default, static_shapes=True)
def aten_inverse_default(self):
    """inverse(Tensor self) -> Tensor"""
    return _inverse(self, "inverse")[0]


@translation(aten.linalg_inv_ex.default, static_shapes=True)
def aten_linalg_inv_ex_default(A, check_errors: bool = False):
    """linalg_inv_ex(Tensor A, *, bool check_errors=False) -> (Tensor inverse, Tensor info)"""
    X, info = _inverse(A, "linalg_inv_ex")
    return X, info


def _solve(A, B, left: bool, opname: str):
    n = _square(A, opname)
    # B is a batch of vectors when B.ndim == 1 or (B.ndim == A.ndim - 1 and the shapes agree).
    a_shape, b_shape = list(A.shape), list(B.shape)
    vector = len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1
                                   and b_shape == a_shape[:-1])
    same = (a_shape[:-2] == b_shape[:-1]) if vector else (a_shape[:-2] == b_shape[:-2])
    ra, rb = len(a_shape), len(b_shape) + (1 if vector else 0)
    if vector:
        nrhs = 1
    else:
        nrhs = b_shape[-2] if not left else b_shape[-1]
        if not isinstance(nrhs, int):
            raise ValueError(f"{opname}: the number of right-hand sides must be static at "
                             f"export time (got {nrhs})")
    if vector:
        B = op.Unsqueeze(B, ints([-1]))
    if not left:
        A = _mT(A, ra)
        B = _mT(B, rb) if not vector else B
    if n == 0:
        X, info = B, None
    else:
        X, info = _gauss_jordan(A, B, n, nrhs, same_batch=same)
    if not left and not vector:
        X = _mT(X, max(ra, rb))
    if vector:
        X = op.Squeeze(X, ints([-1]))
    if info is None:
        info = _zeros_i32(_batch_shape(A))
    return X, info


@translation(aten.linalg_solve.default, static_shapes=True)
def aten_linalg_solve_default(A, B, left: bool = True):
    """linalg_solve(Tensor A, Tensor B, *, bool left=True) -> Tensor"""
    return _solve(A, B, left, "linalg_solve")[0]


@translation(aten.linalg_solve_ex.default, static_shapes=True)
def aten_linalg_solve_ex_default(A, B, left: bool = True, check_errors: bool = False):
    """linalg_solve_ex(Tensor A, Tensor B, *, bool left=True, bool check_errors=False) -> (Tensor result, Tensor info)"""
    return _solve(A, B, left, "linalg_solve_ex")
