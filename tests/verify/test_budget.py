"""The acceptance rule (verify/budget.py): quiet on float32 rounding, sharp on real faults."""

from __future__ import annotations

import numpy as np
import pytest

from onnxmedic.verify import budget
from onnxmedic.verify.budget import judge_output

RNG = np.random.default_rng(0)


def _deep_sum(n: int = 4096, terms: int = 512):
    """A float64 'true' output, PyTorch-like float32 rounding of it, and an ONNX Runtime-like
    one that summed in another order: both carry float32 accumulation error."""
    parts = RNG.standard_normal((terms, n))
    ref = parts.sum(0)
    p32 = parts.astype(np.float32)
    torch_like = p32.sum(0, dtype=np.float32)
    ort_like = p32[::-1].cumsum(0, dtype=np.float32)[-1]
    return ref, torch_like, ort_like


def test_rounding_of_another_summation_order_is_accepted():
    ref, y, o = _deep_sum()
    c = judge_output("y", y, o, ref)
    assert c.ok and c.rule == budget.RULE_BUDGET
    assert 0.1 < c.ratio < 3 and c.torch_error > 0
    assert c.histogram and sum(n for _, n in c.histogram) == y.size


def test_the_fixed_tolerance_would_have_refused_it():
    """The false alarm this rule replaces: deep float32 sums miss rtol=1e-4/atol=1e-5."""
    ref, y, o = _deep_sum(terms=4096)
    y, o = y * 300, o * 300
    assert not judge_output("y", y, o, ref * 300, tolerance=(1e-4, 1e-5)).ok
    assert judge_output("y", y, o, ref * 300).ok


@pytest.mark.parametrize("delta", [1e-3, 1e-4])
def test_a_relative_change_far_above_pytorchs_own_error_is_caught(delta):
    ref, y, o = _deep_sum()
    c = judge_output("y", y, (o * (1 + delta)).astype(np.float32), ref)
    assert not c.ok and "budget" in c.reason and c.ratio > budget.BUDGET


def test_one_wrong_element_cannot_hide_in_the_norm():
    ref, y, o = _deep_sum(n=100_000)
    bad = o.copy()
    bad[123] += 50 * np.abs(y - ref).max()  # normwise this is nothing
    c = judge_output("y", y, bad, ref)
    assert not c.ok and c.mismatched == 1
    assert np.linalg.norm(bad - ref) < budget.BUDGET * np.linalg.norm(y - ref)


def test_nan_and_inf_positions_must_match():
    ref, y, o = _deep_sum(n=64)
    y[3], ref[3], o[3] = np.nan, np.nan, np.nan
    assert judge_output("y", y, o, ref).ok
    o2 = o.copy()
    o2[5] = np.inf
    c = judge_output("y", y, o2, ref)
    assert not c.ok and c.mismatched == 1
    assert c.reason.startswith("ONNX Runtime's output is infinite at 1 of 64 elements where "
                               "PyTorch's is not that infinity; on the others its error is")
    assert "over the budget" not in c.reason


def test_nan_where_pytorch_has_numbers_is_said_in_words():
    """Every element NaN (a pass that broke the graph at one size) used to read 'ONNX Runtime's
    error is 0x PyTorch's own float32 error; 64 of 64 elements over it'."""
    ref, y, o = _deep_sum(n=64)
    c = judge_output("y", y, np.full_like(o, np.nan), ref)
    assert not c.ok and c.mismatched == 64
    assert c.reason == "ONNX Runtime's output is NaN at 64 of 64 elements where PyTorch's is a number"
    y[:2] = np.nan  # and the reverse, with a real error on the rest
    c = judge_output("y", y, o * 1.01, ref)
    assert c.reason.startswith("ONNX Runtime's output is a number at 2 of 64 elements where "
                               "PyTorch's is NaN; on the others its error is")
    assert c.reason.endswith("62 of them over the budget (10x)")
    c = judge_output("y", y, o * 1.01, None)  # the scaled normwise rule says it too
    assert c.reason.startswith("ONNX Runtime's output is a number at 2 of 64 elements where")
    y[5], o[5] = np.inf, 1.0  # PyTorch's inf, a number here
    assert "finite at 1 of 64 elements where PyTorch's is infinite" in judge_output(
        "y", y, o, ref).reason


