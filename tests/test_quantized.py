"""Quantized torch.ao models (issues 41, 53). Eager quantize_dynamic (Linear, LSTM, GRU) and
eager prepare + convert (Quantize, Conv2d, ConvReLU2d, Linear, DeQuantize) export as the
arithmetic their quantized kernels compute and verify against PyTorch's own quantized run
(OM620), and so do FX models (prepare_fx + convert_fx) of those modules. What has no ONNX
form (QFunctional, FX's quantized add) ends in a
precise finding naming the op, the modules and the way around it (OM211; a quantized input
tensor: OM212), never in an internal error. PT2E-style models (float tensors with quantized_decomposed
quantize/dequantize ops) export to ONNX QDQ form and verify, each QDQ output judged with a
budget of one quantization step of its DequantizeLinear (a fault beyond it is caught)."""

from __future__ import annotations

import platform
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import onnxmedic
from onnxmedic import borrow, isa, sandbox
from onnxmedic.verify.budget import RULE_QUANT, judge_quantized, quantization_scales
from onnxmedic.verify.compare import compare_arrays
from tests.optimize.test_int8_isa import QEMU, QEMU_CPU, needs_qemu
from tests.optimize.test_int8_isa import _run as run_files

warnings.filterwarnings("ignore", message=".*quantiz.*")


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


class Stubbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.mlp = Mlp()
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.mlp(self.quant(x)))


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def _eager_dynamic() -> nn.Module:
    torch.manual_seed(0)
    return torch.ao.quantization.quantize_dynamic(Mlp().eval(), {nn.Linear}, dtype=torch.qint8)


def _eager_static() -> nn.Module:
    torch.manual_seed(0)
    m = Stubbed().eval()
    m.qconfig = torch.ao.quantization.get_default_qconfig("x86")
    torch.ao.quantization.prepare(m, inplace=True)
    m(X)
    return torch.ao.quantization.convert(m, inplace=True)


def _fx(cls: type[nn.Module] = Mlp, x: torch.Tensor = X) -> nn.Module:
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = cls()
    p = prepare_fx(model.eval(), torch.ao.quantization.get_default_qconfig_mapping("x86"), (x,))
    p(x)
    return convert_fx(p)


class Residual(nn.Module):
    """FX: the add of two quantized tensors becomes torch.ops.quantized.add (no twin)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + x


class PoolNet(nn.Module):
    """FX: conv + relu, max pool and flatten on quantized tensors, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.pool, self.conv2, self.fc = nn.MaxPool2d(2), nn.Conv2d(8, 4, 3), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.conv2(self.pool(self.relu(self.conv(x)))), 1))


