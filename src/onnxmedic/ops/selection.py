"""Selection and sorting ops torchlib lacks or gets wrong: stable sort/argsort, median, nanmedian,
kthvalue, mode, searchsorted, bucketize, quantile, topk (0-d), argmax/argmin (keepdim without a
dim, NaN).

Sorting is built on ONNX TopK, whose spec makes it stable ("given two equivalent values, the
element with the lower index appears first"); NaN, which TopK does not order, is handled by a
second stable pass on the is-NaN flag (an LSD radix step), so NaN sorts last ascending and first
descending, in original order, exactly like ``torch.sort(stable=True)``.
"""

from __future__ import annotations

import math

import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import const, const_f64, ints, is_float
from onnxmedic.ops._common import norm_axis as _axis
from onnxmedic.ops._common import rank as _rank
from onnxmedic.ops._registry import translation

aten = torch.ops.aten

_TOPK_NATIVE = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT64, ir.DataType.INT32)


def _sort_key(x):
    """A TopK key ordering x exactly as PyTorch's sort (NaN greatest, -0 == 0), and a NaN mask
    that still needs a second stable pass (only for float64, which has no wider type)."""
    wider = {ir.DataType.FLOAT: ir.DataType.DOUBLE, ir.DataType.FLOAT16: ir.DataType.FLOAT,
             ir.DataType.BFLOAT16: ir.DataType.FLOAT}.get(x.dtype)
    if wider is None:
        return _key(x)
    # In the wider type every value of x is exact and there is room above x's +inf:
    # +inf -> a finite value above x's range, NaN -> +inf. One TopK pass, no NaN pass.
    w = op.Cast(x, to=wider)
    above = 1e300 if wider == ir.DataType.DOUBLE else 1e38 * 3
    w = op.Where(op.IsInf(w, detect_negative=0), const_f64(above, w), w)
    return op.Where(op.IsNaN(w), const(math.inf, w), w), None


def _key(x):
    """A TopK-sortable key with the same order as x, and x's NaN mask (None for non-floats).

    NaN becomes +inf in the key; the mask puts NaN after +inf."""
    if x.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        key = op.Cast(x, to=ir.DataType.FLOAT)
    elif x.dtype in _TOPK_NATIVE:
        key = x
    else:  # bool, int8/16, uint8...: exact in int64
        key = op.Cast(x, to=ir.DataType.INT64)
    if not is_float(x):
        return key, None
    nan = op.IsNaN(key)
    return op.Where(nan, const(math.inf, key), key), nan


def stable_argsort(x, axis: int, descending: bool, k: int | None = None):
    """int64 indices that sort x stably along ``axis`` (rank >= 1), NaN greatest; only the
    first ``k`` when given (a partial sort, ascending float32/16 and integers only)."""
    key, nan = _sort_key(x)
    if k is not None and nan is None:
        _, idx = op.TopK(key, ints([k]), axis=axis, largest=int(descending), sorted=1)
        return idx
    n = op.Shape(x, start=axis, end=axis + 1)
    _, idx = op.TopK(key, n, axis=axis, largest=int(descending), sorted=1)
    if nan is not None:
        flag = op.GatherElements(op.Cast(nan, to=ir.DataType.FLOAT), idx, axis=axis)
        _, idx2 = op.TopK(flag, n, axis=axis, largest=int(descending), sorted=1)
        idx = op.GatherElements(idx, idx2, axis=axis)
    return idx


def _index_zero():
    return op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64))


@translation(aten.sort.stable)
def aten_sort_stable(self, *, stable=None, dim: int = -1, descending: bool = False):
    """sort.stable(Tensor self, *, bool? stable, int dim=-1, bool descending=False) -> (Tensor values, Tensor indices)

    Always stable (also for stable=False, which PyTorch allows to be stable)."""
    if _rank(self) == 0:
        _axis(dim, 0)
        return op.Identity(self), _index_zero()
    axis = _axis(dim, _rank(self))
    idx = stable_argsort(self, axis, descending)
    return op.GatherElements(self, idx, axis=axis), idx


