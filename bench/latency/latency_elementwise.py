"""Latency of onnxmedic's elementwise translations in ONNX Runtime vs PyTorch eager.

Run: PYTHONPATH=src python bench/latency/latency_elementwise.py [--threads N] [--repeat N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _oplatency import main  # noqa: E402

N = 1 << 16  # 64k elements per input
g = torch.Generator().manual_seed(0)
a = torch.randn(256, 256, generator=g) * 10
b = torch.randn(256, 256, generator=g) * 10
ia = torch.randint(-10 ** 6, 10 ** 6, (256, 256), generator=g, dtype=torch.int32)
ib = torch.randint(-10 ** 6, 10 ** 6, (256, 256), generator=g, dtype=torch.int32)
counts = torch.randint(-2, 40, (256, 256), generator=g, dtype=torch.int32)
ia16 = ia.to(torch.int16)
c16 = counts.to(torch.int16)

CASES = [
    ("hypot f32 256x256", torch.hypot, (a, b)),
    ("hypot f64 256x256", torch.hypot, (a.double(), b.double())),
    ("copysign f32", torch.copysign, (a, b)),
    ("signbit f32", torch.signbit, (a,)),
    ("nextafter f32", torch.nextafter, (a, b)),
    ("nextafter f64", torch.nextafter, (a.double(), b.double())),
    ("frexp f32", torch.frexp, (a,)),
    ("gcd int32 (|x|<1e6)", torch.gcd, (ia, ib)),
    ("lcm int32", torch.lcm, (ia % 1000, ib % 1000)),
    ("gcd int64", torch.gcd, (ia.long(), ib.long())),
    ("logaddexp f32", torch.logaddexp, (a, b)),
    ("logaddexp2 f32", torch.logaddexp2, (a, b)),
    ("heaviside f32", torch.heaviside, (a, b)),
    ("fmod f32", torch.fmod, (a, b)),
    ("fmod int64", torch.fmod, (ia.long(), ib.long())),
    ("remainder f32", torch.remainder, (a, b)),
    ("left shift int32", torch.bitwise_left_shift, (ia, counts)),
    ("right shift int32", torch.bitwise_right_shift, (ia, counts)),
    ("right shift int16", torch.bitwise_right_shift, (ia16, c16)),
]

if __name__ == "__main__":
    main(CASES, "onnxmedic elementwise translations")
