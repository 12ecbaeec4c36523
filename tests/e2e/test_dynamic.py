"""Dynamic dims are verified at other sizes; a dim that only works at the example's size is
found and the op that baked it in is named."""

from __future__ import annotations

import torch

import onnxmedic
from tests import models
from tests import onnx_models as om


def test_dynamic_batch_verified_at_several_sizes(tmp_path):
    r = onnxmedic.export(models.PoolView(), (torch.randn(2, 3, 8, 8),), tmp_path / "m.onnx",
                         dynamic_shapes={"x": {0: "batch", 2: "h", 3: "w"}})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    sets = {c.input_set for c in r.verification}
    assert {"batch=1", "batch=4", "h=1", "h=16", "w=1", "w=16"} <= sets
    shapes = {c.input_set: c.expected_shape for c in r.verification}
    assert shapes["batch=4"] == [4, 4] and shapes["batch=1"] == [1, 4]


def test_static_export_has_no_shape_variants():
    r = onnxmedic.export(models.CustomNorm(), (torch.randn(4, 8),))
    assert r.ok
    assert {c.input_set for c in r.verification} == {"example", "random#1", "random#2"}


def test_baked_in_size_is_found_with_the_node(tmp_path):
    p = om.baked_reshape_model(tmp_path / "baked.onnx")
    r = onnxmedic.verify(p, models.Identity(), (torch.randn(2, 3),))
    assert not r.ok and r.stages["runtime"] == "passed" and r.stages["compare"] == "failed"
    errs = [f for f in r.errors if f.code == "OM402"]
    assert {e.details["input_set"] for e in errs} == {"batch=1", "batch=4"}
    e = errs[0]
    assert "Reshape node 'node_view'" in e.message
    assert e.location is not None and e.location.file.endswith("models.py")
    # at the example's own size it is right
    assert all(c.ok for c in r.verification if c.input_set in ("example", "random#1"))


def test_wrong_shape_at_other_size(tmp_path):
    p = om.first_two_rows_model(tmp_path / "slice.onnx")
    r = onnxmedic.verify(p, models.Identity(), (torch.randn(2, 3),))
    assert not r.ok
    (e,) = [f for f in r.errors if f.code == "OM402"]
    assert "batch=4" in e.message and "shape" in e.message
    assert not [f for f in r.errors if f.code == "OM601"]


def test_variant_pytorch_rejects_is_skipped_not_failed():
    class NeedsTwoRows(torch.nn.Module):
        def forward(self, x):
            torch._check(x.shape[0] >= 2)
            return x[1:] - x[:-1]

    r = onnxmedic.export(NeedsTwoRows(), (torch.randn(3, 4),), dynamic_shapes={"x": {0: "n"}})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert any(f.code == "OM403" and "n=1" in f.message for f in r.findings)
    assert "n=6" in {c.input_set for c in r.verification}