class AddStubbed(nn.Module):
    """Eager static with a FloatFunctional add (QFunctional once converted): no ONNX form."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.fc = nn.Linear(8, 8)
        self.add = torch.ao.nn.quantized.FloatFunctional()
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        return self.dequant(self.add.add(self.fc(x), x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.conv, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.conv2(self.relu(self.conv(self.quant(x)))))


XC = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _static(model: nn.Module, x: torch.Tensor, fuse: list[list[str]] | None = None
            ) -> nn.Module:
    torch.manual_seed(0)
    m = model.eval()
    if fuse:
        m = torch.ao.quantization.fuse_modules(m, fuse)
    m.qconfig = torch.ao.quantization.get_default_qconfig("x86")
    torch.ao.quantization.prepare(m, inplace=True)
    m(x)
    return torch.ao.quantization.convert(m, inplace=True)


def _eager_add() -> nn.Module:
    torch.manual_seed(0)
    return _static(AddStubbed(), X)


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.lstm(x)


XL = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))


def _eager_lstm() -> nn.Module:
    torch.manual_seed(0)
    return torch.ao.quantization.quantize_dynamic(Lstm().eval(), {nn.LSTM},
                                                  dtype=torch.qint8)


class Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 12, num_layers=2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(x)


def _eager_gru() -> nn.Module:
    torch.manual_seed(0)
    return torch.ao.quantization.quantize_dynamic(Gru().eval(), {nn.GRU}, dtype=torch.qint8)


X3 = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("make", "x", "op", "modules"), [
    (lambda: _fx(Residual), X, "quantized::add", []),
    (_eager_add, X, "quantized::linear", ["fc"]),
])
def test_torch_ao_quantized_models_end_in_a_precise_finding(make, x, op, modules) -> None:
    """A quantized op with no ONNX form here (QFunctional's add, FX's torch.ops.quantized.add:
    quantized.py says why) keeps its precise refusal: OM211 for each kernel, never an
    internal error."""
    model = make()
    given = borrow.copy_inputs((x,))
    result = onnxmedic.export(model, (x,))
    assert not result.ok
    codes = [f.code for f in result.findings]
    assert "OM009" not in codes and "OM211" in codes and "OM620" not in codes
    found = [f for f in result.findings if f.code == "OM211" and f.op == op]
    assert len(found) == 1, [(f.op, f.message) for f in result.findings]
    msg = found[0].message
    assert all(f"{m} (torch.ao.nn." in msg for m in modules)
    assert "--precision int8" in found[0].suggestion and "dequantize" in found[0].suggestion
    assert result.stages["preflight"] == "failed" and result.stages["capture"] != "failed"
    assert borrow.same_inputs(given, (x,))


def test_static_model_names_its_quantize_and_dequantize_modules_too() -> None:
    result = onnxmedic.export(_eager_add(), (X,))
    ops = {f.op for f in result.findings if f.code == "OM211"}
    assert {"aten::quantize_per_tensor", "aten::dequantize", "quantized::linear",
            "quantized::add / quantized::mul / quantized::cat"} <= ops


def _scaled_weight(path, out, factor: float = 1.1) -> None:
    """The file with its first 8-bit weight's DequantizeLinear scale ``factor`` off."""
    proto = onnx.load(path)
    inits = {t.name: t for t in proto.graph.initializer}
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear"
              and n.input[0] in inits and inits[n.input[0]].data_type in (
                  onnx.TensorProto.INT8, onnx.TensorProto.UINT8))
    scale = onnx.numpy_helper.to_array(inits[dq.input[1]])
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        (scale * factor).astype(np.float32), "bad_weight_scale"))
    dq.input[1] = "bad_weight_scale"
    onnx.save(proto, out)


@pytest.mark.parametrize(("make", "x"), [
    (_eager_dynamic, X),
    (_eager_static, X),
    (lambda: _static(ConvNet(), XC, [["conv", "relu"]]), XC),
    (_eager_dynamic, X3),
    (_fx, X),
    (lambda: _fx(PoolNet, XC), XC),
    pytest.param(_eager_lstm, XL, marks=pytest.mark.slow),
    pytest.param(_eager_gru, XL.transpose(0, 1), marks=pytest.mark.slow),
], ids=["quantize_dynamic-linear", "static-linear", "static-conv", "quantize_dynamic-linear-3d",
        "fx-linear", "fx-conv-pool", "quantize_dynamic-lstm", "quantize_dynamic-gru"])
