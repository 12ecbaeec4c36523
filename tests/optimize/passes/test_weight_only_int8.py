"""The weight-only int8 pass (optimize/passes/weight_only_int8.py): every weight MatMul becomes
MatMulNBits, a Gemm is split first, an excluded layer stays float32."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import torch

from onnxmedic.optimize.passes import weight_only_int8
from tests.optimize.fixture_models import sink_model


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_weight_only_turns_every_weight_matmul_into_matmulnbits(tmp_path: Path) -> None:
    _, _, src = sink_model(tmp_path)
    before = _ops(src)
    info = weight_only_int8.quantize_weight_only(str(src), str(tmp_path / "q.onnx"))
    after = _ops(tmp_path / "q.onnx")
    assert before["MatMul"] + before["Gemm"] == 2
    assert after["MatMulNBits"] == 2 and after["MatMul"] == 0 and after["Gemm"] == 0
    assert info["new_ops"] == {"MatMulNBits": 2}
    attrs = {a.name: onnx.helper.get_attribute_value(a)
             for n in onnx.load(str(tmp_path / "q.onnx")).graph.node
             if n.op_type == "MatMulNBits" for a in n.attribute}
    assert attrs["bits"] == 8 and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4


def test_weight_only_splits_gemm_and_honours_exclusions(tmp_path: Path) -> None:
    """2-D Linear layers export as Gemm: the quantizer's own replace_gemm_with_matmul splits
    them; an excluded layer (named as the graph names it) stays float32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).eval()
    src = tmp_path / "g.onnx"
    torch.onnx.export(model, (torch.randn(4, 64),), str(src), dynamo=True, verbose=False)
    gemms = [n.name for n in onnx.load(str(src)).graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 2
    weight_only_int8.quantize_weight_only(str(src), str(tmp_path / "q.onnx"), nodes_to_exclude=gemms[:1])
    after = _ops(tmp_path / "q.onnx")
    assert after["MatMulNBits"] == 1 and after["MatMul"] == 1 and after["Gemm"] == 0
