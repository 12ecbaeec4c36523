"""Dynamic dims are verified at other sizes; a dim that only works at the example's size is
found and the op that baked it in is named."""

from __future__ import annotations

import pytest
import torch

import onnxmedic
from tests import models
from tests import onnx_models as om


def test_dynamic_batch_verified_at_several_sizes(tmp_path):
    r = onnxmedic.export(models.PoolView(), (torch.randn(2, 3, 8, 8),), tmp_path / "m.onnx",
                         dynamic_shapes={"x": {0: "batch", 2: "h", 3: "w"}})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    sets = {c.input_set for c in r.verification}
    # each dim at 1 and the first prime above the example's size
    assert {"batch=1", "batch=3", "h=1", "h=11", "w=1", "w=11"} <= sets
    assert not {"batch=4", "batch=5", "h=16", "h=17"} & sets  # one larger size, not two
    # one further set of the example's shapes: the size variants draw fresh values already
    assert "random#1" in sets and "random#2" not in sets
    shapes = {c.input_set: c.expected_shape for c in r.verification}
    assert shapes["batch=3"] == [3, 4] and shapes["batch=1"] == [1, 4]


def test_static_export_has_no_shape_variants():
    r = onnxmedic.export(models.CustomNorm(), (torch.randn(4, 8),))
    assert r.ok
    assert {c.input_set for c in r.verification} == {"example", "random#1", "random#2"}


def test_baked_in_size_is_found_with_the_node(tmp_path):
    p = om.baked_reshape_model(tmp_path / "baked.onnx")
    r = onnxmedic.verify(p, models.Identity(), (torch.randn(2, 3),))
    assert not r.ok and r.stages["runtime"] == "passed" and r.stages["compare"] == "failed"
    errs = [f for f in r.errors if f.code == "OM402"]
    # every other size: 1 and the first prime above the example's
    assert {e.details["input_set"] for e in errs} == {"batch=1", "batch=3"}
    e = errs[0]
    assert "Reshape node 'node_view'" in e.message
    assert e.location is not None and e.location.file.endswith("models.py")
    nb = e.details["neighbourhood"]  # the graph around the node, for the report
    assert nb["node"] == "Reshape 'node_view'"
    assert [i["from"] for i in nb["inputs"]][0] == "graph input"
    assert nb["outputs"][0]["to"]
    # at the example's own size it is right
    assert all(c.ok for c in r.verification if c.input_set in ("example", "random#1"))


def test_wrong_shape_at_other_size(tmp_path):
    p = om.first_two_rows_model(tmp_path / "slice.onnx")
    r = onnxmedic.verify(p, models.Identity(), (torch.randn(2, 3),))
    assert not r.ok
    # wrong where the batch exceeds the two rows kept: at 3 (the prime above the example)
    errs = [f for f in r.errors if f.code == "OM402"]
    assert {e.details["input_set"] for e in errs} == {"batch=3"}
    assert all("shape" in e.message for e in errs)
    assert not [f for f in r.errors if f.code == "OM601"]


def test_variant_pytorch_rejects_is_skipped_not_failed():
    class NeedsTwoRows(torch.nn.Module):
        def forward(self, x):
            torch._check(x.shape[0] >= 2)
            return x[1:] - x[:-1]

    r = onnxmedic.export(NeedsTwoRows(), (torch.randn(3, 4),), dynamic_shapes={"x": {0: "n"}})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert any(f.code == "OM403" and "n=1" in f.message for f in r.findings)
    assert "n=5" in {c.input_set for c in r.verification}


class _LinearSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return self.lin(x).sum(-1) + y


def _input_dims(r):
    return [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in r.onnx_model.graph.input]


