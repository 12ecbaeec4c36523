"""Linear algebra torchlib does not translate: inv, solve, slogdet, cholesky, LU, QR, eigh, SVD,
lstsq, ...

Every translation here unrolls a direct algorithm over the matrix size, so the matrix size
(the last two dims) must be static at export time; batch dims may be dynamic. All work is
vectorised over the batch: each unrolled step is a handful of whole-tensor ops on [..., n, n].

Algorithms (standard ONNX ops only, opset 18):

* inv / solve: Gauss-Jordan elimination with partial pivoting, blocked by 16-column panels (the
  pivot search and the eliminations run on one panel; the rest of [A | B] is updated once per
  panel with MatMuls). Rows are *selected* (the pivot is the largest |entry| among rows not used
  yet, exactly the row LAPACK's getrf picks) instead of swapped; the result rows are gathered
  in pivot order once at the end.
* slogdet / det / lu_factor / lu / lu_solve: LU with partial pivoting and real row swaps
  (LAPACK ``getrf`` semantics: 1-based int32 pivots, first zero pivot reported in ``info``;
  m x n matrices take min(m, n) steps). lu_solve's left=False is the transposed left solve.
* cholesky (+ solve / inverse): right-looking Cholesky; triangular solves by substitution.
* qr: Householder QR with LAPACK's ``geqrf`` sign convention (R's diagonal is
  ``-sign(alpha) * norm``), so Q and R match PyTorch, not just up to signs.
* eigh / eigvalsh: cyclic Jacobi with a round-robin (parallel) ordering: each step applies n/2
  disjoint rotations as one orthogonal matrix. Eigenvectors are unique only up to sign (and
  within repeated eigenvalues up to rotation): they do not match PyTorch's sign choice.
* svd / svdvals (and pinv, matrix_rank, matrix norms ord=2/'nuc', cond through ``_linalg_svd``):
  one-sided (Hestenes) Jacobi on the columns, which keeps small singular values accurate
  (unlike an eigen-decomposition of A^T A). Singular vectors are unique only up to sign.
  Eigen- and singular vectors are checked with onnxmedic.ops.testing's up-to-sign comparators.
* lstsq: gels by Householder QR / LQ; gelsy, gelsd, gelss by the truncated SVD. torch has no
  fake kernel for it (dynamic_output_shape): one is registered for the static-shape cases.
* matrix_exp: scaling and squaring with a degree-18 Taylor polynomial (Paterson-Stockmeyer).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import add_fake_kernel, const, const_f64, ints
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




def _eye(n: int, like):
    return _np_const(np.eye(n), like)






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


def _unit_triangular_inverse(N, b: int, like):
    """(I + N)^-1 for strictly triangular [..., b, b] N (nilpotent: N^b = 0), as
    (I - N)(I + N^2)(I + N^4)...: 2 log2(b) small MatMuls instead of b substitution steps."""
    eye = _eye(b, like)
    inv = op.Sub(eye, N)
    power, reach = N, 2  # inv covers the powers N^0 .. N^(reach - 1)
    while reach < b:
        power = op.MatMul(power, power)
        inv = op.MatMul(inv, op.Add(eye, power))
        reach *= 2
    return inv


# Panel width of the blocked Gauss-Jordan: wide enough that the rest of the matrix is touched
# by few MatMuls, narrow enough that the per-column steps stay on small tensors (measured with
# bench/latency/latency_linalg.py: 16 beat 8, 12 and 32 at n = 32 and 64).
GJ_PANEL = 16


def _panel_lu(Qp, b: int, col_shape):
    """LU with partial pivoting of one panel ``Qp`` [..., b, n] (rows already used as pivots
    zeroed): per column, its multipliers l [..., 1, n], pivot row p [..., 1, 1], pivot value
    and U column u [..., b, 1] (none of l and u for a 1-column panel)."""
    ls, ps, pivs, us = [], [], [], []
    for j in range(b):
        c = op.Gather(Qp, ints([j]), axis=-2)  # [..., 1, n]: column j of the panel
        p = op.ArgMax(op.Abs(c), axis=-1, keepdims=1)  # [..., 1, 1]
        piv = op.GatherElements(c, p, axis=-1)
        ps.append(p)
        pivs.append(piv)
        if b == 1:  # a 1-column panel: its L and U are just the pivot
            break
        l = op.Div(c, piv)  # multipliers; exactly 1 at the pivot row
        u = op.GatherElements(Qp, op.Expand(p, col_shape), axis=-1)  # [..., b, 1]: U row
        if j < b - 1:
            Qp = op.Sub(Qp, op.Mul(u, l))
        ls.append(l)
        us.append(u)
    return ls, ps, pivs, us


def _eliminate_panel(Q, Qp0, lu, b: int, width: int, shape, like):
    """Gauss-Jordan's b steps of one panel on the rest ``Q`` [..., width, n] as one block:
    the new pivot rows Y = U^-1 L^-1 R_pi, every other row R_r - P_r Y. ``lu``: the panel's
    :func:`_panel_lu`; ``Qp0`` the panel as sliced. Returns (Q, pivot rows [..., 1, b])."""
    ls, ps, pivs, us = lu
    idx = op.Concat(*ps, axis=-1) if b > 1 else ps[0]  # [..., 1, b]
    piv_row = op.Concat(*pivs, axis=-1) if b > 1 else pivs[0]  # [..., 1, b]
    Ridx = op.Expand(idx, shape(width, b))
    Z = op.GatherElements(Q, Ridx, axis=-1)  # R_pi^T [..., width, b]
    if b > 1:
        Lt = op.Concat(*ls, axis=-2)  # [..., b, n]: Lt[i, row] = step i's multiplier
        LpiT = op.GatherElements(Lt, op.Expand(idx, shape(b, b)), axis=-1)  # L_pi^T
        Z = op.MatMul(Z, _unit_triangular_inverse(op.Sub(LpiT, _eye(b, like)), b, like))
    Z = op.Div(Z, piv_row)
    if b > 1:
        UT = op.Concat(*us, axis=-1)  # [..., b, b]: U_pi^T
        Nl = op.Mul(op.Div(UT, piv_row), _np_const(np.tril(np.ones((b, b)), -1), like))
        Z = op.MatMul(Z, _unit_triangular_inverse(Nl, b, like))  # Y^T [..., width, b]
    return op.ScatterElements(op.Sub(Q, op.MatMul(Z, Qp0)), Ridx, Z, axis=-1), idx


def _gauss_jordan(A, B, n: int, m: int, r: int, same_batch: bool, panel: int = GJ_PANEL):
    """Solve A X = B for square [..., n, n] A and [..., n, m] B (broadcast batch dims; r is the
    rank of the result). Returns (X, 1-based info int32).

    Pivot choice = LAPACK partial pivoting (largest |entry| among rows not yet used; first on
    ties). A singular matrix divides by a zero pivot (inf/nan results, as LAPACK's getri would
    refuse); ``info`` is the 1-based step of the first zero pivot, like getrf's.

    Gauss-Jordan elimination blocked by ``panel`` columns (one panel when n <= panel).

    Works on Q = [A | B]^T (rows of Q are columns of [A | B]; ONNX Runtime broadcasts much
    faster along the last axis). For each panel of b columns:

    * LU with the same partial pivoting on the panel alone (rows already chosen as pivots are
      zeroed, so the pivot search is a plain ArgMax of |column|; each step zeroes its pivot row
      exactly, because its multiplier is piv / piv = 1). This gives the panel's pivot rows p_k,
      the pivot block P_pi = L U (b x b) and nothing else: what Gauss-Jordan does to the panel
      is not needed later.
    * Gauss-Jordan's b steps act on the columns right of the panel (R) as one block: the new
      pivot rows are Y = P_pi^-1 R_pi = U^-1 L^-1 R_pi (both triangular inverses from
      :func:`_unit_triangular_inverse`), every other row r becomes R_r - P_r Y.

    Rows are selected, never swapped; the solution is gathered in pivot order at the end.
    """
    zero = const(0.0, A)
    A, B = _broadcast_batch(A, B, same_batch)
    Q = op.Concat(_mT(A, r), _mT(B, r), axis=-2)  # [..., n + m, n]
    batch = _batch_shape(Q)

    def shape(*dims):
        return op.Concat(batch, ints(list(dims)), axis=0)

    avail = None  # [..., 1, n]: 0 for rows already used as pivots, else 1
    all_p, all_piv = [], []
    width = n + m
    for start in range(0, n, panel):
        b = min(panel, n - start)
        width -= b
        Qp0 = op.Slice(Q, ints([0]), ints([b]), ints([-2]))  # the panel [..., b, n]
        Q = op.Slice(Q, ints([b]), ints([2**62]), ints([-2]))  # the rest [..., width, n]
        Qp = Qp0 if avail is None else op.Mul(Qp0, avail)
        lu = _panel_lu(Qp, b, shape(b, 1))
        _, ps, pivs, _ = lu
        all_p += ps
        all_piv += pivs
        Q, idx = _eliminate_panel(Q, Qp0, lu, b, width, shape, A)
        if start + b < n:
            avail = op.ScatterElements(
                avail if avail is not None else op.Expand(const(1.0, A), shape(1, n)),
                idx, op.Expand(zero, shape(1, b)), axis=-1)
    # Q is B^T eliminated, its columns in original row order: column p_k is row k of X
    idx = op.Concat(*all_p, axis=-1) if n > 1 else all_p[0]  # [..., 1, n]
    XT = op.GatherElements(Q, op.Expand(idx, shape(m, n)), axis=-1)
    piv_all = op.Concat(*all_piv, axis=-1) if n > 1 else all_piv[0]  # [..., 1, n]
    info = _first_true_1based(op.Squeeze(op.Equal(piv_all, zero), ints([-2])), n)
    return _mT(XT, r), info


def _empty_batch(*xs) -> bool:
    """True when some input has a batch dim statically 0 (ORT's ArgMax mis-shapes those)."""
    return any(isinstance(d, int) and d == 0
               for x in xs for d in list(getattr(x, "shape", None) or [])[:-2])


def _inverse(A, opname: str):
    n = _square(A, opname)
    if n == 0 or _empty_batch(A):
        return A, _zeros_i32(_batch_shape(A))
    eye = op.Expand(_eye(n, A), op.Concat(_batch_shape(A), ints([n, n]), axis=0))
    return _gauss_jordan(A, eye, n, n, _rank(A), same_batch=True)


@translation(aten.linalg_inv.default, static_shapes=True)
def aten_linalg_inv(A):
    """linalg_inv(Tensor A) -> Tensor"""
    return _inverse(A, "linalg_inv")[0]


@translation(aten.inverse.default, static_shapes=True)
def aten_inverse(self):
    """inverse(Tensor self) -> Tensor"""
    return _inverse(self, "inverse")[0]


@translation(aten.linalg_inv_ex.default, static_shapes=True)
def aten_linalg_inv_ex(A, check_errors: bool = False):
    """linalg_inv_ex(Tensor A, *, bool check_errors=False) -> (Tensor inverse, Tensor info)"""
    X, info = _inverse(A, "linalg_inv_ex")
    return X, info


def _solve(A, B, left: bool, opname: str):
    n = _square(A, opname)
    empty = _empty_batch(A)
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
    if n == 0 or (empty and same):
        X, info = B, None
    else:
        X, info = _gauss_jordan(A, B, n, nrhs, max(ra, rb), same_batch=same)
    if not left and not vector:
        X = _mT(X, max(ra, rb))
    if vector:
        X = op.Squeeze(X, ints([-1]))
    if info is None:
        info = _zeros_i32(_batch_shape(A))
    return X, info


@translation(aten.linalg_solve.default, static_shapes=True)
def aten_linalg_solve(A, B, left: bool = True):
    """linalg_solve(Tensor A, Tensor B, *, bool left=True) -> Tensor"""
    return _solve(A, B, left, "linalg_solve")[0]


@translation(aten.linalg_solve_ex.default, static_shapes=True)
def aten_linalg_solve_ex(A, B, left: bool = True, check_errors: bool = False):
    """linalg_solve_ex(Tensor A, Tensor B, *, bool left=True, bool check_errors=False) -> (Tensor result, Tensor info)"""
    return _solve(A, B, left, "linalg_solve_ex")


# ----------------------------------------------------------------------------- LU (getrf)


def _lu(A, n: int):
    """LAPACK getrf: returns (LU [..., n, n], pivots int32 [..., n] 1-based, info int32, diag list).

    Row swaps are real (GatherElements with a swap index), so LU and pivots match PyTorch.
    A zero pivot skips the scaling of the column, as getrf does.
    """
    LU, pivots, info, d, _ = _lu_with_order(A, n, n, with_order=False)
    return LU, pivots, info, d


def _lu_with_order(A, m: int, n: int, with_order: bool = True):
    """getrf of an m x n matrix (min(m, n) elimination steps): _lu plus ``order`` [..., m]
    int64: row i of L U is row order[i] of A (P[order[i], i] = 1); None unless ``with_order``
    (only linalg_lu needs it). Pivots and the diagonal have min(m, n) entries."""
    K = min(m, n)
    rng = _i64_const(np.arange(m))
    zero = const(0.0, A)
    one = const(1.0, A)
    neg1 = const(-1.0, A)
    full_shape = op.Shape(A)
    order = None
    pivs = []
    diag = []
    for k in range(K):
        col = op.Gather(A, _k(k), axis=-1)  # [..., m]
        score = op.Where(_bool_const(np.arange(m) < k), neg1, op.Abs(col))
        p = op.ArgMax(score, axis=-1, keepdims=1)  # [..., 1]
        pivs.append(p)
        kk = op.Constant(value_int=k)
        idx = op.Where(op.Equal(rng, kk), p, op.Where(op.Equal(rng, p), kk, rng))  # [..., m]
        A = op.GatherElements(A, op.Expand(op.Unsqueeze(idx, ints([-1])), full_shape), axis=-2)
        if with_order:
            order = idx if order is None else op.GatherElements(order, idx, axis=-1)
        if k == m - 1:  # no rows below the pivot: nothing to eliminate
            diag.append(op.Gather(op.Gather(A, _k(k), axis=-1), _k(k), axis=-1))
            break
        colk = op.Gather(A, _k(k), axis=-1)  # [..., m]
        rowk = op.Gather(A, _k(k), axis=-2)  # [..., n]
        piv = op.Gather(colk, _k(k), axis=-1)  # [...]
        diag.append(piv)
        safe = op.Unsqueeze(op.Where(op.Equal(piv, zero), one, piv), ints([-1]))
        below = _np_const((np.arange(m) > k).astype(np.float64), A)
        right = _np_const((np.arange(n) > k).astype(np.float64), A)
        l = op.Mul(op.Div(colk, safe), below)  # multipliers, zero at rows <= k
        upd = op.Mul(op.Unsqueeze(l, ints([-1])), op.Unsqueeze(op.Mul(rowk, right), ints([-2])))
        A = op.Sub(A, upd)
        colmask = _bool_const((np.arange(m)[:, None] > k) & (np.arange(n)[None, :] == k))
        A = op.Where(colmask, op.Unsqueeze(l, ints([-1])), A)
    pivots = _int32(op.Add(op.Concat(*pivs, axis=-1), op.Constant(value_int=1)))
    d = op.Concat(*[op.Unsqueeze(x, ints([-1])) for x in diag], axis=-1)  # [..., K]
    info = _first_true_1based(op.Equal(d, zero), K)
    return A, pivots, info, d, order


def _perm_sign(pivots1, n: int, like):
    """(-1)^(number of real swaps) from 1-based getrf pivots, as ``like``'s dtype."""
    ident = op.Constant(value=ir.tensor(np.arange(1, n + 1, dtype=np.int32)))
    swaps = op.Cast(op.Not(op.Equal(pivots1, ident)), to=_INT64)
    cnt = op.ReduceSum(swaps, ints([-1]), keepdims=0)
    odd = op.Equal(op.Mod(cnt, op.Constant(value_int=2)), op.Constant(value_int=1))
    return op.Where(odd, const(-1.0, like), const(1.0, like))


def _slogdet(A, opname: str):
    n = _square(A, opname)
    if n == 0 or _empty_batch(A):
        b = _batch_shape(A)
        onev = op.Expand(const(1.0, A), b)
        return onev, op.Expand(const(0.0, A), b), A, _zeros_i32(op.Concat(b, ints([n]), axis=0))
    LU, pivots, info, d = _lu(A, n)
    sign = op.Mul(_perm_sign(pivots, n, A), op.ReduceProd(op.Sign(d), ints([-1]), keepdims=0))
    logabs = op.ReduceSum(op.Log(op.Abs(d)), ints([-1]), keepdims=0)
    return sign, logabs, LU, pivots


@translation(aten.linalg_slogdet.default, static_shapes=True)
def aten_linalg_slogdet(A):
    """linalg_slogdet(Tensor A) -> (Tensor sign, Tensor logabsdet)

    A singular matrix gives sign 0 and logabsdet -inf, as in PyTorch.
    """
    sign, logabs, _, _ = _slogdet(A, "linalg_slogdet")
    return sign, logabs


@translation(aten._linalg_slogdet.default, static_shapes=True)
def aten__linalg_slogdet(A):
    """_linalg_slogdet(Tensor A) -> (Tensor sign, Tensor logabsdet, Tensor LU, Tensor pivots)"""
    return _slogdet(A, "_linalg_slogdet")


@translation(aten.linalg_lu.default, static_shapes=True)
def aten_linalg_lu(A, pivot: bool = True):
    """linalg_lu(Tensor A, *, bool pivot=True) -> (Tensor P, Tensor L, Tensor U)

    m x n matrices of a size static at export (getrf's partial pivoting, unrolled over
    min(m, n) steps): P is m x m, L m x min(m, n), U min(m, n) x n."""
    if not pivot:
        raise ValueError("linalg_lu: pivot=False is not supported (LU without pivoting is only "
                         "implemented by PyTorch on CUDA)")
    m, n = _matrix_size(A, "linalg_lu")
    K = min(m, n)
    if K == 0 or _empty_batch(A):
        eye_m = op.Expand(_eye(m, A), op.Concat(_batch_shape(A), ints([m, m]), axis=0))
        return eye_m, _zeros(A, m, K), _zeros(A, K, n)
    LU, _, _, _, order = _lu_with_order(A, m, n)
    r = len(list(A.shape))
    L = op.Slice(LU, ints([0]), ints([K]), ints([-1]))  # [..., m, K]
    L = op.Add(op.Mul(L, _np_const(np.tril(np.ones((m, K)), -1), A)),
               _np_const(np.eye(m, K), A))
    U = op.Slice(LU, ints([0]), ints([K]), ints([-2]))  # [..., K, n]
    U = op.Mul(U, _np_const(np.triu(np.ones((K, n))), A))
    rng = _i64_const(np.arange(m))
    Pt = op.CastLike(op.Equal(op.Unsqueeze(order, ints([-1])), rng), A)  # Pt[i, order[i]] = 1
    return _mT(Pt, r), L, U


def _lu_factor(A, opname: str, pivot: bool):
    if not pivot:
        raise ValueError(f"{opname}: pivot=False is not supported (LU without pivoting is only "
                         f"implemented by PyTorch on CUDA)")
    m, n = _matrix_size(A, opname)
    K = min(m, n)
    if K == 0 or _empty_batch(A):
        b = _batch_shape(A)
        return A, _zeros_i32(op.Concat(b, ints([K]), axis=0)), _zeros_i32(b)
    LU, pivots, info, _, _ = _lu_with_order(A, m, n, with_order=False)
    return LU, pivots, info


@translation(aten.linalg_lu_factor.default, static_shapes=True)
def aten_linalg_lu_factor(A, pivot: bool = True):
    """linalg_lu_factor(Tensor A, *, bool pivot=True) -> (Tensor LU, Tensor pivots)

    m x n matrices (LAPACK getrf semantics: min(m, n) int32 1-based pivots, the first largest
    |entry| on ties).
    """
    LU, pivots, _ = _lu_factor(A, "linalg_lu_factor", pivot)
    return LU, pivots


@translation(aten.linalg_lu_factor_ex.default, static_shapes=True)
def aten_linalg_lu_factor_ex(A, pivot: bool = True, check_errors: bool = False):
    """linalg_lu_factor_ex(Tensor A, *, bool pivot=True, bool check_errors=False) -> (Tensor LU, Tensor pivots, Tensor info)"""
    return _lu_factor(A, "linalg_lu_factor_ex", pivot)


def _apply_pivots(B, pivots, n: int):
    """Apply getrf's row interchanges (1-based, in order) to the rows of [..., n, k] B."""
    rng = _i64_const(np.arange(n))
    p0 = op.Sub(op.Cast(pivots, to=_INT64), op.Constant(value_int=1))
    shape = op.Shape(B)
    for k in range(n):
        p = op.Gather(p0, ints([k]), axis=-1)  # [..., 1]
        kk = op.Constant(value_int=k)
        idx = op.Where(op.Equal(rng, kk), p, op.Where(op.Equal(rng, p), kk, rng))
        B = op.GatherElements(B, op.Expand(op.Unsqueeze(idx, ints([-1])), shape), axis=-2)
    return B


# ----------------------------------------------------------------------------- triangular


def _trsolve(T, B, n: int, lower: bool, unit: bool):
    """Solve T X = B for triangular [..., n, n] T and [..., n, k] B by substitution."""
    xs = [None] * n
    order = range(n) if lower else range(n - 1, -1, -1)
    for k in order:
        bk = op.Gather(B, ints([k]), axis=-2)  # [..., 1, k]
        colk = op.Gather(T, _k(k), axis=-1)  # [..., n]
        if unit:
            xk = bk
        else:
            tkk = op.Gather(colk, ints([k]), axis=-1)  # [..., 1]
            xk = op.Div(bk, op.Unsqueeze(tkk, ints([-1])))
        xs[k] = xk
        rows = (np.arange(n) > k) if lower else (np.arange(n) < k)
        if rows.any():
            c = op.Mul(colk, _np_const(rows.astype(np.float64), T))
            B = op.Sub(B, op.Mul(op.Unsqueeze(c, ints([-1])), xk))
    return op.Concat(*xs, axis=-2) if n > 1 else xs[0]


def _solve_triangular(A, B, upper: bool, left: bool, unit: bool, opname: str):
    n = _square(A, opname)
    ra, rb = len(A.shape), len(B.shape)
    if n == 0:
        return B
    same = list(A.shape)[:-2] == list(B.shape)[:-2]
    if left:
        A2, B2 = _broadcast_batch(A, B, same)
        return _trsolve(A2, B2, n, not upper, unit)
    # X A = B  <=>  A^T X^T = B^T
    A2, B2 = _broadcast_batch(_mT(A, ra), _mT(B, rb), same)
    return _mT(_trsolve(A2, B2, n, upper, unit), max(ra, rb))


@translation(aten.linalg_solve_triangular.default, static_shapes=True)
def aten_linalg_solve_triangular(self, B, upper: bool, left: bool = True,
                                         unitriangular: bool = False):
    """linalg_solve_triangular(Tensor self, Tensor B, *, bool upper, bool left=True, bool unitriangular=False) -> Tensor"""
    return _solve_triangular(self, B, upper, left, unitriangular, "linalg_solve_triangular")


@translation(aten.triangular_solve.default, static_shapes=True)
def aten_triangular_solve(self, A, upper: bool = True, transpose: bool = False,
                                  unitriangular: bool = False):
    """triangular_solve(Tensor self, Tensor A, bool upper=True, bool transpose=False, bool unitriangular=False) -> (Tensor solution, Tensor cloned_coefficient)"""
    n = _square(A, "triangular_solve")
    ra = len(A.shape)
    T = _mT(A, ra) if transpose else A
    up = upper != transpose
    if n == 0:
        X = self
    else:
        same = list(A.shape)[:-2] == list(self.shape)[:-2]
        T2, B2 = _broadcast_batch(T, self, same)
        X = _trsolve(T2, B2, n, not up, unitriangular)
    A_out = A if same_or_true(A, self) else op.Mul(
        A, op.Expand(const(1.0, A), op.Concat(_batch_shape(self), ints([1, 1]), axis=0)))
    return X, A_out


def same_or_true(A, B) -> bool:
    return list(A.shape)[:-2] == list(B.shape)[:-2]


@translation(aten.linalg_lu_solve.default, static_shapes=True)
def aten_linalg_lu_solve(LU, pivots, B, left: bool = True, adjoint: bool = False):
    """linalg_lu_solve(Tensor LU, Tensor pivots, Tensor B, *, bool left=True, bool adjoint=False) -> Tensor

    A = P L U from getrf. left=False solves X A = B (X A^H = B with adjoint=True) through the
    transposed system A^T X^T = B^T (A X^T = B^T): the same two triangular solves."""
    n = _square(LU, "linalg_lu_solve")
    if n == 0:
        return B
    rb = len(B.shape)
    same = list(LU.shape)[:-2] == list(B.shape)[:-2]
    if B.shape[-1 if left else -2] == 0:  # no right-hand sides: an empty X (B's shape)
        return _broadcast_batch(LU, B, same)[1]
    if not left:
        X = _lu_solve_left(LU, pivots, _mT(B, rb), not adjoint, same)
        return _mT(X, max(len(LU.shape), rb))
    return _lu_solve_left(LU, pivots, B, adjoint, same)


def _lu_solve_left(LU, pivots, B, adjoint: bool, same: bool):
    """Solve A X = B (A^T X = B when ``adjoint``) for A = P L U given as getrf's LU, pivots;
    ``same``: LU and B have the same batch dims (no broadcast needed)."""
    n = LU.shape[-1]
    rl = len(LU.shape)
    if not adjoint:
        # A = P L U: X = U^-1 L^-1 P^T B
        LU2, B2 = _broadcast_batch(LU, B, same)
        Bp = _apply_pivots(B2, pivots, n)
        Y = _trsolve(LU2, Bp, n, lower=True, unit=True)
        return _trsolve(LU2, Y, n, lower=False, unit=False)
    # A^T X = B: U^T L^T P^T X = B -> X = P L^-T U^-T B
    LUt = _mT(LU, rl)
    LU2, B2 = _broadcast_batch(LUt, B, same)
    Y = _trsolve(LU2, B2, n, lower=True, unit=False)  # U^T Y = B
    Z = _trsolve(LU2, Y, n, lower=False, unit=True)  # L^T Z = Y
    return _apply_pivots_inverse(Z, pivots, n)


def _apply_pivots_inverse(B, pivots, n: int):
    """P B for getrf pivots: the interchanges applied in reverse order."""
    rng = _i64_const(np.arange(n))
    p0 = op.Sub(op.Cast(pivots, to=_INT64), op.Constant(value_int=1))
    shape = op.Shape(B)
    for k in range(n - 1, -1, -1):
        p = op.Gather(p0, ints([k]), axis=-1)
        kk = op.Constant(value_int=k)
        idx = op.Where(op.Equal(rng, kk), p, op.Where(op.Equal(rng, p), kk, rng))
        B = op.GatherElements(B, op.Expand(op.Unsqueeze(idx, ints([-1])), shape), axis=-2)
    return B


# ----------------------------------------------------------------------------- Cholesky


def _cholesky(A, n: int):
    """Right-looking Cholesky of the lower triangle. Returns (L, info)."""
    zero = const(0.0, A)
    cols = []
    diag = []
    for k in range(n):
        colk = op.Gather(A, _k(k), axis=-1)  # [..., n]
        akk = op.Gather(colk, ints([k]), axis=-1)  # [..., 1]
        diag.append(akk)
        d = op.Sqrt(akk)
        rows = _np_const((np.arange(n) >= k).astype(np.float64), A)
        l = op.Mul(op.Div(colk, d), rows)  # [..., n]
        cols.append(op.Unsqueeze(l, ints([-1])))
        if k < n - 1:
            A = op.Sub(A, op.Mul(op.Unsqueeze(l, ints([-1])), op.Unsqueeze(l, ints([-2]))))
    L = op.Concat(*cols, axis=-1) if n > 1 else cols[0]
    dd = op.Concat(*diag, axis=-1) if n > 1 else diag[0]
    bad = op.Not(op.Greater(dd, zero))  # also true for NaN
    return L, _first_true_1based(bad, n)


def _chol(self, upper: bool, opname: str):
    n = _square(self, opname)
    if n == 0:
        return self, _zeros_i32(_batch_shape(self))
    # Read only the lower triangle (upper=True reads the upper one: chol of A^T then transpose).
    r = len(self.shape)
    A = _mT(self, r) if upper else self
    A = op.Trilu(A, upper=0)
    A = op.Add(A, _mT(op.Trilu(A, op.Constant(value_int=-1), upper=0), r))
    L, info = _cholesky(A, n)
    return (_mT(L, r) if upper else L), info


@translation(aten.linalg_cholesky.default, static_shapes=True)
def aten_linalg_cholesky(self, upper: bool = False):
    """linalg_cholesky(Tensor self, *, bool upper=False) -> Tensor"""
    return _chol(self, upper, "linalg_cholesky")[0]


@translation(aten.linalg_cholesky_ex.default, static_shapes=True)
def aten_linalg_cholesky_ex(self, upper: bool = False, check_errors: bool = False):
    """linalg_cholesky_ex(Tensor self, *, bool upper=False, bool check_errors=False) -> (Tensor L, Tensor info)

    For a matrix that is not positive definite, ``info`` matches PyTorch but L does not (LAPACK
    leaves a partial factor; here the failed column and the ones after it are NaN).
    """
    return _chol(self, upper, "linalg_cholesky_ex")


@translation(aten.cholesky.default, static_shapes=True)
def aten_cholesky(self, upper: bool = False):
    """cholesky(Tensor self, bool upper=False) -> Tensor"""
    return _chol(self, upper, "cholesky")[0]


@translation(aten.cholesky_solve.default, static_shapes=True)
def aten_cholesky_solve(self, input2, upper: bool = False):
    """cholesky_solve(Tensor self, Tensor input2, bool upper=False) -> Tensor"""
    n = _square(input2, "cholesky_solve")
    if n == 0:
        return self
    r2, rb = len(input2.shape), len(self.shape)
    same = list(input2.shape)[:-2] == list(self.shape)[:-2]
    L = _mT(input2, r2) if upper else input2  # A = L L^T
    L2, B2 = _broadcast_batch(L, self, same)
    Y = _trsolve(L2, B2, n, lower=True, unit=False)
    return _trsolve(_mT(L2, max(r2, rb)), Y, n, lower=False, unit=False)


@translation(aten.cholesky_inverse.default, static_shapes=True)
def aten_cholesky_inverse(self, upper: bool = False):
    """cholesky_inverse(Tensor self, bool upper=False) -> Tensor"""
    n = _square(self, "cholesky_inverse")
    if n == 0:
        return self
    r = len(self.shape)
    L = _mT(self, r) if upper else self
    eye = op.Expand(_eye(n, self), op.Concat(_batch_shape(self), ints([n, n]), axis=0))
    Y = _trsolve(L, eye, n, lower=True, unit=False)  # L^-1
    return op.MatMul(_mT(Y, r), Y)  # (L L^T)^-1 = L^-T L^-1


# ----------------------------------------------------------------------------- QR (geqrf)


def _qr(A, m: int, n: int, want_q: bool, complete: bool):
    """Householder QR with LAPACK's conventions. Returns (Q or None, R full [..., m, n])."""
    K = min(m, n)
    zero = const(0.0, A)
    one = const(1.0, A)
    Q = _eye(m, A) if want_q else None
    for k in range(K if m > 1 else 0):
        if k == m - 1:
            break  # a 1-element column: H = I (LAPACK's tau = 0)
        col = op.Gather(A, _k(k), axis=-1)  # [..., m]
        alpha = op.Gather(col, ints([k]), axis=-1)  # [..., 1]
        below = _np_const((np.arange(m) > k).astype(np.float64), A)
        x = op.Mul(col, below)
        xnorm2 = op.ReduceSum(op.Mul(x, x), ints([-1]), keepdims=1)
        norm = op.Sqrt(op.Add(op.Mul(alpha, alpha), xnorm2))
        sgn = op.Where(op.Less(alpha, zero), const(-1.0, A), one)
        beta = op.Neg(op.Mul(sgn, norm))
        noop = op.Equal(xnorm2, zero)
        beta_s = op.Where(noop, one, beta)
        tau = op.Where(noop, zero, op.Div(op.Sub(beta, alpha), beta_s))
        denom = op.Where(noop, one, op.Sub(alpha, beta))
        ek = _np_const((np.arange(m) == k).astype(np.float64), A)
        v = op.Add(op.Div(x, denom), ek)  # [..., m], v_k = 1
        vc = op.Unsqueeze(v, ints([-1]))  # [..., m, 1]
        vr = op.Unsqueeze(v, ints([-2]))  # [..., 1, m]
        t = op.Unsqueeze(tau, ints([-1]))  # [..., 1, 1]
        # A <- (I - tau v v^T) A
        A = op.Sub(A, op.Mul(op.Mul(vc, t), op.MatMul(vr, A)))
        if want_q:
            # Q <- Q (I - tau v v^T)
            Q = op.Sub(Q, op.Mul(op.MatMul(Q, vc), op.Mul(t, vr)))
    R = op.Trilu(A, upper=1)
    return Q, R


@translation(aten.linalg_qr.default, static_shapes=True)
def aten_linalg_qr(A, mode: str = "reduced"):
    """linalg_qr(Tensor A, str mode="reduced") -> (Tensor Q, Tensor R)

    Householder QR with LAPACK geqrf/orgqr's sign convention, so Q and R match PyTorch.
    """
    m, n = _matrix_size(A, "linalg_qr")
    K = min(m, n)
    len(A.shape)
    if mode not in ("reduced", "complete", "r"):
        raise ValueError(f"linalg_qr: unknown mode {mode!r}")
    want_q = mode != "r"
    bshape = _batch_shape(A)
    Q, R = _qr(A, m, n, want_q, mode == "complete")
    if want_q:
        Q = op.Mul(Q, op.Expand(const(1.0, A), op.Concat(bshape, ints([1, 1]), axis=0)))
    if mode == "complete":
        return Q, R
    R = op.Slice(R, ints([0]), ints([K]), ints([-2]))
    if mode == "r":
        return _empty_like_dtype(A), R
    return op.Slice(Q, ints([0]), ints([K]), ints([-1])), R


# ----------------------------------------------------------------------------- Jacobi


def _round_robin(n: int) -> list[tuple[list[int], list[int]]]:
    """n-1 rounds of n/2 disjoint pairs (p < q) covering every pair once (n even)."""
    players = list(range(n))
    rounds = []
    for _ in range(n - 1):
        ps, qs = [], []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            ps.append(min(a, b))
            qs.append(max(a, b))
        rounds.append((ps, qs))
        players = [players[0]] + [players[-1]] + players[1:-1]
    return rounds


def _rotation_basis(n: int, ps: list[int], qs: list[int]) -> np.ndarray:
    """[n, n*n]: (c ; s) @ basis = the rotation matrix J with J_pp = J_qq = c, J_pq = s, J_qp = -s."""
    h = len(ps)
    basis = np.zeros((2 * h, n, n))
    for i, (p, q) in enumerate(zip(ps, qs)):
        basis[i, p, p] = 1
        basis[i, q, q] = 1
        basis[h + i, p, q] = 1
        basis[h + i, q, p] = -1
    return basis.reshape(2 * h, n * n)


def _jacobi_angle(a_pp, a_qq, a_pq, like):
    """(c, s) zeroing a_pq of [[a_pp, a_pq], [a_pq, a_qq]] (Golub & Van Loan 8.4.2)."""
    zero = const(0.0, like)
    one = const(1.0, like)
    skip = op.Equal(a_pq, zero)
    tau = op.Div(op.Sub(a_qq, a_pp), op.Mul(const(2.0, like), op.Where(skip, one, a_pq)))
    sgn = op.Where(op.Less(tau, zero), const(-1.0, like), one)
    t = op.Div(sgn, op.Add(op.Abs(tau), op.Sqrt(op.Add(one, op.Mul(tau, tau)))))
    t = op.Where(skip, zero, t)  # also covers tau = inf (t = 0 already)
    c = op.Div(one, op.Sqrt(op.Add(one, op.Mul(t, t))))
    return c, op.Mul(t, c)


def _sweeps(n: int, like) -> int:
    return (10 if like.dtype == ir.DataType.DOUBLE else 8) + (2 if n > 16 else 0)


def _eigh(A, n: int, uplo: str, want_v: bool):
    """Symmetric eigen-decomposition by parallel cyclic Jacobi. Eigenvalues ascending."""
    r = len(A.shape)
    lower = uplo.upper() == "L"
    T = op.Trilu(A, upper=0 if lower else 1)
    off = op.Trilu(A, op.Constant(value_int=-1 if lower else 1), upper=0 if lower else 1)
    A = op.Add(T, _mT(off, r))
    N = n + (n % 2)
    if N != n:  # pad with a decoupled zero row/column (never rotated: its a_pq stays 0)
        pads = [0] * (2 * r)
        pads[r - 1] = 0
        pads[2 * r - 2] = 1
        pads[2 * r - 1] = 1
        A = op.Pad(A, _i64_const(pads))
    shape_nn = op.Concat(_batch_shape(A), ints([N, N]), axis=0)
    V = None
    for _ in range(_sweeps(n, A)):
        for ps, qs in _round_robin(N):
            d = _diag_n(A, N)
            a_pp = op.Gather(d, _i64_const(ps), axis=-1)
            a_qq = op.Gather(d, _i64_const(qs), axis=-1)
            flat = op.Reshape(A, op.Concat(_batch_shape(A), ints([N * N]), axis=0))
            a_pq = op.Gather(flat, _i64_const([p * N + q for p, q in zip(ps, qs)]), axis=-1)
            c, s = _jacobi_angle(a_pp, a_qq, a_pq, A)
            J = op.Reshape(op.MatMul(op.Concat(c, s, axis=-1),
                                     _np_const(_rotation_basis(N, ps, qs), A)), shape_nn)
            A = op.MatMul(op.MatMul(_mT(J, r), A), J)
            if want_v:
                V = J if V is None else op.MatMul(V, J)
    w = _diag_n(A, N)
    if N != n:
        w = op.Slice(w, ints([0]), ints([n]), ints([-1]))
        if want_v:
            V = op.Slice(V, ints([0, 0]), ints([n, n]), ints([-2, -1]))
    w_sorted, idx = op.TopK(w, ints([n]), axis=-1, largest=0, sorted=1)
    if not want_v:
        return w_sorted, None
    V = op.GatherElements(V, op.Expand(op.Unsqueeze(idx, ints([-2])),
                                       op.Concat(_batch_shape(A), ints([n, n]), axis=0)), axis=-1)
    return w_sorted, V


def _diag_n(x, n: int):
    return op.ReduceSum(op.Mul(x, _eye(n, x)), ints([-1]), keepdims=0)


def _empty_batch(A) -> bool:
    """True when a batch dim is statically 0 (the Jacobi sweeps cannot broadcast over it)."""
    return any(isinstance(d, int) and d == 0 for d in list(A.shape)[:-2])


def _zeros(A, *dims):
    """Zeros of A's dtype with A's batch dims followed by ``dims``."""
    return op.Expand(const(0.0, A), op.Concat(op.Shape(A, end=-2), ints(list(dims)), axis=0))


def _eigh_checked(A, UPLO: str, want_v: bool, opname: str):
    n = _square(A, opname)
    if _empty_batch(A):
        return _zeros(A, n), _zeros(A, n, n)
    if n == 0:  # [..., 0, 0]: empty eigenvalues [..., 0] (ReduceSum over the empty axis
        # gives ONNX Runtime's [..., 0, 0])
        return op.Expand(const(0.0, A), op.Shape(A, end=-1)), A
    if n == 1:
        return op.Squeeze(A, ints([-1])), op.Add(op.Mul(A, const(0.0, A)), const(1.0, A))
    return _eigh(A, n, UPLO, want_v)


_EIGH_DOC = """

    Parallel cyclic Jacobi (8 sweeps for float32, 10 for float64; +2 above 16x16). Eigenvalues
    match PyTorch to ~1e-6 of the largest |eigenvalue|. Eigenvectors are orthonormal and satisfy
    A V = V diag(w), but their signs (and their basis inside a repeated eigenvalue) are not
    LAPACK's: compare them sign-invariantly.
"""


@translation(aten.linalg_eigh.default, static_shapes=True)
def aten_linalg_eigh(self, UPLO: str = "L"):
    w, V = _eigh_checked(self, UPLO, True, "linalg_eigh")
    return w, V


aten_linalg_eigh.__doc__ = str(aten.linalg_eigh.default._schema) + _EIGH_DOC


@translation(aten._linalg_eigh.default, static_shapes=True)
def aten__linalg_eigh(A, UPLO: str = "L", compute_v: bool = True):
    w, V = _eigh_checked(A, UPLO, compute_v, "_linalg_eigh")
    return w, (V if compute_v else _empty_like_dtype(A))


aten__linalg_eigh.__doc__ = str(aten._linalg_eigh.default._schema) + _EIGH_DOC


@translation(aten.linalg_eigvalsh.default, static_shapes=True)
def aten_linalg_eigvalsh(self, UPLO: str = "L"):
    return _eigh_checked(self, UPLO, False, "linalg_eigvalsh")[0]


aten_linalg_eigvalsh.__doc__ = str(aten.linalg_eigvalsh.default._schema) + _EIGH_DOC


# ----------------------------------------------------------------------------- SVD


def _svd_tall(A, m: int, n: int, want_uv: bool, r: int):
    """One-sided Jacobi SVD of rank-r [..., m, n] with m >= n. Returns (U, S descending, V)."""
    N = n + (n % 2)
    if N != n:  # a zero column is never rotated (its dot products are 0)
        pads = [0] * (2 * r)
        pads[2 * r - 1] = 1
        A = op.Pad(A, _i64_const(pads))
    bshape = _batch_shape(A)
    shape_nn = op.Concat(bshape, ints([N, N]), axis=0)
    V = None
    for _ in range(_sweeps(n, A)):
        for ps, qs in _round_robin(N):
            Ap = op.Gather(A, _i64_const(ps), axis=-1)  # [..., m, h]
            Aq = op.Gather(A, _i64_const(qs), axis=-1)
            alpha = op.ReduceSum(op.Mul(Ap, Ap), ints([-2]), keepdims=0)
            beta = op.ReduceSum(op.Mul(Aq, Aq), ints([-2]), keepdims=0)
            gamma = op.ReduceSum(op.Mul(Ap, Aq), ints([-2]), keepdims=0)
            c, s = _jacobi_angle(alpha, beta, gamma, A)
            J = op.Reshape(op.MatMul(op.Concat(c, s, axis=-1),
                                     _np_const(_rotation_basis(N, ps, qs), A)), shape_nn)
            A = op.MatMul(A, J)
            if want_uv:
                V = J if V is None else op.MatMul(V, J)
    if N != n:
        A = op.Slice(A, ints([0]), ints([n]), ints([-1]))
        if want_uv:
            V = op.Slice(V, ints([0, 0]), ints([n, n]), ints([-2, -1]))
    sv = op.Sqrt(op.ReduceSum(op.Mul(A, A), ints([-2]), keepdims=0))  # [..., n]
    S, idx = op.TopK(sv, ints([n]), axis=-1, largest=1, sorted=1)
    if not want_uv:
        return None, S, None
    idx_c = op.Unsqueeze(idx, ints([-2]))
    A = op.GatherElements(A, op.Expand(idx_c, op.Concat(bshape, ints([m, n]), axis=0)), axis=-1)
    V = op.GatherElements(V, op.Expand(idx_c, op.Concat(bshape, ints([n, n]), axis=0)), axis=-1)
    zero = const(0.0, A)
    U = op.Div(A, op.Unsqueeze(op.Where(op.Equal(S, zero), const(1.0, A), S), ints([-2])))
    return U, S, V


def _svd(A, full_matrices: bool, compute_uv: bool, opname: str, exact_vectors: bool = False):
    """(U, S, Vh). ``exact_vectors``: U (m >= n) or V (m < n) orthonormal even for zero
    singular values (_orthonormal_vectors); pinv, lstsq and norms do not need that (those
    columns are multiplied by 0). full_matrices=True on a non-square matrix implies it."""
    m, n = _matrix_size(A, opname)
    r = len(A.shape)
    full = compute_uv and full_matrices and m != n  # square: full and reduced are the same
    K = min(m, n)
    if _empty_batch(A) and K > 0:
        if not compute_uv:
            return _empty_like_dtype(A), _zeros(A, K), _empty_like_dtype(A)
        if full:
            return _zeros(A, m, m), _zeros(A, K), _zeros(A, n, n)
        return _zeros(A, m, K), _zeros(A, K), _zeros(A, K, n)
    if K == 0:  # an m x 0 or 0 x n matrix: no singular values, empty factors
        batch = op.Shape(A, end=-2)
        zero = const(0.0, A)

        def empty(*dims):
            return op.Expand(zero, op.Concat(batch, ints(list(dims)), axis=0))

        S = empty(0)
        if not compute_uv:
            return _empty_like_dtype(A), S, _empty_like_dtype(A)
        if full:  # PyTorch: the identity for the non-empty side
            return (op.Expand(_eye(m, A), op.Concat(batch, ints([m, m]), axis=0)), S,
                    op.Expand(_eye(n, A), op.Concat(batch, ints([n, n]), axis=0)))
        return empty(m, 0), S, empty(0, n)
    if m >= n:
        U, S, V = _svd_tall(A, m, n, compute_uv, r)
        if full or (compute_uv and exact_vectors):
            U = _orthonormal_vectors(U, m, n, full)
        Vh = _mT(V, r) if compute_uv else None
    else:  # A^T = V S U^T
        V, S, U = _svd_tall(_mT(A, r), n, m, compute_uv, r)
        if full or (compute_uv and exact_vectors):
            V = _orthonormal_vectors(V, n, m, full)
        Vh = _mT(V, r) if compute_uv else None
    if not compute_uv:
        return _empty_like_dtype(A), S, _empty_like_dtype(A)
    return U, S, Vh


def _orthonormal_vectors(U, m: int, k: int, full: bool):
    """Jacobi's [..., m, k] singular vectors (m >= k) made exactly what LAPACK returns: an
    orthonormal set. The Householder QR U = Q R gives Q[:, j] = sign(R_jj) U[:, j] for U's
    unit columns; a zero column (a zero singular value: U = A V / S has nothing to normalise)
    becomes a unit vector orthogonal to the others. With ``full`` all m columns of Q are
    returned (full_matrices=True: the trailing ones are an orthonormal basis of the
    complement, any of which is right, as in LAPACK, whose choice differs)."""
    Q, R = _qr(U, m, k, True, True)  # Q [..., m, m]
    d = _diag_n(op.Slice(R, ints([0]), ints([k]), ints([-2])), k)  # [..., k]
    sign = op.Where(op.Less(d, const(0.0, U)), const(-1.0, U), const(1.0, U))
    if full and m > k:
        ones = op.Expand(const(1.0, U), op.Concat(op.Shape(sign, end=-1), ints([m - k]), axis=0))
        return op.Mul(Q, op.Unsqueeze(op.Concat(sign, ones, axis=-1), ints([-2])))
    return op.Mul(op.Slice(Q, ints([0]), ints([k]), ints([-1])), op.Unsqueeze(sign, ints([-2])))


_SVD_DOC = """

    One-sided Jacobi (8 sweeps for float32, 10 for float64; +2 above 16 columns). Singular
    values match PyTorch to ~1e-6 relative, small ones included. Singular vectors are unique up
    to sign (and a rotation inside repeated singular values); the signs are not LAPACK's, so
    compare U diag(S) Vh or |U|, |Vh|. The vectors of zero singular values (which one-sided
    Jacobi leaves at 0) and, for full_matrices=True on an m x n matrix, the completion of the
    shorter factor come from a Householder QR of the Jacobi vectors: orthonormal, as LAPACK's,
    but a different choice among the valid ones. Column norms are
    computed from sums of squares, so entries above ~1e19 (float32) overflow.
"""


@translation(aten.linalg_svd.default, static_shapes=True)
def aten_linalg_svd(A, full_matrices: bool = True, driver=None):
    return _svd(A, full_matrices, True, "linalg_svd", exact_vectors=True)


aten_linalg_svd.__doc__ = str(aten.linalg_svd.default._schema) + _SVD_DOC


@translation(aten._linalg_svd.default, static_shapes=True)
def aten__linalg_svd(A, full_matrices: bool = False, compute_uv: bool = True,
                             driver=None):
    return _svd(A, full_matrices, compute_uv, "_linalg_svd", exact_vectors=True)


aten__linalg_svd.__doc__ = str(aten._linalg_svd.default._schema) + _SVD_DOC


@translation(aten.linalg_svdvals.default, static_shapes=True)
def aten_linalg_svdvals(A, driver=None):
    return _svd(A, False, False, "linalg_svdvals")[1]


aten_linalg_svdvals.__doc__ = str(aten.linalg_svdvals.default._schema) + _SVD_DOC


def _pinv(self, atol, rtol, hermitian: bool, opname: str):
    m, n = _matrix_size(self, opname)
    r = len(self.shape)
    if m == 0 or n == 0 or _empty_batch(self):  # empty in, empty n x m out
        return _zeros(self, n, m)
    eps = float(np.finfo(np.float64 if self.dtype == ir.DataType.DOUBLE else np.float32).eps)
    if hermitian:
        w, V = _eigh_checked(self, "L", True, opname)
        absw = op.Abs(w)
        smax = op.ReduceMax(absw, ints([-1]), keepdims=1)
    else:
        U, S, Vh = _svd(self, False, True, opname)
        absw = S
        smax = op.ReduceMax(S, ints([-1]), keepdims=1)
    zero = const(0.0, self)
    if rtol is None:
        rtol_v = const(eps * max(m, n), self) if (atol is None) else zero
    else:
        rtol_v = op.CastLike(rtol, self) if not isinstance(rtol, (int, float)) else const(rtol, self)
        if not isinstance(rtol, (int, float)):
            rtol_v = op.Unsqueeze(rtol_v, ints([-1]))
    if atol is None:
        atol_v = zero
    else:
        atol_v = op.CastLike(atol, self) if not isinstance(atol, (int, float)) else const(atol, self)
        if not isinstance(atol, (int, float)):
            atol_v = op.Unsqueeze(atol_v, ints([-1]))
    tol = op.Max(atol_v, op.Mul(rtol_v, smax))
    keep = op.Greater(absw, tol)
    inv = op.Where(keep, op.Div(const(1.0, self), op.Where(keep, absw if not hermitian else w,
                                                            const(1.0, self))), zero)
    if hermitian:
        return op.MatMul(op.Mul(V, op.Unsqueeze(inv, ints([-2]))), _mT(V, r))
    return op.MatMul(op.Mul(_mT(Vh, r), op.Unsqueeze(inv, ints([-2]))), _mT(U, r))


@translation(aten.linalg_pinv.atol_rtol_tensor, static_shapes=True)
def aten_linalg_pinv_atol_rtol_tensor(self, atol=None, rtol=None, hermitian: bool = False):
    """linalg_pinv.atol_rtol_tensor(Tensor self, *, Tensor? atol=None, Tensor? rtol=None, bool hermitian=False) -> Tensor

    Via the Jacobi SVD (or eigh when hermitian=True); singular values at or below
    max(atol, rtol * largest) are dropped, as in PyTorch.
    """
    return _pinv(self, atol, rtol, hermitian, "linalg_pinv")


@translation(aten.linalg_pinv.atol_rtol_float, static_shapes=True)
def aten_linalg_pinv_atol_rtol_float(self, atol=None, rtol=None, hermitian: bool = False):
    """linalg_pinv.atol_rtol_float(Tensor self, *, float? atol=None, float? rtol=None, bool hermitian=False) -> Tensor"""
    return _pinv(self, atol, rtol, hermitian, "linalg_pinv")


# ----------------------------------------------------------------------------- lstsq

_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def _lstsq_driver(driver, device_type: str = "cpu") -> str:
    if driver is None:
        return "gelsy" if device_type == "cpu" else "gels"  # PyTorch's defaults
    if driver not in _LSTSQ_DRIVERS:
        raise ValueError(f"linalg_lstsq: unknown driver {driver!r}; valid: {_LSTSQ_DRIVERS}")
    return driver


def _lstsq_dynamic_reason(driver: str, m, n, batched: bool) -> str | None:
    """Why the output shapes cannot be captured, or None.

    PyTorch fills ``residuals`` (m > n only) for gels always, for gelsy never, and for
    gelsd/gelss only when every matrix has full rank n. For a single matrix that is a
    data-dependent length (k or 0: an unbacked size); for a batch the rank of the output
    changes too ([*batch, k] or [0]), which no exported shape can express."""
    if driver in ("gelsd", "gelss") and m > n and n != 0 and batched:
        return (f"linalg_lstsq: with driver={driver!r}, m > n ({m} x {n}) and batched input, "
                f"PyTorch returns residuals [*batch, k] only when every matrix has full rank "
                f"and [0] otherwise: a data-dependent shape, so it cannot be exported; use "
                f"driver='gelsy' (no residuals) or 'gels' (full-rank A, residuals always), or "
                f"compute the residuals from the solution")
    return None


def _lstsq_data_dependent_residuals(driver: str, m, n) -> bool:
    """gelsd/gelss, one m > n matrix: residuals have k entries if A has full rank, else 0."""
    return driver in ("gelsd", "gelss") and m > n and n != 0


def _lstsq_fake(self, b, rcond=None, *, driver=None):
    """Shapes of aten::linalg_lstsq's outputs where they are static (see _lstsq_dynamic_reason).

    solution [*batch, n, k] ([*batch, n] for a vector b); residuals [*batch, k] (gels, m > n;
    [*batch, 1] for a vector b) else [0]; rank [*A.batch] int64 (not gels) else [0];
    singular_values [*A.batch, min(m, n)] (gelsd, gelss) else [0]. The batch dims of A and b
    broadcast (rank and singular_values keep A's own)."""
    drv = _lstsq_driver(driver, self.device.type)
    vector = b.dim() == self.dim() - 1
    m, n = self.shape[-2], self.shape[-1]
    k = 1 if vector else b.shape[-1]
    batch = torch.broadcast_shapes(self.shape[:-2], b.shape[:-1] if vector else b.shape[:-2])
    reason = _lstsq_dynamic_reason(drv, m, n, self.dim() > 2)
    if reason is not None:
        raise RuntimeError(reason)
    solution = self.new_empty((*batch, n) if vector else (*batch, n, k))
    if _lstsq_data_dependent_residuals(drv, m, n):  # k or 0 entries
        from onnxmedic._torch_compat import new_dynamic_size

        residuals = self.new_empty((*batch, new_dynamic_size(max=k)))
    else:
        has_res = m > n and drv in ("gels", "gelsd", "gelss")
        residuals = self.new_empty((*batch, k) if has_res else (0,))
    rank = self.new_empty((0,) if drv == "gels" else tuple(self.shape[:-2]), dtype=torch.int64)
    sv = self.new_empty((*self.shape[:-2], min(m, n)) if drv in ("gelsd", "gelss") else (0,))
    return solution, residuals, rank, sv


add_fake_kernel("aten::linalg_lstsq", _lstsq_fake)


def _lstsq_qr(A, B, m: int, n: int, r: int):
    """gels on rank-r [..., m, n] A and [..., m, k] B: least squares by Householder QR
    (m >= n) or minimum norm by LQ (m < n), as LAPACK does; A must have full rank.
    Returns (X [..., n, k], rows n..m-1 of Q^T B, or None when m <= n)."""
    if m >= n:
        Q, R = _qr(A, m, n, True, True)  # Q [..., m, m], R [..., m, n]
        QtB = op.MatMul(_mT(Q, r), B)
        top = op.Slice(QtB, ints([0]), ints([n]), ints([-2]))
        rest = op.Slice(QtB, ints([n]), ints([m]), ints([-2])) if m > n else None
        Rn = op.Slice(R, ints([0]), ints([n]), ints([-2]))
        return _trsolve(Rn, top, n, lower=False, unit=False), rest
    # A^T = Q R, so A = R^T Q^T and the minimum-norm solution is X = Q R^-T B
    Q, R = _qr(_mT(A, r), n, m, True, False)  # Q [..., n, n], R [..., n, m]
    Rm = op.Slice(R, ints([0]), ints([m]), ints([-2]))  # [..., m, m] upper
    Y = _trsolve(_mT(Rm, r), B, m, lower=True, unit=False)
    return op.MatMul(op.Slice(Q, ints([0]), ints([m]), ints([-1])), Y), None


def _lstsq(A, b, rcond, driver, opname: str = "linalg_lstsq"):
    m, n = _matrix_size(A, opname)
    drv = _lstsq_driver(driver)
    ra = len(A.shape)
    reason = _lstsq_dynamic_reason(drv, m, n, ra > 2)
    if reason is not None:
        raise ValueError(reason)
    vector = len(b.shape) == ra - 1  # PyTorch's rule: b has A's rank, or one less (a vector)
    B = op.Unsqueeze(b, ints([-1])) if vector else b
    k = 1 if vector else b.shape[-1]
    if not isinstance(k, int):
        raise ValueError(f"{opname}: the number of right-hand sides must be static at export "
                         f"time (got {k})")
    b_batch = list(b.shape)[:-1] if vector else list(b.shape)[:-2]
    A2, B2 = _broadcast_batch(A, B, list(A.shape)[:-2] == b_batch)
    bshape = _batch_shape(B2)
    K = min(m, n)
    has_res = m > n and drv != "gelsy"
    zero = const(0.0, A)
    rank = sv = residuals = None
    empty_batch = any(isinstance(d, int) and d == 0 for d in list(A.shape)[:-2] + b_batch)
    if K == 0 or k == 0 or empty_batch:  # PyTorch skips LAPACK: zero solution and rank
        X = op.Expand(zero, op.Concat(bshape, ints([n, k]), axis=0))
        if has_res:  # only n == 0 gets here: gels sums its zero work rows, gelsd/gelss |B|^2
            residuals = (op.Expand(zero, op.Concat(bshape, ints([k]), axis=0)) if drv == "gels"
                         else op.ReduceSum(op.Mul(B2, B2), ints([-2]), keepdims=0))
        if drv != "gels":
            rank = op.ConstantOfShape(_batch_shape(A),
                                      value=ir.tensor(np.zeros((1,), dtype=np.int64)))
        if drv in ("gelsd", "gelss"):
            sv = _zeros(A, K)
    elif drv == "gels":
        X, rest = _lstsq_qr(A2, B2, m, n, ra)
        if has_res:
            residuals = op.ReduceSum(op.Mul(rest, rest), ints([-2]), keepdims=0)
    else:
        # gelsy / gelsd / gelss: the minimum-norm solution of the rank-truncated problem from
        # the SVD of A (singular values <= rcond * largest are dropped)
        U, S, Vh = _svd(A, False, True, opname)
        eps = float(np.finfo(np.float64 if A.dtype == ir.DataType.DOUBLE else np.float32).eps)
        if rcond is None:
            rc = eps * max(m, n)
        else:
            rc = float(rcond) if rcond >= 0 else eps  # LAPACK: rcond < 0 means machine eps
        tol = op.Mul(op.ReduceMax(S, ints([-1]), keepdims=1), const_f64(rc, A))
        keep = op.Greater(S, tol)  # NaN singular values are dropped too
        inv = op.Where(keep, op.Div(const(1.0, A), op.Where(keep, S, const(1.0, A))), zero)
        UtB = op.MatMul(_mT(U, ra), B2)  # [..., K, k]
        X = op.MatMul(_mT(Vh, ra), op.Mul(op.Unsqueeze(inv, ints([-1])), UtB))
        rank = op.ReduceSum(op.Cast(keep, to=_INT64), ints([-1]), keepdims=0)
        if drv in ("gelsd", "gelss"):
            sv = S
        if has_res:  # one matrix (batches are refused): |A X - B|^2 if A has full rank, else []
            R = op.Sub(op.MatMul(A, X), B2)
            residuals = op.ReduceSum(op.Mul(R, R), ints([-2]), keepdims=0)  # [k]
            full = op.Equal(rank, op.Constant(value_int=n))
            length = op.Where(full, ints([k]), ints([0]))
            residuals = op.Slice(residuals, ints([0]), length, ints([0]))
    if vector:
        X = op.Squeeze(X, ints([-1]))
    if rank is None:
        rank = op.Constant(value=ir.tensor(np.zeros((0,), dtype=np.int64)))
    empty_f = _empty_like_dtype(A)
    return (X, residuals if residuals is not None else empty_f, rank,
            sv if sv is not None else empty_f)


@translation(aten.linalg_lstsq.default, static_shapes=True)
def aten_linalg_lstsq(self, b, rcond=None, driver=None):
    """linalg_lstsq(Tensor self, Tensor b, float? rcond=None, *, str? driver=None) -> (Tensor solution, Tensor residuals, Tensor rank, Tensor singular_values)

    CPU semantics (default driver gelsy). gels: Householder QR (m >= n; residuals from Q^T b
    as LAPACK) or LQ (m < n, minimum norm), full-rank A as LAPACK requires. gelsy, gelsd,
    gelss: minimum-norm solution of the problem truncated to the singular values above
    rcond * largest (rcond=None: eps * max(m, n)), from the Jacobi SVD; ``rank`` counts those
    values. That is gelsd/gelss's definition; gelsy estimates the rank from a pivoted QR
    instead, which agrees except for singular values within rounding of the threshold.
    gelsd/gelss with m > n fill residuals only for full-rank inputs (a data-dependent shape):
    refused with that reason, as are matrix sizes unknown at export. Output shapes as
    PyTorch's (outputs a driver does not compute are empty), made capturable by a fake kernel
    (torch has none: the op is tagged dynamic_output_shape)."""
    return _lstsq(self, b, rcond, driver)


# ----------------------------------------------------------------------------- matrix_exp

# Taylor degree 18 is accurate to float64 rounding for ||A||_1 <= 1 (1/19! ~ 8e-18).
_EXP_DEGREE = 18
_EXP_MAX_SQUARINGS = 40


@translation(aten.linalg_matrix_exp.default, static_shapes=True)
def aten_linalg_matrix_exp(self):
    """linalg_matrix_exp(Tensor self) -> Tensor

    Scaling and squaring: A is scaled by 2^-s with s = ceil(log2 ||A||_1) (data dependent,
    0 <= s <= 40), exp(A / 2^s) comes from a degree-18 Taylor polynomial evaluated with
    Paterson-Stockmeyer (about 8 MatMuls), then s squarings (40 unrolled squarings, each kept
    or skipped with Where). Norms above 2^40 are not scaled further (the result overflows
    float32 long before that unless A is, e.g., skew-symmetric; then accuracy drops).
    """
    n = _square(self, "linalg_matrix_exp")
    if n == 0:
        return self
    A = self
    norm = op.ReduceMax(op.ReduceSum(op.Abs(A), ints([-2]), keepdims=0), ints([-1]),
                        keepdims=1)  # [..., 1] 1-norm
    one = const(1.0, A)
    s = op.Ceil(op.Div(op.Log(op.Max(norm, one)), const(math.log(2.0), A)))
    s = op.Min(s, const(float(_EXP_MAX_SQUARINGS), A))  # [..., 1]
    scale = op.Pow(const(2.0, A), op.Neg(s))
    X = op.Mul(A, op.Unsqueeze(scale, ints([-1])))
    eye = _eye(n, A)
    # Paterson-Stockmeyer with block size 6: powers I, X, ..., X^6.
    coeffs = [1.0 / math.factorial(k) for k in range(_EXP_DEGREE + 1)]
    q = 6
    pw = [None, X]
    for _k2 in range(2, q + 1):
        pw.append(op.MatMul(pw[-1], X))

    def block(j: int):
        acc = op.Mul(eye, const(coeffs[j * q], A))
        for i in range(1, q):
            idx = j * q + i
            if idx <= _EXP_DEGREE:
                acc = op.Add(acc, op.Mul(pw[i], const(coeffs[idx], A)))
        return acc

    nblocks = _EXP_DEGREE // q  # 3 -> blocks 0..2 plus the x^18 term
    P = op.Mul(eye, const(coeffs[_EXP_DEGREE], A))  # highest block: c18 I
    for j in range(nblocks - 1, -1, -1):
        P = op.Add(op.MatMul(P, pw[q]), block(j))
    E = P
    s_m = op.Unsqueeze(s, ints([-1]))
    for i in range(_EXP_MAX_SQUARINGS):
        E = op.Where(op.Less(const(float(i), A), s_m), op.MatMul(E, E), E)
    return E


# ----------------------------------------------------------------- einsum: ragged ellipses

def _ellipsis_ranks(equation: str, ranks: list[int]) -> list[int] | None:
    """How many dims each operand's ``...`` stands for (0 without one), or None when the
    equation cannot be read (left to torchlib)."""
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    if len(lhs) != len(ranks):
        return None
    out = []
    for sub, r in zip(lhs, ranks):
        if "..." in sub:
            out.append(r - len(sub.replace("...", "")))
        else:
            out.append(0)
    return out if all(n >= 0 for n in out) else None


@translation(aten.einsum.default, overrides_torchlib=True)
def aten_einsum(equation: str, tensors, path=None):
    """einsum(str equation, Tensor[] tensors, *, int[]? path=None) -> Tensor

    PyTorch broadcasts ``...`` right-aligned across operands whose ellipses cover different
    numbers of dims (``"...i,...ij->...j"`` with a vector and a batch of matrices: zuko's UNAF
    flow); ONNX's Einsum requires every ellipsis to cover the same number, and ONNX Runtime
    refuses to load the model. Here an operand with fewer ellipsis dims gets size-1 dims
    inserted at the start of its ellipsis (what right-aligned broadcasting means); other calls
    are torchlib's single Einsum."""
    ranks = [len(t.shape) if t.shape is not None else -1 for t in tensors]
    counts = _ellipsis_ranks(equation, ranks) if min(ranks, default=0) >= 0 else None
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    if counts is not None and len({c for c, s in zip(counts, lhs) if "..." in s}) > 1:
        most = max(counts)
        padded = []
        for t, sub, n in zip(tensors, lhs, counts):
            if "..." in sub and n < most:
                at = len(sub.split("...")[0])  # explicit letters before the ellipsis
                t = op.Unsqueeze(t, ints(list(range(at, at + most - n))))
            padded.append(t)
        tensors = padded
    return op.Einsum(*tensors, equation=equation)
