"""Capture with validation off (issue 15): library switches and check-only branches.

Each test fails without the recovery (capture falls back to draft_export's OM114, or fails with
OM112) and passes with it; the global settings are as they were afterwards, and verification
still judges the recovered model against the eager one (an injected fault is refused)."""

from __future__ import annotations

import warnings

import pytest
import torch

import onnxmedic
from onnxmedic.capture import validation
from onnxmedic.capture.strategies import CAPTURE_STRATEGIES, ValidationOff


def codes(r):
    return [f.code for f in r.findings]


def om115(r):
    return next(f for f in r.findings if f.code == "OM115")


class ValidatedNormal(torch.nn.Module):
    """torch.distributions with validate_args=True: `if not valid.all(): raise ValueError`."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = torch.nn.Parameter(torch.tensor([0.0, 1.0, -1.0]))
        self.log_scale = torch.nn.Parameter(torch.tensor([0.0, 0.5, -0.5]))

    def forward(self, x):
        d = torch.distributions.Normal(self.loc, self.log_scale.exp(), validate_args=True)
        return d.log_prob(x).sum(-1)


class DefaultValidated(torch.nn.Module):
    """Validation by torch's default (on in debug Python): the switch is what turns it off."""

    def forward(self, x):
        d = torch.distributions.Normal(torch.zeros(3), x.exp())
        return d.log_prob(torch.ones(3)).sum(-1)


class Checked(torch.nn.Module):
    """Checks that only raise or warn: a compound assert (torchdiffeq's time grid check) and
    an `if` whose body only raises, and one that only warns."""

    def forward(self, x, t):
        d = t[1:] > t[:-1]
        assert d.all() or (~d).all(), "t must be strictly increasing or decreasing"
        if torch.isnan(x).any():
            raise ValueError("NaN input")
        if not (x.abs() < 1e6).all():
            warnings.warn("large input", stacklevel=2)
        return x * t.sum()


