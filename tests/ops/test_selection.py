"""Selection and sorting: stable sort/argsort, median, nanmedian, kthvalue, mode, searchsorted,
argmax/argmin.

OpInfo samples plus edge values (NaN, +-inf, -0, ties, all-NaN rows, empty, 0-d, batched),
against PyTorch. Indices must match exactly (integer outputs are compared with zero tolerance).
Edge values are batched into few tensors: every sample costs one export (~1-2 s).
"""

from __future__ import annotations

import math

import onnxruntime as ort
import torch

from onnxmedic.ops.testing import check_call
from tests.ops._table import OpEntry, make_tests

nan, inf = math.nan, math.inf
F32 = {"float32": (1e-5, 1e-6)}


def _mix(dtype, seed=0):
    """(6, 13): special values, three rows of heavy ties, ties with NaN, an all-NaN row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (6, 13), generator=g).to(dtype)
    x[0] = torch.tensor([2.0, nan, 1.0, -0.0, 0.0, nan, inf, 1.0, -inf, 2.0, -3.5, 1e30, -1e-30])
    x[4, torch.rand(13, generator=g) < 0.3] = nan
    x[5] = nan
    return x


def _ties(dtype, shape=(4, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def _sort_edges(dtype):
    x = _mix(dtype)
    return [((x,), {"stable": True}), ((x.T.contiguous(),), {"stable": True, "dim": 0, "descending": True}),
            ((torch.tensor(3.0, dtype=dtype),), {"stable": True}),
            ((torch.empty(3, 0, dtype=dtype),), {"stable": True})]


def _int_sort_edges(dtype):
    x = _ties(dtype, (2, 3, 7))
    return [((x,), {"stable": True, "dim": 1}), ((x,), {"stable": True, "descending": True})]


def _median_dim_edges(dtype):
    # _mix's all-NaN row is left out: nanmedian's index there is whatever std::nth_element
    # leaves at position 0 (it depends only on n); median's (the first NaN) is tested.
    x = _mix(dtype)[:5] if dtype.is_floating_point else _ties(dtype, (6, 13))
    return [((x, 1), {}), ((x[:5], 0, True), {}), ((_ties(dtype, (2, 3, 8)), -2), {}),
            ((torch.tensor(3, dtype=dtype), 0), {})]


def _median_all_edges(dtype):
    x = _mix(dtype)
    return [((x,), {}), ((x[1:4],), {}), ((x[5],), {}), ((torch.empty(0, dtype=dtype),), {})]


def _kthvalue_edges(dtype):
    # Distinct values (PyTorch's tie index is quickselect-defined, see test_kthvalue_ties)
    g = torch.Generator().manual_seed(3)
    distinct = torch.randperm(40, generator=g).to(dtype).reshape(5, 8) - 20
    out = [((distinct, 3, 1), {}), ((distinct, 2, 0, True), {}),
           ((torch.tensor(2, dtype=dtype), 1), {})]
    if dtype.is_floating_point:
        special = torch.tensor([3.0, -inf, 0.5, inf, -2.0, 1e-30, -0.0, nan], dtype=dtype)
        out += [((special, k), {}) for k in (1, 4, 6, 8)]
    return out


def _mode_edges(dtype):
    if not dtype.is_floating_point:
        return [((_ties(dtype, (2, 6, 3)), 1), {})]
    # NaN rows left out: PyTorch's mode with NaN depends on std::sort's placement of NaN
    # (mode_nan test below checks the NaN count does not leak into +inf's).
    x = torch.tensor([[3.0, 1, 2, 1, 3, 2, 1, 3], [2, 1, 2, 1, 3, 0, 0, 5],
                      [1, 8, 2, 8, 0, 7, 7, 7], [-inf, -inf, 1, 2, 3, -inf, inf, inf],
                      [-0.0, 0.0, 4, 4, -0.0, 9, 9, 9], [1e30, 5, 1e30, 4, -1e-30, 3, 1e30, 2]],
                     dtype=dtype)
    return [((x, 1), {}), ((x, 0, True), {}), ((torch.tensor(2.0, dtype=dtype), 0), {}),
            ((torch.empty(0, 3, dtype=dtype), 1), {})]


def _searchsorted_edges(dtype):
    seq = torch.tensor([-inf, -1.0, 0.0, 0.0, 2.5, 2.5, 2.5, 7.0, inf], dtype=dtype)
    seq_nan = torch.tensor([1.0, 2.0, 2.0, 3.0, nan], dtype=dtype)
    v = torch.tensor([[nan, 2.0, 5.0, inf, 3.0, 1.0], [-inf, 0.0, -0.0, 2.5, 7.0, 8.0]],
                     dtype=dtype)
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(9, generator=g)
    return [((seq, v), {}), ((seq_nan, v), {"right": True}), ((seq_nan, v), {"side": "left"}),
            ((seq[perm], v), {"right": True, "sorter": torch.argsort(seq[perm]), "out_int32": True}),
            ((seq, 2.5), {"side": "right"})]


def _int_searchsorted_edges(dtype):
    seq = torch.tensor([1, 3, 3, 7], dtype=dtype)
    return [((seq, torch.tensor([[0, 3], [7, 8]], dtype=dtype)), {"right": True})]


def _bucketize_edges(dtype):
    b = torch.tensor([-inf, -1.0, 0.0, 0.0, 2.5, 2.5, 7.0, inf], dtype=dtype)  # ties
    v = torch.tensor([[nan, 2.5, 5.0, inf, -0.0, 0.0], [-inf, 0.0, -2.0, 2.5, 7.0, 8.0]],
                     dtype=dtype)
    return [((v, b), {}), ((v, b), {"right": True, "out_int32": True}),
            ((torch.tensor(2.5, dtype=dtype), b), {"right": True}),  # 0-d
            ((v[:, :0], b), {}), ((v, b[:0]), {}),  # empty input, empty boundaries
            ((torch.tensor([1.0, nan, 3.0], dtype=dtype), v[0]), {})]  # NaN boundary


def _topk_edges(dtype):
    """Distinct values only (one NaN a row at most: two NaN are a tie, see test_topk_ties)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randperm(48, generator=g).to(dtype) - 24).reshape(4, 12)
    if dtype.is_floating_point:
        x[0, :6] = torch.tensor([nan, inf, -inf, 1e-30, -1e30, 0.5], dtype=dtype)
        x[2, 7] = nan
    return [((x, 4), {}), ((x, 5, 0, False), {}), ((x, 12), {"largest": False}),
            ((x, 0), {}), ((x[:, :0], 0), {}), ((torch.tensor(2.5, dtype=dtype), 1), {}),
            ((torch.tensor(-1.0, dtype=dtype), 0, -1, False), {})]  # 0-d: k 1 and 0


