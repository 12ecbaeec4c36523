"""ONNX files the optimize tests share, exported once a session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.optimize.fixture_models import BAG_ARGS, Bags, OutlierChannel


@pytest.fixture(scope="session")
def bags_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bags (a Loop carrying a sequence, an If returning an initializer) as an ONNX file."""
    path = tmp_path_factory.mktemp("bags") / "bags.onnx"
    torch.onnx.export(Bags().eval(), BAG_ARGS, str(path), dynamo=True, verbose=False)
    return path


@pytest.fixture(scope="session")
def outlier(tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[torch.nn.Module, torch.Tensor, Path]:
    """OutlierChannel, its example input and its ONNX file."""
    torch.manual_seed(0)
    model = OutlierChannel().eval()
    x = torch.randn(1, 3, 32, 32)
    path = tmp_path_factory.mktemp("static") / "m.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
    return model, x, path