@translation(aten.argsort.stable)
def aten_argsort_stable(self, *, stable: bool, dim: int = -1, descending: bool = False):
    """argsort.stable(Tensor self, *, bool stable, int dim=-1, bool descending=False) -> Tensor"""
    if _rank(self) == 0:
        _axis(dim, 0)
        return _index_zero()
    return stable_argsort(self, _axis(dim, _rank(self)), descending)


@translation(aten.topk.default, overrides_torchlib=True)
def aten_topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """topk(Tensor self, SymInt k, int dim=-1, bool largest=True, bool sorted=True) -> (Tensor values, Tensor indices)

    ONNX TopK, as torchlib, which fails on a 0-d input (ONNX Runtime rejects TopK's axis
    there); PyTorch returns the element and index 0 (for k 0 or 1). Tied values: ONNX TopK
    puts the lower index first; PyTorch's CPU kernel (std::partial_sort or std::nth_element,
    neither stable) returns tied elements in an order its algorithm leaves, so indices of tied
    values can differ (values never do). With ``sorted=False`` PyTorch's order of the k
    values is unspecified too."""
    if _rank(self) == 0:
        _axis(dim, 0)
        if isinstance(k, int) and k not in (0, 1):
            raise ValueError(f"topk: k must be 0 or 1 for a 0-d input (got {k})")
        return op.Identity(self), _index_zero()
    axis = _axis(dim, _rank(self))
    k_value = ints([k]) if isinstance(k, int) else op.Reshape(k, ints([1]))
    return op.TopK(self, k_value, axis=axis, largest=int(largest), sorted=int(sorted))


_ARG_NATIVE = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT32, ir.DataType.INT64)


def _arg_along(x, axis: int, keepdim: bool, largest: bool):
    """int64 index of the first largest (smallest) element along ``axis``, as PyTorch: the
    first NaN where the slice holds one (NaN propagates through max and min alike). ONNX
    ArgMax/ArgMin with ``select_last_index=0`` pick the first of tied values, as PyTorch."""
    key = x
    if x.dtype not in _ARG_NATIVE:  # float16/bfloat16, small ints: exact in the wider type
        key = op.Cast(x, to=ir.DataType.FLOAT if is_float(x) else ir.DataType.INT64)
    pick = op.ArgMax if largest else op.ArgMin
    idx = pick(key, axis=axis, keepdims=int(keepdim))
    if not is_float(x):
        return idx
    nan = op.Cast(op.IsNaN(key), to=ir.DataType.INT32)
    first_nan = op.ArgMax(nan, axis=axis, keepdims=int(keepdim))
    any_nan = op.ReduceMax(nan, ints([axis]), keepdims=int(keepdim))
    return op.Where(op.Cast(any_nan, to=ir.DataType.BOOL), first_nan, idx)


def _arg_extreme(x, dim, keepdim: bool, largest: bool):
    rank = _rank(x)
    if dim is None:  # over all elements; keepdim keeps every dim, as 1
        flat = op.Reshape(x, ints([-1]))
        flat.dtype = x.dtype  # traced values carry no type; the helper reads it
        idx = _arg_along(flat, 0, False, largest)
        return op.Reshape(idx, ints([1] * rank)) if keepdim and rank > 0 else idx
    if rank == 0:
        _axis(dim, 0)
        return _index_zero()
    return _arg_along(x, _axis(dim, rank), keepdim, largest)


@translation(aten.argmax.default, overrides_torchlib=True)
def aten_argmax(self, dim=None, keepdim: bool = False):
    """argmax(Tensor self, int? dim=None, bool keepdim=False) -> Tensor

    Overrides torchlib, which with ``dim=None, keepdim=True`` returns shape [1] (PyTorch: a 1
    for every dim of the input, [1, 1, 1] for a 3-D one) and ignores NaN (PyTorch: the index
    of the first NaN)."""
    return _arg_extreme(self, dim, keepdim, largest=True)


