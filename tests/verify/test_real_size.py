"""Verification at real size (default configs, random weights): no false alarm on a deep CNN
and a transformer, and every injected fault caught (verify/faults.py)."""

from __future__ import annotations

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.verify import faults
from onnxmedic.verify.budget import RULE_ESTIMATED
from onnxmedic.verify.faults import trained_like

transformers = pytest.importorskip("transformers")




def _resnet50():
    cfg = transformers.AutoConfig.for_model("resnet")  # ResNet-50
    args = (torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)),)
    return trained_like(transformers.ResNetModel(cfg), args), args


def _bert_base():
    cfg = transformers.AutoConfig.for_model("bert")  # BERT-base
    return (trained_like(transformers.BertModel(cfg)),
            (torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0)),))


def _caught(tmp_path, bad, model, args):
    assert bad is not None, "the fault does not apply to this model"
    p = tmp_path / "fault.onnx"
    onnx.save(bad, p)
    r = onnxmedic.verify(p, model, args)
    return not r.ok and any(f.code in ("OM601", "OM602") for f in r.findings)


@pytest.mark.parametrize("build,faults_", [
    (_resnet50, ["weight", "bias dropped", "activation swapped", "Add -> Sub"]),
    # BERT-base in the slow suite (40 s): ResNet-50 keeps a real-size model in the default run
    pytest.param(_bert_base, ["weight", "bias dropped", "epsilon changed", "softmax axis changed"],
                 marks=pytest.mark.slow),
], ids=["resnet50", "bert-base"])
def test_real_size_verifies_and_every_fault_is_caught(tmp_path, build, faults_):
    model, args = build()
    r = onnxmedic.export(model, args, tmp_path / "m.onnx")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    judged = {c.rule for c in r.verification}
    assert judged <= {"float64 budget", "float32 agreement", RULE_ESTIMATED}, judged
    # the example itself is judged against its own float64 run, never by an estimate
    assert {c.rule for c in r.verification if c.input_set == "example"} <= {
        "float64 budget", "float32 agreement"}
    proto = onnx.load(tmp_path / "m.onnx")
    for name in faults_:
        bad = (faults.scale_weight(proto, 1e-3) if name == "weight"
               else faults.STRUCTURAL[name](proto))
        assert _caught(tmp_path, bad, model, args), name
