"""Config constants kept in 0-d integer non-persistent buffers (EnCodec's conv stride, kernel
size and padding) read by Python control flow: captured with them fixed to their values
(OM116), verified, and the model left exactly as it was."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from onnxmedic.borrow import module_modes
from onnxmedic.capture.strategies import (
    KnownBuffers,
    buffers_as_constants,
    constant_scalar_buffers,
)


class PadToMultiple(torch.nn.Module):
    """Pads the last dim to a multiple of ``stride`` the way EnCodec's convs do: the amounts
    come from int buffers, and a Python ``if`` reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stride", torch.tensor(4), persistent=False)
        self.register_buffer("extra", torch.tensor(2), persistent=False)
        self.conv = torch.nn.Conv1d(1, 3, 4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (self.stride - x.shape[-1] % self.stride) % self.stride + self.extra
        if pad > 0:
            x = torch.nn.functional.pad(x, (0, pad), mode="reflect")
        return self.conv(x)


def _snapshot(model: torch.nn.Module) -> tuple:
    return ([type(m) for m in model.modules()], [flag for _, flag in module_modes(model)],
            {k: v.clone() for k, v in model.state_dict().items()},
            {k: v.clone() for k, v in model.named_buffers()})


def _unchanged(model: torch.nn.Module, before: tuple) -> None:
    types, modes, state, buffers = before
    assert [type(m) for m in model.modules()] == types
    assert [flag for _, flag in module_modes(model)] == modes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    now = dict(model.named_buffers())
    assert now.keys() == buffers.keys() and all(torch.equal(now[k], buffers[k]) for k in now)


def test_int_buffers_read_by_python_control_flow_are_fixed_and_verified():
    torch.manual_seed(0)
    model = PadToMultiple().eval()
    before = _snapshot(model)
    res = onnxmedic.export(model, (torch.randn(2, 1, 10),), dynamic_shapes=({0: "batch"},))
    assert res.ok, [f.one_paragraph() for f in res.findings]
    om116 = [f for f in res.findings if f.code == "OM116"]
    assert om116 and om116[0].details["constants"] == {"stride": 4, "extra": 2}
    _unchanged(model, before)


def test_without_the_strategy_the_capture_fails_on_data_dependent_flow():
    from onnxmedic.capture.strategies import CAPTURE_STRATEGIES, capture

    model = PadToMultiple().eval()
    others = [s for s in CAPTURE_STRATEGIES if s is not KnownBuffers]
    attempts = capture(model, (torch.randn(2, 1, 10),), {}, None, strategies=others[:3])
    assert not attempts[-1].ok
    attempts = capture(model, (torch.randn(2, 1, 10),), {}, None)
    assert attempts[-1].ok and attempts[-1].strategy == KnownBuffers.name


def test_only_non_persistent_integer_scalars_are_fixed_and_restored_after_an_error():
    model = PadToMultiple()
    model.register_buffer("steps", torch.tensor(3))  # persistent: a checkpoint may set it
    model.register_buffer("scale", torch.tensor(0.5), persistent=False)  # float
    found = constant_scalar_buffers(model)
    assert sorted(found) == ["extra", "stride"]
    cls = type(model)
    with pytest.raises(RuntimeError, match="boom"), buffers_as_constants(found):
        assert type(model) is not cls and isinstance(model, cls)
        assert model.stride is not model._buffers["stride"] and int(model.stride) == 4
        raise RuntimeError("boom")
    assert type(model) is cls and model.stride is model._buffers["stride"]


@pytest.mark.slow  # the suite's 20-minute budget: a whole audio codec; the constant rules have their own small models here
def test_tiny_encodec_exports_with_dynamic_batch(tmp_path):
    transformers = pytest.importorskip("transformers")

    class RoundTrip(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_values: torch.Tensor) -> torch.Tensor:
            return self.m(input_values).audio_values

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "encodec", num_filters=4, hidden_size=16, codebook_size=32, codebook_dim=16,
        num_lstm_layers=1, upsampling_ratios=[4, 2], target_bandwidths=[1.5, 3.0],
        sampling_rate=800, audio_channels=1, normalize=False, use_causal_conv=True)
    model = RoundTrip(transformers.EncodecModel(config)).eval()
    before = _snapshot(model)
    path = tmp_path / "encodec.onnx"
    res = onnxmedic.export(model, (torch.randn(2, 1, 640),), path,
                           dynamic_shapes=({0: "batch"},))
    assert res.ok, [f.one_paragraph() for f in res.findings]
    assert any(f.code == "OM116" and "padding_total" in f.message for f in res.findings)
    ver = onnxmedic.verify(path, model, (torch.randn(5, 1, 640),))
    assert ver.ok, [f.one_paragraph() for f in ver.findings]
    _unchanged(model, before)


def test_data_dependent_finding_names_the_library_line_that_raised():
    from onnxmedic.capture.strategies import Result, classify_capture_error

    text = ("Could not guard on data-dependent expression Eq(u0, 1)\n\nThe following call raised "
            "this error:\n  File \"/venv/site-packages/transformers/models/encodec/modeling_"
            "encodec.py\", line 150, in _pad1d\n    if length <= max_pad:\n")
    f = classify_capture_error([Result(None, "torch.export(strict=False)", RuntimeError(text))])
    assert f.code == "OM112"
    assert "modeling_encodec.py:150 in _pad1d (`if length <= max_pad:`)" in f.message
    assert f.details["raised_at"].endswith("(`if length <= max_pad:`)")