@translation(aten.argmin.default, overrides_torchlib=True)
def aten_argmin(self, dim=None, keepdim: bool = False):
    """argmin(Tensor self, int? dim=None, bool keepdim=False) -> Tensor

    As :func:`aten_argmax`, for the smallest element (NaN first too)."""
    return _arg_extreme(self, dim, keepdim, largest=False)


def _keep_shape(x, axis: int):
    """x's shape with the ``axis`` dim set to 1 (the keepdim reduction shape)."""
    parts = []
    if axis > 0:
        parts.append(op.Shape(x, start=0, end=axis))
    parts.append(ints([1]))
    if axis + 1 < _rank(x):
        parts.append(op.Shape(x, start=axis + 1))
    return op.Concat(*parts, axis=0) if len(parts) > 1 else parts[0]


def _pick(x, axis: int, keepdim: bool, pos):
    """Values and indices at sorted position ``pos`` (int64, broadcastable to the keepdim
    shape) of a stable ascending sort of x along ``axis``."""
    idx_sorted = stable_argsort(x, axis, False)
    pos = op.Expand(pos, _keep_shape(x, axis))
    idx = op.GatherElements(idx_sorted, pos, axis=axis)
    val = op.GatherElements(x, idx, axis=axis)
    if not keepdim:
        val = op.Squeeze(val, ints([axis]))
        idx = op.Squeeze(idx, ints([axis]))
    return val, idx


def _not_nan_count(x, axis: int):
    ok = op.Cast(op.Not(op.IsNaN(x)), to=ir.DataType.INT64)
    return op.ReduceSum(ok, ints([axis]), keepdims=1)


def _median_dim(x, dim: int, keepdim: bool, ignore_nan: bool):
    if _rank(x) == 0:
        _axis(dim, 0)
        return op.Identity(x), _index_zero()
    axis = _axis(dim, _rank(x))
    n = op.Shape(x, start=axis, end=axis + 1)
    one, two = ints([1]), ints([2])
    if not is_float(x):
        pos = op.Div(op.Sub(n, one), two)
    elif ignore_nan:
        # lower median of the non-NaN values; an all-NaN row gives the first NaN
        cnt = _not_nan_count(x, axis)
        pos = op.Div(op.Max(op.Sub(cnt, one), ints([0])), two)
    else:
        # any NaN: the result is the first NaN, which the stable sort puts at position cnt
        cnt = _not_nan_count(x, axis)
        pos = op.Where(op.Less(cnt, n), cnt, op.Div(op.Sub(n, one), two))
    return _pick(x, axis, keepdim, pos)


def _median_all(x, ignore_nan: bool):
    shape = x.shape
    if any(isinstance(d, int) and d == 0 for d in shape):
        return op.CastLike(op.Constant(value_float=math.nan), x)  # PyTorch: NaN for empty input
    flat = op.Reshape(x, ints([-1]))
    numel = 1
    for d in shape:
        numel = numel * d if isinstance(d, int) and isinstance(numel, int) else None
    flat.shape = ir.Shape([numel if numel is not None else "numel"])
    flat.dtype = x.dtype  # traced values carry no type; the helpers read it
    val, _ = _median_dim(flat, 0, False, ignore_nan)
    return val


@translation(aten.median.default)
def aten_median(self):
    """median(Tensor self) -> Tensor

    The lower median; NaN if any element is NaN (as PyTorch)."""
    return _median_all(self, ignore_nan=False)


@translation(aten.median.dim)
def aten_median_dim(self, dim: int, keepdim: bool = False):
    """median.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)

    Index: the element at position (n-1)//2 of a stable sort, which is what PyTorch's CPU kernel
    returns for ties too (checked on 2000 random rows with many ties); the first NaN for a row
    with NaN."""
    return _median_dim(self, dim, keepdim, ignore_nan=False)


