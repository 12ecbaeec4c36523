"""onnxfile: the weights-free skeleton the checker and shape inference run on."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxmedic.onnxfile import skeleton
from onnxmedic.stages import check as checks


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


def _normalised(proto: onnx.ModelProto) -> tuple[bytes, dict[str, bytes], dict[str, bytes]]:
    """The model without its initializers and value_info, then those by name (their order is
    not part of a model's meaning)."""
    p = onnx.ModelProto()
    p.CopyFrom(proto)
    inits = {t.name: t.SerializeToString() for t in p.graph.initializer}
    infos = {v.name: v.SerializeToString() for v in p.graph.value_info}
    del p.graph.initializer[:]
    del p.graph.value_info[:]
    return p.SerializeToString(), inits, infos


def test_streamed_single_file_is_the_model_ir_save_writes(tmp_path):
    """save_single_file writes big weights straight into the file (a second, merged graph
    field): parsed, it is exactly the model ir.save writes - every dtype, big and small weights,
    their value_info - and ONNX Runtime computes the same outputs from it."""
    import onnx_ir as ir
    import onnxruntime as ort
    import torch

    from onnxmedic import onnxfile

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Linear(512, 1024)  # 2 MiB weight: streamed
            self.small = torch.nn.Linear(1024, 8)  # 32 KiB: serialised as usual
            self.register_buffer("h16", torch.randn(600, 1024).half())  # float16, streamed
            self.register_buffer("ids", torch.arange(300_000))  # int64, streamed
            self.register_buffer("bf", torch.randn(8).bfloat16())

        def forward(self, x):
            h = self.big(x) + self.h16[: x.shape[0]].float() + self.bf.float().sum()
            return self.small(h), self.ids[: x.shape[0]] * 2

    x = torch.randn(4, 512)
    prog = torch.onnx.export(M().eval(), (x,), dynamo=True, verbose=False)
    streamed = [v.name for v in prog.model.graph.initializers.values()
                if v.const_value.nbytes >= onnxfile.STREAM_BYTES]
    assert len(streamed) >= 3
    onnxfile.save_single_file(prog.model, tmp_path / "fast.onnx")
    ir.save(prog.model, tmp_path / "ref.onnx")
    fast, ref = onnx.load(tmp_path / "fast.onnx"), onnx.load(tmp_path / "ref.onnx")
    assert _normalised(fast) == _normalised(ref)
    onnx.checker.check_model(fast, full_check=True)
    assert not list((tmp_path).glob("*.part"))
    outs = [ort.InferenceSession(str(tmp_path / n)).run(None, {"x": x.numpy()})
            for n in ("fast.onnx", "ref.onnx")]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    # the comparison is not blind: one changed weight element is seen
    t = next(t for t in fast.graph.initializer if t.name == streamed[0])
    raw = bytearray(t.raw_data)
    raw[0] ^= 1
    t.raw_data = bytes(raw)
    assert _normalised(fast) != _normalised(ref)


def test_tensor_bytes_and_array_read_external_data_without_keeping_it(tmp_path):
    """One reader of external data (onnxfile.tensor_bytes / tensor_array): an initializer's
    bytes and array from its file at its offset, the tensor itself left external; inline data
    as it is; a location outside the model's folder refused."""
    import pytest

    from onnxmedic.onnxfile import tensor_array, tensor_bytes

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    (tmp_path / "w.data").write_bytes(b"\0" * 16 + a.tobytes())
    t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 4],
                    data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "w.data"), ("offset", "16"), ("length", str(a.nbytes))):
        t.external_data.add(key=k, value=v)
    assert tensor_bytes(t, tmp_path) == a.tobytes()
    np.testing.assert_array_equal(tensor_array(t, tmp_path), a)
    assert t.data_location == TensorProto.EXTERNAL and not t.raw_data
    inline = numpy_helper.from_array(a, "x")
    assert tensor_bytes(inline, tmp_path) == a.tobytes()
    np.testing.assert_array_equal(tensor_array(inline, tmp_path), a)
    t.external_data[0].value = "../w.data"
    with pytest.raises(ValueError, match="outside"):
        tensor_bytes(t, tmp_path)
