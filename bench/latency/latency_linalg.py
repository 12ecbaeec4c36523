"""Latency of onnxmedic's linear-algebra translations in ONNX Runtime vs PyTorch eager (CPU).

Run: PYTHONPATH=src python bench/latency/latency_linalg.py [--threads 1] [--repeat 50] [--only REGEX]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _oplatency import main  # noqa: E402


def _spd(b: int, n: int) -> torch.Tensor:
    a = torch.randn(b, n, n)
    return a @ a.mT + n * torch.eye(n)


def cases():
    torch.manual_seed(0)
    out = []
    for n in (4, 16, 32, 64):
        a = torch.randn(8, n, n)
        b = torch.randn(8, n, 4)
        out.append((f"inv 8x{n}x{n}", torch.linalg.inv, (a,)))
        out.append((f"solve 8x{n}x{n}, 4 rhs", torch.linalg.solve, (a, b)))
    a16 = torch.randn(8, 16, 16)
    s16 = _spd(8, 16)
    out += [
        ("slogdet 8x16x16", torch.linalg.slogdet, (a16,)),
        ("cholesky 8x16x16", torch.linalg.cholesky, (s16,)),
        ("cholesky_solve 8x16x16", torch.cholesky_solve,
         (torch.randn(8, 16, 4), torch.linalg.cholesky(s16))),
        ("solve_triangular 8x16x16", lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
         (torch.triu(a16) + 4 * torch.eye(16), torch.randn(8, 16, 4))),
        ("lu_factor 8x16x16", torch.linalg.lu_factor, (a16,)),
        ("qr 8x16x16", torch.linalg.qr, (a16,)),
        ("eigh 8x8x8", torch.linalg.eigh, (_spd(8, 8),)),
        ("eigvalsh 8x16x16", torch.linalg.eigvalsh, (s16,)),
        ("svdvals 8x8x8", torch.linalg.svdvals, (torch.randn(8, 8, 8),)),
        ("svd 8x16x8", lambda a: torch.linalg.svd(a, full_matrices=False), (torch.randn(8, 16, 8),)),
        ("pinv 8x8x6", torch.linalg.pinv, (torch.randn(8, 8, 6),)),
        ("matrix_exp 8x16x16", torch.linalg.matrix_exp, (a16,)),
    ]
    return out


if __name__ == "__main__":
    main(cases(), "onnxmedic linalg: ONNX Runtime vs eager")
