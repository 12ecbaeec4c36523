"""Latency of the selection / sorting / cumulative translations: ONNX Runtime vs PyTorch eager.

Run: PYTHONPATH=src python bench/latency/latency_selection.py [--repeat N] [--threads T]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _oplatency import main

torch.manual_seed(0)
X = torch.randn(64, 256)
TIES = torch.randint(0, 16, (64, 256)).float()
SEQ = torch.sort(torch.randn(1024)).values
VALS = torch.randn(64, 256)

CASES = [
    ("sort stable 64x256", lambda a: torch.sort(a, dim=1, stable=True), (TIES,)),
    ("argsort stable desc 64x256", lambda a: torch.argsort(a, dim=1, stable=True,
                                                           descending=True), (TIES,)),
    ("median dim 64x256", lambda a: torch.median(a, 1), (X,)),
    ("nanmedian all 64x256", lambda a: torch.nanmedian(a), (X,)),
    ("kthvalue k=10 64x256", lambda a: torch.kthvalue(a, 10, 1), (X,)),
    ("mode 64x256 (O(n^2))", lambda a: torch.mode(a, 1), (TIES,)),
    ("searchsorted 1024 x 64x256", lambda s, v: torch.searchsorted(s, v), (SEQ, VALS)),
    ("quantile 3 qs linear 64x256", lambda a: torch.quantile(a, torch.tensor([0.1, 0.5, 0.9]), 1),
     (X,)),
    ("cumprod 64x256", lambda a: torch.cumprod(a, 1), (X,)),
    ("cummax 64x256", lambda a: torch.cummax(a, 1), (X,)),
    ("cummin 64x256", lambda a: torch.cummin(a, 1), (X,)),
    ("logcumsumexp 64x256", lambda a: torch.logcumsumexp(a, 1), (X,)),
]

if __name__ == "__main__":
    main(CASES, "selection, sorting and cumulative ops")
