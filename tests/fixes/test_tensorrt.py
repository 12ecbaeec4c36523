"""--target tensorrt and the default opset.

TensorRT has no kernel registry to query: onnxmedic checks models against ONNX-TensorRT's operator
support matrix (tools/data/onnx_tensorrt_operators.md -> fixes/data/tensorrt_ops.json by
tools/gen_trt_ops.py). Nodes the parser does not take run on CUDA between TensorRT engines
(OM305, with the engine count); below that the CUDA table decides (OM304 / OM301). The default
export opset is the highest the target supports: the lowest of torch.onnx's ceiling, the ONNX
Runtime release's and TensorRT's. No GPU or TensorRT needed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import onnxmedic
from onnxmedic import api
from onnxmedic.fixes import dtypes as fx
from onnxmedic.fixes import opset as opset_fix
from tests.test_cli import cli

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_trt_ops", ROOT / "tools" / "gen_trt_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_table_is_generated_from_the_copied_matrix():
    gen = _gen()
    assert gen.main(["--check"]) == 0
    doc = gen.parse(gen.SRC.read_text(encoding="utf-8"))
    assert doc["tensorrt"] == "10.15" and doc["opset"] == [9, 24]
    assert len(doc["ops"]) == 200
    assert doc["ops"]["Gemm"] == {"supported": True, "restrictions": "",
                                  "types": ["tensor(bfloat16)", "tensor(float)",
                                            "tensor(float16)"]}
    assert not doc["ops"]["Unique"]["supported"] and not doc["ops"]["NonMaxSuppression"] == {}
    assert "Antialiasing is not supported" in doc["ops"]["Resize"]["restrictions"]
    assert fx.tensorrt_table() == json.loads(gen.OUT.read_text(encoding="utf-8"))


def test_parser_refuses_a_table_it_does_not_understand():
    gen = _gen()
    with pytest.raises(ValueError, match="no source line"):
        gen.parse("| Operator | Supported |\n| Abs | Y | FP32 |")
    text = gen.SRC.read_text(encoding="utf-8").replace("| FP32, FP16, BF16 |", "| FP33 |", 1)
    with pytest.raises(ValueError, match="unknown type"):
        gen.parse(text)


def _chain(nodes, inputs, outputs, value_info=(), opset=18, initializers=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, value_info=list(value_info),
                          initializer=list(initializers))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def _vi(name, dtype, shape=(2, 3)):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def test_nodes_tensorrt_does_not_take_and_the_engines_they_split():
    """float -> Relu -> Cast(double) -> Sin(double) -> Cast(float) -> Relu: the middle three
    are not TensorRT's (double), both Relus are, in two engines."""
    F, D = TensorProto.FLOAT, TensorProto.DOUBLE
    m = _chain([helper.make_node("Relu", ["x"], ["a"], name="relu1"),
                helper.make_node("Cast", ["a"], ["b"], to=D, name="to_double"),
                helper.make_node("Sin", ["b"], ["c"], name="sin"),
                helper.make_node("Cast", ["c"], ["d"], to=F, name="to_float"),
                helper.make_node("Relu", ["d"], ["y"], name="relu2")],
               [_vi("x", F)], [_vi("y", F)],
               [_vi("a", F), _vi("b", D), _vi("c", D), _vi("d", F)])
    gaps = fx.kernel_gaps(m, "tensorrt")
    assert [(g.node, g.kind) for g in gaps] == [("to_double", "trt-fallback"),
                                               ("sin", "trt-fallback"),
                                               ("to_float", "trt-fallback")]
    assert "not double" in gaps[1].detail and "casts double down" in gaps[1].detail
    assert fx.tensorrt_partitions(m, gaps) == 2
    assert fx.tensorrt_partitions(m, []) == 1
    assert fx.kernel_gaps(m, "cpu") == [] and fx.kernel_gaps(m, "cuda") == []


def test_integer_operands_after_the_data_input_are_not_held_against_the_node():
    """Resize's sizes and CumSum's axis are int64; the matrix lists float types only for
    both: the parser takes them (they are shape operands), so no gap."""
    F, L = TensorProto.FLOAT, TensorProto.INT64
    sizes = helper.make_tensor("sizes", L, [4], [1, 1, 4, 6])
    axis = helper.make_tensor("axis", L, [], [3])
    m = _chain([helper.make_node("Resize", ["x", "", "", "sizes"], ["r"], mode="nearest",
                                 name="resize"),
                helper.make_node("CumSum", ["r", "axis"], ["y"], name="cumsum")],
               [_vi("x", F, (1, 1, 2, 3))], [_vi("y", F, (1, 1, 4, 6))],
               [_vi("r", F, (1, 1, 4, 6))], initializers=[sizes, axis])
    assert fx.kernel_gaps(m, "tensorrt") == []


