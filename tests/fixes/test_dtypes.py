"""Dtypes that fit the target: nodes without an ONNX Runtime kernel for their dtype are found
from ONNX Runtime's own kernel registrations and repaired with casts (fixes/dtypes.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

import onnxmedic
from onnxmedic import api, sandbox
from onnxmedic.fixes import dtypes as fx
from onnxmedic.fixes import opset as opset_fix
from tests.test_cli import MODELS, cli


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))) * 2


def _bf16():
    return MLP().to(torch.bfloat16).eval(), (torch.randn(3, 8, dtype=torch.bfloat16),)


def test_kernel_table_is_onnxruntimes_own():
    t = fx.kernel_table("CPUExecutionProvider")
    gemm = t[("", "Gemm")]
    allowed = set().union(*(c["T"] for lo, hi, c in gemm if lo <= 13 <= hi))
    assert "tensor(float)" in allowed and "tensor(bfloat16)" not in allowed
    assert fx.kernel_table("NoSuchExecutionProvider") is None


def test_plain_export_of_bf16_model_does_not_load():
    """The failure onnxmedic fixes: torch.onnx's bf16 model is refused by ONNX Runtime."""
    m, x = _bf16()
    prog = torch.onnx.export(m, x, dynamo=True, verbose=False)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        prog.save(f"{d}/m.onnx")
        r = sandbox.run_model(f"{d}/m.onnx", [{"x": x[0].float().numpy()}])
    assert not r.ok and "Could not find an implementation" in (r.error or "")


def test_keep_reports_every_node_without_a_kernel():
    m, x = _bf16()
    r = onnxmedic.export(m, x, dtype_policy="keep")
    assert not r.ok and r.stages["fix"] == "failed" and r.stages["runtime"] == "not run"
    errs = [f for f in r.errors if f.code == "OM301"]
    assert sorted(f.op for f in errs) == ["Gemm", "Gemm", "Mul", "Relu"]  # all at once
    gemm = next(f for f in errs if f.op == "Gemm")
    assert gemm.details["types"] == {"T": "tensor(bfloat16)"}
    assert gemm.location and gemm.location.file.endswith("test_dtypes.py")
    assert "--dtype-policy upcast" in gemm.suggestion


@pytest.mark.parametrize("policy,casts", [("upcast", 13), ("boundary", 2)])
def test_bf16_model_repaired_and_verified(tmp_path, policy, casts):
    m, x = _bf16()
    out = tmp_path / "m.onnx"
    r = onnxmedic.export(m, x, out, dtype_policy=policy)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f310,) = [f for f in r.findings if f.code == "OM310"]
    assert f310.details["casts"] == casts and len(f310.details["nodes"]) == 4
    model = onnx.load(out)
    assert fx.kernel_gaps(model) == []
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.BFLOAT16
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.BFLOAT16
    assert r.stages["compare"] == "passed"


def test_float16_on_cpu_is_a_soft_gap():
    m = MLP().half().eval()
    x = (torch.randn(3, 8, dtype=torch.float16),)
    r = onnxmedic.export(m, x)
    assert r.ok
    (w,) = [f for f in r.findings if f.code == "OM302"]
    assert w.severity.value == "warning" and len(w.details["nodes"]) == 4
    rb = onnxmedic.export(m, x, dtype_policy="boundary")
    assert rb.ok and "OM302" not in [f.code for f in rb.findings]
    assert any(f.code == "OM310" for f in rb.findings)


def _mixed_model(path):
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node("Add", ["x", "y"], ["s"], name="add"),
                           helper.make_node("Relu", ["s"], ["z"], name="relu")], "g", [x, y], [z])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, path)  # unchecked on purpose: the exporter left the types inconsistent
    return path


def test_mixed_int_float_found_by_doctor_and_repaired(tmp_path):
    p = _mixed_model(tmp_path / "mixed.onnx")
    feeds = {"x": np.array([[1, -2, 3], [4, 5, -6]], np.int64),
             "y": np.full((2, 3), 0.5, np.float32)}
    before = sandbox.run_model(p, [feeds])
    assert not before.ok  # ONNX Runtime refuses it
    r = api.doctor(p)
    assert "OM303" in [f.code for f in r.errors]
    model = onnx.load(p)
    (g,) = fx.kernel_gaps(model)
    assert g.kind == "mixed" and g.node == "add" and "int64" in g.detail
    irm = ir.from_proto(model)
    rep = fx.apply_policy(irm, [g], "upcast")
    assert rep.fixed == [g] and rep.casts_added == 1
    fixed = tmp_path / "fixed.onnx"
    ir.save(irm, fixed)
    onnx.checker.check_model(onnx.load(fixed), full_check=True)
    after = sandbox.run_model(fixed, [feeds])
    assert after.ok, after.error
    np.testing.assert_array_equal(after.outputs[0][0],
                                  np.maximum(feeds["x"].astype(np.float32) + feeds["y"], 0))