def test_eager_quantized_models_export_and_verify_against_their_own_run(
        tmp_path, make, x) -> None:
    """Eager torch.ao models ended in OM211. Now each is exported as the arithmetic its
    quantized kernels compute (OM620) and verified against PyTorch's own quantized run (a
    static model's output within one quantization step of its DequantizeLinear, a dynamic
    Linear's, LSTM's and GRU's within float32 rounding). Fault injection: a weight scale 10%
    off is caught. A dynamic Linear on a 3-D input (an LSTM's input projection over all
    time steps) was 1e-3 off in ONNX Runtime, which turned its DequantizeLinear + MatMul into
    MatMulNBits with int8 activations (quantized._dynamic_linear)."""
    model = make()
    given = borrow.copy_inputs((x,))
    path = tmp_path / "q.onnx"
    result = onnxmedic.export(model, (x,), path)
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert "OM620" in [f.code for f in result.findings]
    assert borrow.same_inputs(given, (x,))
    assert any(type(m).__module__.startswith("torch.ao.nn.quantized")
               for m in model.modules())  # the user's model keeps its quantized modules
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert "DequantizeLinear" in ops
    import onnxruntime as ort

    opts = ort.SessionOptions()  # it loads with the setting an AVX2 CPU needs (OM546)
    for k, v in isa.PRECISION_CONFIG.items():
        opts.add_session_config_entry(k, v)
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    _scaled_weight(path, tmp_path / "bad.onnx")
    r = onnxmedic.verify(tmp_path / "bad.onnx", model, (x,))
    assert not r.ok and "OM601" in [f.code for f in r.findings]