def test_below_tensorrt_the_cuda_table_decides():
    """Unique: not TensorRT's, no CUDA kernel, a CPU one -> cpu-fallback (OM304), not OM305;
    an op the CUDA table has (Abs on int8 is not TensorRT's: int8 is a quantized type there)
    -> trt-fallback."""
    F = TensorProto.FLOAT
    m = _chain([helper.make_node("Unique", ["x"], ["y"], name="unique", sorted=1)],
               [_vi("x", F, (5,))], [helper.make_tensor_value_info("y", F, ["n"])])
    (g,) = fx.kernel_gaps(m, "tensorrt")
    assert g.kind == "cpu-fallback" and "not in ONNX-TensorRT's supported operators" in g.detail
    I8 = TensorProto.INT8
    m = _chain([helper.make_node("Abs", ["x"], ["y"], name="abs")], [_vi("x", I8)], [_vi("y", I8)])
    (g,) = fx.kernel_gaps(m, "tensorrt")
    assert g.kind == "trt-fallback" and "not int8" in g.detail


class _DoubleIsland(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.lin(x).double().sin().float()).relu()


def test_export_and_doctor_for_tensorrt(tmp_path):
    out = tmp_path / "m.onnx"
    r = onnxmedic.export(_DoubleIsland().eval(), (torch.randn(2, 4),), out, target="tensorrt")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    codes = [f.code for f in r.findings]
    assert "OM305" in codes and r.opset <= 24
    (f,) = [f for f in r.findings if f.code == "OM305"]
    # the double island (Cast, Sin, Cast) leaves TensorRT: the casts run on CUDA; Sin too where
    # the CUDA table serves the opset's Sin, else on the CPU (OM304) - either way two engines
    cpu = [g for x in r.findings if x.code == "OM304" for g in x.details["nodes"]]
    assert f.details["engines"] == 2 and len(f.details["nodes"]) + len(cpu) == 3, cpu
    assert all("double" in why for why in f.details["reasons"].values())
    import onnxruntime as ort
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        (fb,) = [f for f in r.findings if f.code == "OM535"]
        assert "TensorrtExecutionProvider is not available" in fb.message
        assert "TensorRT's libraries" in fb.suggestion
    d = api.doctor(out, target="tensorrt")
    assert d.ok and "OM305" in [f.code for f in d.findings]
    assert "OM305" not in [f.code for f in api.doctor(out, target="cuda").findings]
    p = cli("doctor", str(out), "--target", "tensorrt", "--json")
    assert p.returncode == 0 and "OM305" in p.stdout
    with pytest.raises(ValueError, match="tensorrt"):
        onnxmedic.export(_DoubleIsland(), (torch.randn(2, 4),), target="tpu")


def test_doctor_tensorrt_flags_an_opset_beyond_the_parser(tmp_path):
    F = TensorProto.FLOAT
    m = _chain([helper.make_node("Relu", ["x"], ["y"], name="relu")], [_vi("x", F)],
               [_vi("y", F)], opset=25)
    onnx.save(m, tmp_path / "m.onnx")
    r = api.doctor(tmp_path / "m.onnx", target="tensorrt", smoke_test=False)
    (f,) = [f for f in r.findings if f.code == "OM305"]
    assert "opset 25" in f.message and f.details["tensorrt_opsets"] == [9, 24]


# ------------------------------------------------------------------------ default opset

def test_default_opset_is_the_highest_every_layer_supports(monkeypatch):
    here = opset_fix.installed_version()
    mx = opset_fix.installed_max_opset()
    assert mx is not None and mx >= 21  # onnxruntime >= 1.22 kernels reach opset 22+
    best, bound = opset_fix.choose_opset("cpu")
    assert best == min(opset_fix.exporter_max_opset(), opset_fix.VERIFIED_MAX_OPSET, mx) == 22
    assert bound == opset_fix.VERIFIED_MAX_REASON
    assert opset_fix.choose_opset("cpu", (1, 17)) == (20, "ONNX Runtime 1.17")
    assert opset_fix.choose_opset("cuda", (1, 14)) == (18, "ONNX Runtime 1.14")
    assert opset_fix.choose_opset("cpu", here)[0] == best  # the installed release is asked
    monkeypatch.setattr(opset_fix, "exporter_max_opset", lambda: 30)
    monkeypatch.setattr(opset_fix, "VERIFIED_MAX_OPSET", 30)
    monkeypatch.setattr(opset_fix, "installed_max_opset", lambda: 28)
    assert opset_fix.choose_opset("tensorrt") == (24, "TensorRT 10.15")
    assert opset_fix.choose_opset("cpu") == (28, f"ONNX Runtime {here[0]}.{here[1]} (installed)")


def test_default_opset_export_says_what_set_it():
    r = onnxmedic.export(_DoubleIsland().eval(), (torch.randn(2, 4),))
    best, bound = opset_fix.choose_opset("cpu")
    assert r.ok and r.opset == best
    (f,) = [f for f in r.findings if f.code == "OM320"]
    assert f"set by {bound}" in f.message and f.details["opset"] == best


def test_default_opset_the_converter_cannot_reach_falls_back(monkeypatch):
    """When the version converter fails, torch.onnx keeps opset 18: for the default that is a
    note (OM324) and the model is kept; for an asked-for opset the export stops (OM321)."""
    from onnxmedic.fixes.opset import check_opset

    r = api.ExportResult(command="export")
    r.opset = 18
    assert check_opset(r, 23, explicit=False, bound="torch.onnx")
    assert [f.code for f in r.findings] == ["OM324"] and "stays at opset 18" in r.findings[0].message
    r = api.ExportResult(command="export")
    r.opset = 18
    assert not check_opset(r, 23, explicit=True)
    assert [f.code for f in r.findings] == ["OM321"]