@translation(aten.nanmedian.default)
def aten_nanmedian(self):
    """nanmedian(Tensor self) -> Tensor"""
    return _median_all(self, ignore_nan=True)


@translation(aten.nanmedian.dim)
def aten_nanmedian_dim(self, dim: int, keepdim: bool = False):
    """nanmedian.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)"""
    return _median_dim(self, dim, keepdim, ignore_nan=True)


@translation(aten.kthvalue.default)
def aten_kthvalue(self, k: int, dim: int = -1, keepdim: bool = False):
    """kthvalue(Tensor self, SymInt k, int dim=-1, bool keepdim=False) -> (Tensor values, Tensor indices)

    Values are exact. Index: the k-th element of a stable sort. For distinct values that is
    PyTorch's index; for tied values PyTorch's quickselect picks an implementation-defined
    occurrence, which this index may differ from (it always points at an equal value)."""
    if _rank(self) == 0:
        _axis(dim, 0)
        return op.Identity(self), _index_zero()
    if not isinstance(k, int):
        raise ValueError(f"kthvalue: k must be known at export time (got {k!r})")  # noqa: TRY004
    axis = _axis(dim, _rank(self))
    if self.dtype != ir.DataType.DOUBLE:  # partial sort: the k smallest, take the last
        idx = stable_argsort(self, axis, False, k=k)
        idx = _sl_axis(idx, k - 1, k, axis)
        val = op.GatherElements(self, idx, axis=axis)
        if not keepdim:
            val, idx = op.Squeeze(val, ints([axis])), op.Squeeze(idx, ints([axis]))
        return val, idx
    return _pick(self, axis, keepdim, ints([k - 1]))


def _sl_axis(x, start: int, end: int, axis: int):
    return op.Slice(x, ints([start]), ints([end]), ints([axis]))


@translation(aten.mode.default)
def aten_mode(self, dim: int = -1, keepdim: bool = False):
    """mode(Tensor self, int dim=-1, bool keepdim=False) -> (Tensor values, Tensor indices)

    The most frequent value (ties: the smallest) and the index of its last occurrence; pairwise
    counting, O(n^2) memory per row. Matches PyTorch's CPU kernel exactly for rows of up to 16
    elements; for longer rows PyTorch's index is whichever occurrence its unstable std::sort
    leaves last (the value still matches, and our index points at an equal element). With NaN,
    PyTorch's result depends on how std::sort happens to place NaN (it is not ordered by <);
    here each NaN is its own value, counted once, ranked above +inf."""
    if _rank(self) == 0:
        _axis(dim, 0)
        return op.Identity(self), _index_zero()
    rank = _rank(self)
    axis = _axis(dim, rank)
    key, nan = _key(self)
    raw = self if self.dtype in _TOPK_NATIVE else op.Cast(
        self, to=ir.DataType.FLOAT if is_float(self) else ir.DataType.INT64)
    eq = op.Equal(op.Unsqueeze(raw, ints([axis + 1])), op.Unsqueeze(raw, ints([axis])))
    count = op.ReduceSum(op.Cast(eq, to=ir.DataType.INT64), ints([axis + 1]), keepdims=0)
    if nan is not None:
        count = op.Add(count, op.Cast(nan, to=ir.DataType.INT64))
    cand = op.Equal(count, op.ReduceMax(count, ints([axis]), keepdims=1))
    if nan is not None:
        real = op.And(cand, op.Not(nan))
        vmin = op.ReduceMin(op.Where(real, key, const(math.inf, key)), ints([axis]), keepdims=1)
        has_real = op.ReduceMax(op.Cast(real, to=ir.DataType.INT64), ints([axis]), keepdims=1)
        has_real = op.Cast(has_real, to=ir.DataType.BOOL)
        match = op.Or(op.And(has_real, op.And(op.Equal(key, vmin), op.Not(nan))),
                      op.And(op.Not(has_real), nan))
    else:
        big = op.Constant(value=ir.tensor(2**63 - 1, dtype=ir.DataType.INT64))
        vmin = op.ReduceMin(op.Where(cand, key, op.CastLike(big, key)), ints([axis]), keepdims=1)
        match = op.Equal(key, vmin)
    n = op.Squeeze(op.Shape(self, start=axis, end=axis + 1), ints([0]))
    pos = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    if rank - axis - 1 > 0:
        pos = op.Reshape(pos, ints([-1] + [1] * (rank - axis - 1)))
    idx = op.ReduceMax(op.Where(match, pos, op.Constant(value_int=-1)), ints([axis]), keepdims=1)
    val = op.GatherElements(self, idx, axis=axis)
    if not keepdim:
        val = op.Squeeze(val, ints([axis]))
        idx = op.Squeeze(idx, ints([axis]))
    return val, idx


