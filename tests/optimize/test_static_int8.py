"""Static int8 (QDQ, calibrated) for convolutional graphs: calibration apart from verification,
per-layer sensitivity, and the layers ONNX Runtime's QDQ quantizer ties together."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.optimize import (
    Pipeline,
    calibration_feeds,
    default_pipelines,
    files,
    judge_reduced,
    optimize,
    optimize_file,
    passes,
    reference_sets,
)

FAST = {"repeats": 3, "rounds": 1}
STATIC = Pipeline("int8-static", [(f"{passes.__name__}:quantize_static_int8",
                                   {"per_channel": True})], precision="int8")


def _conv_names(path: Path) -> list[str]:
    return [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"]


def test_static_int8_keeps_the_layer_reading_the_outlier_in_float32(
        outlier: tuple[torch.nn.Module, torch.Tensor, Path], tmp_path: Path) -> None:
    model, x, src = outlier
    a, b, _ = _conv_names(src)
    feeds, expected, _, _ = reference_sets(src, model, onnxmedic.inputs.Inputs((x,)))
    calibration = calibration_feeds(src, onnxmedic.inputs.Inputs((x,)))
    # all layers int8 (what a blind quantize_static writes): outside the budget

    npz = files.save_feeds(calibration, tmp_path / "cal.npz")
    blind = Pipeline("blind", [(STATIC.steps[0][0], {"calibration": str(npz)})])
    ok, _, err = passes.run_pipeline(blind, src, tmp_path / "blind.onnx")
    assert ok, err
    sbx = onnxmedic.sandbox.run_model(tmp_path / "blind.onnx", feeds)
    good, acc, why = judge_reduced(["conv2d_2"], expected, sbx.outputs)
    assert not good and "cosine" in why
    res = optimize_file(src, feeds, expected, pipelines=[STATIC], calibration=calibration,
                        **FAST)
    v = res.variants[1]
    assert v.verified, v.rejected
    ranking = next(s for s in v.steps if "ranking" in s)["ranking"]
    assert ranking[0][0] == b  # the layer whose input quantization breaks
    # b reads a's output: it is float32 only with a float32 too (the quantizer ties them)
    assert v.steps[-1]["excluded"] == [b, a] and v.steps[-1]["calibration_sets"] == 8
    assert v.worst_cosine() >= 0.999
    assert v.nodes and v.nodes < 30  # QuantizeLinear/DequantizeLinear left around c


def test_static_errors_score_each_layers_own_error(
        outlier: tuple[torch.nn.Module, torch.Tensor, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """b's output is ~90 % off (its input rounded); a's output, compared past the Relu the
    quantizer folds into its QuantizeLinear, is within a few %; c adds no error of its own."""
    from onnxmedic.optimize import int8

    model, x, src = outlier
    a, b, c = _conv_names(src)
    inputs = onnxmedic.inputs.Inputs((x,))
    feeds = files.save_feeds(reference_sets(src, model, inputs)[0], tmp_path / "f.npz")
    cal = files.save_feeds(calibration_feeds(src, inputs), tmp_path / "c.npz")
    errors = int8.static_errors(str(src), "", str(feeds), str(cal))["errors"]
    assert set(errors) == {a, b, c}
    assert errors[b] > 0.5 and abs(errors[a]) < 0.05 and errors[c] < 0.05
    # given the QDQ file the search already built, it ranks that file and quantizes nothing
    qdq = tmp_path / "qdq.onnx"
    passes.quantize_static_int8(str(src), str(qdq), str(cal))

    def no_second_calibration(*args: object, **kwargs: object) -> None:
        raise AssertionError("quantized twice")

    monkeypatch.setattr(passes, "quantize_static_int8", no_second_calibration)
    again = int8.static_errors(str(src), "", str(feeds), "", quantized=str(qdq))["errors"]
    assert again == pytest.approx(errors)


def test_calibration_sets_are_apart_from_the_verification_sets(
        outlier: tuple[torch.nn.Module, torch.Tensor, Path]) -> None:
    model, x, src = outlier
    inputs = onnxmedic.inputs.Inputs((x,))
    verification = [f["x"] for f in reference_sets(src, model, inputs)[0]]
    calibration = [f["x"] for f in calibration_feeds(src, inputs)]
    assert len(calibration) == 8
    assert not any(np.array_equal(c, v) for c in calibration for v in verification)
    # drawn like the verification sets: in the example's range
    assert all(c.min() >= x.min().item() - 1e-6 and c.max() <= x.max().item() + 1e-6
               for c in calibration)


def test_static_int8_is_a_candidate_for_convolutional_graphs(
        outlier: tuple[torch.nn.Module, torch.Tensor, Path], tmp_path: Path) -> None:
    _, _, src = outlier
    # a convolutional stem under MatMul layers (ViT, Whisper): dynamic int8's ground
    mlp = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 1), torch.nn.Linear(8, 8),
                              torch.nn.Linear(8, 8)).eval()
    other = tmp_path / "mlp.onnx"
    torch.onnx.export(mlp, (torch.randn(1, 4, 8),), str(other), dynamo=True, verbose=False)
    assert passes.is_convolutional(src) and not passes.is_convolutional(other)
    names = [p.name for p in default_pipelines("cpu", "int8", convolutional=True)]
    assert "int8-static" in names
    assert "int8-static" not in [p.name for p in default_pipelines("cpu", "int8")]


def test_static_int8_without_calibration_sets_is_rejected_with_the_reason(
        outlier: tuple[torch.nn.Module, torch.Tensor, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxmedic.optimize.maker import CandidateMaker

    model, x, src = outlier
    feeds, expected, _, _ = reference_sets(src, model, onnxmedic.inputs.Inputs((x,)))

    def no_prefix(*args: object, **kwargs: object) -> None:
        raise AssertionError("the prefix was built for a candidate rejected without it")

    monkeypatch.setattr(CandidateMaker, "prefix", no_prefix)
    res = optimize_file(src, feeds, expected, pipelines=[STATIC], **FAST)
    assert res.chosen == "plain" and "calibration input sets" in res.variants[1].rejected


def test_optimize_int8_calibrates_and_writes_static_int8_for_a_cnn(tmp_path: Path) -> None:
    """The whole path from the model: optimize derives the calibration sets, the static variant
    verifies within the budget (ReLU CNN, nothing to keep float32) and is listed with its
    QDQ ops."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(1, 3, 24, 24)
    src = tmp_path / "cnn.onnx"
    torch.onnx.export(model, (x,), str(src), dynamo=True, verbose=False)
    res = optimize(src, model, (x,), precision="int8", pipelines=[STATIC], **FAST)
    v = res.variants[1]
    assert v.verified, v.rejected
    step = v.steps[-1]
    assert step["excluded"] == [] and step["new_ops"]["QuantizeLinear"] >= 3
    assert v.worst_cosine() >= 0.999