def test_a_quantized_input_tensor_is_a_finding_not_a_crash() -> None:
    """A quantized example input crashed (a byte view of a quantized tensor segfaults) or
    ended in OM009 'unsupported ScalarType QUInt8'."""
    class Deq(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.dequantize() * 2

    qx = torch.quantize_per_tensor(X, 0.05, 10, torch.quint8)
    given = borrow.copy_inputs((qx,))
    result = onnxmedic.export(Deq(), (qx,))
    assert [f.code for f in result.findings if f.severity.name.lower() == "error"] == ["OM212"]
    assert "args[0] (torch.quint8" in next(f.message for f in result.findings
                                            if f.code == "OM212")
    assert borrow.same_inputs(given, (qx,))


def test_a_model_that_returns_a_quantized_tensor_is_a_finding() -> None:
    """No quantized module, but forward() quantizes itself: the output's conversion to numpy
    ended in OM009 'unsupported ScalarType QUInt8'."""
    class Quantizes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.quantize_per_tensor(x * 2, 0.05, 10, torch.quint8)

    result = onnxmedic.export(Quantizes(), (X,))
    codes = [f.code for f in result.findings if f.severity.name.lower() == "error"]
    assert codes == ["OM211"]
    assert "output 0 (torch.quint8)" in result.findings[-1].message


# -- QDQ (PT2E form) ----------------------------------------------------------------------------
class Qdq(nn.Module):
    """What convert_pt2e leaves: float Linear layers between quantize/dequantize pairs of
    quantized_decomposed ops (int8 weights dequantized, activations quantized per tensor)."""

    def __init__(self, out_scale: float = 0.02) -> None:
        super().__init__()
        import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers the ops

        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.out_scale = out_scale

    @staticmethod
    def _qdq(x: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
        ops = torch.ops.quantized_decomposed
        q = ops.quantize_per_tensor.default(x, scale, zp, -128, 127, torch.int8)
        return ops.dequantize_per_tensor.default(q, scale, zp, -128, 127, torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self._qdq(self.fc1.weight, 0.003, 0)
        w2 = self._qdq(self.fc2.weight, 0.002, 0)
        h = torch.relu(nn.functional.linear(self._qdq(x, 0.015, 3), w1, self.fc1.bias))
        y = nn.functional.linear(self._qdq(h, 0.005, -128), w2, self.fc2.bias)
        return self._qdq(y, self.out_scale, -5)


def test_a_qdq_model_exports_to_onnx_qdq_and_verifies(tmp_path) -> None:
    path = tmp_path / "q.onnx"
    result = onnxmedic.export(Qdq().eval(), (X,), path)
    assert result.ok, [(f.code, f.message) for f in result.findings]
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count("QuantizeLinear") >= 3 and ops.count("DequantizeLinear") >= 3
    assert quantization_scales(onnx.load(path)) == {
        onnx.load(path).graph.output[0].name: pytest.approx(0.02)}


def _output_scale_off(proto: onnx.ModelProto) -> None:
    """The fault: the output DequantizeLinear gets a scale of its own, 10% off (the
    QuantizeLinear before it shares the original one), so the integers stay right and the
    values come out up to ~10 steps off."""
    out_dq = next(n for n in proto.graph.node if n.output[0] == proto.graph.output[0].name)
    scale = next(onnx.numpy_helper.to_array(t) for t in proto.graph.initializer
                 if t.name == out_dq.input[1])
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        (scale * 1.1).astype(np.float32), "bad_scale"))
    out_dq.input[1] = "bad_scale"


def _qdq_files(tmp_path) -> dict[str, Any]:
    """The Qdq model's file and two faults: its output scale 10% off (the integers are right,
    the values up to ~10 steps off) and one bias of the last layer three output steps off."""
    path = tmp_path / "q.onnx"
    assert onnxmedic.export(Qdq().eval(), (X,), path).ok
    proto = onnx.load(path)
    _output_scale_off(proto)
    onnx.save(proto, tmp_path / "bad_scale.onnx")
    wrong = onnx.load(path)
    b = next(t for t in wrong.graph.initializer if t.name == "fc2.bias")
    arr = onnx.numpy_helper.to_array(b).copy()
    arr[0] += 3 * 0.02
    b.CopyFrom(onnx.numpy_helper.from_array(arr, b.name))
    onnx.save(wrong, tmp_path / "bad_bias.onnx")
    return {"good": path, "bad_scale.onnx": tmp_path / "bad_scale.onnx",
            "bad_bias.onnx": tmp_path / "bad_bias.onnx"}


def test_a_fault_beyond_one_quantization_step_is_caught(tmp_path) -> None:
    """Fault injection: a wrong output scale and a wrong bias (_qdq_files) are both refused
    (OM601), the comparison saying they are beyond one quantization step."""
    files = _qdq_files(tmp_path)
    for name in ("bad_scale.onnx", "bad_bias.onnx"):
        r = onnxmedic.verify(files[name], Qdq().eval(), (X,))
        assert not r.ok and "OM601" in [f.code for f in r.findings], name
        assert any("quantization step" in c.reason for c in r.verification if not c.ok)


@needs_qemu
def test_the_quantization_budget_holds_on_avx2(tmp_path) -> None:
    """The ISA lane: the Qdq file and its two faults run by ONNX Runtime under QEMU's Haswell
    (AVX2, no VNNI: the u8s8 kernels add pairs in int16) - the file is within one
    quantization step of PyTorch there too, the faults beyond it (one emulated child)."""
    files = _qdq_files(tmp_path)
    step = quantization_scales(onnx.load(files["good"]))
    (name, s), = step.items()
    expected = Qdq().eval()(X).detach().numpy()
    name_in = onnx.load(files["good"]).graph.input[0].name
    outs = run_files(tmp_path, {name_in: X.numpy()}, list(files.values()), emulate=True)
    for (label, _), act in zip(files.items(), outs):
        c = judge_quantized(compare_arrays(name, expected, act), expected, act, s)
        assert c.ok is (label == "good"), (label, c.max_abs / s)


def test_one_quantization_step_is_the_budget() -> None:
    """The rule itself: a QDQ output one step s off at an element (a half-way value rounded
    the other way by a quantized kernel) is accepted; 1.5 steps, or a NaN where PyTorch has a
    number, is not."""
    s = 0.02
    exp = (np.arange(-6, 6, dtype=np.float32) * s).reshape(3, 4)
    for delta, ok in ((s, True), (-s, True), (1.5 * s, False), (3 * s, False)):
        act = exp.copy()
        act[1, 2] += delta
        c = judge_quantized(compare_arrays("y", exp, act), exp, act, s)
        assert c.ok is ok, delta
        assert (c.rule == RULE_QUANT) is ok
    act = exp.copy()
    act[0, 0] = np.nan
    assert not judge_quantized(compare_arrays("y", exp, act), exp, act, s).ok


def _pt2e_model() -> torch.fx.GraphModule:
    """The real PT2E flow (torchao's prepare_pt2e / convert_pt2e with the XNNPACK quantizer,
    symmetric int8; torch 2.13 moved PT2E out of torch.ao): int8 activations and weights."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    torch.manual_seed(0)
    gm = torch.export.export(Mlp().eval(), (X,)).module()
    prepared = prepare_pt2e(gm, XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config()))
    prepared(X)
    return convert_pt2e(prepared)


def test_pt2e_quantized_model_exports_and_verifies(tmp_path) -> None:
    """The exported module refused eval() with NotImplementedError, which ended in OM009. It
    verifies on every x86-64 CPU: where ONNX Runtime's u8s8 kernels add in int32 (VNNI, AMX,
    arm64) as it is; where they saturate (AVX2 without VNNI: 46 quantization steps off by
    default) with session.x64quantprecision=1, which OM546 names with both figures and the
    file's metadata records (the QEMU Haswell test below checks that side everywhere)."""
    result = onnxmedic.export(_pt2e_model(), (X,), tmp_path / "p.onnx")
    assert result.ok, [(f.code, f.message) for f in result.findings]
    proto = onnx.load(tmp_path / "p.onnx")
    ops = [n.op_type for n in proto.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    codes = [f.code for f in result.findings]
    assert "OM601" not in codes and "OM610" not in codes
    saturates = isa.present_isa() == "avx2"  # where the sandbox runs ONNX Runtime
    assert ("OM546" in codes) == saturates
    assert (isa.session_config_of(proto) == isa.PRECISION_CONFIG) == saturates


def test_the_setting_loads_a_file_whose_weights_share_a_zero_point(tmp_path) -> None:
    """torch.onnx writes one int8 zero point for all weights; ONNX Runtime 1.32 with
    session.x64quantprecision=1 fails to load that on x86-64 ("Attempt to replace the existing
    tensor"). The written file gives each weight's DequantizeLinear its own (the same values):
    it loads with the setting and computes what it computes without it (here, within one
    quantization step of PyTorch on any CPU)."""
    import onnxruntime as ort

    model = _pt2e_model()
    path = tmp_path / "p.onnx"
    assert onnxmedic.export(model, (X,), path).ok
    proto = onnx.load(path)
    weight_dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"
                  and n.input[0].startswith("_frozen_param")]
    assert len(weight_dqs) == 2 and weight_dqs[0].input[2] != weight_dqs[1].input[2]

    def run(p) -> np.ndarray:
        opts = ort.SessionOptions()
        for k, v in isa.PRECISION_CONFIG.items():
            opts.add_session_config_entry(k, v)
        sess = ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
        return sess.run(None, {sess.get_inputs()[0].name: X.numpy()})[0]

    step = next(iter(quantization_scales(proto).values()))
    assert np.abs(run(path) - model(X).detach().numpy()).max() <= step * (1 + 1e-6)
    shared = onnx.load(path)  # the same file with the zero point shared again
    by_dq = [n for n in shared.graph.node if n.op_type == "DequantizeLinear"
             and n.input[0].startswith("_frozen_param")]
    by_dq[1].input[2] = by_dq[0].input[2]
    onnx.save(shared, tmp_path / "shared.onnx")
    if platform.machine() in ("x86_64", "AMD64"):
        with pytest.raises(Exception, match="replace the existing tensor"):
            run(tmp_path / "shared.onnx")