def _quantile_edges(dtype):
    x = _mix(dtype)  # a row with NaN, an all-NaN row, +-inf, ties
    qs = torch.tensor([0.0, 0.25, 0.5, 0.61, 1.0], dtype=dtype)
    out = [((x[[1, 2, 3]], qs), {"dim": 1, "interpolation": m}) for m in
           ("linear", "lower", "higher", "midpoint", "nearest")]
    out += [((x, 0.37), {"dim": 1, "keepdim": True}), ((x.T.contiguous(), qs), {"dim": 0}),
            ((x[1:4], 0.5), {"keepdim": True, "interpolation": "nearest"})]
    return out


def _arg_all(x):
    """argmax and argmin in every form on one input (one export): keepdim without a dim
    (PyTorch keeps every dim as 1; torchlib gave [1]), along the first and last dim with and
    without keepdim, and over all elements."""
    return tuple(f(x, *a) for f in (torch.argmax, torch.argmin)
                 for a in ((None, True), (None, False), (0, True), (-1, False)))


def _arg_edges(dtype):
    """Ties (the first index wins); for floats NaN (the first NaN wins, for argmin too), +-inf
    and -0/0 ties."""
    out = [((_ties(dtype, (2, 3, 4), seed=6),), {})]
    if dtype.is_floating_point:
        g = torch.Generator().manual_seed(6)
        special = torch.randn(4, 6, generator=g).to(dtype)
        special[0, [1, 4]] = nan
        special[1] = torch.tensor([-0.0, 0.0, inf, -inf, inf, -inf], dtype=dtype)
        special[2, 5] = nan
        out.append(((special,), {}))
    return out