def _searchsorted(seq, values, out_int32, right, side, sorter):
    if side is not None:
        if side not in ("left", "right"):
            raise ValueError(f"searchsorted: side must be 'left' or 'right' (got {side!r})")
        if right and side == "left":
            raise ValueError("searchsorted: side='left' contradicts right=True")
        right = side == "right"
    seq_rank = _rank(seq)
    m = seq.shape[seq_rank - 1]
    seq_dtype, seq_float = seq.dtype, is_float(seq)
    if sorter is not None:
        seq = op.GatherElements(seq, sorter, axis=seq_rank - 1)
    vals = values
    # compare in a common type (PyTorch promotes both)
    if seq_dtype != vals.dtype:
        if is_float(vals) and not seq_float:
            seq = op.CastLike(seq, vals)
        else:
            vals = op.CastLike(vals, seq)
    if isinstance(m, int):
        # emulate PyTorch's binary search exactly (it decides with !(mid >= v) / !(mid > v),
        # which matters when the sequence holds NaN): ceil(log2(m+1)) masked steps
        start = op.Expand(op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64)),
                          op.Shape(vals))
        end = op.Add(start, op.Constant(value=ir.tensor(m, dtype=ir.DataType.INT64)))
        zero = op.Constant(value=ir.tensor(0, dtype=ir.DataType.INT64))
        one = op.Constant(value=ir.tensor(1, dtype=ir.DataType.INT64))
        top = op.Constant(value=ir.tensor(max(m - 1, 0), dtype=ir.DataType.INT64))
        steps = max(m, 1).bit_length()
        for _ in range(steps if m > 0 else 0):
            active = op.Less(start, end)
            mid = op.Add(start, op.Div(op.Sub(end, start), op.Constant(
                value=ir.tensor(2, dtype=ir.DataType.INT64))))
            safe = op.Min(op.Max(mid, zero), top)
            if seq_rank == 1:
                mid_val = op.Gather(seq, safe, axis=0)
            else:
                mid_val = op.GatherElements(seq, safe, axis=seq_rank - 1)
            go_right = op.Not(op.Greater(mid_val, vals) if right else
                              op.GreaterOrEqual(mid_val, vals))
            start = op.Where(op.And(active, go_right), op.Add(mid, one), start)
            end = op.Where(op.And(active, op.Not(go_right)), mid, end)
        out = start
    else:
        # dynamic length: count (exact for NaN-free sorted sequences)
        if seq_rank == 1:
            s = seq
            v = op.Unsqueeze(vals, ints([-1]))
        else:
            s = op.Unsqueeze(seq, ints([-2]))
            v = op.Unsqueeze(vals, ints([-1]))
        below = op.Not(op.Greater(s, v) if right else op.GreaterOrEqual(s, v))
        out = op.ReduceSum(op.Cast(below, to=ir.DataType.INT64), ints([-1]), keepdims=0)
    if out_int32:
        out = op.Cast(out, to=ir.DataType.INT32)
    return out


