"""Cumulative ops: cumprod, cummax, cummin, logcumsumexp (OpInfo samples plus edge values).

Edge values are batched into few tensors: every sample costs one export (~1-2 s).
"""

from __future__ import annotations

import math

import torch

from onnxmedic.ops.testing import check_call
from tests.ops._table import OpEntry, make_tests

nan, inf = math.nan, math.inf
# rtol 1e-5: the log-step scan multiplies in a different order than PyTorch's loop (a few ulp)
F32 = {"float32": (1e-5, 1e-6), "float64": (1e-12, 1e-14)}


def _mix(dtype, seed=0):
    """(5, 37): zeros, negatives, +-inf, NaN, -0, ties; 37 is not a power of two."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(5, 37, generator=g) * 2 + 0.5).to(dtype)
    x[0, ::5] *= -1
    x[1, 7] = 0.0
    x[1, 20] = inf
    x[2, 3] = nan
    x[2, 30] = -inf
    x[3] = torch.randint(-2, 3, (37,), generator=g).to(dtype)
    x[4, 10] = -0.0
    return x


def _prod_edges(dtype):
    x = _mix(dtype)
    return [((x, 1), {}), ((x.T.contiguous(), 0), {}), ((torch.tensor(-2.5, dtype=dtype), 0), {}),
            ((torch.empty(0, 4, dtype=dtype), 0), {}), ((x[:2, :9], -1), {"dtype": torch.float64})]


def _ext_edges(dtype):
    x = _mix(dtype)
    return [((x, 1), {}), ((x.reshape(37, 5), 0), {}), ((torch.tensor(1.5, dtype=dtype), 0), {}),
            ((torch.empty(3, 0, dtype=dtype), 1), {})]


def _int_ext_edges(dtype):
    g = torch.Generator().manual_seed(5)
    return [((torch.randint(-3, 4, (3, 2, 17), generator=g).to(dtype), 2), {})]


def _lcse_edges(dtype):
    x = _mix(dtype)
    big = torch.tensor([[0.0, 1000.0, -1000.0, inf, -inf, 1e-30, 88.0, 89.0],
                        [nan, 1.0, 2.0, 3.0, -inf, -inf, inf, 5.0],
                        [-inf] * 8, [-30.0, 0.0, -40.0, -50.0, 1e4, 1e4, -1e4, 3.0]], dtype=dtype)
    return [((x, 1), {}), ((big, 1), {}), ((big, 0), {}), ((torch.tensor(2.0, dtype=dtype), 0), {})]


ENTRIES = [
    OpEntry("cumprod", dtypes=(torch.float32, torch.float64), tolerance=F32, edge=_prod_edges,
            max_samples=3),
    OpEntry("cumprod", fn=torch.cumprod, dtypes=(torch.int64, torch.int32), use_opinfo=False,
            edge=_int_ext_edges),
    OpEntry("cummax", dtypes=(torch.float32, torch.float64), edge=_ext_edges, max_samples=3),
    OpEntry("cummax", fn=torch.cummax, dtypes=(torch.int64, torch.uint8), use_opinfo=False,
            edge=_int_ext_edges),
    OpEntry("cummin", dtypes=(torch.float32,), edge=_ext_edges, max_samples=3),
    OpEntry("cummin", fn=torch.cummin, dtypes=(torch.int32,), use_opinfo=False,
            edge=_int_ext_edges),
    OpEntry("logcumsumexp", dtypes=(torch.float32, torch.float64), tolerance=F32,
            edge=_lcse_edges, max_samples=3),
]

make_tests(ENTRIES, globals())


def test_logcumsumexp_torchlib_is_wrong():
    """Why this translation overrides torchlib's: torchlib gives inf/NaN where PyTorch is finite."""
    x = torch.tensor([[0.0, 1000.0, -1000.0, 3.0], [-inf, -inf, 1.0, 2.0]])
    def fn(a):
        return torch.logcumsumexp(a, 1)
    assert not check_call(fn, (x,), registry=None).ok
    res = check_call(fn, (x,), tolerance=(1e-5, 1e-6))
    assert res.ok, res.error


def test_scan_dim_must_be_static():
    """A dynamic scanned dim reaches the user as a clear ValueError."""
    from onnxmedic.ops.testing import wrap_call

    m, t = wrap_call(lambda a: torch.cummax(a, 1), (torch.randn(2, 5),))
    ep = torch.export.export(m, t, dynamic_shapes=(({1: torch.export.Dim("n", min=2)},),),
                             strict=False)
    from onnxmedic.ops import REGISTRY

    try:
        torch.onnx.export(ep, t, dynamo=True, custom_translation_table=REGISTRY.table())
    except Exception as e:  # noqa: BLE001 - torch.onnx wraps it in its own error types
        msg = str(e) + "".join(str(c) for c in (e.__cause__, getattr(e.__cause__, "__cause__", None)))
        assert "must be static at export time" in msg
    else:
        raise AssertionError("export with a dynamic scanned dim should fail")


class _LinearThen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x):
        y = torch.round(self.lin(x) * 2) / 2  # zeros, negatives and ties
        cmax, imax = torch.cummax(y, 1)
        cmin, imin = torch.cummin(y, 0)
        return torch.cumprod(y, 1), cmax, imax, cmin, imin, torch.logcumsumexp(y * 50, 1)


def test_module_cumulative():
    res = check_call(_LinearThen().eval(), (torch.randn(4, 8),), tolerance=(1e-5, 1e-6))
    assert res.ok, res.error
    assert len(res.comparisons) == 6
