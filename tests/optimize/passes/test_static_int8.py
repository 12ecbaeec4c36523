"""The static int8 pass (optimize/passes/static_int8.py): an excluded layer takes the layer it
reads through a Relu with it, and a quantizer that refuses every op type is asked for the layers
only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onnxmedic.optimize import files
from onnxmedic.optimize.passes import static_int8


def test_excluding_a_layer_excludes_the_layer_it_reads_through_a_relu() -> None:
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
         helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
         helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
         helper.make_node("Conv", ["x", "w3"], ["c3"], name="conv3")], "g", [], [])
    assert static_int8.with_producers(graph, ["conv2"]) == ["conv2", "conv1"]
    assert static_int8.with_producers(graph, ["conv3"]) == ["conv3"]  # reads the graph input
    assert static_int8.with_producers(graph, ["conv1", "conv2"]) == ["conv1", "conv2"]


def test_static_int8_quantizes_layers_only_where_the_quantizer_refuses_every_op(
        outlier: tuple[torch.nn.Module, torch.Tensor, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's quantizer refuses some graphs when it quantizes every op type (diffusers'
    VAE encoder: "Quantization parameter shared mode is not supported for weight yet"); the
    step then quantizes the layers (Conv, MatMul, Gemm) only and says so."""
    import onnxruntime.quantization as q


    _, x, src = outlier
    real, asked = q.quantize_static, []

    def refuses_every_op(*args: object, op_types_to_quantize: list[str] | None = None,
                         **kwargs: object) -> None:
        asked.append(op_types_to_quantize)
        if op_types_to_quantize is None:
            raise ValueError("Quantization parameter shared mode is not supported for weight yet")
        real(*args, op_types_to_quantize=op_types_to_quantize, **kwargs)

    monkeypatch.setattr(q, "quantize_static", refuses_every_op)
    cal = files.save_feeds([{"x": x.numpy()}], tmp_path / "c.npz")
    info = static_int8.quantize_static_int8(str(src), str(tmp_path / "q.onnx"), str(cal))
    assert asked == [None, ["Conv", "MatMul", "Gemm"]]
    assert info["op_types"].startswith("Conv, MatMul, Gemm only")
    assert "shared mode" in info["op_types"]
    assert info["new_ops"]["QuantizeLinear"] >= 3  # every Conv reads a quantized input
