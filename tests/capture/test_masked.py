"""``if torch.any(m):`` whose body only writes through ``m``, taken for every input (issue 15,
capture/masked.py, OM117).

nflows' rational-quadratic splines compute the spline on the inputs inside the tail bound and
write the results back through the mask, skipping the call when no input is inside; the guard
failed every capture (OM112). With nothing selected such a body writes nothing, so taking it
for every input is the same computation; any other body keeps OM112."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from onnxmedic.capture import masked
from onnxmedic.capture.strategies import ValidationOff, capture
from onnxmedic.inputs import Inputs
from onnxmedic.verify.input_sets import branch_probe_sets

BOUND = 3.0


def codes(r):
    return [f.code for f in r.findings]


def spline(x, w, inverse=False, bound=1.0):
    """A stand-in for nflows' rational_quadratic_spline: a domain check that only raises,
    then elementwise work on the selected rows."""
    if torch.min(x) < -bound or torch.max(x) > bound:
        raise ValueError("input outside the domain")
    y = torch.tanh(x / bound) * w[:, 0].exp() + w[:, 1]
    return (-y if inverse else y), torch.log1p(x * x) + w[:, 0]


class MaskedSpline(torch.nn.Module):
    """nflows' unconstrained_rational_quadratic_spline, library-free: identity outside the
    bound, the spline inside, written through the mask under `if torch.any(mask)`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)

    def forward(self, x):
        w = self.lin(x).reshape(x.shape[0], 4, 2)
        inside = (x >= -BOUND) & (x <= BOUND)
        out = torch.zeros_like(x)
        lad = torch.zeros_like(x)
        out[~inside] = x[~inside]
        if torch.any(inside):
            out[inside], lad[inside] = spline(x[inside], w[inside, :], inverse=False,
                                              bound=BOUND)
        return out, lad


class MethodForm(torch.nn.Module):
    """``m.any()`` and an augmented write through the mask."""

    def forward(self, x):
        m = x > 0
        out = x.clone()
        if m.any():
            out[m] += torch.sqrt(x[m])
        return out


class AlsoWritesWhole(torch.nn.Module):
    """The body writes through the mask and also changes a tensor as a whole: with nothing
    selected it still changes `out`, so it is a real branch."""

    def forward(self, x):
        m = (x >= -BOUND) & (x <= BOUND)
        out = torch.zeros_like(x)
        out[~m] = x[~m]
        if torch.any(m):
            out[m] = torch.tanh(x[m])
            out = out + 1
        return out


class ReturnsInBody(torch.nn.Module):
    """The body returns: the other path returns something else."""

    def forward(self, x):
        m = x > BOUND
        if torch.any(m):
            return x[m].sum() * x
        return x


def example() -> torch.Tensor:
    """Values inside and outside the bound (a partly selected mask)."""
    return torch.linspace(-5.0, 5.0, 24).reshape(6, 4)


def test_masked_branch_exports_and_verifies_on_none_all_and_some_selected():
    """Failed with OM112 (GuardOnDataDependentSymNode at `if torch.any(inside)`)."""
    torch.manual_seed(0)
    model, x = MaskedSpline().eval(), example()
    for dims in (None, ({0: "batch"},)):
        r = onnxmedic.export(model, (x,), dynamic_shapes=dims)
        assert r.ok, [(f.code, f.message[:300]) for f in r.findings]
        assert "OM114" not in codes(r) and "OM112" not in codes(r), codes(r)
        f = next(f for f in r.findings if f.code == "OM117")
        assert f.severity == "info" and f.location.file == __file__
        assert f.location.code == "if torch.any(inside):"
        assert f.details["sites"][0]["mask"] == "inside"
        assert "OM115" in codes(r)  # the spline's domain check, taken as passing
        by_set = {c.input_set for c in r.verification}
        assert {"example", "scaled x100", "zeros", "negated",
                "every third element x100"} <= by_set, by_set
        assert all(c.ok and c.max_abs < 1e-5 for c in r.verification)
    # the example and the every-third probe select some elements, x100 none, zeros all
    sets = {s.specs[-1]: s.args[0] for s in branch_probe_sets(Inputs((x,), {}), masks=True)}
    for probe in (x, sets["every third element x100"]):
        inside = probe.abs() <= BOUND
        assert inside.any() and not inside.all()
    assert not (sets["scaled x100"].abs() <= BOUND).any()
    assert (sets["zeros"].abs() <= BOUND).all()


