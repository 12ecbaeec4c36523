"""Small models for the end-to-end tests (also used by CLI tests as tests/models.py:Name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvLog1p(nn.Module):
    """Seed write-up example 1: conv, log1p, relu."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(torch.log1p(F.relu(self.conv(x))))


class PoolView(nn.Module):
    """Seed write-up example 2: adaptive_avg_pool2d then view(batch, -1) then Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(x, (1, 1))
        x = x.view(x.size(0), -1)
        return self.fc(x)


class BilinearAlignCorners(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True)


class CustomNorm(nn.Module):
    """A hand-written normalisation via torch.norm."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((8,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = torch.norm(x, p=2, dim=-1, keepdim=True)
        return self.scale * x / (n + 1e-6)


class TwoLinear(nn.Module):
    """Seed write-up example 3: a Linear stack; fed int32 or float16 it fails in PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(10, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Erfinv(nn.Module):
    """Uses an op torch.onnx cannot translate but onnxmedic can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfinv(torch.tanh(x)) * 2.0


class DataDependentIf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this model is broken on purpose")


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0


class KwargsModel(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            x = x * mask
        return x.sum(-1)


class MultiOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"mean": x.mean(-1), "max": x.amax(-1), "idx": x.argmax(-1)}


class NamedScript(nn.Module):
    """A submodule with a name that would run as script if a report forgot to escape it."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("<script>alert(1)</script>", nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfinv(torch.tanh(getattr(self, "<script>alert(1)</script>")(x)))


def make_model() -> nn.Module:
    return TwoLinear()


def make_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 10),)


def make_kwargs_inputs():
    return (torch.randn(2, 3),), {"mask": torch.ones(2, 3)}


not_a_model = 42


class Bf16Linear(nn.Module):
    """A bfloat16 Linear: torch.onnx exports a bf16 Gemm that ONNX Runtime's CPU cannot load."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)
