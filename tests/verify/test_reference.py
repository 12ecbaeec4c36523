"""The float64 reference (verify/reference.py) and what happens without one."""

from __future__ import annotations

import numpy as np
import torch

import onnxmedic
from onnxmedic.inputs import Inputs
from onnxmedic.verify import reference as ref_mod
from onnxmedic.verify.reference import reference_outputs

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _expected(model, x):
    return [model(x).detach().numpy()]


def test_reference_runs_a_float64_copy_and_leaves_the_model_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    ref = reference_outputs(model, [Inputs((X,), {})], [_expected(model, X)])
    assert ref.why_not is None and ref.dtype == "float64"
    assert ref.outputs[0][0].dtype == np.float64
    assert all(p.dtype == torch.float32 for p in model.parameters())


class CastsItself(torch.nn.Module):
    def forward(self, x):
        return x.float() * 2, x * 3  # the first output is float32 whatever the input


def test_an_output_the_model_computes_in_float32_itself_has_no_reference():
    m = CastsItself()
    exp = [t.numpy() for t in m(X)]
    ref = reference_outputs(m, [Inputs((X,), {})], [exp])
    assert ref.outputs[0][0] is None and ref.outputs[0][1].dtype == np.float64


class Float32Only(torch.nn.Module):
    def forward(self, x):
        return x @ torch.ones(8, 3)  # a float32 constant: float64 inputs fail here


def test_a_model_that_cannot_run_in_float64_verifies_with_om605():
    r = onnxmedic.export(Float32Only(), (X,))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    om605 = [f for f in r.findings if f.code == "OM605"]
    if om605:  # only asked for when the outputs are not within a few ulps anyway
        assert "does not run in float64" in om605[0].message


def test_no_reference_when_the_copy_would_not_fit(monkeypatch):
    monkeypatch.setattr(ref_mod, "MEMORY_SHARE", 1e-12)
    model = torch.nn.Linear(8, 8)
    ref = reference_outputs(model, [Inputs((X,), {})], [_expected(model, X)])
    assert ref.outputs == [] and "GiB" in ref.why_not and "available" in ref.why_not


def test_float16_models_get_a_float32_reference():
    model = torch.nn.Linear(8, 8).half()
    x = X.half()
    ref = reference_outputs(model, [Inputs((x,), {})], [_expected(model, x)])
    assert ref.dtype == "float32" and ref.outputs[0][0].dtype == np.float32


class Cancels(torch.nn.Module):
    def forward(self, x):  # each row sums 64 values near 1e6 and subtracts 64e6: float32
        return (x + 1e6).sum(-1) - 64e6  # keeps ~1/16 of x's precision, in any order


def test_an_unstable_model_gets_om604_not_a_false_om601():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    r = onnxmedic.export(Cancels(), (x,))
    codes = [f.code for f in r.findings]
    assert r.ok and "OM601" not in codes, codes
    (w,) = [f for f in r.findings if f.code == "OM604"]
    assert "numerically unstable" in w.message


def test_the_float64_runs_stop_at_the_time_limit(monkeypatch):
    """Sets after the limit get no reference (judged by the scaled normwise rule), said why."""
    monkeypatch.setattr(ref_mod, "TIME_LIMIT", 0.0)
    model = torch.nn.Linear(8, 8)
    sets = [Inputs((X,), {}), Inputs((X * 2,), {}), Inputs((X * 3,), {})]
    ref = reference_outputs(model, sets, [_expected(model, s.args[0]) for s in sets])
    assert ref.outputs[0][0] is not None and ref.outputs[1] == [None] and ref.outputs[2] == [None]
    assert "took over 0 s" in ref.why_not
