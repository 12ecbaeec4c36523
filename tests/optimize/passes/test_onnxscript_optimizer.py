"""The onnxscript optimizer pass (optimize/passes/onnxscript_optimizer.py): constants folded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from onnxmedic.optimize.passes import onnxscript_optimizer


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_onnxscript_optimizer_folds_constants(tmp_path: Path) -> None:
    c = helper.make_tensor("c", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    nodes = [helper.make_node("Add", ["c", "c"], ["c2"]),
             helper.make_node("Mul", ["c2", "c"], ["c3"]),
             helper.make_node("Add", ["x", "c3"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [c])
    src = tmp_path / "c.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), src)
    info = onnxscript_optimizer.onnxscript_optimize(str(src), str(tmp_path / "o.onnx"))
    assert info["nodes_before"] == 3 and info["nodes_after"] == 1
    assert _ops(tmp_path / "o.onnx") == Counter({"Add": 1})
