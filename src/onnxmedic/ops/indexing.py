"""Indexing ops torchlib lacks or gets wrong: masked_select, index_reduce, put, take, nonzero
(0-d), bincount (weights), histc (range from the data), histogram, unique (NaN),
unique_consecutive, nonzero_static, scatter(reduce=), combinations (which torch.export cannot
capture without the decomposition registered here), squeeze of a dim that is not 1 (left in
place, as PyTorch leaves it; torchlib's Squeeze of it is a graph ONNX Runtime cannot load).

Data-dependent output sizes (masked_select, nonzero, unique) use ONNX's own dynamic-size ops
(Compress, NonZero). Scatter-style ops use ScatterElements with its ``reduction`` attribute
(opset 18: add, mul, max, min); ScatterElements ignores NaN in max/min, so NaN propagation is
restored with a separate mask, as PyTorch propagates NaN in ``amax``/``amin``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import const, ints, is_float, static_shape
from onnxmedic.ops._common import norm_axis as _axis
from onnxmedic.ops._common import rank as _rank
from onnxmedic.ops._registry import translation

aten = torch.ops.aten

_I64 = ir.DataType.INT64


def _flat(x):
    return op.Reshape(x, ints([-1]))


def _i64(value: int):
    return op.Constant(value=ir.tensor(value, dtype=_I64))


@translation(aten.masked_select.default)
def aten_masked_select(self, mask):
    """masked_select(Tensor self, Tensor mask) -> Tensor

    self and mask broadcast against each other (either may be the larger); the selected
    elements in row-major order of the broadcast shape (ONNX Compress)."""
    s = op.Expand(self, op.Shape(mask))
    m = op.Expand(op.Cast(mask, to=ir.DataType.BOOL), op.Shape(s))
    return op.Compress(_flat(s), _flat(m), axis=0)


@translation(aten.nonzero.default, overrides_torchlib=True)
def aten_nonzero(self):
    """nonzero(Tensor self) -> Tensor

    torchlib transposes ONNX NonZero's [rank, n] output, but ONNX Runtime's NonZero treats a
    0-d input as 1-d, so a 0-d tensor gives shape [n, 1] instead of PyTorch's [n, 0]."""
    if _rank(self) == 0:
        nz = op.Transpose(op.NonZero(op.Reshape(self, ints([1]))), perm=[1, 0])
        return op.Slice(nz, ints([0]), ints([0]), ints([1]))
    return op.Transpose(op.NonZero(self), perm=[1, 0])


def _index_full(index, source, axis: int, rank: int):
    """``index`` (1-D, along ``axis``) expanded to source's shape, for ScatterElements."""
    if rank <= 1:
        return op.Expand(op.Reshape(index, ints([-1])), op.Shape(source))
    shape = [1] * rank
    shape[axis] = -1
    return op.Expand(op.Reshape(index, ints(shape)), op.Shape(source))


