"""Capture and translation on fake weights (OM515): the model's own tensors are bound to the
ONNX model afterwards; the file is the same model as a normal export's."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import onnxmedic
from onnxmedic import onnxfile
from onnxmedic._torch_compat import fake_weights, is_fake
from onnxmedic.capture.strategies import capture
from onnxmedic.stages import capture as capture_stage
from onnxmedic.stages.translate import translate


class TinyDecoder(torch.nn.Module):
    """Embedding, linears on 3-D activations (torch.onnx folds their transposes), a norm, a
    non-persistent buffer (a lifted constant, like rotary frequencies) and a tied head."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d, bias=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("freq", torch.linspace(0.1, 1.0, d), persistent=False)

    def forward(self, ids):
        h = self.emb(ids) * torch.cos(self.freq)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))


class ReadsItsBuffer(TinyDecoder):
    """Python reads a buffer's value: a fake weight has none."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids):
        out = super().forward(ids)
        return out * 2 if self.scale.item() > 1 else out


def _ort(path, ids):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {ort.InferenceSession(str(path)).get_inputs()[0].name: ids.numpy()})


@pytest.mark.parametrize("external", [False, True])
def test_fake_weight_export_equals_the_normal_one(tmp_path, monkeypatch, external):
    torch.manual_seed(0)
    model = TinyDecoder().eval()
    ids = torch.randint(0, 50, (2, 7))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    if external:  # the weights streamed into external data from the model's own tensors
        monkeypatch.setattr(onnxfile, "EXTERNAL_DATA_THRESHOLD", 100)
    normal = onnxmedic.export(model, (ids,), tmp_path / "normal.onnx")
    monkeypatch.setattr(capture_stage, "FAKE_WEIGHTS_SHARE", 0.0)  # forced
    fake = onnxmedic.export(model, (ids,), tmp_path / "fake.onnx")
    assert normal.ok and fake.ok, [f.one_paragraph() for f in normal.findings + fake.findings]
    assert "OM515" not in [f.code for f in normal.findings]
    (f515,) = [f for f in fake.findings if f.code == "OM515"]
    assert f515.stage == "capture" and f515.details["weight_bytes"] == sum(
        t.numel() * t.element_size() for t in {id(t): t for t in
                                               [*model.parameters(), *model.buffers()]}.values())
    assert (tmp_path / "fake.onnx.data").is_file() == external
    for a, b in zip(_ort(tmp_path / "normal.onnx", ids), _ort(tmp_path / "fake.onnx", ids)):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit-equal
    # the model is left with its own tensors, unchanged
    assert all(not is_fake(t) for t in [*model.parameters(), *model.buffers()])
    assert model.head.weight is model.emb.weight
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    # the captured program holds the model's tensors after translation, not fakes
    assert all(not is_fake(t) for t in fake.program.state_dict.values())


def test_fake_weight_translation_wraps_the_models_own_tensors():
    torch.manual_seed(0)
    model = TinyDecoder().eval()
    ids = torch.randint(0, 50, (2, 7))
    with fake_weights(model, (ids,), {}) as (fargs, fkwargs, real):
        (res,) = capture(model, fargs, fkwargs)
    assert all(is_fake(t) for t in res.program.state_dict.values())
    tr = translate(res.program, (ids,), {}, weights=real)
    inits = tr.onnx_program.model.graph.initializers
    assert inits["up.bias"].const_value.raw is model.up.bias  # wrapped, not copied
    assert inits["head.weight"].const_value.raw is model.emb.weight  # tied: one tensor
    # the transposed linear weights the optimizer folded (after binding) are views of them
    folded = [v.const_value.numpy() for v in inits.values() if v.const_value.shape == (32, 64)]
    assert folded and np.shares_memory(folded[0], model.up.weight.detach().numpy())
    assert not any(is_fake(getattr(v.const_value, "raw", None)) for v in inits.values())


def test_a_model_reading_its_weights_keeps_the_normal_capture(tmp_path, monkeypatch):
    """A branch on a buffer's value cannot be traced on fake weights: the fake capture gives
    way (said in the report's reasons), and the normal capture (which reads the buffer's
    value) exports the model; no OM515."""
    monkeypatch.setattr(capture_stage, "FAKE_WEIGHTS_SHARE", 0.0)
    torch.manual_seed(0)
    model = ReadsItsBuffer().eval()
    r = onnxmedic.export(model, (torch.randint(0, 50, (2, 7)),), tmp_path / "m.onnx")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM515" not in [f.code for f in r.findings]
    (why,) = [x["reason"] for x in r.reasons if x["what"] == "capture on fake weights"]
    assert "item" in why or "data-dependent" in why.lower(), why
    assert all(not is_fake(t) for t in [*model.parameters(), *model.buffers()])


class ComplexBuffer(torch.nn.Module):
    """A complex buffer: torch.onnx stores it as a real view, which binding cannot give."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rot", torch.polar(torch.ones(8), torch.linspace(0, 3, 8)))

    def forward(self, x):
        return x * torch.view_as_real(self.rot)[:, 0]


def test_a_complex_weight_keeps_the_normal_capture(tmp_path, monkeypatch):
    monkeypatch.setattr(capture_stage, "FAKE_WEIGHTS_SHARE", 0.0)
    r = onnxmedic.export(ComplexBuffer(), (torch.randn(3, 8),), tmp_path / "m.onnx")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM515" not in [f.code for f in r.findings]
    (why,) = [x["reason"] for x in r.reasons if x["what"] == "capture on fake weights"]
    assert "cannot be bound" in why and "rot" in why, why
