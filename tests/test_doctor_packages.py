"""doctor on a generation package's graph, as onnxruntime-genai's builder writes it (the
default backend's package): its ops ONNX Runtime defines in the ONNX domain are not an
onnx.checker rejection (OM739, info), and its smoke test feeds the cache as the package
contract says - random sizes for its symbolic head size (``kv_cache_dim``) made ONNX Runtime
fail and doctor blame the file (OM511) for its own inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxmedic import api
from onnxmedic.stages.check import check_model

HEAD = 16


def _package(folder: Path, op: str = "SimplifiedLayerNormalization") -> Path:
    """A builder-shaped decoder step: the cache's head size symbolic (kv_cache_dim), a node
    ``op`` in the ONNX domain, and a present that only a past of head size HEAD fits (Add of
    a [1, 2, 1, HEAD] constant: a past of another head size does not broadcast)."""
    folder.mkdir()
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                             ["batch_size", "seq", HEAD])]
    bias = helper.make_tensor("bias", TensorProto.FLOAT, [1, 2, 1, HEAD], [0.5] * 2 * HEAD)
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [HEAD], [1.0] * HEAD)
    nodes = [helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["f", "axis"], ["f3"]),
             helper.make_node("Expand", ["f3", "shape"], ["x"]),
             helper.make_node(op, ["x", "scale"], ["logits"], axis=-1, epsilon=1e-6)]
    inits = [bias, scale, helper.make_tensor("axis", TensorProto.INT64, [1], [2]),
             helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, HEAD])]
    for kind in ("key", "value"):
        past, present = f"past_key_values.0.{kind}", f"present.0.{kind}"
        inputs.append(helper.make_tensor_value_info(
            past, TensorProto.FLOAT, ["batch_size", 2, "past_sequence_length", "kv_cache_dim"]))
        outputs.append(helper.make_tensor_value_info(
            present, TensorProto.FLOAT, ["batch_size", 2, "total_sequence_length",
                                         "kv_cache_dim"]))
        nodes.append(helper.make_node("Add", [past, "bias"], [present]))
    graph = helper.make_graph(nodes, "step", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    (folder / "config.json").write_text(json.dumps(
        {"num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 2 * HEAD}))
    return folder / "model.onnx"


def test_ort_defined_op_in_the_onnx_domain_is_not_a_checker_rejection(tmp_path):
    found = check_model(onnx.load(_package(tmp_path / "pkg")))
    assert [f.code for f in found] == ["OM739"], [f.one_paragraph() for f in found]
    assert "SimplifiedLayerNormalization" in found[0].message


def test_an_op_no_runtime_defines_is_still_rejected(tmp_path):
    model = onnx.load(_package(tmp_path / "pkg"))
    model.graph.node[-3].op_type = "NoSuchOp"  # (the Expand)
    found = check_model(model)
    assert [f.code for f in found] == ["OM501"] and "NoSuchOp" in found[0].message


def test_doctor_feeds_a_package_step_as_its_contract_says(tmp_path):
    path = _package(tmp_path / "pkg")
    result = api.doctor(path)
    assert result.ok, [f.one_paragraph() for f in result.findings]
    assert result.stages["runtime"] == "passed" and "OM511" not in {f.code for f in
                                                                    result.findings}
    model = onnx.load(path)  # a real fault is still caught: a bias no past head size fits
    model.graph.initializer[0].CopyFrom(helper.make_tensor(
        "bias", TensorProto.FLOAT, [1, 2, 1, HEAD + 1], np.zeros(2 * (HEAD + 1)).tolist()))
    onnx.save(model, path)
    assert "OM511" in {f.code for f in api.doctor(path).findings}
