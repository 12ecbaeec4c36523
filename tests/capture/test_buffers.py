"""Python control flow that reads a buffer's value (an 'initialised' flag, a time grid): the
capture decides it by the buffer's current value - a constant in the ONNX file - (OM116),
verification still compares with the eager model (an injected wrong decision is refused), a
branch that involves an input is not decided, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from onnxmedic.capture import buffers
from onnxmedic.capture.strategies import CAPTURE_STRATEGIES, KnownBuffers, capture
from tests._state import snapshot_state, state_differences


def codes(r):
    return [f.code for f in r.findings]


class InitOnce(torch.nn.Module):
    """Initialises itself on the first call, like gpytorch's variational strategy and
    normflows' ActNorm: a bool buffer read by ``if``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("initialised", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialised.item():
            with torch.no_grad():
                self.lin.bias.copy_(-self.lin(x).mean(0))
            self.initialised.fill_(True)
        return self.lin(x) * 2


class TimeGrid(torch.nn.Module):
    """A fixed-step solver over a time grid kept as a buffer, like torchdiffeq's odeint:
    the direction test and the step count read the grid."""

    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(4, 4)
        self.register_buffer("t", torch.tensor([0.0, 1.0]))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        t, sign = self.t, 1.0
        if len(t) > 1 and t[0] > t[1]:
            t, sign = -t, -1.0
        steps = int(torch.ceil((t[-1] - t[0]) / 0.25).item())
        for _ in range(steps):
            y = y + sign * 0.25 * torch.tanh(self.f(y))
        return y


class InputBranch(torch.nn.Module):
    """A branch on an input scaled by a buffer: not decidable from the buffer alone."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.sum() * self.scale) > 0:
            return x * 2
        return -x


def _warm(model: torch.nn.Module, *args: torch.Tensor) -> torch.nn.Module:
    model(*args)  # the first call initialises, as preflight's does
    return model.eval()


def test_an_initialised_flag_is_decided_by_its_value():
    torch.manual_seed(0)
    model = _warm(InitOnce(), torch.randn(8, 4))
    before = snapshot_state(model)
    r = onnxmedic.export(model, (torch.randn(3, 4),), dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    om116 = next(f for f in r.findings if f.code == "OM116")
    assert om116.details["buffers"] == {"initialised": "True"}
    assert "if not self.initialised.item()" in om116.message
    assert "computes the branch these values select, for every input" in om116.message
    assert "OM114" not in codes(r)
    assert state_differences(before, snapshot_state(model)) == []


def test_a_time_grid_buffer_fixes_the_direction_and_the_step_count(tmp_path):
    torch.manual_seed(0)
    model = TimeGrid().eval()
    before = snapshot_state(model)
    path = tmp_path / "grid.onnx"
    r = onnxmedic.export(model, (torch.randn(3, 4),), path, dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    om116 = next(f for f in r.findings if f.code == "OM116")
    assert om116.details["buffers"] == {"t": "[0.0, 1.0]"}
    assert [g["read"] for g in om116.details["guards"]] == ["reads False", "reads 4.0"]
    ver = onnxmedic.verify(path, model, (torch.randn(7, 4),))
    assert ver.ok, [f.one_paragraph() for f in ver.findings]
    assert state_differences(before, snapshot_state(model)) == []


def test_without_the_strategy_the_capture_fails_or_specialises():
    model = TimeGrid().eval()
    others = [s for s in CAPTURE_STRATEGIES if s is not KnownBuffers]
    attempts = capture(model, (torch.randn(3, 4),), {}, None, strategies=others)
    assert not attempts[-1].ok or "draft_export" in attempts[-1].strategy
    attempts = capture(model, (torch.randn(3, 4),), {}, None)
    assert attempts[-1].ok and attempts[-1].strategy == KnownBuffers.name


def test_a_branch_on_an_input_is_not_decided_by_the_buffer():
    attempts = capture(InputBranch().eval(), (torch.ones(2, 3),), {}, None)
    known = next(a for a in attempts if a.strategy == KnownBuffers.name)
    assert not known.ok and "data-dependent" in str(known.error)


def test_a_wrongly_decided_branch_is_refused_by_verification(monkeypatch):
    """Injected fault: the capture sees the flag flipped, so the ONNX model takes the
    initialising branch the eager model no longer takes; verification refuses it."""
    torch.manual_seed(0)
    model = _warm(InitOnce(), torch.randn(8, 4))
    flip = buffers.real_value

    def wrong(buf: torch.Tensor, clone: bool) -> torch.Tensor:
        value = flip(buf, clone)
        return ~value if value.dtype == torch.bool else value

    monkeypatch.setattr(buffers, "real_value", wrong)
    r = onnxmedic.export(model, (torch.randn(3, 4),))
    assert not r.ok
    assert "OM116" in codes(r)
    assert any(c.startswith("OM6") for c in codes(r)), codes(r)


def test_buffers_known_restores_torch_after_an_error():
    import torch.export._trace as trace
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    originals = (trace._fakify_params_buffers, ShapeEnv._log_real_tensor_propagation,
                 FakeTensorMode._dispatch_impl)
    with pytest.raises(Exception, match="data-dependent"), \
            buffers.buffers_known(InputBranch(), buffers.Decided()):
        torch.export.export(InputBranch(), (torch.ones(2, 3),), strict=False)
    assert (trace._fakify_params_buffers, ShapeEnv._log_real_tensor_propagation,
            FakeTensorMode._dispatch_impl) == originals


def test_torchdiffeq_rk4_exports_with_its_time_grid_buffer(tmp_path):
    pytest.importorskip("torchdiffeq")
    from torchdiffeq import odeint

    class ODEBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                         torch.nn.Linear(16, 4))
            self.register_buffer("t", torch.tensor([0.0, 1.0]))

        def forward(self, y0: torch.Tensor) -> torch.Tensor:
            return odeint(lambda t, y: self.f(y), y0, self.t, method="rk4",
                          options={"step_size": 0.25})[-1]

    torch.manual_seed(0)
    model = ODEBlock().eval()
    before = snapshot_state(model)
    path = tmp_path / "rk4.onnx"
    r = onnxmedic.export(model, (torch.randn(2, 4),), path, dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM116" in codes(r) and "OM114" not in codes(r)
    assert any(g["code"].startswith("if len(t) > 1 and t[0] > t[1]")
               for g in next(f for f in r.findings if f.code == "OM116").details["guards"])
    ver = onnxmedic.verify(path, model, (torch.randn(5, 4),))
    assert ver.ok, [f.one_paragraph() for f in ver.findings]
    assert state_differences(before, snapshot_state(model)) == []
