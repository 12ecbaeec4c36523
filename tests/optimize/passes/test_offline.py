"""ONNX Runtime's offline optimizer pass (optimize/passes/offline.py): the extended level's
contrib ops."""

from __future__ import annotations

from pathlib import Path

import torch

from onnxmedic.optimize.passes import offline
from tests.optimize.fixture_models import NormAttention


def _export(model: torch.nn.Module, args: tuple, path: Path) -> Path:
    torch.onnx.export(model, args, str(path), dynamo=True, verbose=False)
    return path


def test_ort_offline_extended_emits_contrib_ops(tmp_path: Path) -> None:
    src = _export(NormAttention(), (torch.randn(1, 16, 32),), tmp_path / "m.onnx")
    info = offline.ort_offline(str(src), str(tmp_path / "e.onnx"), level="extended")
    assert info["nodes_after"] < info["nodes_before"]
    assert "FusedMatMul" in info["new_ops"]  # com.microsoft: not portable
