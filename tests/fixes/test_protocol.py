"""Every fix follows one protocol: check(subject) -> the reason it does not apply (None when it
does), apply(subject) -> what it did; try_fix records the reason on the result."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper

from onnxmedic.fixes import try_fix
from onnxmedic.fixes.custom_ops import CustomOpInlining
from onnxmedic.fixes.dtypes import DtypeRepair
from onnxmedic.fixes.opset import IrVersionFit
from onnxmedic.fixes.rewrites import REWRITES
from onnxmedic.result import ExportResult


def _matmul(dtype: int, ir_version: int = 10) -> onnx.ModelProto:
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("a", dtype, [2, 2]),
         helper.make_tensor_value_info("b", dtype, [2, 2])],
        [helper.make_tensor_value_info("y", dtype, [2, 2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=ir_version)


def test_ir_version_fit_applies_only_above_the_release():
    m = _matmul(TensorProto.FLOAT, ir_version=10)
    fit = IrVersionFit((1, 14))  # ONNX Runtime 1.14 loads IR 8
    assert fit.check(m) is None
    assert fit.apply(m) == "IR version 10 -> 8" and m.ir_version == 8
    assert "already loads" in IrVersionFit((1, 20)).check(_matmul(TensorProto.FLOAT))


def test_dtype_repair_has_a_reason_for_a_clean_model_and_fixes_a_gap():
    clean = _matmul(TensorProto.FLOAT)
    r = ExportResult()
    assert try_fix(DtypeRepair("cpu", "upcast"), ir.from_proto(clean), r, check_on=clean) is None
    assert r.reasons == [{"what": "dtype repair",
                          "reason": "every node has a cpu kernel as typed"}]
    bf16 = _matmul(TensorProto.BFLOAT16)  # no bfloat16 MatMul kernel on the CPU
    model = ir.from_proto(bf16)
    report = try_fix(DtypeRepair("cpu", "upcast"), model, check_on=bf16)
    assert [g.op for g in report.fixed] == ["MatMul"] and report.casts_added >= 3


def test_custom_op_inlining_has_a_reason_without_custom_ops():
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    assert "no custom op" in CustomOpInlining({}).check(program)


def test_rewrites_check_the_error_they_apply_to():
    unrelated = RuntimeError("something else entirely")
    view = RuntimeError("Cannot view a tensor with shape [2, 3] and strides [1, 2] as ...")
    r = ExportResult()
    assert all(try_fix(rw, None, r, check_on=unrelated) is None for rw in REWRITES)
    assert [n["what"] for n in r.reasons] == [rw.name for rw in REWRITES]
    (view_rewrite,) = [rw for rw in REWRITES if rw.code == "OM122"]
    assert view_rewrite.check(view) is None
