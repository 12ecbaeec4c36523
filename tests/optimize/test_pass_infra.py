"""optimize's pass infrastructure (pass_infra.py): preconditions, postconditions and whether a
pipeline modified the model, on a two-node file (no ONNX Runtime, no child process)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from onnxmedic.optimize.pass_infra import (
    PostconditionError,
    PreconditionError,
    Sequential,
    StepPass,
)

HERE = __name__


def copy_step(src: str, dst: str) -> dict[str, Any]:
    shutil.copyfile(src, dst)
    return {"copied": True}


def relu_to_abs(src: str, dst: str) -> dict[str, Any]:
    proto = onnx.load(src)
    for n in proto.graph.node:
        n.op_type = "Abs" if n.op_type == "Relu" else n.op_type
    onnx.save(proto, dst)
    return {}


def writes_nothing(src: str, dst: str) -> dict[str, Any]:
    return {"measured": 1}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]),
                           helper.make_node("Neg", ["r"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g), path)
    return path


def test_a_pipeline_says_whether_it_modified_the_model(model: Path, tmp_path: Path) -> None:
    ended: list[str] = []
    run = Sequential(StepPass(f"{HERE}:copy_step"), StepPass(f"{HERE}:copy_step"),
                     scratch=tmp_path, on_pass=lambda p, r: ended.append(p.name))
    res = run(model, tmp_path / "same.onnx")
    assert not res.modified and res.info["steps"] == [{"copied": True}] * 2
    assert ended == [f"{HERE}:copy_step"] * 2
    run = Sequential(StepPass(f"{HERE}:copy_step"), StepPass(f"{HERE}:relu_to_abs"),
                     scratch=tmp_path)
    res = run(model, tmp_path / "abs.onnx")
    assert res.modified and res.path == tmp_path / "abs.onnx"


def test_pre_and_postconditions_are_checked(model: Path, tmp_path: Path) -> None:
    with pytest.raises(PreconditionError, match="does not exist"):
        StepPass(f"{HERE}:copy_step")(tmp_path / "missing.onnx", tmp_path / "o.onnx")
    with pytest.raises(PostconditionError, match="wrote no model"):
        StepPass(f"{HERE}:writes_nothing")(model, tmp_path / "o.onnx")
    measured = StepPass(f"{HERE}:writes_nothing", writes=False)(model, tmp_path / "o.onnx")
    assert measured.path == model and not measured.modified and measured.info == {"measured": 1}
