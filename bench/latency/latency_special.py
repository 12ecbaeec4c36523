"""Latency of onnxmedic's special-function translations: ONNX Runtime vs PyTorch eager (CPU).

Run: PYTHONPATH=src python bench/latency/latency_special.py [--threads N] [--repeat N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _oplatency import main  # noqa: E402

sp = torch.special
torch.manual_seed(0)
X = torch.randn(64, 1024) * 5  # real line
P = torch.rand(64, 1024) * 20 + 0.01  # positive
U = torch.rand(64, 1024) * 0.998 + 0.001  # (0, 1)

CASES = [
    ("erfinv", torch.erfinv, (U * 2 - 1,)),
    ("lgamma", torch.lgamma, (X,)),
    ("digamma", torch.digamma, (X,)),
    ("polygamma n=1", lambda x: torch.polygamma(1, x), (X,)),
    ("polygamma n=3", lambda x: torch.polygamma(3, x), (P,)),
    ("mvlgamma p=3", lambda x: torch.mvlgamma(x, 3), (P + 1.0,)),
    ("zeta", sp.zeta, (P + 1.0, P)),
    ("i0", torch.i0, (X,)),
    ("i1e", sp.i1e, (X,)),
    ("bessel_j0", sp.bessel_j0, (X,)),
    ("bessel_y1", sp.bessel_y1, (P,)),
    ("modified_bessel_k0", sp.modified_bessel_k0, (P,)),
    ("erfcx", sp.erfcx, (X,)),
    ("ndtr", sp.ndtr, (X,)),
    ("ndtri", sp.ndtri, (U,)),
    ("log_ndtr", sp.log_ndtr, (X,)),
    ("xlogy", torch.xlogy, (X, P)),
    ("xlog1py", sp.xlog1py, (X, P)),
]

if __name__ == "__main__":
    main(CASES, "special functions, 64x1024 float32")
