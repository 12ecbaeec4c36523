"""Real-size vision models (bench/zoo/vision.py, random weights) with a dynamic batch, in
.venv-vision: a handful of the zoo's families export and verify at several batch sizes, and
the same verification catches faults injected into a real-size vision model (without that, "no
false alarm" would mean nothing). Slow: about a minute per model on two cores."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.sweep import import_source
from onnxmedic.verify import faults
from tests.vision.conftest import SKIP_REASON

pytest.importorskip("torchvision", reason=SKIP_REASON)

ROOT = Path(__file__).resolve().parents[2]
VISION = import_source(str(ROOT / "bench" / "zoo" / "vision.py"))

# one per family: a torchvision CNN, a segmentation head, a timm hybrid (attention with biases
# by position), a timm ViT, an MLP-mixer
HANDFUL = ["tv/squeezenet1_1", "tv/lraspp_mobilenet_v3_large", "timm/levit_128",
           "timm/deit_small_patch16_224", "timm/resmlp_12_224"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", HANDFUL)
def test_zoo_entry_verifies_at_several_batch_sizes(tmp_path, name):
    case = VISION.ZOO[name]()
    r = onnxmedic.export(case.model, case.args, tmp_path / "m.onnx",
                         dynamic_shapes=case.dynamic_shapes)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert {"example", "random#1", "batch=1", "batch=3"} <= {c.input_set
                                                              for c in r.verification}
    dims = onnx.load(tmp_path / "m.onnx", load_external_data=False).graph.input[0].type
    assert not dims.tensor_type.shape.dim[0].HasField("dim_value")  # the batch stayed dynamic


def _caught(tmp_path: Path, bad: onnx.ModelProto | None, model, args) -> bool:
    assert bad is not None, "the fault does not apply to this model"
    p = tmp_path / "fault.onnx"
    onnx.save(bad, p)
    r = onnxmedic.verify(p, model, args)
    return not r.ok and any(f.code in ("OM601", "OM602", "OM402") for f in r.findings)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name,kinds", [
    ("tv/mobilenet_v3_large", ["weight", "bias dropped", "activation swapped", "Add -> Sub"]),
    ("timm/deit_small_patch16_224", ["weight", "bias dropped", "epsilon changed",
                                     "softmax axis changed"]),
])
def test_vision_verification_catches_faults_at_real_size(tmp_path, name, kinds):
    """Trained-like weights (verify.faults.trained_like: random biases, norm statistics
    measured), exported with a dynamic batch and verified; then each fault, injected into the
    verified file, fails verification, while the file itself passed."""
    case = VISION.ZOO[name]()
    model = faults.trained_like(case.model, case.args)
    r = onnxmedic.export(model, case.args, tmp_path / "m.onnx",
                         dynamic_shapes=case.dynamic_shapes)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    proto = onnx.load(tmp_path / "m.onnx")
    for kind in kinds:
        bad = (faults.scale_weight(proto, 1e-3) if kind == "weight"
               else faults.STRUCTURAL[kind](proto))
        assert _caught(tmp_path, bad, model, case.args), kind
    with torch.no_grad():  # the model is still the one the file was verified against
        assert torch.isfinite(model(*case.args)).all()