def test_dynamic_auto_keeps_what_the_model_allows_and_says_so():
    """auto: x[0] (1 in the example: capture is size-oblivious, so it stays dynamic), x[1] (and
    y[0], tied to it) dynamic; x[2] fixed by the Linear. Verified at the other sizes."""
    r = onnxmedic.export(_LinearSum(), (torch.randn(1, 5, 4), torch.randn(5)),
                         dynamic_shapes="auto")
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (f404,) = [f for f in r.findings if f.code == "OM404"]
    assert f404.details["dynamic"] == ["x[0]", "x[1]", "y[0]"]
    assert f404.details["static"] == ["x[2]=4"]
    x_dims, y_dims = _input_dims(r)
    assert isinstance(x_dims[1], str) and x_dims[2] == 4  # no "4" names
    assert y_dims[0] == x_dims[1]
    assert len({c.input_set for c in r.verification}) > 3  # shape variants were run


def test_dynamic_axes_dict_form(tmp_path):
    r = onnxmedic.export(_LinearSum(), (torch.randn(2, 5, 4), torch.randn(5)),
                         dynamic_shapes={"x": [0, 1], "y": [0]})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    x_dims, y_dims = _input_dims(r)
    assert x_dims[:2] == ["x_dim0", "x_dim1"] and x_dims[2] == 4 and y_dims == ["x_dim1"]