def test_integers_and_booleans_are_exact_and_a_user_tolerance_is_kept():
    a = np.arange(10, dtype=np.int64)
    b = a.copy()
    b[4] += 1
    assert judge_output("i", a, a, None).rule == budget.RULE_EXACT
    assert not judge_output("i", a, b, None).ok
    c = judge_output("y", np.ones(3, np.float32), np.ones(3, np.float32) * 1.01, None,
                     tolerance=(0.1, 0.0))
    assert c.ok and c.rule == budget.RULE_FIXED


def test_without_a_reference_the_scaled_normwise_rule_judges():
    ref, y, o = _deep_sum(terms=4096)
    y, o = y * 300, o * 300  # errors of 1e-4 abs at a scale of 1e3: fine normwise
    c = judge_output("y", y, o, None)
    assert c.ok and c.rule == budget.RULE_NORMWISE
    c = judge_output("y", y, (o * 1.001).astype(np.float32), None)  # 1e-3: caught
    assert not c.ok and "scaled normwise" in c.reason


def test_a_reference_at_the_same_precision_is_not_used():
    ref, y, o = _deep_sum(n=64)
    assert judge_output("y", y, o, ref.astype(np.float32)).rule == budget.RULE_NORMWISE


def test_fast_agreement_needs_no_reference_and_sends_the_rest_on():
    y = RNG.standard_normal(1000).astype(np.float32)
    close = (y * (1 + 2e-7)).astype(np.float32)
    assert judge_output("y", y, close, None, fast=True).rule == budget.RULE_AGREE
    far = (y * (1 + 1e-5)).astype(np.float32)
    c = judge_output("y", y, far, None, fast=True)
    assert c.rule == budget.RULE_PENDING  # no verdict yet: the caller runs the reference


def test_an_unstable_model_is_flagged_not_refused():
    x = RNG.standard_normal(1000)
    ref = x  # (x + 1e6) - 1e6 in exact arithmetic
    y = ((x.astype(np.float32) + np.float32(1e6)) - np.float32(1e6)).astype(np.float32)
    c = judge_output("y", y, y.copy(), ref)
    assert c.ok and c.unstable and c.torch_error > budget.UNSTABLE["float32"]


def test_budget_excess_for_intermediate_values():
    """Localisation's form of the rule: rounding of another order stays under 1, one element
    off by 1e-4 of the scale goes over, NaN against a number is inf, no reference is None."""
    ref, y, o = _deep_sum()
    quiet = budget.budget_excess(y, o, ref)
    assert quiet is not None and quiet[0] <= 1.0 and quiet[1] == 0
    bad = o.copy()
    bad[7] += np.float32(1e-4 * np.abs(ref).max())
    score, over = budget.budget_excess(y, bad, ref)
    assert score > 1.0 and over == 1
    nan = o.copy()
    nan[3] = np.nan
    assert budget.budget_excess(y, nan, ref)[0] == np.inf
    assert budget.budget_excess(y, o, None) is None
    assert budget.budget_excess(y, o, ref.astype(np.float32)) is None  # not more precise


# -- other input sets judged by the example's measured error --------------------------------
def test_estimated_budget_accepts_rounding_and_declines_faults():
    """Another set of the same model: ONNX Runtime within (BUDGET - 1) x the example's measured
    float32 error of PyTorch is accepted without a float64 run; a 1e-4 change, or one wrong
    element, is not (the set then gets its own reference and the exact rule)."""
    ref0, y0, _ = _deep_sum()
    scale = budget.torch_error_scale(y0, ref0)
    assert scale is not None and 0 < scale[0] < 1e-5
    _, y, o = _deep_sum()  # another input, same "model"
    c = budget.estimated_budget("y", y, o, scale, input_set="random#1")
    assert c is not None and c.ok and c.rule == budget.RULE_ESTIMATED
    assert c.torch_error == scale[0] and c.histogram
    for delta in (1e-3, 1e-4):
        assert budget.estimated_budget("y", y, (o * (1 + delta)).astype(np.float32), scale,
                                       input_set="random#1") is None
    bad = o.copy()
    bad[7] += 50 * np.abs(y0 - ref0).max()
    assert budget.estimated_budget("y", y, bad, scale, input_set="random#1") is None
    nan = o.copy()
    nan[0] = np.nan
    assert budget.estimated_budget("y", y, nan, scale, input_set="random#1") is None
    assert budget.torch_error_scale(y0, None) is None
    assert budget.torch_error_scale(y0, y0) is None  # the same precision is no reference


