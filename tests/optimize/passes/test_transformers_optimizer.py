"""ONNX Runtime's transformers optimizer pass (optimize/passes/transformers_optimizer.py): its
fusions, and the model type it is given for a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onnxmedic.optimize.passes import transformers_optimizer
from tests.optimize.fixture_models import FeedForward, export_dynamo, op_types


def test_ort_transformers_optimizer_fuses_bias_gelu_and_skip_layernorm(tmp_path: Path) -> None:
    src = export_dynamo(FeedForward().eval(), (torch.randn(2, 16, 32),), tmp_path / "m.onnx")
    info = transformers_optimizer.ort_transformers(str(src), str(tmp_path / "t.onnx"), model_type="bert")
    assert info["fusions"] == {"BiasGelu": 1, "SkipLayerNormalization": 1}
    assert op_types(tmp_path / "t.onnx")["SkipLayerNormalization"] == 1
    assert info["nodes_after"] < info["nodes_before"]


@pytest.mark.parametrize(("model_type", "expect"), [
    ("bert", "bert"), ("vit", "vit"), ("llama", "gpt2"), ("qwen2", "gpt2"), ("phi", "gpt2"),
    ("whisper", "bart"),
    ("segformer", "vit"), ("roberta", "bert"), ("resnet", None), ("convnext", None),
    (None, None)])
def test_ort_model_type_from_the_model_or_a_wrapped_submodule(model_type: str | None,
                                                              expect: str | None) -> None:
    assert transformers_optimizer.ort_model_type(FeedForward(model_type)) == expect
    wrapped = torch.nn.Sequential(torch.nn.Identity(), FeedForward(model_type))
    assert transformers_optimizer.ort_model_type(wrapped) == expect


def test_ort_model_types_are_the_optimizers_own() -> None:
    from onnxruntime.transformers.optimizer import MODEL_TYPES

    assert set(transformers_optimizer.ORT_MODEL_TYPES) <= set(MODEL_TYPES)
    assert set(transformers_optimizer.ORT_TYPE_FAMILIES) <= set(MODEL_TYPES)


def test_ort_phi_optimizer_fails_on_a_dynamo_export_so_phi_is_a_decoder(tmp_path: Path) -> None:
    """ONNX Runtime's "phi" optimizer unrolls a per-layer local function torch's exporter no
    longer writes, and raises on any export (HF zoo phi: both ort-transformers-phi candidates
    "the pass failed"); the "gpt2" optimizer runs. If ONNX Runtime mends it, this fails:
    time to give phi back its own type."""
    src = export_dynamo(FeedForward("phi").eval(), (torch.randn(2, 16, 32),), tmp_path / "m.onnx")
    with pytest.raises(TypeError, match="'method' object is not iterable"):
        transformers_optimizer.ort_transformers(str(src), str(tmp_path / "phi.onnx"), model_type="phi")
    assert transformers_optimizer.ort_transformers(str(src), str(tmp_path / "g.onnx"), model_type="gpt2")
    assert transformers_optimizer.ort_model_type(FeedForward("phi")) == "gpt2"