def test_mixed_int32_int64_max_widened(tmp_path):
    """Mask R-CNN's export leaves a Max of an int32 and an int64 (T bound twice): without a
    float to cast to, the int32 input is widened to int64, as torch promotes."""
    x = helper.make_tensor_value_info("x", TensorProto.INT32, [3])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [3])
    z = helper.make_tensor_value_info("z", TensorProto.INT64, [3])
    g = helper.make_graph([helper.make_node("Max", ["x", "y"], ["m"], name="max"),
                           helper.make_node("Neg", ["m"], ["z"], name="neg")], "g", [x, y], [z])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    p = tmp_path / "imax.onnx"
    onnx.save(m, p)
    big = 1 << 40  # beyond int32: a cast the other way would lose it
    feeds = {"x": np.array([1, -7, 3], np.int32), "y": np.array([2, -9, big], np.int64)}
    assert not sandbox.run_model(p, [feeds]).ok
    (gap,) = fx.kernel_gaps(onnx.load(p))
    assert gap.kind == "mixed" and gap.op == "Max" and set(gap.clashing) == {
        "tensor(int32)", "tensor(int64)"}
    irm = ir.from_proto(onnx.load(p))
    rep = fx.apply_policy(irm, [gap], "upcast")
    assert rep.fixed == [gap] and rep.casts_added == 1 and not rep.not_fixed
    fixed = tmp_path / "fixed.onnx"
    ir.save(irm, fixed)
    onnx.checker.check_model(onnx.load(fixed), full_check=True)
    assert fx.kernel_gaps(onnx.load(fixed)) == []
    after = sandbox.run_model(fixed, [feeds])
    assert after.ok, after.error
    np.testing.assert_array_equal(after.outputs[0][0], -np.maximum(feeds["x"], feeds["y"]))


def test_mixed_unsigned_int_clash_is_not_guessed(tmp_path):
    """A clash between a signed and an unsigned integer has no widening that keeps both: it
    is reported, not repaired."""
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, [3])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [3])
    z = helper.make_tensor_value_info("z", TensorProto.INT32, [3])
    g = helper.make_graph([helper.make_node("Max", ["x", "y"], ["z"], name="max")], "g",
                          [x, y], [z])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    (gap,) = fx.kernel_gaps(m)
    rep = fx.apply_policy(ir.from_proto(m), [gap], "upcast")
    assert not rep.fixed and "widen" in rep.not_fixed[0][1]


def test_doctor_lists_bf16_nodes_without_kernels(tmp_path):
    m, x = _bf16()
    torch.onnx.export(m, x, dynamo=True, verbose=False).save(tmp_path / "bf16.onnx")
    r = api.doctor(tmp_path / "bf16.onnx")
    assert not r.ok
    assert sorted(f.op for f in r.findings if f.code == "OM301") == ["Gemm", "Gemm", "Mul",
                                                                       "Relu"]


@pytest.mark.slow  # three CLI exports (28 s); the API tests above cover the policy, test_cli the exit codes
def test_cli_dtype_policy(tmp_path):
    p = cli("export", f"{MODELS}:Bf16Linear", "--input", "2x4:bfloat16", "--dtype-policy", "keep")
    assert p.returncode == 1 and "OM301" in p.stderr
    p = cli("export", f"{MODELS}:Bf16Linear", "--input", "2x4:bfloat16",
            "-o", str(tmp_path / "m.onnx"), "--json")
    assert p.returncode == 0, p.stderr
    assert "OM310" in [f["code"] for f in json.loads(p.stdout)["findings"]]
    p = cli("export", f"{MODELS}:Bf16Linear", "--input", "2x4:bfloat16", "--dtype-policy", "x")
    assert p.returncode == 2


def test_bad_policy_is_a_caller_error():
    with pytest.raises(ValueError, match="dtype_policy"):
        onnxmedic.export(MLP(), (torch.randn(1, 8),), dtype_policy="fast")


# ----------------------------------------------------------------------- --ort-version

@pytest.mark.parametrize("version,opset,ir_version", [("1.14", 18, 8), ("1.17", 20, 9),
                                                      ("1.20", 21, 10)])
def test_export_fitted_to_an_older_onnxruntime(tmp_path, version, opset, ir_version):
    """The default opset is the highest the release loads (torch.onnx reaches 23) and the IR
    version is lowered to what it loads (ONNX Runtime < 1.18 cannot load IR 10)."""
    from tests import models
    out = tmp_path / "m.onnx"
    r = onnxmedic.export(models.ConvLog1p(), (torch.randn(1, 3, 8, 8),), out,
                         ort_version=version)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    m = onnx.load(out)
    assert m.ir_version == ir_version
    assert next(o.version for o in m.opset_import if o.domain == "") == opset
    (fit,) = [f for f in r.findings if f.code == "OM323"]
    assert f"-> {opset}" in fit.message
    assert api.doctor(out, ort_version=version).ok


