"""Each capture attempt leaves the model as it found it (issue 15, gpytorch SVGP).

A capture runs the model's Python on fake tensors; what it writes on the model - a memo cache
filled on a plain object the model holds (linear_operator's ``_memoize_cache`` on a cached
distribution) - would hold fake tensors of a trace that is over, which a later attempt reads
("fake tensor in the exported program constant's list"). And a draft_export program is
decomposed without real-tensor propagation (its parameters' fakes carry no values then), and
a first call that initialises parameters through ``.data`` is seen (OM126)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

import onnxmedic
from onnxmedic import borrow
from onnxmedic.capture.strategies import capture


class Scaled:
    """A plain object the model holds, with a memo cache of a value it derives (as
    linear_operator's operators memoise their Cholesky factors)."""

    def __init__(self, loc: torch.Tensor) -> None:
        self.loc = loc
        self._memo: dict[str, torch.Tensor] = {}

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in self._memo:
            self._memo["scale"] = (self.loc * 2 + x.mean()).detach()
        return self._memo["scale"]


class MemoBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loc = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.held = Scaled(self.loc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.held.scale(x)
        if y.sum() > 0:  # data-dependent: only draft_export captures it
            return y + 1
        return y - 1


def _fakes(obj: object) -> list[str]:
    return [k for k, v in vars(obj).items() if isinstance(v, FakeTensor)] + [
        k for k, v in getattr(obj, "_memo", {}).items() if isinstance(v, FakeTensor)]


def test_failed_attempts_leave_no_fake_tensor_on_objects_the_model_holds() -> None:
    model = MemoBranch().eval()
    x = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])
    attempts = capture(model, (x,), {})
    assert not attempts[0].ok  # the data-dependent branch
    assert attempts[-1].ok and "draft_export" in attempts[-1].strategy, [
        a.summary() for a in attempts]
    assert model.held._memo == {} and not _fakes(model.held)


def test_reach_records_and_puts_back_nested_caches() -> None:
    model = MemoBranch()
    before = dict(model.held.__dict__)
    state = borrow.record_state(model, values=False, reach=True)
    model.held._memo["scale"] = torch.ones(3)
    model.held.other = 1
    restored, _ = borrow.restore_state(state)
    assert model.held._memo == {} and vars(model.held) == before and restored


class FirstCallInit(torch.nn.Module):
    """gpytorch's variational strategy: on the first call, parameters are initialised through
    ``.data.copy_`` (no version counter of the parameter's moves) and a flag is set."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = torch.nn.Parameter(torch.zeros(3))
        self.register_buffer("initialised", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialised.item():
            self.mean.data.copy_(torch.tensor([1.0, 2.0, 3.0]))
            self.initialised.fill_(1)
        return x + self.mean


def test_parameters_initialised_through_data_are_seen() -> None:
    model = FirstCallInit().eval()
    res = onnxmedic.export(model, (torch.randn(2, 3),))
    om126 = [f for f in res.findings if f.code == "OM126"]
    assert om126 and om126[0].details["parameters"] == ["mean"], [
        (f.code, f.message[:200]) for f in res.findings]
    assert res.ok


class CholeskyBranch(torch.nn.Module):
    """A Cholesky of a parameter and a data-dependent branch: captured by draft_export, then
    decomposed; with real-tensor propagation left on, the decomposition runs the Cholesky on
    the uninitialised memory of the parameter's fake."""

    def __init__(self) -> None:
        super().__init__()
        self.cov = torch.nn.Parameter(torch.tensor([[2.0, 0.3], [0.3, 1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chol = torch.linalg.cholesky(self.cov)
        if chol.diagonal().min() > 0:  # on the parameter's values: true for every input
            return x @ chol
        return x


def test_draft_export_program_decomposes_without_real_values(monkeypatch) -> None:
    from onnxmedic.capture import strategies

    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # the branch reads parameters only: the constant-values capture decides it (OM119) ...
    res = onnxmedic.export(CholeskyBranch().eval(), (x,))
    assert res.ok and "OM119" in [f.code for f in res.findings]
    # ... and without it, draft_export's program must decompose too
    monkeypatch.setattr(strategies, "CAPTURE_STRATEGIES", [
        s for s in strategies.CAPTURE_STRATEGIES if s is not strategies.KnownBuffers])
    res = onnxmedic.export(CholeskyBranch().eval(), (x,))
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings if f.severity.value == "error"]
    assert "OM114" in [f.code for f in res.findings]


class Converge(torch.nn.Module):
    """A loop whose trip count depends on the values (a convergence loop)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while x.abs().max() > 1:
            x = x / 2
        return x


def test_a_value_dependent_while_loop_is_named_with_what_to_change() -> None:
    from onnxmedic.capture.strategies import TorchExportNonStrict, classify_capture_error

    # draft_export unrolls the loop for the example (verification then catches it: OM601);
    # the finding of the attempts that stop at the guard names the loop
    attempts = capture(Converge(), (torch.tensor([3.0, -5.0]),), {},
                       strategies=[TorchExportNonStrict])
    f = classify_capture_error(attempts)
    assert f.code == "OM112" and "inside the loop at" in f.message, f.message
    assert "while x.abs().max() > 1" in f.message and f.details["loop"].endswith(
        f":{Converge.forward.__code__.co_firstlineno + 1}")
    assert "fixed number of iterations" in f.suggestion and "while_loop" in f.suggestion
