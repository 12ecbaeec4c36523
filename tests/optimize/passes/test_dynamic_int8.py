"""The dynamic int8 pass (optimize/passes/dynamic_int8.py): the quantizable layers listed as
``nodes_to_exclude`` names them, an excluded Gemm left float32 (the quantizer splits it into
``<name>_MatMul`` first), the rest MatMulInteger with run-time activation ranges."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from onnxmedic.optimize.passes import dynamic_int8
from tests.optimize.fixture_models import mlp_model


def test_dynamic_int8_quantizes_every_layer_but_the_excluded_one(tmp_path: Path) -> None:
    import onnxruntime as ort

    model, x, src = mlp_model(tmp_path, 64, 8, rows=4)
    dst = tmp_path / "q.onnx"
    gemms = [n.name for n in onnx.load(str(src)).graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 2
    info = dynamic_int8.quantize_int8(str(src), str(dst), nodes_to_exclude=gemms[:1])
    assert info["layers"] == gemms and info["excluded"] == gemms[:1]
    assert info["reduce_range"] is True  # the portable default (isa.py)
    ops = Counter(n.op_type for n in onnx.load(str(dst)).graph.node)
    assert ops["MatMulInteger"] == 1 and ops["DynamicQuantizeLinear"] == 1
    assert ops["MatMul"] == 1 and ops["Gemm"] == 0  # the excluded layer, float32
    got = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(
        None, {onnx.load(str(src)).graph.input[0].name: x.numpy()})[0]
    want = model(x).detach().numpy()
    cosine = float((got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.999
