"""Verification at real size (default configs, random weights): no false alarm on a deep CNN
and a transformer, and every injected fault caught (verify/faults.py)."""

from __future__ import annotations

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.verify import faults

transformers = pytest.importorskip("transformers")


def _trained_like(model):
    """Random weights as initialised leave biases, norm shifts and running statistics at 0/1,
    which trained models never have (and a dropped bias would change nothing): draw them."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("bias") or name.endswith("running_mean"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif "layer_scale" in name:  # ConvNeXt initialises them to 1e-6
                t.copy_(torch.rand(t.shape, generator=g) * 0.9 + 0.1)
    return model.eval()


def _resnet50():
    cfg = transformers.AutoConfig.for_model("resnet")  # ResNet-50
    return (_trained_like(transformers.ResNetModel(cfg)),
            (torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)),))


def _bert_base():
    cfg = transformers.AutoConfig.for_model("bert")  # BERT-base
    return (_trained_like(transformers.BertModel(cfg)),
            (torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0)),))


def _caught(tmp_path, bad, model, args):
    assert bad is not None, "the fault does not apply to this model"
    p = tmp_path / "fault.onnx"
    onnx.save(bad, p)
    r = onnxmedic.verify(p, model, args)
    return not r.ok and any(f.code in ("OM601", "OM602") for f in r.findings)


@pytest.mark.parametrize("build,faults_", [
    (_resnet50, ["weight", "bias dropped", "activation swapped", "Add -> Sub"]),
    (_bert_base, ["weight", "bias dropped", "epsilon changed", "softmax axis changed"]),
], ids=["resnet50", "bert-base"])
def test_real_size_verifies_and_every_fault_is_caught(tmp_path, build, faults_):
    model, args = build()
    r = onnxmedic.export(model, args, tmp_path / "m.onnx")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    judged = {c.rule for c in r.verification}
    assert judged <= {"float64 budget", "float32 agreement"}, judged
    proto = onnx.load(tmp_path / "m.onnx")
    for name in faults_:
        bad = (faults.scale_weight(proto, 1e-3) if name == "weight"
               else faults.STRUCTURAL[name](proto))
        assert _caught(tmp_path, bad, model, args), name
