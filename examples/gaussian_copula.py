"""A Gaussian-copula output head: plain torch.onnx.export(dynamo=True) cannot export it.

The head maps features to probabilities in (0, 1) and then to standard-normal quantiles with
``torch.special.erfinv`` — an ATen op torch.onnx (torch 2.13) has no translation for. onnxmedic
translates it (ONNX Script, standard ONNX ops) and verifies the result in ONNX Runtime.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class GaussianCopulaHead(nn.Module):
    def __init__(self, features: int = 16, outputs: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(features, outputs)
        self.norm = nn.LayerNorm(outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.sigmoid(self.norm(self.proj(x)))  # probabilities in (0, 1)
        z = math.sqrt(2.0) * torch.special.erfinv(2.0 * u - 1.0)  # normal quantiles
        return z


def make_inputs() -> tuple[torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(4, 16),)