ENTRIES = [
    OpEntry("sort", tolerance=F32, edge=_sort_edges, max_samples=4),
    OpEntry("sort", fn=torch.sort, dtypes=(torch.float64, torch.int64, torch.uint8),
            use_opinfo=False, edge=_int_sort_edges),
    OpEntry("argsort", edge=_sort_edges, max_samples=3),
    OpEntry("median", tolerance=F32, edge=_median_dim_edges, max_samples=4),
    OpEntry("median", fn=torch.median, dtypes=(torch.float64, torch.int64), use_opinfo=False,
            edge=lambda d: _median_dim_edges(d)[:1]),
    OpEntry("median.all", fn=torch.median, use_opinfo=False, edge=_median_all_edges),
    OpEntry("nanmedian", tolerance=F32, edge=_median_dim_edges, max_samples=4),
    OpEntry("nanmedian.all", fn=torch.nanmedian, use_opinfo=False, edge=_median_all_edges),
    OpEntry("kthvalue", tolerance=F32, edge=_kthvalue_edges, max_samples=4),
    OpEntry("kthvalue", fn=torch.kthvalue, dtypes=(torch.int64,), use_opinfo=False,
            edge=lambda d: _kthvalue_edges(d)[:1]),
    OpEntry("mode", tolerance=F32, edge=_mode_edges, max_samples=4),
    OpEntry("mode", fn=torch.mode, dtypes=(torch.float64, torch.int64), use_opinfo=False,
            edge=lambda d: _mode_edges(d)[:1]),
    OpEntry("searchsorted", edge=_searchsorted_edges, max_samples=4),
    OpEntry("searchsorted", fn=torch.searchsorted, dtypes=(torch.int64,), use_opinfo=False,
            edge=_int_searchsorted_edges),
    OpEntry("topk", edge=_topk_edges, max_samples=6),
    OpEntry("topk", fn=torch.topk, dtypes=(torch.float64, torch.int64), use_opinfo=False,
            edge=_topk_edges),
    OpEntry("bucketize", edge=_bucketize_edges, max_samples=4),
    OpEntry("bucketize.scalar", fn=torch.bucketize, use_opinfo=False,
            edge=lambda d: [((2.5, torch.tensor([0.0, 2.5, 2.5, 3.0], dtype=d)), {"right": r})
                            for r in (False, True)]),
    OpEntry("quantile", tolerance=F32, edge=_quantile_edges, max_samples=3),
    OpEntry("argmax", max_samples=6),
    OpEntry("argmin", max_samples=6),
    OpEntry("argmax.argmin", fn=_arg_all, use_opinfo=False, edge=_arg_edges,
            dtypes=(torch.float32, torch.float16, torch.int64, torch.uint8)),
    OpEntry("nanquantile", tolerance=F32, edge=_quantile_edges, max_samples=3),
]

make_tests(ENTRIES, globals())


def test_quantile_torchlib_is_wrong():
    """Why quantile overrides torchlib: PyTorch's quantile is NaN for a row holding NaN; with
    interpolation lower/higher/nearest torchlib can return a number (here 1.5419)."""
    x = torch.tensor([[-0.2159, -0.7425, nan, 0.2596, -0.1740, 1.5419, 0.5073],
                      [0.4455, 1.3253, -1.6293, -0.5497, -0.4798, -0.4997, -1.0670]])
    def fn(a):
        return torch.quantile(a, 0.37, dim=1, interpolation="lower")
    # ONNX Runtime 1.32 fixed this for torchlib's graph; the override stays for older runtimes
    if tuple(int(v) for v in ort.__version__.split(".")[:2]) < (1, 32):
        assert not check_call(fn, (x,), registry=None).ok
    res = check_call(fn, (x,))
    assert res.ok, res.error


