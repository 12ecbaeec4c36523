"""Python control flow on a tensor value that depends on no input - a time grid the model builds
in forward with torch.linspace / torch.arange (torchcde's splines, torchdiffeq's fixed-step
grid), a parameter's value - is decided at capture by that value, the same for every input
(OM119); a guard that involves an input, random numbers, or a constant an input was written
into is not decided this way."""

from __future__ import annotations

import torch

import onnxmedic
from onnxmedic.capture import buffers
from onnxmedic.capture.strategies import (
    CAPTURE_STRATEGIES,
    KnownBuffers,
    TorchExportNonStrict,
    capture,
    classify_capture_error,
)
from tests._state import snapshot_state, state_differences


def codes(r):
    return [f.code for f in r.findings]


class GridSteps(torch.nn.Module):
    """A time grid built in forward from constants and a static size; the direction test and
    the step count (``int(... .item())``) read it, and a Python loop runs that many steps."""

    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(4, 4)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        t = torch.linspace(0, 1, y.shape[-1] + 1)  # the static feature dim: 5 points
        if t[0] > t[1]:
            t = -t
        n = int(((t[-1] - t[0]) / 0.25).item())
        for _ in range(n):
            y = y + 0.25 * torch.tanh(self.f(y))
        return y


class FixedStepGrid(torch.nn.Module):
    """torchdiffeq's fixed-step solver (rk4 with step_size): the step count read with
    ``.item()``, the grid built by ``arange`` of it, the solver iterating over its pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(4, 4)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        t = torch.linspace(0, 1, 3)
        if len(t) > 1 and t[0] > t[1]:
            t = -t
        niters = torch.ceil((t[-1] - t[0]) / 0.25 + 1).item()
        grid = torch.arange(0, niters, dtype=t.dtype) * 0.25 + t[0]
        grid[-1] = t[-1]
        for t0, t1 in zip(grid[:-1], grid[1:]):
            y = y + (t1 - t0) * torch.tanh(self.f(y))
        return y


class AttributeGrid(torch.nn.Module):
    """A grid kept as a plain tensor attribute (not a buffer): a constant of the ONNX file."""

    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(4, 4)
        self.t = torch.linspace(0, 1, 5)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        n = int(((self.t[-1] - self.t[0]) / 0.25).item())
        for _ in range(n):
            y = y + 0.25 * torch.tanh(self.f(y))
        return y


class LiteralWritten(torch.nn.Module):
    """A tensor literal written in place with a constant, then read: the value after the
    write."""

    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(4, 4)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([0.0, 1.0])
        t[0] = -1.0
        n = int(((t[-1] - t[0]) / 0.25).item())
        for _ in range(n):
            y = y + 0.25 * torch.tanh(self.f(y))
        return y


class ParameterGate(torch.nn.Module):
    """A branch on a parameter's value (a learned gate)."""

    def __init__(self, gate: float = 0.5) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.gate = torch.nn.Parameter(torch.tensor(gate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate > 0:
            x = self.lin(x)
        return x * torch.sigmoid(self.gate)


class InputBranch(torch.nn.Module):
    """A branch on an input scaled by a grid built from constants: not decidable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.linspace(0, 1, 5)
        if (x.sum() * t[-1]) > 0:
            return x * 2
        return -x


class RandomBranch(torch.nn.Module):
    """A branch on a random number drawn in forward: input-free but not the same on every call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) < 2.0:  # always true, but a random draw: never decided from a value
            return x * 2
        return -x


class WrittenThroughView(torch.nn.Module):
    """A constant tensor an input is added into, read through a view taken before the write:
    the view's value depends on the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(2)
        first = t[0:1]
        t.add_(x.sum())
        if first.item() > 0:
            return x * 2
        return -x


class ClampsItsParameter(torch.nn.Module):
    """Clamps a parameter in place in forward, then branches on it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.clamp_(0.0, 0.1)
        if self.scale > 0.2:  # 0.1 once clamped
            return x * self.scale
        return -x


def _without_strategy_fails_or_specialises(model: torch.nn.Module, *args: torch.Tensor) -> None:
    others = [s for s in CAPTURE_STRATEGIES if s is not KnownBuffers]
    attempts = capture(model, args, {}, None, strategies=others)
    assert not attempts[-1].ok or "draft_export" in attempts[-1].strategy


def test_a_grid_built_in_forward_decides_direction_and_step_count(tmp_path):
    torch.manual_seed(0)
    model = GridSteps().eval()
    _without_strategy_fails_or_specialises(model, torch.randn(3, 4))
    before = snapshot_state(model)
    path = tmp_path / "grid.onnx"
    r = onnxmedic.export(model, (torch.randn(3, 4),), path, dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM114" not in codes(r) and "OM116" not in codes(r)
    om119 = next(f for f in r.findings if f.code == "OM119")
    assert om119.severity == "info"
    assert [(g["code"], g["read"]) for g in om119.details["guards"]] == [
        ("if t[0] > t[1]:", "reads False"),
        ("n = int(((t[-1] - t[0]) / 0.25).item())", "reads 4.0")]
    assert om119.location.code == "if t[0] > t[1]:" and om119.location.line
    assert om119.details["parameters"] == {}
    summary = r.verification_summary()
    assert summary and all(v["max_abs"] < 1e-4 for v in summary.values())
    ver = onnxmedic.verify(path, model, (torch.randn(7, 4),))
    assert ver.ok, [f.one_paragraph() for f in ver.findings]
    assert state_differences(before, snapshot_state(model)) == []


def test_a_fixed_step_grid_from_item_and_arange_is_unrolled(tmp_path):
    torch.manual_seed(0)
    model = FixedStepGrid().eval()
    _without_strategy_fails_or_specialises(model, torch.randn(3, 4))
    path = tmp_path / "steps.onnx"
    r = onnxmedic.export(model, (torch.randn(3, 4),), path, dynamic_shapes=({0: "batch"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM114" not in codes(r)
    om119 = next(f for f in r.findings if f.code == "OM119")
    assert [g["read"] for g in om119.details["guards"]] == ["reads False", "reads 5.0"]
    ver = onnxmedic.verify(path, model, (torch.randn(2, 4),))
    assert ver.ok, [f.one_paragraph() for f in ver.findings]


def test_a_plain_tensor_attribute_and_a_written_literal_are_read_as_constants():
    torch.manual_seed(0)
    grid = AttributeGrid().eval()
    for model, read in ((grid, "reads 4.0"), (LiteralWritten().eval(), "reads 8.0")):
        _without_strategy_fails_or_specialises(model, torch.randn(3, 4))
        r = onnxmedic.export(model, (torch.randn(3, 4),), dynamic_shapes=({0: "batch"},))
        assert r.ok, [f.one_paragraph() for f in r.findings]
        assert "OM114" not in codes(r)
        om119 = next(f for f in r.findings if f.code == "OM119")
        assert [g["read"] for g in om119.details["guards"]] == [read]
    assert torch.equal(grid.t, torch.linspace(0, 1, 5))  # the model's own tensor, untouched


def test_a_branch_on_a_parameter_is_decided_by_its_value():
    torch.manual_seed(0)
    for gate, linear in ((0.5, True), (-0.5, False)):
        model = ParameterGate(gate).eval()
        before = snapshot_state(model)
        r = onnxmedic.export(model, (torch.randn(3, 4),), dynamic_shapes=({0: "batch"},))
        assert r.ok, [f.one_paragraph() for f in r.findings]
        assert "OM114" not in codes(r)
        om119 = next(f for f in r.findings if f.code == "OM119")
        assert om119.details["parameters"] == {"gate": repr(gate)}
        assert om119.details["guards"][0]["code"] == "if self.gate > 0:"
        gemms = [n for n in r.onnx_model.graph.node if n.op_type in ("Gemm", "MatMul")]
        assert bool(gemms) is linear  # the branch the parameter selects, and only it
        assert state_differences(before, snapshot_state(model)) == []


def test_a_guard_on_an_input_is_not_decided():
    model = InputBranch().eval()
    attempts = capture(model, (torch.ones(2, 3),), {}, None,
                       strategies=[TorchExportNonStrict, KnownBuffers])
    assert [a.strategy for a in attempts] == [TorchExportNonStrict.name, KnownBuffers.name]
    assert not attempts[-1].ok and "data-dependent" in str(attempts[-1].error)
    assert attempts[-1].decided.constant == []
    assert classify_capture_error(attempts).code == "OM112"
    r = onnxmedic.export(model, (torch.ones(2, 3),))
    assert "OM119" not in codes(r)


def test_random_numbers_and_values_an_input_was_written_into_are_not_decided():
    for model in (RandomBranch(), WrittenThroughView()):
        attempts = capture(model.eval(), (torch.ones(2, 3),), {}, None,
                           strategies=[TorchExportNonStrict, KnownBuffers])
        assert not attempts[-1].ok, type(model).__name__
        assert attempts[-1].decided.constant == [], type(model).__name__
        assert classify_capture_error(attempts).code == "OM112"


def test_the_models_own_parameters_are_never_written(monkeypatch):
    """Beyond the copy budget the model's own tensors carry the values; an in-place write of
    one is then not run on the values (and what it wrote is not known)."""
    monkeypatch.setattr(buffers, "CLONE_LIMIT", 0)
    model = ClampsItsParameter().eval()
    attempts = capture(model, (torch.ones(2, 3),), {}, None,
                       strategies=[TorchExportNonStrict, KnownBuffers])
    assert not attempts[-1].ok and attempts[-1].decided.constant == []
    assert model.scale.item() == 0.5
    # with a copy, the write runs on the copy and the guard reads what it wrote
    monkeypatch.setattr(buffers, "CLONE_LIMIT", 2**20)
    attempts = capture(model, (torch.ones(2, 3),), {}, None,
                       strategies=[TorchExportNonStrict, KnownBuffers])
    assert attempts[-1].ok
    assert [g[3] for g in attempts[-1].decided.constant] == ["reads False"]
    assert model.scale.item() == 0.5


def test_a_wrongly_decided_parameter_branch_is_refused_by_verification(monkeypatch):
    """Injected fault: the capture sees the gate's sign flipped, so the ONNX model skips the
    linear layer the eager model applies; verification refuses the file."""
    torch.manual_seed(0)
    flip = buffers.real_value

    def wrong(t: torch.Tensor, clone: bool) -> torch.Tensor:
        value = flip(t, clone)
        return -value if value.dim() == 0 else value

    monkeypatch.setattr(buffers, "real_value", wrong)
    r = onnxmedic.export(ParameterGate(0.5).eval(), (torch.randn(3, 4),))
    assert not r.ok
    assert "OM119" in codes(r)
    assert any(c.startswith("OM6") for c in codes(r)), codes(r)