class Branchy(torch.nn.Module):
    """A genuine data-dependent branch: not a check, so not decided by ValidationOff."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_validation_off_comes_before_draft_export():
    names = [c.__name__ for c in CAPTURE_STRATEGIES]
    assert names.index("ValidationOff") < names.index("DraftExportSpecialised")


def test_distribution_with_validate_args_is_captured_with_checks_taken_as_passing():
    before = torch.distributions.Distribution._validate_args
    r = onnxmedic.export(ValidatedNormal().eval(), (torch.randn(4, 3),))
    assert r.ok, r.findings
    assert "OM115" in codes(r) and "OM114" not in codes(r), codes(r)
    f = om115(r)
    assert "torch/distributions/distribution.py" in f.message, f.message
    assert torch.distributions.Distribution._validate_args is before


def test_default_validation_is_switched_off_for_the_capture_and_restored():
    torch.distributions.Distribution.set_default_validate_args(True)
    try:
        r = onnxmedic.export(DefaultValidated().eval(), (torch.randn(3),))
        assert r.ok, r.findings
        f = om115(r)
        assert "torch.distributions validate_args=False" in f.message, f.message
        assert torch.distributions.Distribution._validate_args is True
    finally:
        torch.distributions.Distribution.set_default_validate_args(__debug__)


def test_settings_restored_when_the_capture_raises():
    torch.distributions.Distribution.set_default_validate_args(True)
    try:
        with pytest.raises(RuntimeError), validation.validation_off(validation.Neutralised()):
            assert torch.distributions.Distribution._validate_args is False
            raise RuntimeError("capture failed")
        assert torch.distributions.Distribution._validate_args is True
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        assert ShapeEnv.evaluate_sym_node.__module__ == "torch.fx.experimental.symbolic_shapes"
        assert torch.distributions.Distribution.__init__.__module__ == \
            "torch.distributions.distribution"
    finally:
        torch.distributions.Distribution.set_default_validate_args(__debug__)


def test_assert_and_raise_only_branches_are_taken_as_passing():
    t = torch.tensor([0.0, 0.5, 1.0])
    r = onnxmedic.export(Checked().eval(), (torch.randn(4, 3), t))
    assert r.ok, r.findings
    assert "OM114" not in codes(r), codes(r)
    f = om115(r)
    assert f.details["checks"] == [f"{__file__}:{n}" for n in (54, 55, 57)], f.details
    assert "torch.distributions" not in f.message  # no distribution built: not named


def test_without_the_recovery_the_checks_need_draft_export():
    from onnxmedic.capture.strategies import KnownBuffers, capture

    # the constant-values capture runs with validation off too
    strategies = [c for c in CAPTURE_STRATEGIES if c not in (ValidationOff, KnownBuffers)]

    attempts = capture(Checked().eval(), (torch.randn(4, 3), torch.tensor([0.0, 0.5, 1.0])),
                       {}, strategies=strategies)
    assert "draft_export" in attempts[-1].strategy or attempts[-1].program is None


def test_a_real_branch_is_not_taken_for_a_check():
    r = onnxmedic.export(Branchy(), (torch.ones(2, 3),))
    assert "OM114" in codes(r) and "OM115" not in codes(r), codes(r)


def test_wrongly_decided_branch_is_refused_by_verification(monkeypatch):
    """Injected fault: the recovery decides a real branch (`if x.sum() > 0: return x * 2`) as
    not taken; verification against the eager model refuses the result."""

    def wrong(frame):
        return False, (frame.f_code.co_filename, frame.f_lineno, "injected")

    monkeypatch.setattr(validation, "check_only_value", wrong)
    r = onnxmedic.export(Branchy(), (torch.ones(2, 3),))
    assert not r.ok
    assert "OM115" in codes(r)
    assert any(c.startswith("OM6") for c in codes(r)), codes(r)


@pytest.mark.parametrize("src,expect", [
    ("assert a.all() or (~a).all()", True),
    ("assert not bad.any()", False),
    ("if bad.any():\n    raise ValueError('x')", False),
    ("if not ok.all():\n    warnings.warn('x')", True),
    ("if x.sum() > 0:\n    y = 2", None),
    ("if bad.any():\n    raise ValueError('x')\nelse:\n    y = 1", None),
    ("assert a.all() or not b.all()", None),
])
def test_check_only_value(source_frame, src, expect):
    got = validation.check_only_value(source_frame(src))
    assert (got[0] if got else None) == expect


def test_pyro_mixture_uses_pyro_switch_and_restores_it():
    pytest.importorskip("pyro")
    import pyro.distributions as dist
    from pyro.distributions import util

    class Mixture(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logits = torch.nn.Parameter(torch.tensor([0.1, -0.3, 0.5]))
            self.loc = torch.nn.Parameter(torch.tensor([[-1.0, 0.0], [0.5, 1.0], [2.0, -1.0]]))

        def forward(self, x):
            comp = dist.Normal(self.loc, torch.ones(3, 2)).to_event(1)
            return dist.MixtureSameFamily(dist.Categorical(logits=self.logits),
                                          comp).log_prob(x)

    before = (util.is_validation_enabled(), torch.distributions.Distribution._validate_args)
    r = onnxmedic.export(Mixture().eval(), (torch.randn(5, 2),))
    assert r.ok, r.findings
    assert "OM114" not in codes(r), codes(r)
    assert "pyro.enable_validation(False)" in om115(r).message
    assert (util.is_validation_enabled(),
            torch.distributions.Distribution._validate_args) == before


def test_gpytorch_switches_are_restored():
    pytest.importorskip("gpytorch")
    import gpytorch
    import linear_operator

    before = (gpytorch.settings.debug.on(), gpytorch.settings.trace_mode.on(),
              linear_operator.settings.trace_mode.on())
    with validation.validation_off(rec := validation.Neutralised()):
        assert gpytorch.settings.trace_mode.on() and linear_operator.settings.trace_mode.on()
        assert not gpytorch.settings.debug.on()
    assert "linear_operator.settings.trace_mode(True)" in rec.switches
    assert (gpytorch.settings.debug.on(), gpytorch.settings.trace_mode.on(),
            linear_operator.settings.trace_mode.on()) == before


def test_om112_names_the_guarding_line_left_after_validation_off():
    """The precise OM112 names the statement of the remaining guard (from the validation-off
    attempt, whose checks are already past), not only the user's call into the library."""
    from onnxmedic.capture.strategies import Result, guard_line

    def library_branch():
        raise RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)")

    try:
        library_branch()
    except RuntimeError as e:
        err = e
    got = guard_line([Result(None, "torch.export(strict=False), validation off", err)])
    assert got is not None and got[0] == __file__
    assert got[2] == 'raise RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)")'
