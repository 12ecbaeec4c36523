"""A tied decoder's embedding read from its 4-bit LM head (optimize/int4_embed.py): the
embedding returns exactly the rows the head's 4-bit weights represent, the float32 table is
gone, and an untied, 8-bit or float32 head leaves the embedding as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxmedic.optimize import int4

VOCAB = 96


def _decoder(path, hidden: int, tied: bool) -> np.ndarray:
    """ids -> Gather(E) (also an output) -> Tanh -> MatMul(., Transpose(E) or its own head)
    -> logits: an embedding and an LM head, tied or not. Returns E."""
    rng = np.random.default_rng(hidden)
    e = rng.standard_normal((VOCAB, hidden)).astype(np.float32)
    inits = [numpy_helper.from_array(e, "embed.weight")]
    if tied:
        head = [helper.make_node("Transpose", ["embed.weight"], ["head_w"], perm=[1, 0])]
    else:
        inits.append(numpy_helper.from_array(
            rng.standard_normal((hidden, VOCAB)).astype(np.float32), "head_w"))
        head = []
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["emb"], name="embed"),
             helper.make_node("Tanh", ["emb"], ["h"]), *head,
             helper.make_node("MatMul", ["h", "head_w"], ["logits"], name="lm_head")]
    graph = helper.make_graph(
        nodes, "dec", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", VOCAB]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, "s", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return e


def _run(path, ids):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input_ids": ids})


def _head_rows(path) -> np.ndarray:
    """The LM head's 4-bit weights dequantized, one row per token (vocab, K padded)."""
    m = onnx.load(str(path))
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    q, s = inits[head.input[1]], inits[head.input[2]]
    n, blocks, blob = q.shape
    codes = np.stack([q & 15, q >> 4], -1).reshape(n, blocks, blob * 2).astype(np.float32)
    return ((codes - 8) * s.reshape(n, blocks, 1)).reshape(n, -1)


@pytest.mark.parametrize("hidden", [64, 40])  # 40: K padded to two blocks of 32, sliced
def test_the_tied_embedding_reads_the_4bit_head(tmp_path, hidden):
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    e = _decoder(src, hidden, tied=True)
    info = int4.quantize_int4(str(src), str(dst), 32, 0, "int4")
    assert info["embedding"] == "int4 (shared with the LM head)"
    m = onnx.load(str(dst))
    ops = [n.op_type for n in m.graph.node]
    assert "GatherBlockQuantized" in ops and "Gather" not in ops
    assert not [i.name for i in m.graph.initializer if list(i.dims) in (
        [VOCAB, hidden], [hidden, VOCAB])]  # no float32 table left
    ids = np.asarray([[0, 5, VOCAB - 1, 5]], np.int64)
    logits, emb = _run(dst, ids)
    rows = _head_rows(dst)[:, :hidden]
    assert np.array_equal(emb[0], rows[ids[0]])  # exactly the head's 4-bit rows
    assert np.abs(emb[0] - e[ids[0]]).max() < 0.2 * np.abs(e).max()  # and near the table
    ref, _ = _run(src, ids)
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.99


def test_an_untied_or_unquantized_head_keeps_the_float_embedding(tmp_path):
    src = tmp_path / "u.onnx"
    _decoder(src, 64, tied=False)
    for case, kw in (("untied", {}), ("head fp32", {"lm_head": "fp32"}),
                     ("head int8", {"lm_head": "int8"}), ("off", {"tied_embedding": False})):
        if case != "untied":
            _decoder(src, 64, tied=True)
        dst = tmp_path / "q.onnx"
        info = int4.quantize_int4(str(src), str(dst), 32, 0, **{"lm_head": "int4", **kw})
        ops = [n.op_type for n in onnx.load(str(dst)).graph.node]
        assert info["embedding"] == "float32" and "Gather" in ops, case
        assert "GatherBlockQuantized" not in ops, case


def test_the_int4_package_keeps_its_weights_beside_the_graph(tmp_path):
    """int4_package.save_external: the weights in model.onnx.data (ONNX Runtime builds the
    session without the whole protobuf in memory), the outputs unchanged, readable as the
    graph is; a second save replaces the data file rather than appending to it."""
    from onnxmedic.hf.transforms.int4_package import save_external

    src, dst = tmp_path / "f.onnx", tmp_path / "model.onnx"
    _decoder(src, 64, tied=True)
    int4.quantize_int4(str(src), str(dst), 32, 0, "int4")
    ids = np.asarray([[1, 2, 3]], np.int64)
    before = _run(dst, ids)
    save_external(dst)
    data = tmp_path / "model.onnx.data"
    size = data.stat().st_size
    assert size > dst.stat().st_size and data.stat().st_mode == dst.stat().st_mode
    save_external(dst)
    assert data.stat().st_size == size
    for a, b in zip(before, _run(dst, ids)):
        assert np.array_equal(a, b)
