"""Logical reductions: aten._is_all_true, aten._is_any_true (no OpInfo: edge tables only)."""

from __future__ import annotations

import torch

import onnxmedic
from onnxmedic.ops.testing import check_call
from tests.ops._table import OpEntry, make_tests


def _bools(dtype):
    g = torch.Generator().manual_seed(0)
    mixed = torch.rand(3, 5, generator=g) > 0.3
    return [((mixed,), {}), ((torch.ones(2, 3, dtype=torch.bool),), {}),
            ((torch.zeros(4, dtype=torch.bool),), {}), ((torch.tensor(True),), {}),
            ((torch.tensor(False),), {}), ((torch.empty(0, 3, dtype=torch.bool),), {}),
            ((torch.ones(2, 2, 2, dtype=torch.bool).index_fill(2, torch.tensor([1]), False),),
             {})]


ENTRIES = [
    OpEntry("_is_all_true", fn=torch.ops.aten._is_all_true, dtypes=(torch.bool,),
            use_opinfo=False, edge=_bools),
    OpEntry("_is_any_true", fn=torch.ops.aten._is_any_true, dtypes=(torch.bool,),
            use_opinfo=False, edge=_bools),
]
make_tests(ENTRIES, globals())


class _AllPositive(torch.nn.Module):
    """pyro-style validation feeding a value: all(x > 0) gates the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ok = torch.ops.aten._is_all_true(x > 0)
        return torch.where(ok, x.log(), x)


def test_module_is_all_true_end_to_end():
    res = check_call(_AllPositive().eval(), (torch.rand(3, 4) + 0.1,), tolerance=(1e-6, 1e-7))
    assert res.ok, res.error


def test_export_is_all_true_verifies():
    result = onnxmedic.export(_AllPositive().eval(), (torch.rand(3, 4) + 0.1,))
    assert result.ok, [(f.code, f.message) for f in result.findings]