def test_every_third_probe_only_with_masks():
    x = torch.randn(3, 4)
    plain = [s.specs[-1] for s in branch_probe_sets(Inputs((x,), {}))]
    assert "every third element x100" not in plain
    probe = branch_probe_sets(Inputs((x,), {}), masks=True)[-1].args[0]
    scaled = (probe != x).reshape(-1)
    assert scaled.tolist() == [i % 3 == 0 for i in range(12)]
    assert set(torch.nonzero(scaled.reshape(3, 4))[:, 1].tolist()) == {0, 1, 2, 3}


def test_without_the_decision_the_masked_branch_fails_with_om112(monkeypatch):
    monkeypatch.setattr(masked, "masked_write_value", lambda frame: None)
    r = onnxmedic.export(MaskedSpline().eval(), (example(),))
    assert not r.ok and "OM112" in codes(r) and "OM117" not in codes(r), codes(r)


def test_method_form_and_augmented_write_are_decided():
    x = torch.linspace(-2.0, 2.0, 10)
    res = ValidationOff()(MethodForm(), (x,), {}, None)
    assert res.ok, res.error
    assert [s.code for s in res.neutralised.masked] == ["if m.any():"]


@pytest.mark.parametrize("model", [AlsoWritesWhole(), ReturnsInBody()])
def test_a_body_that_does_more_than_write_through_the_mask_keeps_om112(model):
    r = onnxmedic.export(model, (example(),))
    assert not r.ok and "OM112" in codes(r), codes(r)
    assert "OM117" not in codes(r)


def test_a_wrongly_taken_branch_is_refused_by_verification(monkeypatch):
    """Injected fault: AlsoWritesWhole's branch (which adds 1 to every output) taken for every
    input; the probe that selects nothing (x100) shows the mismatch."""

    def wrong(frame):
        return masked.MaskedSite(frame.f_code.co_filename, frame.f_lineno, "injected", "m")

    monkeypatch.setattr(masked, "masked_write_value", wrong)
    r = onnxmedic.export(AlsoWritesWhole(), (example(),))
    assert not r.ok and "OM117" in codes(r), codes(r)
    bad = {c.input_set for c in r.verification if not c.ok}
    assert "scaled x100" in bad, bad


_T = torch.zeros(4)
_M = torch.zeros(4, dtype=torch.bool)


@pytest.mark.parametrize("src,decided", [
    ("if torch.any(m):\n    out[m] = f(x[m], w[m, :], k=2.0)", True),
    ("if m.any():\n    out[m], lad[m] = f(x[m, ...], inverse=False)", True),
    ("if torch.any(m):\n    out[m] += x[m].exp() * s", True),
    ("if torch.any(m):\n    out[m] = x[m]\nelse:\n    out[m] = 0", False),   # an else
    ("if torch.any(m):\n    out[m] = x[m] + x.sum()", False),              # x read whole
    ("if torch.any(m):\n    out[m] = x[m]\n    y = 1", False),             # a name assigned
    ("if torch.any(m):\n    out[m] = x[m]\n    out.add_(1)", False),       # a bare call
    ("if torch.any(m):\n    out[~m] = x[~m]", False),                      # another mask
    ("if torch.any(m):\n    out[m, 0] = x[m]", False),                     # more than the mask
    ("if torch.any(m):\n    out[m] = mod(x[m])", False),                   # a module call
    ("if torch.any(m):\n    out[m] = (lambda v: v)(x[m])", False),
    ("if torch.any(x):\n    out[x] = x[x]", False),                        # not a bool tensor
    ("if torch.any(m):\n    return x[m]", False),
    ("if torch.all(m):\n    out[m] = x[m]", False),
])
def test_masked_write_value(source_frame, src, decided):
    frame = source_frame(src, f_locals={"m": _M, "out": _T.clone(), "lad": _T.clone(), "x": _T,
                                        "w": _T, "s": 2.0, "mod": torch.nn.Identity()},
                         f_globals={"torch": torch, "f": spline})
    site = masked.masked_write_value(frame)
    assert (site is not None) == decided, src
    if decided:
        assert site.line == 1 and site.mask == "m"


def test_the_decision_is_active_only_with_validation_off():
    """The plain first attempt still fails (and is reported as OM110), so a model that needs
    no recovery never goes through one."""
    r = capture(MaskedSpline().eval(), (example(),), {})
    assert not r[0].ok and "data-dependent" in str(r[0].error)
    assert r[-1].ok and r[-1].strategy == ValidationOff.name
    assert [s.mask for s in r[-1].neutralised.masked] == ["inside"]