@pytest.mark.slow  # CLI runs of what the API tests above check (23 s)
def test_cli_dynamic_auto_and_dynamic_axes(tmp_path):
    import json

    from tests.test_cli import MODELS, cli
    p = cli("export", f"{MODELS}:PoolView", "--input", "2x3x8x8:float32", "--dynamic", "auto",
            "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    (f404,) = [f for f in d["findings"] if f["code"] == "OM404"]
    assert "x[0]" in f404["details"]["dynamic"]
    p = cli("export", f"{MODELS}:PoolView", "--input", "2x3x8x8:float32", "--dynamic",
            "{'x': {0: 'batch'}}", "--json")
    assert p.returncode == 0, p.stderr
    assert any(c["input_set"] == "batch=3" for c in json.loads(p.stdout)["verification"])
    p = cli("export", f"{MODELS}:PoolView", "--input", "2x3x8x8:float32", "--dynamic",
            "{'x': __import__('os')}")
    assert p.returncode == 2 and "OM004" in p.stderr


def test_dim_the_model_fixes_is_made_static_with_a_warning():
    """torch.export refuses a dim declared dynamic that the code fixes (Linear's in-features):
    plain torch.onnx stops there; onnxmedic makes it static, says so (OM406) and verifies the
    rest at several sizes."""
    lin = torch.nn.Linear(4, 2)
    x = (torch.randn(3, 4),)
    ds = {"input": {0: "batch", 1: "features"}}
    import pytest
    with pytest.raises(Exception):
        torch.onnx.export(lin, x, dynamic_shapes=ds, dynamo=True, verbose=False)
    r = onnxmedic.export(lin, x, dynamic_shapes=ds)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (w,) = [f for f in r.findings if f.code == "OM406"]
    assert w.details["fixes"] == ["input[1] = 4 (the model fixes it)"]
    assert _input_dims(r) == [["batch", 4]]
    assert {"batch=1", "batch=5"} <= {c.input_set for c in r.verification}


def test_suggested_fixes_are_applied():
    """Two Dims that the model forces equal: torch.export suggests `b = a`; it is applied."""
    from torch.export import Dim

    class Add(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    a, b = Dim("a"), Dim("b")
    r = onnxmedic.export(Add(), (torch.randn(3, 4), torch.randn(3, 4)),
                         dynamic_shapes={"x": {0: a}, "y": {0: b}})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    (w,) = [f for f in r.findings if f.code == "OM406"]
    assert w.details["fixes"] == ["b = a"]
    x_dims, y_dims = _input_dims(r)
    assert x_dims[0] == y_dims[0] and isinstance(x_dims[0], str)


class _Centre(torch.nn.Module):
    """A batch-centring block: its mean over the dynamic batch is the op the test breaks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x).relu()
        mean = h.mean(0, keepdim=True)  # CENTRE-MEAN
        return (h - mean).tanh()


def test_wrong_value_at_another_size_is_localised_there(registry_snapshot, tmp_path):
    """A translation that bakes the example's batch size in (mean over dim 0 as a sum divided
    by the constant 2): right at the example's size, wrong at batch=1 and 4. Export says OM402
    and localises at the failing size: the mean node, with the user's line, born there."""
    from onnxscript import opset18 as op

    from onnxmedic.ops import translation

    @translation(torch.ops.aten.mean.dim)
    def aten_mean_dim(self, dim, keepdim=False, dtype=None):
        axes = op.Constant(value_ints=list(dim))
        return op.Div(op.ReduceSum(self, axes, keepdims=1 if keepdim else 0),
                      op.Constant(value_float=2.0))

    import inspect

    src, start = inspect.getsourcelines(_Centre.forward)
    line = start + next(i for i, t in enumerate(src) if "CENTRE-MEAN" in t)
    r = onnxmedic.export(_Centre().eval(), (torch.randn(2, 4),), tmp_path / "m.onnx",
                         dynamic_shapes={"x": {0: "batch"}})
    assert not r.ok and r.stages["compare"] == "failed"
    assert all(c.ok for c in r.verification if c.input_set in ("example", "random#1"))
    e = next(f for f in r.errors if f.code == "OM402")
    assert e.details["input_set"] in ("batch=1", "batch=3")
    assert r.localization is not None and r.localization.input_set == e.details["input_set"]
    first = r.localization.first
    assert first is not None and first.aten_op.startswith("aten::mean")
    assert first.input_score <= 1.0  # born there: the Linear before it is right at that size
    assert e.op.startswith("aten::mean") and e.details["first_divergent"]["fx_node"] == \
        first.fx_node
    assert e.location is not None and e.location.line == line
    assert e.location.file.endswith("test_dynamic.py")
    assert "FX node mean" in e.message
    loc_finding = next(f for f in r.findings if f.code == "OM610")
    assert e.details["input_set"] in loc_finding.message
    assert not (tmp_path / "m.onnx").exists()  # a model wrong at a declared size is not kept


def test_correct_translation_of_the_same_block_verifies_at_every_size(tmp_path):
    """The control for the test above: the real mean translation passes at every size."""
    r = onnxmedic.export(_Centre().eval(), (torch.randn(2, 4),), tmp_path / "m.onnx",
                         dynamic_shapes={"x": {0: "batch"}})
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert {"batch=1", "batch=3"} <= {c.input_set for c in r.verification}
    assert r.localization is None


class _PadsOddWidths(torch.nn.Module):
    """A UNet-style skip: pool, upsample, pad by one where the width is odd, concatenate.
    torch.export follows the example's (even) branch, so the file only works at even widths;
    the branch leaves a guard (``Eq(2*(width//2), width)``) that says so."""

    def forward(self, x):
        u = torch.nn.functional.interpolate(torch.nn.functional.max_pool2d(x, 2),
                                            scale_factor=2.0)
        if u.shape[-1] != x.shape[-1]:  # ODD-PAD
            u = torch.nn.functional.pad(u, (0, 1, 0, 0), mode="replicate")
        return torch.cat([u, x], 1)


def test_a_file_that_only_works_at_even_sizes_is_refined(tmp_path):
    """Issue 16: refused with OM402 before; now the guard's rule (even widths) explains the
    failure at 11, the file verifies at even sizes and is written with the rule (OM408)."""
    import inspect

    x = torch.randn(1, 2, 8, 8)
    res = onnxmedic.export(_PadsOddWidths().eval(), (x,), tmp_path / "m.onnx",
                           dynamic_shapes=({3: "width"},))
    assert res.ok and (tmp_path / "m.onnx").exists(), [f.one_paragraph() for f in res.findings]
    f = next(f for f in res.findings if f.code == "OM408")
    assert "width is dynamic in sizes that are a multiple of 2" in f.message
    assert f.details["failed_at"] == [11]
    src, start = inspect.getsourcelines(_PadsOddWidths.forward)
    assert f.location.line == start + next(i for i, t in enumerate(src) if "ODD-PAD" in t)
    assert "width=11" not in {c.input_set for c in res.verification}