@translation(aten.index_reduce.default)
def aten_index_reduce(self, dim: int, index, source, reduce: str, *, include_self: bool = True):
    """index_reduce(Tensor self, int dim, Tensor index, Tensor source, str reduce, *, bool include_self=True) -> Tensor

    ScatterElements with reduction mul/max/min/add. Without include_self, each touched element
    is seeded from a source element that lands on it (max/min), with 1 (prod) or 0 (mean).
    amax/amin propagate NaN like PyTorch (ScatterElements does not). mean divides by the count
    (+1 with include_self), floor division for integers, as PyTorch."""
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise ValueError(f"index_reduce: reduce must be prod, mean, amax or amin (got {reduce!r})")
    rank = _rank(self)
    if rank == 0:
        s1, src1 = op.Reshape(self, ints([1])), op.Reshape(source, ints([-1]))
        s1.shape, s1.dtype = ir.Shape([1]), self.dtype  # traced values carry no type
        src1.shape, src1.dtype = ir.Shape(["n"]), source.dtype
        out = aten_index_reduce(s1, 0, index, src1, reduce, include_self=include_self)
        return op.Reshape(out, ints([]))
    axis = _axis(dim, rank)
    idx = _index_full(index, source, axis, rank)
    zeros = op.ConstantOfShape(op.Shape(self), value=ir.tensor([0], dtype=_I64))
    ones = op.ConstantOfShape(op.Shape(source), value=ir.tensor([1], dtype=_I64))
    count = op.ScatterElements(zeros, idx, ones, axis=axis, reduction="add")
    touched = op.Greater(count, _i64(0))
    if reduce == "prod":
        base = self if include_self else op.Where(touched, const(1, self), self)
        return op.ScatterElements(base, idx, source, axis=axis, reduction="mul")
    if reduce == "mean":
        base = self if include_self else op.Where(touched, const(0, self), self)
        total = op.ScatterElements(base, idx, source, axis=axis, reduction="add")
        if include_self:
            count = op.Add(count, _i64(1))
        count = op.Max(count, _i64(1))
        if is_float(self):
            return op.Div(total, op.CastLike(count, self))
        c = op.CastLike(count, self)
        q = op.Div(total, c)
        rem = op.Sub(total, op.Mul(q, c))  # counts are positive: floor = trunc - (rem < 0)
        return op.Sub(q, op.CastLike(op.Less(rem, const(0, rem)), q))
    red = "max" if reduce == "amax" else "min"
    base = self
    if not include_self:
        # any one contribution per element (which one, with duplicates, does not matter)
        seed = op.ScatterElements(self, idx, source, axis=axis)
        base = op.Where(touched, seed, self)
    out = op.ScatterElements(base, idx, source, axis=axis, reduction=red)
    if is_float(self):
        nan_src = op.Cast(op.IsNaN(source), to=_I64)
        nan_hit = op.ScatterElements(zeros, idx, nan_src, axis=axis, reduction="max")
        nan = op.Greater(nan_hit, _i64(0))
        if include_self:
            nan = op.Or(nan, op.IsNaN(self))
        out = op.Where(nan, const(math.nan, self), out)
    return out


@translation(aten.put.default)
def aten_put(self, index, source, accumulate: bool = False):
    """put(Tensor self, Tensor index, Tensor source, bool accumulate=False) -> Tensor

    self viewed as 1-D; negative indices count from the end (ScatterElements does too).
    Without accumulate, duplicate indices pick an arbitrary write (undefined in PyTorch and in
    ONNX alike; the tests use distinct indices there)."""
    flat = _flat(self)
    out = op.ScatterElements(flat, _flat(index), _flat(source), axis=0,
                             reduction="add" if accumulate else "none")
    return op.Reshape(out, op.Shape(self))


@translation(aten.take.default)
def aten_take(self, index):
    """take(Tensor self, Tensor index) -> Tensor

    self viewed as 1-D, gathered at ``index`` (negative indices count from the end, as in ONNX
    Gather). torchlib has no take, and the decomposition torch.onnx falls back to
    (``self.reshape(-1)[index]``) reads a 0-d index as a Python int, which fails to trace
    (GuardOnDataDependentSymNode)."""
    return op.Gather(_flat(self), index, axis=0)


def _scatter_reduce(self, dim: int, index, src, reduce: str):
    if reduce not in ("add", "multiply"):
        raise ValueError(f"scatter: reduce must be 'add' or 'multiply' (got {reduce!r})")
    rank = _rank(self)
    if rank == 0:  # ScatterElements needs rank >= 1; 0-d index and src come with a 0-d self
        _axis(dim, 0)
        out = op.ScatterElements(op.Reshape(self, ints([1])), op.Reshape(index, ints([1])),
                                 op.Reshape(src, ints([1])), axis=0,
                                 reduction="add" if reduce == "add" else "mul")
        return op.Reshape(out, ints([]))
    axis = _axis(dim, rank)
    return op.ScatterElements(self, index, src, axis=axis,
                              reduction="add" if reduce == "add" else "mul")


@translation(aten.scatter.reduce)
def aten_scatter_reduce_legacy(self, dim: int, index, src, *, reduce: str):
    """scatter.reduce(Tensor self, int dim, Tensor index, Tensor src, *, str reduce) -> Tensor

    ScatterElements with reduction add/mul. PyTorch reads src only where index reaches (src
    may be larger in any dim), so src is cut to index's shape first."""
    if _rank(src) > 0:
        src = op.Slice(src, ints([0] * _rank(src)), op.Shape(index),
                       ints(list(range(_rank(src)))))
    return _scatter_reduce(self, dim, index, src, reduce)


