"""onnxfile: the weights-free skeleton the checker and shape inference run on."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmedic import checks
from onnxmedic.onnxfile import skeleton


def _model(shape_const: bool = True) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")  # 16 KiB: left out
    shape = numpy_helper.from_array(np.array([2, -1], np.int64), "shape")  # kept
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("Reshape", ["y", "shape"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["a", "b"])], [w, shape])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_skeleton_drops_big_weights_keeps_shape_constants_and_inference():
    m = _model()
    sk = skeleton(m)
    assert [t.name for t in sk.graph.initializer] == ["shape"]
    assert [v.name for v in sk.graph.input] == ["x", "w"]
    assert sk.ByteSize() < 1024 < m.ByteSize()
    full = onnx.shape_inference.infer_shapes(m, data_prop=True).graph.output[0]
    light = onnx.shape_inference.infer_shapes(sk, data_prop=True).graph.output[0]
    assert full.type == light.type  # data propagation still read the shape constant
    assert [d.dim_value for d in light.type.tensor_type.shape.dim] == [2, 128]
    assert len(m.graph.initializer) == 2  # the model itself is untouched


def test_check_model_still_catches_a_broken_graph():
    assert checks.check_model(_model()) == []
    bad = _model()
    bad.graph.node[0].input[1] = "missing"  # an input nothing produces
    assert [f.code for f in checks.check_model(bad)] == ["OM501"]
    wrong = _model()
    wrong.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64  # declared wrongly
    assert [f.code for f in checks.check_model(wrong)] == ["OM502"]
