"""Property-based tests: no spec string makes the parsers raise anything but a finding."""

from __future__ import annotations

import string

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxmedic import inputs
from onnxmedic.findings import InputError

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# text that looks like specs: digits, 'x', ':', '@', ',', '=', '.', '-', letters
spec_chars = st.sampled_from(list("0123456789x:@,=.-_ eE") + list("abfilnostuy"))
spec_text = st.text(spec_chars, max_size=30)


@SETTINGS
@given(spec_text)
def test_shape_spec_parser_never_crashes(spec):
    try:
        shape, dtype, rng = inputs.parse_shape_spec(spec)
    except InputError as e:
        assert e.finding.code == "OM004" and e.finding.exit_code == 2
        return
    assert all(isinstance(d, int) and d >= 0 for d in shape)
    assert isinstance(dtype, torch.dtype)
    assert rng is None or rng[0] < rng[1]


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=0, max_size=4),
       st.sampled_from(sorted(inputs.DTYPES)))
def test_valid_shape_specs_round_trip(dims, dtype_name):
    spec = ("x".join(map(str, dims)) or "scalar") + ":" + dtype_name
    (t,) = inputs.load_inputs([spec]).args
    assert list(t.shape) == dims and t.dtype == inputs.DTYPES[dtype_name]


@SETTINGS
@given(st.lists(spec_text, max_size=3))
def test_dynamic_spec_parser_never_crashes(specs):
    try:
        out = inputs.parse_dynamic_specs(specs)
    except InputError as e:
        assert e.finding.code == "OM004"
        return
    if out == inputs.AUTO:  # ["auto"] (hypothesis finds it): every dim dynamic, by design
        return
    for name, dims in out.items():
        assert name and all(isinstance(d, int) and isinstance(v, str) for d, v in dims.items())


@SETTINGS
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_input_specs_from_any_text_give_findings(spec):
    # keep module-style specs out: "pkg.mod:fn" would import and call real functions
    if ":" in spec and not spec.split(":", 1)[0].replace("x", "").isdigit():
        spec = spec.replace(":", "")
    try:
        inputs.load_inputs([spec])
    except InputError as e:
        assert e.finding.code in ("OM004", "OM005")


@SETTINGS
@given(st.text(string.ascii_letters + string.digits + "/._-", min_size=1, max_size=30)
       .map(lambda s: f"/nonexistent_onnxmedic_dir/{s}.py:Model"))
def test_model_spec_for_missing_files(spec):
    try:
        inputs.load_model(spec)
    except InputError as e:
        assert e.finding.code in ("OM001", "OM004")
