"""The onnxslim pass (optimize/passes/slim.py): fewer bias kernels, the same outputs, and none of
onnxslim's own shapes left for ONNX Runtime's memory planner to trust."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.optimize import passes
from onnxmedic.optimize.passes import slim


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _export(model: torch.nn.Module, args: tuple, path: Path) -> Path:
    torch.onnx.export(model, args, str(path), dynamo=True, verbose=False)
    return path


def test_onnxslim_turns_matmul_and_add_into_gemm(tmp_path: Path) -> None:
    """The onnxslim candidate: a Linear on 3-D input (MatMul + Add in the export)
    becomes one Gemm between Reshapes - fewer bias kernels - and computes the same."""
    import onnxruntime as ort

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8)).eval()
    x = torch.randn(2, 4, 16)
    src = _export(model, (x,), tmp_path / "l.onnx")
    assert _ops(src)["MatMul"] == 2 and _ops(src)["Add"] == 2
    slim.onnxslim_pass(str(src), str(tmp_path / "s.onnx"))
    ops = _ops(tmp_path / "s.onnx")
    assert ops["Gemm"] == 2 and not ops["MatMul"] and not ops["Add"], ops
    name = onnx.load(str(src)).graph.input[0].name
    got = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"]
                               ).run(None, {name: x.numpy()})[0]
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    assert all("onnxslim" in [p.name for p in passes.default_pipelines(t)]
               for t in ("cpu", "cuda", "tensorrt"))


@pytest.mark.slow  # the suite's 20-minute budget: onnxslim's pass is also run by the other tests of this file
def test_onnxslim_shapes_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxslim's symbolic inference declared julius' FFT filter bank's frequency-domain values
    (203 bins) and its time-domain blocks (405 samples) with one dim name, and ONNX Runtime's
    memory planner reused one's buffer for the other: "Shape mismatch attempting to re-use
    buffer" at every size. Its intermediate shapes are left out (ONNX Runtime infers them), the
    outputs keep the source's declared types, and the file computes PyTorch's output."""
    julius = pytest.importorskip("julius")
    model = julius.LowPassFilters([0.1, 0.25]).eval()
    x = torch.randn(2, 400)
    src = tmp_path / "m.onnx"
    assert onnxmedic.export(model, (x,), src,
                            dynamic_shapes=({0: "batch", 1: "samples"},)).ok
    info = slim.onnxslim_pass(str(src), str(tmp_path / "s.onnx"))
    assert info["shapes_dropped"] > 0
    slimmed = onnx.load(str(tmp_path / "s.onnx"))
    assert not any(vi.type.tensor_type.HasField("shape") for vi in slimmed.graph.value_info)
    assert slimmed.graph.output[0].type == onnx.load(str(src)).graph.output[0].type
    feeds = [torch.randn(2, 400), torch.randn(3, 777)]
    sbx = onnxmedic.sandbox.run_model(tmp_path / "s.onnx", [{"input": f.numpy()} for f in feeds])
    assert sbx.ok, sbx.summary()
    for got, f in zip(sbx.outputs, feeds):
        np.testing.assert_allclose(got[0], model(f).numpy(), rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(slim, "drop_slim_shapes", lambda proto, declared: 0)
    slim.onnxslim_pass(str(src), str(tmp_path / "broken.onnx"))
    broken = onnxmedic.sandbox.run_model(tmp_path / "broken.onnx", [{"input": x.numpy()}])
    assert broken.status == "run_error" and "re-use buffer" in broken.error