def test_kthvalue_ties():
    """With ties PyTorch's index is whichever occurrence its quickselect lands on; ours is the
    stable-sort one. Values must match; the index must point at an equal element."""
    x = _ties(torch.float32, (6, 11), seed=7)
    res = check_call(torch.kthvalue, (x, 4, 1))
    assert res.comparisons and res.comparisons[0].ok, res.error  # values
    from onnxmedic.ops.testing import export_call, run_onnx
    model, tensors = export_call(torch.kthvalue, (x, 4, 1))
    vals, idx = run_onnx(model, tensors)
    picked = torch.gather(x, 1, torch.from_numpy(idx)[:, None])[:, 0]
    assert torch.equal(picked, torch.from_numpy(vals))
    assert torch.equal(torch.from_numpy(vals), torch.kthvalue(x, 4, 1).values)


def test_topk_ties():
    """Tied values: ONNX TopK returns the lower index first (the stable order); PyTorch's CPU
    topk (std::partial_sort when k * 64 <= n, else std::nth_element, neither stable) returns
    tied elements in whatever order its algorithm leaves them. Values match; each index points
    at an element equal to its value; the indices are the stable-sort ones, not PyTorch's."""
    from onnxmedic.ops.testing import export_call, run_onnx

    x = _ties(torch.float32, (6, 16), seed=9)
    x[0, [3, 9]] = nan  # NaN ties with NaN (NaN is the largest)
    for largest in (True, False):
        model, tensors = export_call(torch.topk, (x, 5), {"largest": largest})
        vals, idx = (torch.from_numpy(a) for a in run_onnx(model, tensors))
        expected = torch.topk(x, 5, largest=largest)
        assert torch.equal(vals.nan_to_num(9.0), expected.values.nan_to_num(9.0))
        assert torch.equal(torch.gather(x, 1, idx).nan_to_num(9.0), vals.nan_to_num(9.0))
        stable = torch.sort(x, dim=1, descending=largest, stable=True).indices[:, :5]
        assert torch.equal(idx, stable)
        assert not torch.equal(idx, expected.indices)  # why topk's ties are not exact


def test_mode_long_rows():
    """Rows longer than 16: values match; PyTorch's index is its unstable sort's pick, ours the
    last occurrence - both point at the mode value."""
    x = _ties(torch.float32, (5, 40), seed=8)
    from onnxmedic.ops.testing import export_call, run_onnx
    model, tensors = export_call(torch.mode, (x, 1))
    vals, idx = run_onnx(model, tensors)
    assert torch.equal(torch.from_numpy(vals), torch.mode(x, 1).values)
    last = [int((x[r] == x[r, int(idx[r])]).nonzero()[-1]) for r in range(5)]
    assert list(idx) == last
    assert torch.equal(torch.gather(x, 1, torch.from_numpy(idx)[:, None])[:, 0],
                       torch.from_numpy(vals))


def test_mode_nan():
    """Two NaN and two +inf: NaN is not equal to +inf, so +inf wins (the PyTorch result)."""
    x = torch.tensor([[nan, nan, 1.0, 2.0, 3.0, -inf, inf, inf]])
    res = check_call(torch.mode, (x, 1))
    assert res.ok, res.error


class _LinearThen(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 12)
        self.fn = fn

    def forward(self, x):
        return self.fn(torch.round(self.lin(x) * 2))  # rounding makes ties


def _module_check(fn):
    m = _LinearThen(fn).eval()
    x = torch.randn(3, 8)
    res = check_call(m, (x,), tolerance=(1e-5, 1e-6))
    assert res.ok, res.error
    assert res.comparisons


def test_module_sort_median_mode_searchsorted():
    def f(y):
        s = torch.sort(y, dim=-1, stable=True, descending=True)
        med = torch.median(y, dim=1)
        nmed = torch.nanmedian(y, dim=0)
        mo = torch.mode(y, 1)
        kth = torch.kthvalue(y + torch.arange(12.0) * 1e-3, 5, 1)  # distinct values
        pos = torch.searchsorted(torch.sort(y[0]).values, y, right=True)
        return (s.values, s.indices, torch.argsort(y, dim=0, stable=True), med.values,
                med.indices, nmed.values, nmed.indices, torch.median(y), torch.nanmedian(y),
                mo.values, mo.indices, kth.values, kth.indices, pos,
                torch.quantile(y, 0.3, dim=1), torch.nanquantile(y, torch.tensor([0.2, 0.8]), 0))

    _module_check(f)