@translation(aten.scatter.value_reduce)
def aten_scatter_value_reduce(self, dim: int, index, value, *, reduce: str):
    """scatter.value_reduce(Tensor self, int dim, Tensor index, Scalar value, *, str reduce) -> Tensor"""
    src = op.Expand(const(value, self), op.Shape(index))
    return _scatter_reduce(self, dim, index, src, reduce)


@translation(aten.nonzero_static.default)
def aten_nonzero_static(self, *, size: int, fill_value: int = -1):
    """nonzero_static(Tensor self, *, SymInt size, int fill_value=-1) -> Tensor

    The first ``size`` rows of nonzero(self), padded with ``fill_value`` rows: (size, rank)."""
    if not isinstance(size, int):
        raise ValueError("nonzero_static: size must be known at export time")
    rank = _rank(self)
    if rank == 0:  # (size, 0): no coordinates to fill
        return op.ConstantOfShape(ints([size, 0]), value=ir.tensor([0], dtype=_I64))
    nz = op.Transpose(op.NonZero(self), perm=[1, 0])
    pad = op.ConstantOfShape(ints([size, rank]), value=ir.tensor([fill_value], dtype=_I64))
    return op.Slice(op.Concat(nz, pad, axis=0), ints([0]), ints([size]), ints([0]))


@translation(aten.bincount.default)
def aten_bincount(self, weights=None, minlength: int = 0):
    """bincount(Tensor self, Tensor? weights=None, SymInt minlength=0) -> Tensor

    torchlib rejects weights. The result has max(self)+1 bins (0 for an empty input), at least
    ``minlength``; with weights it is float32 for float32 weights and float64 otherwise, as
    PyTorch's CPU kernel, except for an empty input: int64 zeros (told apart only when the
    input size is known at export time)."""
    shape = static_shape(self)
    if shape is not None and math.prod(shape) == 0:  # PyTorch: int64 zeros, even with weights
        return op.ConstantOfShape(ints([max(int(minlength), 0)]),
                                  value=ir.tensor([0], dtype=_I64))
    x = op.Cast(_flat(self), to=_I64)
    top = op.ReduceMax(op.Concat(x, ints([-1]), axis=0), keepdims=1)  # -1 when empty
    depth = op.Add(top, ints([1]))
    if isinstance(minlength, int) and minlength > 0:
        depth = op.Max(depth, ints([minlength]))
    if weights is None:
        zeros = op.Expand(_i64(0), depth)
        w = op.Expand(_i64(1), op.Shape(x))
    else:
        to = ir.DataType.FLOAT if weights.dtype == ir.DataType.FLOAT else ir.DataType.DOUBLE
        w = op.Cast(_flat(weights), to=to)
        zeros = op.Expand(op.CastLike(_i64(0), w), depth)
    return op.ScatterElements(zeros, x, w, axis=0, reduction="add")


@translation(aten.histc.default, overrides_torchlib=True)
def aten_histc(self, bins: int = 100, min: float = 0.0, max: float = 0.0):  # noqa: A002
    """histc(Tensor self, int bins=100, Scalar min=0, Scalar max=0) -> Tensor

    PyTorch's CPU formula, in the input's type: bin = int((x - min) * bins / (max - min)),
    x == max in the last bin, x outside [min, max] and NaN ignored. With min == max the range
    is the data's (widened by 1 each way when the data is constant); torchlib rejects that case,
    and its precomputed bin edges can put values near an edge in the neighbouring bin."""
    flat = _flat(self)
    shape = static_shape(self)
    numel = None if shape is None else math.prod(shape)
    if min == max:
        if numel == 0:
            lo, hi = const(float(min) - 1, self), const(float(max) + 1, self)
        else:
            lo = op.ReduceMin(flat, keepdims=0)
            hi = op.ReduceMax(flat, keepdims=0)
            same = op.Equal(lo, hi)
            lo = op.Where(same, op.Sub(lo, const(1, lo)), lo)
            hi = op.Where(same, op.Add(hi, const(1, hi)), hi)
    else:
        lo, hi = const(float(min), self), const(float(max), self)
    inside = op.And(op.GreaterOrEqual(flat, lo), op.LessOrEqual(flat, hi))  # False for NaN
    safe = op.Where(inside, flat, lo)
    pos = op.Div(op.Mul(op.Sub(safe, lo), const(bins, self)), op.Sub(hi, lo))
    pos = op.Cast(pos, to=_I64)  # truncation, like static_cast<int64_t>
    pos = op.Min(pos, _i64(bins - 1))
    ones = op.CastLike(op.Cast(inside, to=_I64), self)
    zeros = op.CastLike(op.ConstantOfShape(ints([bins]), value=ir.tensor([0], dtype=_I64)), self)
    return op.ScatterElements(zeros, pos, ones, axis=0, reduction="add")