def test_ort_version_conflicts_and_doctor():
    from tests import models
    x = (torch.randn(1, 3, 8, 8),)
    r = onnxmedic.export(models.ConvLog1p(), x, ort_version="1.14", opset=20)
    assert [f.code for f in r.errors] == ["OM322"] and r.stages["capture"] == "not run"
    with pytest.raises(ValueError, match="ort_version"):
        onnxmedic.export(models.ConvLog1p(), x, ort_version="latest")


def test_doctor_ort_version_names_opset_and_ir(tmp_path):
    from tests import models
    out = tmp_path / "m.onnx"
    assert onnxmedic.export(models.ConvLog1p(), (torch.randn(1, 3, 8, 8),), out).ok
    r = api.doctor(out, ort_version="1.15")
    msgs = [f.message for f in r.errors if f.code == "OM322"]
    assert len(msgs) == 2 and f"opset {r.opset}" in msgs[0] and "IR version 10" in msgs[1]
    p = cli("doctor", str(out), "--ort-version", "1.15")
    assert p.returncode == 1 and "OM322" in p.stderr
    assert cli("doctor", str(out), "--ort-version", "one").returncode == 2


def test_runtime_failures_point_at_the_node_and_its_neighbourhood(tmp_path):
    """doctor on torch.onnx's bf16 model: ONNX Runtime's load error names one node; the
    finding carries its op, the user's line and the graph around it, and the HTML report shows
    that neighbourhood."""
    m, x = _bf16()
    torch.onnx.export(m, x, dynamo=True, verbose=False).save(tmp_path / "bf16.onnx")
    r = api.doctor(tmp_path / "bf16.onnx", report=tmp_path / "r.html")
    (load,) = [f for f in r.errors if f.code == "OM510"]
    assert load.op in ("Gemm", "Relu", "Mul")
    nb = load.details["neighbourhood"]
    assert nb["node"].startswith(load.op) and nb["inputs"] and nb["outputs"]
    gemm = next(f for f in r.errors if f.code == "OM301" and f.op == "Gemm")
    gnb = gemm.details["neighbourhood"]
    assert {i["from"] for i in gnb["inputs"]} >= {"initializer"}
    assert any("bfloat16" in i["type"] for i in gnb["inputs"])
    html = (tmp_path / "r.html").read_text()
    assert "graph around" in html and "node_linear" in html


def test_kernel_versions_match_like_onnx_runtime():
    """A kernel registered without an end version serves only the schema version it starts
    at (ONNX Runtime's VerifyKernelDef); a versioned one serves its whole range."""
    from onnxmedic.fixes.dtypes import version_matches

    open_end = 2**31 - 1
    assert version_matches(1, open_end, 1) and not version_matches(1, open_end, 22)
    assert version_matches(13, 18, 13) and version_matches(13, 18, 18)
    assert not version_matches(13, 18, 19) and not version_matches(13, 18, 12)


class RandLike(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0 * torch.rand_like(x)  # deterministic output, a RandomUniformLike node


def test_op_without_a_kernel_at_the_default_opset_lowers_it(tmp_path):
    """RandomUniformLike-22 has no ONNX Runtime kernel (only RandomUniformLike-1): at the
    default opset 22 the model is translated again at opset 21 (OM325), which verifies - not
    OM510 from inside ONNX Runtime. Asked for opset 22, it stops before the runtime with OM301
    naming opset 21."""
    if opset_fix.choose_opset("cpu")[0] != 22:
        pytest.skip("the default opset here is not 22")
    res = onnxmedic.export(RandLike().eval(), (torch.randn(3, 4),), tmp_path / "m.onnx")
    assert res.ok and res.opset == 21, [x.one_paragraph() for x in res.findings]
    # the first translation's temporary folder (beside the output) is gone too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    (f,) = [f for f in res.findings if f.code == "OM325"]
    assert f.details == {"from": 22, "to": 21, "ops": ["RandomUniformLike-22"]}
    codes = [x.code for x in res.findings]
    assert "OM301" not in codes and "OM510" not in codes
    assert codes.count("OM320") == 1  # the first translation's findings are not kept
    assert "RandomUniformLike-22" in next(x for x in res.findings if x.code == "OM320").message
    asked = onnxmedic.export(RandLike().eval(), (torch.randn(3, 4),), opset=22)
    assert not asked.ok and "OM325" not in {x.code for x in asked.findings}
    f = next(f for f in asked.findings if f.code == "OM301")
    assert f.details["lower_opset"] == 21 and "opset=21" in f.suggestion
    assert "OM510" not in {x.code for x in asked.findings}