def _export_on_haswell(tmp_path, monkeypatch) -> tuple[torch.fx.GraphModule, Any, Any]:
    """The PT2E model exported with the sandbox's ONNX Runtime under QEMU's Haswell (AVX2, no
    VNNI), as on the AMD EPYC of issue 53: (model, result, path)."""
    model = _pt2e_model()
    monkeypatch.setenv(sandbox.WRAPPER_ENV, f"{QEMU} -cpu {QEMU_CPU}")
    path = tmp_path / "p.onnx"
    return model, onnxmedic.export(model, (X,), path), path


@needs_qemu
def test_pt2e_model_on_avx2_verifies_with_the_setting_and_runs_with_it(
        tmp_path, monkeypatch) -> None:
    """By default the file's output is ~46 quantization steps off on AVX2 (u8s8 saturates),
    which was refused as OM601/OM610 ("check the translation of aten::linear"). Now: OM546
    names the instruction set and the setting with both figures, the file verifies with it
    and records it, and `onnxmedic run` uses it (within a step of PyTorch)."""
    model, result, path = _export_on_haswell(tmp_path, monkeypatch)
    assert result.ok, [(f.code, f.message) for f in result.findings]
    codes = [f.code for f in result.findings]
    assert "OM601" not in codes and "OM610" not in codes
    found = next(f for f in result.findings if f.code == "OM546")
    default, precise = found.details["default"], found.details["with_setting"]
    assert not default["ok"] and default["steps"] > 10  # 46 steps on the EPYC
    assert precise["ok"] and precise["steps"] <= 1
    assert found.details["isa"] == "avx2" and "session.x64quantprecision" in found.message
    assert 'add_session_config_entry("session.x64quantprecision", "1")' in found.suggestion
    proto = onnx.load(path)
    assert isa.session_config_of(proto) == isa.PRECISION_CONFIG

    ran = onnxmedic.run(path, [X.numpy()])
    assert ran.ok and "OM548" in [f.code for f in ran.findings]
    step = next(iter(quantization_scales(proto).values()))
    out = next(iter(ran.outputs.values()))
    assert np.abs(out - model(X).detach().numpy()).max() <= step * (1 + 1e-6)


