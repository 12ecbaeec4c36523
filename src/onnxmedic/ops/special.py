"""Special functions torchlib does not translate: erfinv, ...

Each translation is a traced ONNX Script function using standard ONNX ops only.
"""

from __future__ import annotations

import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import const
from onnxmedic.ops._registry import translation

aten = torch.ops.aten

# M. Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011): single-precision
# polynomials, relative error below 4e-7 on (-1, 1).
_GILES_CENTRAL = (
    2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
    -0.00125372503, -0.00417768164, 0.246640727, 1.50140941,
)
_GILES_TAIL = (
    -0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
    -0.0076224613, 0.00943887047, 1.00167406, 2.83297682,
)


def _horner(coeffs: tuple[float, ...], w, like):
    p = const(coeffs[0], like)
    for c in coeffs[1:]:
        p = op.Add(op.Mul(p, w), const(c, like))
    return p


def _erfinv(x):
    one = const(1.0, x)
    w = op.Neg(op.Log(op.Mul(op.Sub(one, x), op.Add(one, x))))
    central = op.Less(w, const(5.0, x))
    # Clamp each branch's argument to its own range so the unused branch stays finite.
    w_c = op.Sub(op.Min(w, const(5.0, x)), const(2.5, x))
    w_t = op.Sub(op.Sqrt(op.Max(w, const(5.0, x))), const(3.0, x))
    p = op.Where(central, _horner(_GILES_CENTRAL, w_c, x), _horner(_GILES_TAIL, w_t, x))
    y = op.Mul(p, x)
    ax = op.Abs(x)
    inf = op.Mul(x, const(float("inf"), x))  # +-inf at x = +-1
    y = op.Where(op.Equal(ax, one), inf, y)
    nan = const(float("nan"), x)
    return op.Where(op.Greater(ax, one), nan, y)


@translation(aten.erfinv.default)
def aten_erfinv(self):
    """erfinv(Tensor self) -> Tensor"""
    return _erfinv(self)


@translation(aten.special_erfinv.default)
def aten_special_erfinv(self):
    """special_erfinv(Tensor self) -> Tensor"""
    return _erfinv(self)
