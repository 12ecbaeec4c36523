"""Hand-built ONNX models that misbehave in ONNX Runtime, for the sandbox tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def identity_model(path: Path, shape: tuple[int, ...] = (2, 3)) -> Path:
    """y = x + 0, matching tests/models.py:Identity."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    zero = numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")
    g = helper.make_graph([helper.make_node("Add", ["x", "zero"], ["y"])], "id", [x], [y], [zero])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def scaled_model(path: Path, scale: float, shape: tuple[int, ...] = (2, 3)) -> Path:
    """y = x * scale: with scale != 1 it disagrees with tests/models.py:Identity."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    s = numpy_helper.from_array(np.array(scale, dtype=np.float32), "s")
    g = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["y"])], "sc", [x], [y], [s])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def endless_loop_model(path: Path, shape: tuple[int, ...] = (2, 3)) -> Path:
    """A Loop with trip count 2**62 whose body adds 0: ONNX Runtime spins for ever."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "zero_b"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero_b")],
    )
    inits = [numpy_helper.from_array(np.array(2**62, dtype=np.int64), "trip"),
             numpy_helper.from_array(np.array(True), "cond")]
    loop = helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body)
    g = helper.make_graph([loop], "hang", [x], [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def huge_expand_model(path: Path) -> Path:
    """Expands a scalar to 2**16 x 2**16 x 64 floats (64 GiB): exhausts any memory cap."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = numpy_helper.from_array(np.array([2**16, 2**16, 64], dtype=np.int64), "shape")
    g = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
         helper.make_node("Expand", ["s", "shape"], ["y"])],
        "oom", [x], [y], [shape])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def baked_reshape_model(path: Path) -> Path:
    """Input x[batch, 3] declared dynamic, but a Reshape to the constant [2, 3] bakes batch=2 in
    (what a traced x.view(2, -1) leaves behind). Matches tests/models.py:Identity at batch 2."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    shape = numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "shape")
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="node_view")
    node.metadata_props.add(key="pkg.torch.onnx.stack_trace",
                            value=f'File "{Path(__file__).parent / "models.py"}", line 1, in forward')
    g = helper.make_graph([node], "baked", [x], [y], [shape])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def first_two_rows_model(path: Path) -> Path:
    """y = x[:2] with x[batch, 3] dynamic: right at batch 2, wrong shape elsewhere."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    inits = [numpy_helper.from_array(np.array([0], dtype=np.int64), "starts"),
             numpy_helper.from_array(np.array([2], dtype=np.int64), "ends")]
    g = helper.make_graph([helper.make_node("Slice", ["x", "starts", "ends"], ["y"])], "slice",
                          [x], [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def external_data_model(path: Path, location: str) -> Path:
    """y = x + w, with w's data declared external at ``location`` (no data file written)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    w = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, 3])
    w.data_location = onnx.TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)
    return path