def _linspace(lo, hi, steps: int):
    """PyTorch's CPU linspace in lo's type: start + step*i for the first half, end -
    step*(steps-1-i) for the second (lo, hi: 0-d)."""
    i = op.CastLike(op.Constant(value=ir.tensor(np.arange(steps, dtype=np.int64))), lo)
    if steps == 1:
        return op.Reshape(lo, ints([1]))
    step = op.Div(op.Sub(hi, lo), const(steps - 1, lo))
    back = op.CastLike(op.Constant(value=ir.tensor(np.arange(steps, dtype=np.int64)[::-1].copy())),
                       lo)
    first = op.Constant(value=ir.tensor(np.arange(steps) < steps // 2))
    return op.Where(first, op.Add(lo, op.Mul(step, i)), op.Sub(hi, op.Mul(step, back)))


def _histogram(flat, edges, n_edges: int, weight, density: bool, local_search: bool):
    """PyTorch's histogramdd CPU kernel for one dim: elements outside [edges[0], edges[-1]]
    and NaN skipped; the bin by linear interpolation then a search among the neighbouring edges
    (``local_search``, bin_ct) or by a search among all edges (bins tensor); the last bin
    includes its right edge."""
    bins = n_edges - 1
    lo = op.Gather(edges, _i64(0), axis=0)
    hi = op.Gather(edges, _i64(n_edges - 1), axis=0)
    inside = op.And(op.GreaterOrEqual(flat, lo), op.LessOrEqual(flat, hi))  # False for NaN
    safe = op.Where(inside, flat, lo)
    if local_search:
        pos = op.Cast(op.Div(op.Mul(op.Sub(safe, lo), const(bins, flat)), op.Sub(hi, lo)),
                      to=_I64)
        pos_min = op.Max(op.Sub(pos, _i64(1)), _i64(0))
        pos_max = op.Min(op.Add(pos, _i64(2)), _i64(n_edges))
        count = None
        for j in range(3):  # edges[pos_min + j] <= x, for the window [pos_min, pos_max)
            at = op.Add(pos_min, _i64(j))
            le = op.And(op.Less(at, pos_max),
                        op.LessOrEqual(op.Gather(edges, op.Min(at, _i64(n_edges - 1)), axis=0),
                                       safe))
            c = op.Cast(le, to=_I64)
            count = c if count is None else op.Add(count, c)
        pos = op.Sub(op.Add(pos_min, count), _i64(1))
    else:
        le = op.LessOrEqual(op.Unsqueeze(edges, ints([0])), op.Unsqueeze(safe, ints([1])))
        pos = op.Sub(op.ReduceSum(op.Cast(le, to=_I64), ints([1]), keepdims=0), _i64(1))
    pos = op.Where(op.Equal(pos, _i64(bins)), _i64(bins - 1), pos)
    pos = op.Max(pos, _i64(0))  # only for skipped elements, which add 0
    w = op.CastLike(op.Cast(inside, to=_I64), flat)
    if weight is not None:
        w = op.Where(inside, op.CastLike(_flat(weight), flat), w)
    zeros = op.CastLike(op.ConstantOfShape(ints([bins]), value=ir.tensor([0], dtype=_I64)), flat)
    hist = op.ScatterElements(zeros, pos, w, axis=0, reduction="add")
    if density:
        lengths = op.Sub(op.Slice(edges, ints([1]), ints([n_edges]), ints([0])),
                         op.Slice(edges, ints([0]), ints([bins]), ints([0])))
        hist = op.Div(op.Div(hist, op.ReduceSum(hist, keepdims=0)), lengths)
    return hist


@translation(aten.histogram.bin_ct, static_shapes=True)
def aten_histogram_bin_ct(self, bins: int = 100, *, range=None, weight=None,  # noqa: A002
                          density: bool = False):
    """histogram.bin_ct(Tensor self, int bins=100, *, float[]? range=None, Tensor? weight=None, bool density=False) -> (Tensor hist, Tensor bin_edges)

    The range (given, or the data's min and max; widened by 0.5 each way when empty, [0, 1]
    for an empty input) in float64 then the input's type, edges by PyTorch's linspace. The
    vectorised CPU linspace can round some edges one ulp differently; the local search keeps
    every count consistent with the edges returned."""
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"histogram: bins must be a positive int known at export (got {bins!r})")
    flat = _flat(self)
    shape = static_shape(self)
    f64 = ir.DataType.DOUBLE
    if range is not None:
        lo = op.Constant(value=ir.tensor(np.array(float(range[0]), dtype=np.float64)))
        hi = op.Constant(value=ir.tensor(np.array(float(range[1]), dtype=np.float64)))
    elif shape is not None and math.prod(shape) == 0:
        lo = op.Constant(value=ir.tensor(np.array(0.0, dtype=np.float64)))
        hi = op.Constant(value=ir.tensor(np.array(1.0, dtype=np.float64)))
    else:
        lo = op.Cast(op.ReduceMin(flat, keepdims=0), to=f64)
        hi = op.Cast(op.ReduceMax(flat, keepdims=0), to=f64)
    same = op.Equal(lo, hi)
    half = op.Constant(value=ir.tensor(np.array(0.5, dtype=np.float64)))
    lo = op.CastLike(op.Where(same, op.Sub(lo, half), lo), self)
    hi = op.CastLike(op.Where(same, op.Add(hi, half), hi), self)
    edges = _linspace(lo, hi, bins + 1)
    return _histogram(flat, edges, bins + 1, weight, density, local_search=True), edges


@translation(aten.histogram.bins_tensor, static_shapes=True)
def aten_histogram_bins_tensor(self, bins, *, weight=None, density: bool = False):
    """histogram.bins_tensor(Tensor self, Tensor bins, *, Tensor? weight=None, bool density=False) -> (Tensor hist, Tensor bin_edges)

    ``bins`` are the edges (their count must be known at export); each element's bin by a
    search among them, as PyTorch's BINARY_SEARCH path."""
    n_edges = bins.shape[0] if _rank(bins) == 1 else None
    if not isinstance(n_edges, int) or n_edges < 2:
        raise ValueError("histogram: bins must be 1-D with at least 2 edges known at export")
    edges = op.CastLike(bins, self)
    return _histogram(_flat(self), edges, n_edges, weight, density, local_search=False), \
        op.Identity(edges)


def _tri_indices(fn, row: int, col: int, offset: int, dtype):
    if not all(isinstance(v, int) for v in (row, col, offset)):
        raise ValueError(f"{fn.__name__}: row, col and offset must be known at export time")
    value = fn(row, col, offset).numpy()
    out = op.Constant(value=ir.tensor(value.reshape(2, -1).astype("int64"), dtype=_I64))
    if dtype in (None, 4):  # ScalarType Long
        return out
    if dtype == 3:  # Int
        return op.Cast(out, to=ir.DataType.INT32)
    raise ValueError(f"{fn.__name__}: dtype must be int32 or int64 (got ScalarType {dtype})")


@translation(aten.tril_indices.default, static_shapes=True)
def aten_tril_indices(row: int, col: int, offset: int = 0, *, dtype=4, layout=None, device=None,
                      pin_memory=None):
    """tril_indices(int row, int col, int offset=0, *, ScalarType? dtype=4, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor

    A constant (all arguments are export-time integers); torchlib's fails to export when the
    result is empty (e.g. row == 0)."""
    return _tri_indices(torch.tril_indices, row, col, offset, dtype)


@translation(aten.triu_indices.default, static_shapes=True)
def aten_triu_indices(row: int, col: int, offset: int = 0, *, dtype=4, layout=None, device=None,
                      pin_memory=None):
    """triu_indices(int row, int col, int offset=0, *, ScalarType? dtype=4, Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor

    A constant (all arguments are export-time integers); torchlib's fails to export when the
    result is empty (e.g. offset >= col)."""
    return _tri_indices(torch.triu_indices, row, col, offset, dtype)


def _combinations_static(self, r: int = 2, with_replacement: bool = False):
    """aten::combinations for a 1-D input of export-time length: one gather by a constant index
    table (itertools' order, which is PyTorch's: lexicographic over ascending positions)."""
    n = self.shape[0] if self.dim() == 1 else None
    if not isinstance(n, int) or r < 0:
        # a symbolic length (or an input PyTorch rejects): PyTorch's own composite
        return torch.ops.aten.combinations.default._op_dk(
            torch._C.DispatchKey.CompositeImplicitAutograd, self, r, with_replacement)
    if r == 0:
        return self.new_empty((0,))
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    table = list(pick(range(n), r))
    index = torch.tensor(table, dtype=torch.long, device=self.device).reshape(len(table) * r)
    return torch.index_select(self, 0, index).reshape(len(table), r)


def _register_combinations_decomposition() -> None:
    """Make aten::combinations capturable by torch.export.

    PyTorch's composite masks a meshgrid once per output column (masked_select): each call
    makes a new data-dependent size, only the first of which reaches the output, and
    torch.export gives up (PendingUnbackedSymbolNotFound) - for every input, not only 0-d ones.
    The output size C(n, r) is known from the static length, so a Python kernel for the
    CompositeImplicitAutograd key (consulted only under the Python dispatcher, i.e. while
    tracing; eager calls keep PyTorch's kernel) gathers by a constant index table instead."""
    target = torch.ops.aten.combinations.default
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    if key not in target.py_kernels:
        target.py_impl(key)(_combinations_static)


_register_combinations_decomposition()


@translation(aten.combinations.default, static_shapes=True)
def aten_combinations(self, r: int = 2, with_replacement: bool = False):
    """combinations(Tensor self, int r=2, bool with_replacement=False) -> Tensor

    A Gather by a constant index table: the length must be known at export time (the output
    size C(n, r) depends on it). Kept whole by torch.onnx: its decomposition (ours, above)
    builds the table as a tensor constant, which torch.onnx's re-trace cannot lift."""
    n = self.shape[0] if _rank(self) == 1 else None
    if not isinstance(n, int):
        raise ValueError("combinations: the input must be 1-D with a length known at export time")
    if r < 0:
        raise ValueError(f"combinations: r must be non-negative (got {r})")
    if r == 0:
        return op.Slice(self, ints([0]), ints([0]), ints([0]))
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    table = np.array(list(pick(range(n), r)), dtype=np.int64).reshape(-1, r)
    return op.Gather(self, op.Constant(value=ir.tensor(table)), axis=0)


def _run_starts(seq, n):
    """True where a run of equal elements starts in ``seq`` (1-D); NaN never equals NaN."""
    differ = op.Not(op.Equal(op.Slice(seq, ints([1]), ints([2**62]), ints([0])),
                             op.Slice(seq, ints([0]), ints([-1]), ints([0]))))
    flag = op.Concat(op.Constant(value=ir.tensor([True], dtype=ir.DataType.BOOL)), differ, axis=0)
    return op.Slice(flag, ints([0]), op.Reshape(n, ints([1])), ints([0]))


def _run_counts(flag, n):
    pos = op.Range(_i64(0), n, _i64(1))
    starts = op.Compress(pos, flag, axis=0)
    ends = op.Concat(op.Slice(starts, ints([1]), ints([2**62]), ints([0])),
                     op.Reshape(n, ints([1])), axis=0)
    return op.Sub(ends, starts)


def _group_ids(flag):
    return op.Sub(op.CumSum(op.Cast(flag, to=_I64), _i64(0)), _i64(1))


@translation(aten.unique_consecutive.default)
def aten_unique_consecutive(self, return_inverse: bool = False, return_counts: bool = False,
                            dim=None):
    """unique_consecutive(Tensor self, bool return_inverse=False, bool return_counts=False, int? dim=None) -> (Tensor, Tensor, Tensor)

    torchlib handles only 1-D int32/int64 without dim. Any dtype and rank here; with ``dim``
    whole slices are compared. NaN never equals NaN, as PyTorch's != comparison."""
    if dim is None or _rank(self) == 0:
        flat = _flat(self)
        n = op.Squeeze(op.Shape(flat), ints([0]))
        flag = _run_starts(flat, n)
        values = op.Compress(flat, flag, axis=0)
        inverse = op.Reshape(_group_ids(flag), op.Shape(self))
        return values, inverse, _run_counts(flag, n)
    rank = _rank(self)
    axis = _axis(dim, rank)
    n = op.Squeeze(op.Shape(self, start=axis, end=axis + 1), ints([0]))
    end = ints([2**62])
    differ = op.Not(op.Equal(op.Slice(self, ints([1]), end, ints([axis])),
                             op.Slice(self, ints([0]), ints([-1]), ints([axis]))))
    others = [a for a in range(rank) if a != axis]
    if others:
        differ = op.Cast(op.ReduceMax(op.Cast(differ, to=ir.DataType.INT32), ints(others),
                                      keepdims=0), to=ir.DataType.BOOL)
    flag = op.Concat(op.Constant(value=ir.tensor([True], dtype=ir.DataType.BOOL)), differ, axis=0)
    flag = op.Slice(flag, ints([0]), op.Reshape(n, ints([1])), ints([0]))
    values = op.Compress(self, flag, axis=axis)
    return values, _group_ids(flag), _run_counts(flag, n)


@translation(aten._unique2.default, overrides_torchlib=True)
def aten__unique2(self, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
                  return_counts: bool = False):
    """_unique2(Tensor self, bool sorted=True, bool return_inverse=False, bool return_counts=False) -> (Tensor, Tensor, Tensor)

    A stable sort then run starts. Always sorted (PyTorch's CPU kernel sorts for sorted=False
    too). Each NaN is its own value, last, as PyTorch; torchlib's ONNX Unique merges NaNs."""
    from onnxmedic.ops.selection import stable_argsort

    flat = _flat(self)
    shape = static_shape(self)
    flat.shape = ir.Shape([math.prod(shape) if shape is not None else "numel"])
    flat.dtype = self.dtype  # traced values carry no type; the helper reads it
    n = op.Squeeze(op.Shape(flat), ints([0]))
    idx = stable_argsort(flat, 0, False)
    seq = op.Gather(flat, idx, axis=0)
    flag = _run_starts(seq, n)
    values = op.Compress(seq, flag, axis=0)
    zeros = op.ConstantOfShape(op.Shape(flat), value=ir.tensor([0], dtype=_I64))
    inverse = op.ScatterElements(zeros, idx, _group_ids(flag), axis=0)
    return values, op.Reshape(inverse, op.Shape(self)), _run_counts(flag, n)


_UNIQUE_DIM_INSERTION = 16  # libstdc++'s std::sort is a plain insertion sort up to 16 elements


def _slice_less(a):
    """comp(i, j) of PyTorch's unique_dim sort for every pair of rows of ``a`` (n, m): the
    first element where the rows are ordered (< or >) decides, NaN orders with nothing."""
    if a.dtype == ir.DataType.BOOL or a.dtype == ir.DataType.BFLOAT16:
        a = op.Cast(a, to=ir.DataType.FLOAT if is_float(a) else ir.DataType.INT32)
    left, right = op.Unsqueeze(a, ints([1])), op.Unsqueeze(a, ints([0]))
    lt = op.Cast(op.Less(left, right), to=ir.DataType.INT32)
    ordered = op.Cast(op.Or(op.Less(left, right), op.Greater(left, right)), to=ir.DataType.INT32)
    first = op.ArgMax(ordered, axis=2, keepdims=1)  # the first ordered element (0 if none)
    decided = op.ReduceMax(ordered, ints([2]), keepdims=0)
    lt_first = op.Squeeze(op.GatherElements(lt, first, axis=2), ints([2]))
    less = op.Cast(op.Mul(decided, lt_first), to=ir.DataType.BOOL)
    same = op.Cast(op.ReduceMin(op.Cast(op.Equal(left, right), to=ir.DataType.INT32), ints([2]),
                                keepdims=0), to=ir.DataType.BOOL)
    return less, same


@translation(aten.unique_dim.default, overrides_torchlib=True)
def aten_unique_dim(self, dim: int, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
                    return_counts: bool = False):
    """unique_dim(Tensor self, int dim, bool sorted=True, bool return_inverse=False, bool return_counts=False) -> (Tensor, Tensor, Tensor)

    PyTorch sorts the slices with std::sort and a lexicographic comparator under which NaN is
    ordered with nothing, then starts a new value wherever neighbours differ (NaN != NaN): each
    slice holding NaN stays apart, at the place the sort leaves it. For up to 16 slices
    (static) std::sort is libstdc++'s insertion sort, replayed here step by step, so values,
    inverse and counts match exactly, NaN included. Otherwise torchlib's ONNX Unique, exact
    without NaN but merging slices that hold NaN in the same places (PyTorch's introsort order
    with NaN is not reproduced)."""
    shape = static_shape(self)
    rank = _rank(self)
    axis = _axis(dim, rank)
    n = shape[axis] if shape is not None and rank > 0 else None
    if n is None or n > _UNIQUE_DIM_INSERTION or 0 in shape:
        from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

        return torchlib_core.aten_unique_dim(self, dim, sorted, True, True)
    rows = self if axis == 0 else op.Transpose(
        self, perm=[axis] + [i for i in range(rank) if i != axis])
    rows = op.Reshape(rows, ints([n, -1]))
    rows.dtype = self.dtype
    less, same = _slice_less(rows)
    perm = op.Constant(value=ir.tensor(np.arange(n, dtype=np.int64)))
    for i in range(1, n):  # std::__insertion_sort, one element at a time
        v = op.Slice(perm, ints([i]), ints([i + 1]), ints([0]))
        c = op.Gather(op.Squeeze(op.Gather(less, v, axis=0), ints([0])),
                      op.Slice(perm, ints([0]), ints([i]), ints([0])), axis=0)  # v < perm[j]
        first = op.Slice(c, ints([0]), ints([1]), ints([0]))
        j = op.Constant(value=ir.tensor(np.arange(i, dtype=np.int64)))
        last_stop = op.ReduceMax(op.Where(c, _i64(-1), j), keepdims=1)  # top j with !c[j]
        pos = op.Where(first, ints([0]), op.Add(last_stop, ints([1])))
        q = op.Constant(value=ir.tensor(np.arange(i + 1, dtype=np.int64)))
        src = op.Where(op.Less(q, pos), q, op.Where(op.Equal(q, pos), ints([i]),
                                                    op.Sub(q, ints([1]))))
        head = op.Gather(perm, src, axis=0)
        perm = head if i + 1 == n else op.Concat(
            head, op.Slice(perm, ints([i + 1]), ints([n]), ints([0])), axis=0)
    if n > 1:
        prev_same = op.GatherElements(
            op.Gather(same, op.Slice(perm, ints([0]), ints([n - 1]), ints([0])), axis=0),
            op.Unsqueeze(op.Slice(perm, ints([1]), ints([n]), ints([0])), ints([1])), axis=1)
        flag = op.Concat(op.Constant(value=ir.tensor([True], dtype=ir.DataType.BOOL)),
                         op.Not(op.Reshape(prev_same, ints([-1]))), axis=0)
    else:
        flag = op.Constant(value=ir.tensor([True] * n, dtype=ir.DataType.BOOL))
    values = op.Gather(self, op.Compress(perm, flag, axis=0), axis=axis)
    zeros = op.Constant(value=ir.tensor(np.zeros(n, dtype=np.int64)))
    inverse = op.ScatterElements(zeros, perm, _group_ids(flag), axis=0)
    return values, inverse, _run_counts(flag, _i64(n))


def _squeezed(self, dims):
    """``self`` with the dims of ``dims`` that are 1 removed: PyTorch leaves a dim of another
    size in place, which ONNX's Squeeze rejects (ONNX Runtime refuses to load the graph)."""
    shape = getattr(self, "shape", None)
    if shape is None or len(shape) == 0:
        return op.Identity(self)
    rank = len(shape)
    keep = [d % rank for d in dims if not (isinstance(shape[d % rank], int)
                                            and shape[d % rank] != 1)]
    return op.Squeeze(self, ints(sorted(set(keep)))) if keep else op.Identity(self)


@translation(aten.squeeze.dim, overrides_torchlib=True)
def aten_squeeze_dim(self, dim: int):
    """squeeze.dim(Tensor(a) self, int dim) -> Tensor(a)

    torchlib's Squeeze also of a dim whose size is known not to be 1 (LongCat-Flash's
    ``expert_mask[e].squeeze(0)`` of its [top_k, tokens] mask): ONNX Runtime cannot load the
    graph (OM510). Such a dim is left in place, as PyTorch leaves it."""
    return _squeezed(self, [dim])


@translation(aten.squeeze.dims, overrides_torchlib=True)
def aten_squeeze_dims(self, dim: list[int]):
    """squeeze.dims(Tensor(a) self, int[] dim) -> Tensor(a): as :func:`aten_squeeze_dim`."""
    return _squeezed(self, list(dim))