@pytest.mark.slow
@needs_qemu
def test_a_wrong_scale_on_avx2_fails_with_the_setting_too(tmp_path, monkeypatch) -> None:
    """Fault injection: the setting does not hide a real fault. The file's output scale 10%
    off, verified as a user's file (no setting recorded) on the emulated Haswell: it fails
    both ways - OM601, with OM547 saying the kernels saturate here but that is not all."""
    model, result, path = _export_on_haswell(tmp_path, monkeypatch)
    assert result.ok
    bad = onnx.load(path)
    del bad.metadata_props[:]
    _output_scale_off(bad)
    onnx.save(bad, tmp_path / "bad_scale.onnx")
    r = onnxmedic.verify(tmp_path / "bad_scale.onnx", model, (X,))
    codes = [f.code for f in r.findings]
    assert not r.ok and "OM601" in codes and "OM547" in codes and "OM546" not in codes
    found = next(f for f in r.findings if f.code == "OM547")
    assert not found.details["default"]["ok"] and not found.details["with_setting"]["ok"]


def test_an_exported_module_that_refuses_eval_is_exported() -> None:
    """convert_pt2e's module refuses train()/eval() (torchao's _disallow_eval_train raises
    NotImplementedError); export() called model.eval() and ended in OM009. The same refusal
    on a torch.export module, without torchao."""
    import types

    def refuse(self, mode: bool = True):
        raise NotImplementedError("Calling train() or eval() is not supported for exported "
                                  "models.")

    gm = torch.export.export(Qdq().eval(), (X,)).module()
    gm.train = types.MethodType(refuse, gm)
    gm.eval = types.MethodType(refuse, gm)
    gm.training = True
    result = onnxmedic.export(gm, (X,))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert "OM009" not in [f.code for f in result.findings]
    assert gm.training  # its flag back as it was


