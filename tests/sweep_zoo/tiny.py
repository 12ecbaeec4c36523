"""A tiny zoo for the sweep tests: two models that verify, one whose worker aborts, one that
hangs, one whose factory raises."""

from __future__ import annotations

import os
import time

import torch

from onnxmedic.sweep import ZooCase


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def mlp() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(Mlp(), (torch.randn(2, 4),), dynamic_shapes=({0: "batch"},), note="tiny")


def scale() -> tuple:
    return Scale(), (torch.randn(3, 5),)


def aborts() -> ZooCase:
    os.abort()  # the worker dies of SIGABRT


def hangs() -> ZooCase:
    time.sleep(3600)
    raise AssertionError("unreachable")


def broken() -> ZooCase:
    raise ValueError("this config is wrong")


ZOO = {"mlp": mlp, "scale": scale, "aborts": aborts, "hangs": hangs, "broken": broken}
GOOD = {"mlp": mlp, "scale": scale}


class SignBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # specialised by capture; the zero input takes the other branch
            return x * 2
        return x - 1


def wrong() -> ZooCase:
    return ZooCase(SignBranch(), (torch.ones(3),), note="exports, does not verify")


def _failing_check(onnx_path: str, case: ZooCase) -> dict:
    return {"ok": False, "message": "decoded tokens differ", "steps": 4}


def check_fails() -> ZooCase:
    return ZooCase(Scale(), (torch.randn(3, 5),), check=_failing_check)


# entries that run to the end but fail: not verified (OM700), own check fails (OM710)
FAILING = {"wrong": wrong, "check_fails": check_fails}