@translation(aten.searchsorted.Tensor)
def aten_searchsorted_tensor(sorted_sequence, self, *, out_int32: bool = False,
                             right: bool = False, side=None, sorter=None):
    """searchsorted.Tensor(Tensor sorted_sequence, Tensor self, *, bool out_int32=False, bool right=False, str? side=None, Tensor? sorter=None) -> Tensor

    With a static sequence length this replays PyTorch's binary search step by step, so results
    match even for sequences holding NaN; with a dynamic length it counts, which is exact for
    sorted NaN-free sequences."""
    return _searchsorted(sorted_sequence, self, out_int32, right, side, sorter)


@translation(aten.searchsorted.Scalar)
def aten_searchsorted_scalar(sorted_sequence, self, *, out_int32: bool = False,
                             right: bool = False, side=None, sorter=None):
    """searchsorted.Scalar(Tensor sorted_sequence, Scalar self, *, bool out_int32=False, bool right=False, str? side=None, Tensor? sorter=None) -> Tensor"""
    if isinstance(self, (bool, int)):
        v = op.Constant(value=ir.tensor(int(self), dtype=ir.DataType.INT64))
    else:
        v = op.Constant(value=ir.tensor(float(self), dtype=ir.DataType.DOUBLE))
    if _rank(sorted_sequence) != 1:
        raise ValueError("searchsorted: a scalar value needs a 1-D sorted_sequence")
    if is_float(sorted_sequence) or not isinstance(self, float):
        v = op.CastLike(v, sorted_sequence)
    return _searchsorted(sorted_sequence, v, out_int32, right, side, sorter)


@translation(aten.bucketize.Tensor)
def aten_bucketize_tensor(self, boundaries, *, out_int32: bool = False, right: bool = False):
    """bucketize.Tensor(Tensor self, Tensor boundaries, *, bool out_int32=False, bool right=False) -> Tensor

    searchsorted(boundaries, self) with the same ``right``, as PyTorch computes it. torchlib
    has no bucketize, and torch.onnx's fallback decomposition reads a 0-d input as a Python
    number (GuardOnDataDependentSymNode)."""
    if _rank(boundaries) != 1:
        raise ValueError("bucketize: boundaries must be 1-D")
    return _searchsorted(boundaries, self, out_int32, right, None, None)


@translation(aten.bucketize.Scalar)
def aten_bucketize_scalar(self, boundaries, *, out_int32: bool = False, right: bool = False):
    """bucketize.Scalar(Scalar self, Tensor boundaries, *, bool out_int32=False, bool right=False) -> Tensor"""
    return aten_searchsorted_scalar(boundaries, self, out_int32=out_int32, right=right)