def test_qdq_ops_translate_after_a_float_export_in_the_same_process() -> None:
    """onnxmedic caches its torch.onnx registry; built by a float export before the
    quantized_decomposed ops were defined (a PT2E model made later in the same process), it
    had no QuantizeLinear translation: OM201."""
    import subprocess
    import sys

    code = (
        "import sys, torch, onnxmedic\n"
        "sys.path.insert(0, '.')\n"
        "assert onnxmedic.export(torch.nn.Linear(8, 4), (torch.randn(2, 8),), verify=False).ok\n"
        "assert 'torch.ao.quantization.fx._decomposed' in sys.modules\n"
        "from tests.test_quantized import Qdq, X\n"
        "r = onnxmedic.export(Qdq().eval(), (X,), verify=False)\n"
        "assert r.ok, [(f.code, f.message) for f in r.findings]\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


def test_run_and_doctor_use_the_session_settings_a_file_records(tmp_path) -> None:
    """A file verified with session.x64quantprecision (OM546) records it; run and doctor's
    smoke test load it with it and say so with the line for the user's own session (OM548).
    On any CPU the setting computes the exact integers: the same outputs as PyTorch's, within
    one quantization step."""
    from onnxmedic.onnxfile import append_metadata

    path = _qdq_files(tmp_path)["good"]
    append_metadata(path, isa.SESSION_CONFIG_KEY, '{"session.x64quantprecision": "1"}')
    assert isa.session_config_of(onnx.load(path)) == isa.PRECISION_CONFIG
    ran = onnxmedic.run(path, [X.numpy()])
    assert ran.ok
    found = next(f for f in ran.findings if f.code == "OM548")
    assert 'add_session_config_entry("session.x64quantprecision", "1")' in found.suggestion
    step = next(iter(quantization_scales(onnx.load(path)).values()))
    out = next(iter(ran.outputs.values()))
    assert np.abs(out - Qdq().eval()(X).detach().numpy()).max() <= step * (1 + 1e-6)
    assert "OM548" in [f.code for f in onnxmedic.doctor(path).findings]


class SmallLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.lstm(x)


def _small_lstm() -> nn.Module:
    torch.manual_seed(0)
    return torch.ao.quantization.quantize_dynamic(SmallLstm().eval(), {nn.LSTM},
                                                  dtype=torch.qint8)


@pytest.mark.parametrize(("make", "x", "weight"), [
    (_small_lstm, XL[:, :3, :6], "lstm.cells.0.w_hh.q"),
    pytest.param(_eager_gru, XL.transpose(0, 1), "gru.cells.0.w_hh.q",
                 marks=pytest.mark.slow),
], ids=["lstm", "gru"])
def test_dynamic_recurrence_verifies_and_a_wrong_weight_is_caught(tmp_path, make, x,
                                                                   weight) -> None:
    """quantize_dynamic's LSTM/GRU ended in OM211; it exports as its kernels' arithmetic
    (the input projection over all steps, the hidden state quantized at each step: OM620) and
    verifies against PyTorch's own run. Fault injection: one int8 of a hidden-to-hidden weight
    4 steps off (carried through every time step), and a weight scale 10% off, are caught."""
    model = make()
    path = tmp_path / "q.onnx"
    result = onnxmedic.export(model, (x,), path)
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert "OM620" in [f.code for f in result.findings]
    proto = onnx.load(path)
    init = next(t for t in proto.graph.initializer if t.name == weight)
    q = onnx.numpy_helper.to_array(init).copy()
    q.flat[0] = q.flat[0] - 4 if q.flat[0] > 128 else q.flat[0] + 4  # uint8 (q + 128)
    init.CopyFrom(onnx.numpy_helper.from_array(q, weight))
    onnx.save(proto, tmp_path / "bad.onnx")
    _scaled_weight(path, tmp_path / "scaled.onnx")
    for bad in ("bad.onnx", "scaled.onnx"):
        r = onnxmedic.verify(tmp_path / bad, model, (x,))
        assert not r.ok and "OM601" in [f.code for f in r.findings], bad
