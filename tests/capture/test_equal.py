"""torch.equal during capture (capture/equal.py) and draft_export's real values (issue 15).

gpytorch's kernels branch on ``torch.equal(x1, x2)``; torch raises DataDependentOutputException
for it in every capture, draft_export included (OM112). Computed as a data-dependent guard, it
is decided by the sizes, by known values, or by the example under draft_export (OM114, which
names the call and what it gave); verification on other inputs catches a wrong outcome. And
draft_export's real-tensor propagation must see the parameters' values, not uninitialised
memory (torch copies the data of plain tensors only)."""

from __future__ import annotations

import torch

import onnxmedic
from onnxmedic.capture.equal import equal_as_guard, equal_decomposed


def codes(r):
    return [f.code for f in r.findings]


class EqualFastPath(torch.nn.Module):
    """A kernel's fast path (gpytorch's covar_dist): the squared distances of the points to
    themselves, whose diagonal is zeroed when x1 equals x2 - true for every input here."""

    def __init__(self) -> None:
        super().__init__()
        self.lengthscale = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        x1, x2 = x / self.lengthscale, x / self.lengthscale
        d = ((x1[:, None, :] - x2[None, :, :]) ** 2).sum(-1)
        if torch.equal(x1, x2):
            d = d * (1 - torch.eye(d.shape[0]))
        return torch.exp(-0.5 * d)


class EqualInputs(torch.nn.Module):
    """A branch on torch.equal of two inputs: the example has them equal, other inputs not."""

    def forward(self, x, y):
        if torch.equal(x, y):
            return x * 2
        return x + 3 * y


class ParameterBranch(torch.nn.Module):
    """A branch on a value computed from a parameter only (not a buffer): decided by the
    parameter's real value (the constant-values capture, OM119; draft_export without it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(1.0, 5.0))

    def forward(self, x):
        if (self.w == torch.arange(1.0, 5.0)).all():
            return x * self.w
        return x - 1


def test_equal_decomposed_follows_torch_equal() -> None:
    a = torch.tensor([1.0, 2.0])
    cases = [(a, a.clone()), (a, torch.tensor([1.0, 3.0])), (a, torch.tensor([[1.0, 2.0]])),
             (torch.zeros(2, 1), torch.zeros(1, 2)), (torch.zeros(0, 3), torch.zeros(0, 3)),
             (torch.tensor([1, 2]), a), (torch.tensor([float("nan")]),) * 2]
    for x, y in cases:
        assert bool(equal_decomposed(x, y)) == torch.equal(x, y), (x, y)
    with equal_as_guard() as sites:  # eager: the same answers, each read from the values
        assert [torch.equal(x, y) for x, y in cases] == [torch.equal(x, y) for x, y in cases]
        assert a.equal(a.clone())
    assert sites and all(s.file == __file__ for s in sites)


def test_torch_equal_fast_path_exports_and_verifies(tmp_path) -> None:
    """Failed with OM112 (DataDependentOutputException: aten.equal.default in every attempt)."""
    x = torch.rand(7, 2, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(EqualFastPath(), (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "points"},))
    assert r.ok, [(f.code, f.message[:300]) for f in r.findings]
    om114 = next(f for f in r.findings if f.code == "OM114")
    assert "torch.equal" in om114.message and "gave True" in om114.message
    assert om114.details["equal"][0]["at"].endswith(f"{__file__}:33")


def test_a_wrong_torch_equal_outcome_is_caught_by_verification(tmp_path) -> None:
    """The example has x == y, so the ONNX model takes `x * 2` for every input; verification's
    other input sets (x and y permuted apart) take the other branch and refuse the file."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(EqualInputs(), (x, x.clone()), tmp_path / "m.onnx")
    assert "OM114" in codes(r)
    assert not r.ok and r.stages["compare"] == "failed"
    assert not (tmp_path / "m.onnx").exists()


def test_draft_export_decides_a_branch_by_the_parameters_values(tmp_path) -> None:
    """torch's real-tensor propagation gave a Parameter's fake uninitialised memory, so the
    branch went by garbage (and verification refused the file, or passed by luck). The
    branch depends on no input, so the constant-values capture decides it first (OM119);
    draft_export, without that strategy, must decide it by the real values too."""
    from onnxmedic.capture.strategies import CAPTURE_STRATEGIES, KnownBuffers, capture

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    model = ParameterBranch()
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx")
    assert "OM119" in codes(r) and "OM114" not in codes(r)
    assert r.ok, [(f.code, f.message[:300]) for f in r.findings]
    attempts = capture(model, (x,), {}, None,
                       strategies=[s for s in CAPTURE_STRATEGIES if s is not KnownBuffers])
    assert "draft_export" in attempts[-1].strategy and attempts[-1].ok
    torch.testing.assert_close(attempts[-1].program.module()(x), model(x))
