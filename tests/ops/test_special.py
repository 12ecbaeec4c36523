"""Special functions: OpInfo samples plus edge values, against PyTorch."""

from __future__ import annotations

import math

import torch

from tests.ops._table import OpEntry, make_tests


def _erfinv_edges(dtype: torch.dtype):
    x = torch.tensor(
        [-1.0, 1.0, 0.0, -0.0, 0.5, -0.5, 0.999999, -0.999999, 1e-30, -1e-30, 1.5, -2.0,
         math.inf, -math.inf, math.nan],
        dtype=dtype,
    )
    dense = torch.linspace(-0.999, 0.999, 4001, dtype=dtype)
    return [((x,), {}), ((dense,), {}), ((torch.tensor(0.25, dtype=dtype),), {}),
            ((torch.empty(0, 3, dtype=dtype),), {})]


ENTRIES = [
    OpEntry("erfinv", edge=_erfinv_edges, tolerance={"float32": (1e-5, 1e-6)}),
]

make_tests(ENTRIES, globals())