def test_only_the_sets_the_estimate_does_not_show_run_in_float64(monkeypatch):
    """The compare stage: the example runs in float64; a clean set is accepted by its error
    (no float64 run); a set with a fault only there still gets its own float64 run and is
    refused by the exact rule."""
    import copy

    import torch

    from onnxmedic.inputs import Inputs
    from onnxmedic.result import ExportResult
    from onnxmedic.stages import verify as stage

    class Offset(torch.nn.Module):  # float32 rounds the sum at 3000's scale: its own error
        def forward(self, h):          # is ~1e-4 of the output, far above float32 agreement
            return (h + 3000.0) - 3000.0

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), Offset(), torch.nn.Linear(64, 64))
    model.eval()
    xs = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    sets = stage.InputSets()
    for label, x in zip(["example", "random#1", "random#2"], xs):
        with torch.no_grad():
            y = model(x).numpy()
        sets.add(label, Inputs((x,)), [y])
    sets.n_required = 3
    # "ONNX Runtime": sums rounded otherwise (here: exactly, then to float32), and a weight
    # fault that only the third set sees (one output row scaled by 1.05)
    high = copy.deepcopy(model).double()
    with torch.no_grad():
        outs = [[high(x.double()).float().numpy()] for x in xs]
        high[-1].weight[3] *= 1.05
        outs[2] = [high(xs[2].double()).float().numpy()]
    ran = []
    real = stage.reference_outputs
    monkeypatch.setattr(stage, "reference_outputs",
                        lambda m, s, e, t=0.0: ran.extend(x.specs[0] for x in s) or real(m, s, e, t))
    for i, s in enumerate(sets.sets):
        s.specs.append(sets.labels[i])
    comps = {i: [budget.judge_output("out", sets.expected[i][0], outs[i][0], None,
                                     input_set=sets.labels[i], fast=True)] for i in range(3)}
    pending = [i for i in range(3) if comps[i][0].rule == budget.RULE_PENDING]
    assert pending == [0, 1, 2], [c[0].rule for c in comps.values()]
    result = ExportResult()
    stage.judge_pending(result, model, sets, outs, ["out"], None, comps, pending)
    assert ran == ["example", "random#2"]  # random#1 needed no float64 run
    assert comps[0][0].ok and comps[0][0].rule == budget.RULE_BUDGET
    assert comps[1][0].ok and comps[1][0].rule == budget.RULE_ESTIMATED
    assert not comps[2][0].ok and comps[2][0].rule == budget.RULE_BUDGET


def test_the_error_histogram_counts_as_numpys_histogram_does():
    """Decades of |error| / rms from 1e-10 to 10: zeros and values on an edge, over the last
    edge and under the first, counted as np.histogram counts them (with its uneven bins)."""
    edges = 10.0 ** np.arange(-10, 2)
    err = np.concatenate([np.zeros(5), edges, edges * (1 + 1e-12), edges * (1 - 1e-12),
                          [1e3, 10.0, 9.999, 1e-14], RNG.standard_normal(10_000)
                          * 10.0 ** RNG.uniform(-13, 2, 10_000)])
    err = err[:10_040].reshape(8, -1)  # an output's shape: counted over all its elements
    for scale in (1.0, 0.37, 0.0):
        rel = np.abs(err) / (scale or 1.0)
        want = np.histogram(np.clip(rel, 0, edges[-1]), bins=np.concatenate([[0], edges]))[0]
        got = budget.error_histogram(err, scale)
        assert [e for e, _ in got] == list(edges)
        assert [n for _, n in got] == want.tolist()
    assert budget.error_histogram(np.zeros(0), 1.0) == []