def _quantile(self, q, dim, keepdim: bool, interpolation: str, ignore_nan: bool):
    """PyTorch's quantile_compute: stable sort (NaN last), ranks, gather, lerp."""
    if interpolation not in ("linear", "lower", "higher", "midpoint", "nearest"):
        raise ValueError(f"quantile: unknown interpolation {interpolation!r}")
    rank = _rank(self)
    q_scalar = isinstance(q, (int, float))
    if q_scalar:
        qv = op.CastLike(op.Constant(value_floats=[float(q)]), self)
    else:
        qv = op.Reshape(q, ints([-1]))
    if dim is None or rank == 0:
        x = op.Reshape(self, ints([-1]))
        x.shape, x.dtype = ir.Shape(["numel"]), self.dtype
        axis, out_rank = 0, 1
    else:
        x, axis, out_rank = self, _axis(dim, rank), rank
    idx = stable_argsort(x, axis, False)
    srt = op.GatherElements(x, idx, axis=axis)
    perm = [i for i in range(out_rank) if i != axis] + [axis]
    if perm != list(range(out_rank)):
        srt = op.Transpose(srt, perm=perm)
    n = op.CastLike(op.Shape(x, start=axis, end=axis + 1), x)  # [1]
    one = const(1.0, x)
    last = op.Sub(n, one)
    cnt = op.CastLike(op.ReduceSum(op.Cast(op.Not(op.IsNaN(srt)), to=ir.DataType.INT64),
                                   ints([-1]), keepdims=1), x)  # [..., 1]
    if ignore_nan:
        ranks = op.Mul(qv, op.Sub(cnt, one))
        ranks = op.Where(op.Equal(cnt, const(0.0, x)), op.Expand(last, op.Shape(ranks)), ranks)
    else:
        ranks = op.Mul(qv, op.Expand(last, op.Shape(cnt)))
        ranks = op.Where(op.Less(cnt, n), op.Expand(last, op.Shape(ranks)), ranks)
    def to_idx(r):
        return op.Cast(r, to=ir.DataType.INT64)

    if interpolation in ("lower", "higher", "nearest"):
        r = {"lower": op.Floor, "higher": op.Ceil, "nearest": op.Round}[interpolation](ranks)
        res = op.GatherElements(srt, to_idx(r), axis=-1)
    else:
        below = op.Floor(ranks)
        v_lo = op.GatherElements(srt, to_idx(below), axis=-1)
        v_hi = op.GatherElements(srt, to_idx(op.Ceil(ranks)), axis=-1)
        if interpolation == "linear":
            w = op.Sub(ranks, below)
        else:  # midpoint
            w = op.Expand(const(0.5, x), op.Shape(ranks))
        diff = op.Sub(v_hi, v_lo)
        # torch.lerp: weight < 0.5 ? lo + w * (hi - lo) : hi - (hi - lo) * (1 - w)
        res = op.Where(op.Less(w, const(0.5, x)), op.Add(v_lo, op.Mul(w, diff)),
                       op.Sub(v_hi, op.Mul(diff, op.Sub(one, w))))
    # res: [...rest, Q] -> [Q, ...rest] (keepdim: a 1 where the reduced dim(s) were)
    rest = out_rank - 1
    if rest > 0:
        res = op.Transpose(res, perm=[rest] + list(range(rest)))
    if keepdim and rank > 0:  # a 0-d input keeps no dim to keep
        if dim is None:
            res = op.Reshape(res, op.Concat(ints([-1]), ints([1] * rank), axis=0))
        else:
            res = op.Unsqueeze(res, ints([axis + 1]))
    if q_scalar:
        res = op.Squeeze(res, ints([0]))
    return res


@translation(aten.quantile.scalar, overrides_torchlib=True)
def aten_quantile_scalar(self, q: float, dim=None, keepdim: bool = False, *,
                         interpolation: str = "linear"):
    """quantile.scalar(Tensor self, float q, int? dim=None, bool keepdim=False, *, str interpolation="linear") -> Tensor

    Overrides torchlib, which with interpolation lower/higher/nearest returns a number for a
    slice holding NaN (PyTorch: NaN). Exact: same sort, ranks and lerp as PyTorch."""
    return _quantile(self, q, dim, keepdim, interpolation, ignore_nan=False)


@translation(aten.quantile.default, overrides_torchlib=True)
def aten_quantile(self, q, dim=None, keepdim: bool = False, *, interpolation: str = "linear"):
    """quantile(Tensor self, Tensor q, int? dim=None, bool keepdim=False, *, str interpolation="linear") -> Tensor"""
    return _quantile(self, q, dim, keepdim, interpolation, ignore_nan=False)


@translation(aten.nanquantile.scalar, overrides_torchlib=True)
def aten_nanquantile_scalar(self, q: float, dim=None, keepdim: bool = False, *,
                            interpolation: str = "linear"):
    """nanquantile.scalar(Tensor self, float q, int? dim=None, bool keepdim=False, *, str interpolation="linear") -> Tensor"""
    return _quantile(self, q, dim, keepdim, interpolation, ignore_nan=True)


@translation(aten.nanquantile.default, overrides_torchlib=True)
def aten_nanquantile(self, q, dim=None, keepdim: bool = False, *, interpolation: str = "linear"):
    """nanquantile(Tensor self, Tensor q, int? dim=None, bool keepdim=False, *, str interpolation="linear") -> Tensor"""
    return _quantile(self, q, dim, keepdim, interpolation, ignore_nan=True)
